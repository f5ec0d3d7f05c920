"""Megatron adapter: the Plan applied to Megatron-Core's process groups, layer split and DDP settings.

Three ways in (docs/megatron.md):

* Megatron-LM, no patch: ``pip install`` ships an import hook (``het_plugin_megatron.pth`` ->
  :mod:`het_plugin.megatron.hook`) that, only when ``--heterogeneous-nic`` is on the command line,
  extends Megatron-LM's argument parser and applies the plan when Megatron builds its groups.
* Megatron-LM, patched: ``het-plugin patch megatron PATH`` (diffs in ``patches/``).
* Megatron-Core only: :func:`initialize_model_parallel`, a drop-in for
  ``parallel_state.initialize_model_parallel``.

This ``__init__`` stays import-light (the hook imports this package in every Python process);
the heavy parts load on first use.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "initialize_model_parallel": "mcore",
    "resolve_megatron_plan": "mcore",
    "current_plan": "mcore",
    "forget_plan": "mcore",
    "replica_share": "replicas",
    "replica_sampler": "replicas",
    "model_from_args": "modelspec",
    "layout_for_plan": "pipeline_layout",
    "layout_string": "pipeline_layout",
    "apply_plan_to_config": "pipeline_layout",
    "ddp_config_for_plan": "pipeline_layout",
    "planned_groups": "groups",
    "planned_collection": "collection",
    "check_groups": "group_check",
    "add_arguments": "args",
    "chain_extra_args_provider": "args",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
