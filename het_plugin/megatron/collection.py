"""A ``ProcessGroupCollection`` on the plan's placement, for the code that takes explicit process groups.

Megatron is moving from its ``parallel_state`` globals to a ``ProcessGroupCollection`` handed to the model, the
optimizer and the schedules (Megatron-LM main's training.py fills one from the globals "until initialize.py
builds a pgcollection"; the new model builders take one). :func:`planned_collection` gives one whose every group
is the plan's:

* after het_plugin built Megatron's groups (``initialize_model_parallel`` through the plan), the collection is
  Megatron's own over those globals (``use_mpu_process_groups``): the same communicators, nothing created twice,
  and the globals stay filled for the code that still reads them;
* ``from_plan=True``: every field is created afresh from the plan's groups, each through the one group policy
  (backend, network, member order), for a second collection beside the globals (a MiMo-style module), or the one
  collection of a script that builds no Megatron globals (``pretrain(..., skip_model_parallel_init=True,
  pg_collection=planned_collection(from_plan=True))``): on a Megatron-LM launch with ``--heterogeneous-nic`` whose
  plan is not applied yet, the call runs the start-up first (``lm.start_explicit_groups``), and without
  Megatron's globals the default is this one.

Every field of the installed release's dataclass (megatron-core 0.16.1: 20, 0.19.2: 27) is covered by
:data:`FIELDS`; a field het_plugin does not know stops with the field's name rather than being left empty. Without
GTP rematerialisation (what het_plugin places) Megatron's GTP groups are the plain ones: so are the collection's.
With ``N`` distributed-optimizer instances the partial fields are cut as megatron-core 0.16.1 and 0.19.2
``initialize_model_parallel`` cuts them, from the plan's groups in Megatron's order: ``intra_dp_cp`` each data-parallel
(dp x cp) group in ``N`` consecutive blocks, ``intra_expt_dp`` / ``inter_dist_opt`` the two levels of its
hierarchical expert data-parallel groups (consecutive blocks; then one rank of each block), ``intra_dist_opt`` the
expert tp-ep-pp groups concatenated by ``edp / N``; with one instance they are ``dp_cp``, ``expt_dp``, none and the
world, as Megatron's.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

from ..core.errors import ConfigError
from .applied_state import current_plan
from .group_check import EXPERT_AS_DECODER
from .dist_opt import ARG as INSTANCES, check_groups_kwarg
from .late_groups import own_creation
from .lm import megatron_args, start_explicit_groups

# field -> how it is made from the plan: ("kind", plan kind) | ("alias", field) | ("first_of", kind) |
# ("self",) | ("none",) | ("all_gather", kind) | ("instance" | "across_instances" | "instance_of", kind)
FIELDS = {
    "tp": ("kind", "tp"), "pp": ("kind", "pp"), "mp": ("kind", "tp-pp"), "embd": ("kind", "embedding"),
    "pos_embd": ("first_of", "pp"), "cp": ("kind", "cp"), "tp_cp": ("kind", "tp-cp"), "hcp": ("none",),
    "ep": ("kind", "expert-ep"), "expt_tp": ("kind", "expert-tp"), "tp_ep": ("kind", "expert-tp-ep"),
    "tp_ep_pp": ("kind", "expert-tp-ep-pp"), "tp_dp_cp": ("kind", "tp-dp-cp"), "dp": ("kind", "dp"),
    "dp_cp": ("kind", "dp-cp"), "expt_dp": ("kind", "expert-dp"),
    # the distributed-optimizer instances (module docstring)
    "intra_dp_cp": ("instance", "dp-cp"), "intra_expt_dp": ("instance", "expert-dp"),
    "inter_dist_opt": ("across_instances", "expert-dp"), "intra_dist_opt": ("instance_of", "expert-tp-ep-pp"),
    # megatron-core 0.19
    "tp_ep_pp_with_egtp_remat": ("alias", "tp_ep_pp"), "dp_cp_gtp_remat": ("alias", "dp_cp"),
    "gtp_remat": ("self",), "expt_gtp_remat": ("self",), "expt_dp_gtp_remat": ("alias", "expt_dp"),
    "dp_cp_ag": ("all_gather", "dp-cp"), "expt_dp_ag": ("all_gather", "expert-dp"),
}


def collection_class():
    from megatron.core.process_groups_config import ProcessGroupCollection
    return ProcessGroupCollection


def planned_collection(applied=None, *, from_plan: bool = False, all_gather: bool = False,
                       parallel_state=None, num_distributed_optimizer_instances: Optional[int] = None) -> Any:
    """The run's ``ProcessGroupCollection`` on the plan (see the module docstring); ``applied``: the applied plan
    (None: :func:`~het_plugin.megatron.mcore.current_plan`); ``all_gather``: also the all-gather groups
    (``dp_cp_ag``/``expt_dp_ag``, megatron-core 0.19's ``--create-all-gather-group``) on the plan's data-parallel
    groups; ``num_distributed_optimizer_instances`` (``from_plan``): the instances the run's DDP and optimizer use
    (None: :func:`run_instances`), refused where one would span clusters (dist_opt). Every rank calls it (groups
    are created collectively)."""
    applied = (current_plan() or start_explicit_groups()) if applied is None else applied
    if applied is None:
        raise ConfigError("no plan was applied in this process, so there is no planned process-group collection",
                          field="pg_collection",
                          fix="call het_plugin.megatron.initialize_model_parallel first (Megatron-LM: launch with "
                              "--heterogeneous-nic)")
    cls = collection_class()
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [n for n in names if n not in FIELDS]
    if unknown:
        raise ConfigError(f"this Megatron's ProcessGroupCollection has fields het_plugin does not place: {unknown}",
                          field="pg_collection", fix="use a megatron-core release het_plugin supports "
                                                     "(het_plugin.megatron.version)")
    if parallel_state is None:
        from megatron.core import parallel_state
    if not from_plan and parallel_state.model_parallel_is_initialized():
        collection = cls.use_mpu_process_groups()
        if all_gather and hasattr(parallel_state, "create_all_gather_groups"):
            ep = parallel_state.get_expert_model_parallel_world_size()
            collection.dp_cp_ag, collection.expt_dp_ag = parallel_state.create_all_gather_groups(
                for_expert_parallelism=ep > 1)
        return collection
    instances = num_distributed_optimizer_instances or run_instances(parallel_state)
    check_groups_kwarg(applied.plan, {INSTANCES: instances})
    with applied.guarding("het_plugin's planned ProcessGroupCollection"):
        return _from_plan(applied, cls, names, all_gather, instances)


def run_instances(parallel_state) -> int:
    """The distributed-optimizer instances of this run: what Megatron built its groups with (its data-parallel
    group's size over its partial one), else Megatron-LM's ``--num-distributed-optimizer-instances``, else 1."""
    import torch.distributed as dist
    if parallel_state.model_parallel_is_initialized():
        full = parallel_state.get_data_parallel_group(with_context_parallel=True)
        part = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
        return dist.get_world_size(full) // dist.get_world_size(part)
    margs = megatron_args()
    return int(getattr(margs, INSTANCES, 1) or 1) if margs is not None else 1


def instance_lists(how: str, groups: list[list[int]], instances: int) -> list[list[int]]:
    """The member lists of a distributed-optimizer field (module docstring) from the plan's ``groups`` of its kind,
    in Megatron's order: ``instance`` consecutive blocks, ``across_instances`` one rank of each block (none with one
    instance), ``instance_of`` the groups concatenated by (their count / instances)."""
    if how == "instance_of":
        per = len(groups) // instances
        return [[r for g in groups[i * per:(i + 1) * per] for r in g] for i in range(instances)]
    out = []
    for g in groups:
        size = len(g) // instances
        if how == "instance":
            out += [g[i * size:(i + 1) * size] for i in range(instances)]
        elif instances > 1:
            out += [g[j::size] for j in range(size)]
    return out


def _from_plan(applied, cls, names: list[str], all_gather: bool, instances: int = 1) -> Any:
    import torch.distributed as dist
    plan, me = applied.plan, applied.rank
    made: dict[tuple, Any] = {}

    def create(ranks, desc):
        key = tuple(ranks)
        if key not in made:
            def make(spec):
                order = list(spec.torch_ranks) if not spec.sort_ranks else sorted(spec.ranks)
                with own_creation(applied):       # through the policy here: not again in late_groups' new_group
                    return dist.new_group(ranks=order, group_desc=desc, **spec.new_group_kwargs())
            made[key] = applied.create(make, list(ranks), desc=desc)
        return made[key]

    def groups_of(kind):
        if kind not in plan.groups:
            kind = EXPERT_AS_DECODER.get(kind, kind)
        if kind in plan.groups:
            return [list(g.ranks) for g in plan.groups[kind]]
        if kind == "expert-ep":                    # ep=1: each rank alone
            return [[r] for r in range(plan.world_size)]
        if kind == "embedding":                    # Megatron's default: the first and the last stage
            return [g[:1] + g[-1:] if len(g) > 1 else g[:1] for g in groups_of("pp")]
        raise ConfigError(f"the plan has no {kind} groups", field="pg_collection", fix="re-plan with this het_plugin")

    def mine(lists, desc):
        chosen = None
        for ranks in lists:                        # every rank creates every group, in the same order
            group = create(ranks, desc)
            if me in ranks:
                chosen = group
        return chosen

    collection = cls()
    values: dict[str, Any] = {}
    for name in names:
        how = FIELDS[name]
        desc = f"PLANNED_{name.upper()}"
        if how[0] == "kind":
            values[name] = mine(groups_of(how[1]), desc)
        elif how[0] == "first_of":
            values[name] = mine([g[:1] for g in groups_of(how[1])], desc)
        elif how[0] in ("instance", "across_instances", "instance_of"):
            lists = instance_lists(how[0], groups_of(how[1]), instances)
            values[name] = mine(lists, desc) if lists else None
        elif how[0] == "self":
            values[name] = mine([[r] for r in range(plan.world_size)], desc)
        elif how[0] == "all_gather" and all_gather:
            # separate communicators with the data-parallel members (what create_all_gather_groups makes)
            made_before = dict(made)
            made.clear()
            values[name] = mine(groups_of(how[1]), desc)
            made.update(made_before)
        else:
            values[name] = None
    for name in names:
        how = FIELDS[name]
        if how[0] == "alias":
            values[name] = values[how[1]]
        setattr(collection, name, values[name])
    return collection


def collection_kwargs(builder: Any) -> dict[str, Any]:
    """``{'pg_collection': ...}`` for a Megatron builder that takes one (GPTModel in 0.16-0.19), else ``{}``: the
    planned collection where a plan was applied, Megatron's own over its globals otherwise."""
    try:
        takes = "pg_collection" in inspect.signature(builder).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        return {}
    if current_plan() is not None:
        return {"pg_collection": planned_collection()}
    return {"pg_collection": collection_class().use_mpu_process_groups()}
