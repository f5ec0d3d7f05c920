"""On every rank: the plan a wrapped config stands for, checked against what DeepSpeed is about to run.

Three sources, in order: the plan stored in the section (wrap's default); a plan file; a cluster file
or discovery plus the planning model, planned here by :func:`het_plugin.core.launch.resolve_plan` (then the
hash must equal the one wrap recorded, if it recorded one). Every failure is a ConfigError; the adapters run
this inside the start-up sequence (:func:`het_plugin.runtime.startup.startup`, as :func:`section_planning`) so one
rank's failure stops all ranks with the same message.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..core.errors import ConfigError
from ..core.inputs.yamlio import validate
from ..core.inputs.model import ModelSpec
from ..core.plan import Plan
from ..core.inputs.cluster import Cluster
from ..discovery import discover_cluster
from ..core.launch import Resolved, load_source, resolve_launch
from ..core.subsets import check_launch_nodes
from ..core.request import Launch, LaunchRequest, Timeout
from ..runtime.all_nodes import use_all_nodes as all_nodes_asked
from ..runtime.plan_once import node_sharing
from ..runtime.startup import Planning, Replan, resolve_start
from ..core.ranks.dims import Degrees
from .checkpoints import read_shape
from .config import AUTO, DEEPSPEED_NAMES, SECTION, HetSection, check_plan

@dataclass(frozen=True)
class RunShape:
    """What the user's model and launch say: these win, the plan must agree."""
    world_size: int
    pp: int
    tp: int = 1
    num_layers: Optional[int] = None     # layers the plan counts (pipeline models only)

    def degrees(self, source: str) -> Degrees:
        """tp and pp as given, dp inferred from the world size (a ConfigError when they do not divide it)."""
        return Degrees(self.world_size, tp=self.tp, pp=self.pp, dp=-1, names=DEEPSPEED_NAMES, source=source)

    def request(self, source: str, *, micro_batch_size: Optional[int] = None,
                use_all_nodes: Optional[bool] = None) -> LaunchRequest:
        """The launch request the plan is resolved for: the model's degrees (checked here), DeepSpeed's names; no
        optimizer instances (DeepSpeed's pipeline engine shards ZeRO-1 over all of data parallelism).
        ``use_all_nodes``: the section's option (None: HET_PLUGIN_USE_ALL_NODES, else plan over node subsets)."""
        return LaunchRequest(Launch(self.world_size), self.degrees(source), micro_batch_size=micro_batch_size,
                             names=DEEPSPEED_NAMES, optimizer_instances=False,
                             use_all_nodes=all_nodes_asked(use_all_nodes))     # no partial ZeRO (docs/deepspeed.md)

    def start_request(self, section: HetSection, source: str, rank: int) -> LaunchRequest:
        """What the start-up sequence needs before any plan: this rank and the section's ``timeout_s``. The
        degrees are checked where the plan is resolved (:meth:`request`), after the section's own checks."""
        return LaunchRequest.of(self.world_size, rank=rank,
                                timeout=Timeout(section.timeout_s, f"{SECTION}.timeout_s", source))


def resolve_section_plan(section: HetSection, shape: RunShape, *, derive_model: Optional[Callable[[], ModelSpec]] = None,
                 source: str = "<config>") -> Plan:
    """The plan for this run; ``derive_model`` builds a planning model from the layer list when the
    section has none."""
    return resolve_section(section, shape, derive_model=derive_model, source=source).plan


def resolve_section(section: HetSection, shape: RunShape, *, derive_model: Optional[Callable[[], ModelSpec]] = None,
                    source: str = "<config>", rank: int = 0) -> Resolved:
    """:func:`resolve_section_plan` with the cluster the plan came from (for the pre-flight's NICs): the one
    planned from, or, for an embedded plan, the section's cluster file when it is still the one planned from.
    With ``replan_on_restart``: re-planned on restart (:func:`section_planning`; ``rank``: this rank; rank 0
    prints its reasoning)."""
    return resolve_start(section_planning(section, shape, derive_model=derive_model, source=source), rank)


def section_planning(section: HetSection, shape: RunShape, *,
                     derive_model: Optional[Callable[[], ModelSpec]] = None, source: str = "<config>",
                     check: Optional[Callable[[Resolved], None]] = None) -> Planning:
    """How a wrapped config's run gets its plan, for the start-up sequence (``check``: the adapter's checks).

    Re-plan on restart (:mod:`het_plugin.runtime.restart_replan`, the rule Megatron-LM's
    ``--heterogeneous-replan-on-restart`` uses): the plan as wrapped, or, when the last attempt left a measured
    profile at ``profile_out``, one planned with it for the nodes of this start (the section's cluster file as it
    is now, or discovery) with the model's own pipeline and tensor degrees and the config's micro-batch size; not
    taken when the checkpoint in ``resume_from`` would not load under it."""
    if not section.replan_on_restart:
        return Planning(lambda profile: _as_wrapped(section, shape, derive_model, source), check=check)
    checkpoint = (lambda: read_shape(section.resume_from)) if section.resume_from else None
    return Planning(_restart_resolve(section, shape, derive_model, source), check=check,
                    replan=Replan(section.profile_out, checkpoint=checkpoint))


def _restart_resolve(section: HetSection, shape: RunShape, derive_model, source: str):
    """``resolve(profile)`` for a re-plan: the plan as wrapped (profile None), else one planned with the profile
    for the cluster of this start."""
    @functools.lru_cache(maxsize=1)
    def this_start() -> Resolved:
        wrapped = _as_wrapped(section, shape, derive_model, source)
        cluster: Optional[Cluster] = wrapped.cluster        # the one planned from, when it is still this start's
        if cluster is None and section.cluster == AUTO:
            cluster = discover_cluster()
        elif cluster is None:
            loaded = load_source(section.cluster)
            cluster = loaded if isinstance(loaded, Cluster) else None      # a plan file: nothing to re-plan for
        return Resolved(wrapped.plan, cluster)

    def resolve(profile) -> Resolved:
        start = this_start()
        if profile is None:
            return start
        model = lambda: _planning_model(section, derive_model, source)  # noqa: E731
        request = shape.request(source, micro_batch_size=start.plan.micro_batch_size,
                                use_all_nodes=section.use_all_nodes)
        resolved = resolve_launch(start.cluster, request, model=model, profile=profile)
        check_plan(resolved.plan, world_size=shape.world_size, pp=shape.pp, tp=shape.tp, dp=resolved.plan.dp,
                   num_layers=shape.num_layers, source=source)
        return resolved
    return resolve


def _as_wrapped(section: HetSection, shape: RunShape, derive_model, source: str) -> Resolved:
    """The plan the section stands for, as wrap made it (see :func:`resolve_section`)."""
    degrees = shape.degrees(source)
    cluster: Optional[Cluster] = None
    if section.plan is not None:
        plan = Plan.from_dict(section.plan, f"{source}: {SECTION}.plan")
        cluster = _cluster_file_of(section, plan)
    elif section.cluster is None:
        raise ConfigError("the section has neither a plan nor a cluster", source=source, field=SECTION,
                          fix="re-create it with het_plugin.deepspeed.wrap or `het-plugin wrap-config`")
    else:
        loaded = load_source(None if section.cluster == AUTO else section.cluster)
        if isinstance(loaded, Plan):
            plan = loaded
        else:
            if loaded is not None and section.cluster_digest is not None and loaded.digest != section.cluster_digest:
                raise ConfigError(f"the cluster file changed since the config was wrapped (digest {loaded.digest}, "
                                  f"recorded {section.cluster_digest})", source=section.cluster, field="cluster",
                                  fix="re-wrap the config with `het-plugin wrap-config`")
            model = lambda: _planning_model(section, derive_model, source)  # noqa: E731 - derived only if needed
            request = shape.request(source, use_all_nodes=section.use_all_nodes)
            resolved = resolve_launch(loaded, request, model=model, discover=discover_cluster,
                                      share_plan=node_sharing())
            plan, cluster = resolved.plan, resolved.cluster
    if section.plan_hash is not None and plan.hash != section.plan_hash:
        raise ConfigError(f"the plan here ({plan.hash}) is not the one the config was wrapped with "
                          f"({section.plan_hash}): the cluster, the model or het_plugin's planner changed",
                          source=source, field=f"{SECTION}.plan_hash",
                          fix="re-wrap the config, or wrap with the plan embedded (the default)")
    if plan.left_out:          # a plan for its kept nodes (issue 32): a launch of more is refused naming them
        try:
            check_launch_nodes(plan, world_size=shape.world_size)
        except ConfigError as exc:
            raise ConfigError(exc.problem, source=source, field=exc.field, fix=exc.fix) from None
    check_plan(plan, world_size=shape.world_size, pp=shape.pp, tp=shape.tp, dp=degrees.dp,
               num_layers=shape.num_layers, source=source)
    return Resolved(plan, cluster)


def _cluster_file_of(section: HetSection, plan: Plan) -> Optional[Cluster]:
    """The section's cluster file, if this rank has it and it is the one the plan was made from (else None:
    an embedded plan needs no file, and a changed file says nothing about the plan's nodes)."""
    if not section.cluster or section.cluster == AUTO or not Path(section.cluster).is_file():
        return None
    try:
        loaded = load_source(section.cluster)
    except Exception:          # noqa: BLE001 - unreadable now: the plan itself is what counts
        return None
    return loaded if isinstance(loaded, Cluster) and loaded.digest == plan.cluster_digest else None


def _planning_model(section: HetSection, derive_model, source: str) -> ModelSpec:
    if section.model is not None:
        return validate(ModelSpec, section.model, f"{source}: {SECTION}.model")
    if derive_model is None:
        raise ConfigError("no planning model: the section has none and this model has no layer list to derive "
                          "one from", source=source, field=f"{SECTION}.model",
                          fix="wrap with model=<model file or preset>")
    return derive_model()
