"""The import-time hook shipped as ``het_plugin_megatron.pth`` (no patch to Megatron-LM needed).

Python runs the ``.pth`` line at every start-up, so the line itself does the least possible: unless
``--heterogeneous-nic`` is in ``sys.argv`` (and ``HET_PLUGIN_NO_HOOK`` is unset or 0) it imports nothing,
not even this module (measured: no difference in ``python -c pass`` within the noise; the earlier line,
which imported this module in every process, cost ~10 ms). With the flag, :func:`install` puts a small
finder on ``sys.meta_path`` (no imports beyond the standard library). When ``megatron.training.arguments`` is
imported *and* ``--heterogeneous-nic`` is on the command line, the finder wraps that module's
``parse_args`` so that it (1) chains the script's ``extra_args_provider`` with het_plugin's flags (Megatron
parses strictly) and (2) applies the plan (:func:`het_plugin.megatron.lm.prepare_args`), which also routes
``parallel_state.initialize_model_parallel`` through het_plugin. Anything else: untouched.
Set ``HET_PLUGIN_NO_HOOK=1`` to switch the hook off (the .pth then imports nothing either). A program that
puts the flag into ``sys.argv`` only after start-up calls :func:`install` itself.
"""
from __future__ import annotations

import functools
import os
import sys

from ..runtime.import_patch import PatchOnLoad
from ..runtime.patches import PATCHES

TARGET = "megatron.training.arguments"
FLAG = "--heterogeneous-nic"
ENV_OFF = "HET_PLUGIN_NO_HOOK"


def _flag_on(argv=None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return any(a == FLAG or a.startswith(FLAG + "=") for a in argv)


class MegatronArgsFinder(PatchOnLoad):
    """Finds nothing itself; wraps the real loader of megatron.training.arguments when the flag is on."""

    target = TARGET

    def active(self) -> bool:
        return _flag_on()

    def patch(self, module) -> None:
        patch_arguments_module(module)


def patch_arguments_module(module) -> None:
    """Wrap ``parse_args`` of a loaded megatron.training.arguments (idempotent)."""
    if getattr(module, "parse_args", None) is None:
        return
    PATCHES.apply(module, "parse_args", _wrap_parse_args, label="megatron.hook")


def _wrap_parse_args(original):
    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        from .args import chain_extra_args_provider
        from .lm import prepare_args
        args = original(chain_extra_args_provider(extra_args_provider), ignore_unknown_args)
        return prepare_args(args)

    return parse_args


def install() -> None:
    """Register the finder once (called from the .pth at interpreter start-up)."""
    if os.environ.get(ENV_OFF, "") not in ("", "0"):
        return
    if any(isinstance(f, MegatronArgsFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, MegatronArgsFinder())
    loaded = sys.modules.get(TARGET)      # imported before us (unusual): patch in place
    if loaded is not None and _flag_on():
        patch_arguments_module(loaded)
