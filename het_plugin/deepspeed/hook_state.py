"""The DeepSpeed import hook's mode, apart from the hook so that the engine can say why a PipelineModule has no
plan without importing the hook (which imports the engine). Written only by :mod:`het_plugin.deepspeed.hook`
(``install``/``uninstall``; its ``_patch`` records the targets).
"""
from __future__ import annotations

ENV_OFF = "HET_PLUGIN_NO_HOOK"
_state = {"mode": None, "targets": []}   # mode None: not installed; "plan"; "guard" (HET_PLUGIN_NO_HOOK)


def unapplied_reason() -> str:
    """Why a PipelineModule has no plan although initialize sees a section (for the ConfigError)."""
    if _state["mode"] == "guard":
        return f"{ENV_OFF}=1 switched het_plugin's DeepSpeed hook off"
    if _state["mode"] is None:
        return "het_plugin's DeepSpeed hook is not installed (het_plugin_deepspeed.pth; or call het_plugin.deepspeed.hook.install())"
    return ("the section reached only deepspeed.initialize (a config dict or path passed there), which runs after the "
            "PipelineModule was built")
