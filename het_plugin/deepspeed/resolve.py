"""On every rank: the plan a wrapped config stands for, checked against what DeepSpeed is about to run.

Three sources, in order: the plan stored in the section (wrap's default); a plan file; a cluster file
or discovery plus the planning model, planned here (then the hash must equal the one wrap recorded, if
it recorded one). Every failure is a ConfigError; the caller runs this inside ``agree_on_plan`` so one
rank's failure stops all ranks with the same message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import ConfigError
from ..model import ModelSpec
from ..plan import Plan
from .config import AUTO, SECTION, HetSection, check_plan, load_cluster_or_plan


@dataclass(frozen=True)
class RunShape:
    """What the user's model and launch say: these win, the plan must agree."""
    world_size: int
    pp: int
    tp: int = 1
    num_layers: Optional[int] = None     # layers the plan counts (pipeline models only)

    @property
    def dp(self) -> Optional[int]:
        if self.world_size % (self.pp * self.tp):
            return None
        return self.world_size // (self.pp * self.tp)


def resolve_plan(section: HetSection, shape: RunShape, *, derive_model: Optional[Callable[[], ModelSpec]] = None,
                 source: str = "<config>") -> Plan:
    """The plan for this run; ``derive_model`` builds a planning model from the layer list when the
    section has none."""
    if shape.dp is None:
        raise ConfigError(f"{shape.world_size} ranks cannot hold pp*tp = {shape.pp}*{shape.tp}", source=source,
                          field="num_stages", fix="launch a multiple of pp*tp ranks")
    if section.plan is not None:
        plan = Plan.from_dict(section.plan, f"{source}: {SECTION}.plan")
        if section.plan_hash is not None and plan.hash != section.plan_hash:
            raise ConfigError(f"the stored plan hashes to {plan.hash}, the section says {section.plan_hash}",
                              source=source, field=f"{SECTION}.plan_hash", fix="re-wrap the config")
    elif section.cluster is None:
        raise ConfigError("the section has neither a plan nor a cluster", source=source, field=SECTION,
                          fix="re-create it with het_plugin.deepspeed.wrap or `het-plugin wrap-config`")
    else:
        plan = _plan_from_cluster(section, shape, derive_model, source)
    check_plan(plan, world_size=shape.world_size, pp=shape.pp, tp=shape.tp, dp=shape.dp,
               num_layers=shape.num_layers, source=source)
    return plan


def _plan_from_cluster(section: HetSection, shape: RunShape, derive_model, source: str) -> Plan:
    if section.cluster == AUTO:
        cluster = discover()
    else:
        loaded = load_cluster_or_plan(section.cluster)
        if isinstance(loaded, Plan):
            _check_recorded_hash(section, loaded, source)
            return loaded
        cluster = loaded
        if section.cluster_digest is not None and cluster.digest != section.cluster_digest:
            raise ConfigError(f"the cluster file changed since the config was wrapped (digest {cluster.digest}, "
                              f"recorded {section.cluster_digest})", source=section.cluster, field="cluster",
                              fix="re-wrap the config with `het-plugin wrap-config`")
    if cluster.world_size != shape.world_size:
        raise ConfigError(f"the cluster has {cluster.world_size} accelerators but {shape.world_size} ranks were "
                          "launched", source=str(section.cluster), field="cluster",
                          fix=f"launch {cluster.world_size} ranks, or describe the nodes you launch")
    model = _planning_model(section, derive_model, source)
    from ..planner import make_plan
    plan = make_plan(cluster, model, tp=shape.tp, pp=shape.pp, dp=shape.dp, micro_batch_size=model.micro_batch_size)
    _check_recorded_hash(section, plan, source)
    return plan


def _check_recorded_hash(section: HetSection, plan: Plan, source: str) -> None:
    if section.plan_hash is not None and plan.hash != section.plan_hash:
        raise ConfigError(f"the plan computed here ({plan.hash}) is not the one the config was wrapped with "
                          f"({section.plan_hash}): the cluster, the model or het_plugin's planner changed",
                          source=source, field=f"{SECTION}.plan_hash",
                          fix="re-wrap the config, or wrap with the plan embedded (the default)")


def _planning_model(section: HetSection, derive_model, source: str) -> ModelSpec:
    if section.model is not None:
        from ..yamlio import validate
        return validate(ModelSpec, section.model, f"{source}: {SECTION}.model")
    if derive_model is None:
        raise ConfigError("no planning model: the section has none and this model has no layer list to derive "
                          "one from", source=source, field=f"{SECTION}.model",
                          fix="wrap with model=<model file or preset>")
    return derive_model()


def discover():
    """The cluster seen by discovery (het_plugin.discovery, shared with the Megatron adapter)."""
    try:
        from ..discovery import discover_cluster
    except ImportError as exc:
        raise ConfigError(f"cluster 'auto' needs het_plugin.discovery, which is not available ({exc})",
                          field=f"{SECTION}.cluster", fix="wrap with a cluster file instead of 'auto'") from None
    return discover_cluster()
