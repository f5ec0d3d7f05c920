"""The import-time hook shipped as ``het_plugin_deepspeed.pth``: an unmodified DeepSpeed script takes a wrapped config.

The ``.pth`` line (setup.py's ``DS_PTH_TEXT``) imports nothing: it puts a finder made of one lambda on
``sys.meta_path`` that answers nothing until a module named ``deepspeed`` is imported. Then it imports this
module, which lets DeepSpeed load and patches it (:func:`install`):

* ``deepspeed.runtime.pipe.module.PipelineModule.__init__`` (the class every name of it refers to): when the
  process's config holds a ``"heterogeneous"`` section (:func:`process_section`: ``--deepspeed_config`` /
  ``--deepspeed-config`` on the command line, else the file named by ``HET_PLUGIN_DEEPSPEED_CONFIG``), the
  module is built as :class:`het_plugin.deepspeed.PipelineModule` builds it (the plan's topology, split,
  groups and pipeline hops, :func:`het_plugin.deepspeed.pipe.build_with_plan`); otherwise untouched;
* ``PipelineModule._partition_layers``: the plan's split where one was applied;
* ``deepspeed.runtime.pipe.topology.ProcessTopology.__init__``: remembers the topologies the script builds
  (:mod:`het_plugin.deepspeed.script_topology`), so they answer with the plan's coordinates;
* ``deepspeed.initialize``: :func:`het_plugin.deepspeed.engine.initialize_with_plan` (the config passed, the
  module's plan, or the process's section; none: DeepSpeed's own call).

Every patch goes through :func:`_patch`, i.e. the process's one patch registry (``het_plugin.runtime.patches``,
label ``deepspeed.hook``); :func:`uninstall` takes exactly this hook's patches away.
``HET_PLUGIN_NO_HOOK=1`` switches the plan off, but ``deepspeed.initialize`` still refuses a config with a
section (it would otherwise be silently ignored: DeepSpeed ignores unknown keys).
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any, Callable, Optional

from ..core.errors import ConfigError
from ..runtime.import_patch import PatchOnLoad
from ..runtime.patches import PATCHES
from .config import SECTION, load_ds_config, section_of
from .engine import initialize_with_plan, original_initialize  # noqa: F401   hook.original_initialize: read here before
from .hook_state import ENV_OFF, _state, unapplied_reason  # noqa: F401   the hook's mode, read by engine too
from .script_topology import remembering

TARGET = "deepspeed"
ENV_CONFIG = "HET_PLUGIN_DEEPSPEED_CONFIG"
ARG_NAMES = ("--deepspeed_config", "--deepspeed-config")


LABEL = "deepspeed.hook"         # this hook's patches in het_plugin.runtime.patches.PATCHES


def hook_off() -> bool:
    return os.environ.get(ENV_OFF, "") not in ("", "0")


# ---- where the process's config is ---------------------------------------------------------------

def config_path_from_argv(argv=None) -> Optional[str]:
    """The value of ``--deepspeed_config`` / ``--deepspeed-config`` (``X`` or ``=X``), the last one given."""
    argv = sys.argv[1:] if argv is None else list(argv)
    found = None
    for i, a in enumerate(argv):
        for name in ARG_NAMES:
            if a == name and i + 1 < len(argv):
                found = argv[i + 1]
            elif a.startswith(name + "="):
                found = a[len(name) + 1:]
    return found


def process_section():
    """``(section, source)`` of the process's wrapped config (command line, then HET_PLUGIN_DEEPSPEED_CONFIG), or
    None. A named file that is missing or not JSON is a ConfigError (naming it), not silence."""
    for path in (config_path_from_argv(), os.environ.get(ENV_CONFIG) or None):
        if path is None:
            continue
        cfg, source = load_ds_config(path)
        section = section_of(cfg, source)
        if section is not None:
            return section, source
    return None


# ---- the patches ---------------------------------------------------------------------------------

def _patch(owner, name: str, make: Callable[[Any], Any]) -> None:
    """Replace ``owner.name`` by ``make(original)`` through the process's patch registry (recorded, idempotent,
    undone by :func:`uninstall`)."""
    PATCHES.apply(owner, name, make, label=LABEL)
    if (owner, name) not in _state["targets"]:
        _state["targets"].append((owner, name))


def patched() -> list[tuple[str, str]]:
    """What this hook has patched now: (owner, attribute) pairs."""
    return [(getattr(o, "__qualname__", getattr(o, "__name__", repr(o))), n) for o, n in _state["targets"]
            if PATCHES.patch(o, n, LABEL) is not None]


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, layers, num_stages=None, topology=None, *args, **kwargs):
        if getattr(self, "_het_explicit", False) or _state["mode"] != "plan":
            return original(self, layers, num_stages, topology, *args, **kwargs)
        found = process_section()
        if found is None:
            return original(self, layers, num_stages, topology, *args, **kwargs)
        from .pipe import Wrapped, build_with_plan
        section, source = found
        cfg, _ = load_ds_config(source)
        object.__setattr__(self, "_het_explicit", True)      # the inner DeepSpeed __init__ call runs plain
        build_with_plan(self, functools.partial(original, self), layers, num_stages, topology, args, kwargs,
                        Wrapped(cfg, section, source))
    return __init__


def _wrap_partition(original):
    @functools.wraps(original)
    def _partition_layers(self, method="uniform"):
        from .pipe import planned_partition
        if not planned_partition(self):
            return original(self, method=method)
    return _partition_layers


def _wrap_initialize(original):
    @functools.wraps(original)
    def initialize(*args, **kwargs):
        if _state["mode"] == "guard":
            _refuse_section(original, args, kwargs)
            return original(*args, **kwargs)
        return initialize_with_plan(original, args, kwargs, process_section=process_section())
    return initialize


def _refuse_section(original, args, kwargs) -> None:
    """With the hook off, a section in the config (or the process's) is an error, not silence."""

    arguments = inspect.signature(original).bind(*args, **kwargs).arguments
    config = arguments.get("config", arguments.get("config_params"))
    if config is None:
        config = getattr(arguments.get("args"), "deepspeed_config", None)
    found = None
    if config is not None:
        cfg, source = load_ds_config(config)
        if section_of(cfg, source) is not None:
            found = source
    if found is None:
        for path in (config_path_from_argv(), os.environ.get(ENV_CONFIG) or None):
            if path and section_of(*load_ds_config(path)) is not None:
                found = path
                break
    if found is not None:
        raise ConfigError(f"the config has a heterogeneous section but {ENV_OFF}=1 switched het_plugin's DeepSpeed "
                          "hook off, so DeepSpeed would ignore it (its placement and uniform split, no plan)",
                          source=found, field=SECTION,
                          fix=f"unset {ENV_OFF} to apply the plan, or train with the unwrapped config")


def patch_deepspeed(module=None) -> None:
    """Patch a loaded ``deepspeed`` (idempotent): initialize always, PipelineModule unless the hook is off."""
    if module is None:
        import deepspeed as module
    from deepspeed.runtime.pipe import module as pipe_module
    _patch(module, "initialize", _wrap_initialize)
    if _state["mode"] == "plan":
        cls = pipe_module.PipelineModule
        _patch(cls, "__init__", _wrap_init)
        _patch(cls, "_partition_layers", _wrap_partition)
        from deepspeed.runtime.pipe.topology import ProcessTopology
        _patch(ProcessTopology, "__init__", remembering)     # the script's own topologies (script_topology)


# ---- finding deepspeed ---------------------------------------------------------------------------

class DeepSpeedFinder(PatchOnLoad):
    """Finds nothing itself; wraps the real loader of ``deepspeed`` so it is patched once loaded."""

    target = TARGET

    def patch(self, module) -> None:
        patch_deepspeed(module)

    def skips(self, finder) -> bool:
        return _is_trigger(finder)


def _is_trigger(finder) -> bool:
    return type(finder).__name__ == "HetPluginDeepSpeedTrigger"


def from_trigger(trigger, fullname, path=None, target=None):
    """Called by the .pth's finder when ``deepspeed`` is first imported: install, and hand back the spec."""
    # Every trigger goes, not only the one asked: the .pth can run twice in one process (an explicit
    # site.addsitedir of site-packages, or a venv and its base sharing the line), and all of them are this hook.
    sys.meta_path[:] = [f for f in sys.meta_path if not _is_trigger(f)]
    install(register_finder=False)
    if _state["mode"] is None:
        return None
    return DeepSpeedFinder().real_spec(fullname, path, target, also_skip=(trigger,))


def install(register_finder: bool = True) -> None:
    """Patch DeepSpeed when it is imported (now, if it already is). ``HET_PLUGIN_NO_HOOK=1``: only the guard
    that refuses an unapplied section."""
    if _state["mode"] is not None:
        return
    _state["mode"] = "guard" if hook_off() else "plan"
    loaded = sys.modules.get(TARGET)
    if loaded is not None and hasattr(loaded, "initialize"):
        patch_deepspeed(loaded)
    elif register_finder and not any(isinstance(f, DeepSpeedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedFinder())


def uninstall() -> None:
    """Undo every patch (newest first) and drop the finders; DeepSpeed is then DeepSpeed's own."""
    PATCHES.undo(LABEL)
    _state["targets"] = []
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, DeepSpeedFinder) and not _is_trigger(f)]
    _state["mode"] = None
