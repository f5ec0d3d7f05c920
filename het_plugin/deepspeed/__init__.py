"""DeepSpeed adapter. The usual path needs no script edit: wrap the config (``het-plugin wrap-config``) and launch
as before; the import hook shipped as ``het_plugin_deepspeed.pth`` (:mod:`het_plugin.deepspeed.hook`) applies the
plan in ``deepspeed.pipe.PipelineModule`` and ``deepspeed.initialize``. The explicit equivalent:

    cfg = het_plugin.deepspeed.wrap("ds_config.json", cluster="cluster.yaml", pp=2)
    model = het_plugin.deepspeed.PipelineModule(layers, num_stages=2, loss_fn=..., config=cfg)
    engine, *_ = het_plugin.deepspeed.initialize(model=model, optimizer=opt, config=cfg)

``wrap`` needs no DeepSpeed (it also backs ``het-plugin wrap-config``); the other names import DeepSpeed
when first used. See docs/deepspeed.md.
"""
from __future__ import annotations

from .config import SECTION, HetSection, load_ds_config, section_of, strip_section, wrap, write_config

__all__ = ["wrap", "initialize", "PipelineModule", "PlanTopology", "HetSection", "SECTION", "load_ds_config",
           "section_of", "strip_section", "write_config", "replica_batch_sampler", "ReplicaDataError",
           "replica_sampler", "forget_plan"]


def __getattr__(name):
    if name == "initialize":
        from .engine import initialize
        return initialize
    if name == "PipelineModule":
        from .pipe import PipelineModule
        return PipelineModule
    if name == "forget_plan":
        from .script_topology import forget_plan
        return forget_plan
    if name == "PlanTopology":
        from .process_topology import PlanTopology
        return PlanTopology
    if name == "replica_sampler":
        from .samplers import replica_sampler
        return replica_sampler
    if name in ("replica_batch_sampler", "ReplicaDataError"):
        from . import replicas
        return getattr(replicas, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
