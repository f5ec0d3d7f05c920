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
:data:`FIELDS`; a field het_plugin does not know stops with the field's name rather than being left empty. With
one distributed-optimizer instance and no GTP rematerialisation (what het_plugin places), Megatron's partial and
GTP groups are the plain ones: so are the collection's.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from ..core.errors import ConfigError
from .applied_state import current_plan
from .group_check import EXPERT_AS_DECODER
from .lm import start_explicit_groups

# field -> how it is made from the plan: ("kind", plan kind) | ("alias", field) | ("first_of", kind) |
# ("world",) | ("self",) | ("none",) | ("all_gather", kind)
FIELDS = {
    "tp": ("kind", "tp"), "pp": ("kind", "pp"), "mp": ("kind", "tp-pp"), "embd": ("kind", "embedding"),
    "pos_embd": ("first_of", "pp"), "cp": ("kind", "cp"), "tp_cp": ("kind", "tp-cp"), "hcp": ("none",),
    "ep": ("kind", "expert-ep"), "expt_tp": ("kind", "expert-tp"), "tp_ep": ("kind", "expert-tp-ep"),
    "tp_ep_pp": ("kind", "expert-tp-ep-pp"), "tp_dp_cp": ("kind", "tp-dp-cp"), "dp": ("kind", "dp"),
    "dp_cp": ("kind", "dp-cp"), "expt_dp": ("kind", "expert-dp"), "intra_dp_cp": ("alias", "dp_cp"),
    "intra_expt_dp": ("alias", "expt_dp"), "inter_dist_opt": ("none",), "intra_dist_opt": ("world",),
    # megatron-core 0.19
    "tp_ep_pp_with_egtp_remat": ("alias", "tp_ep_pp"), "dp_cp_gtp_remat": ("alias", "dp_cp"),
    "gtp_remat": ("self",), "expt_gtp_remat": ("self",), "expt_dp_gtp_remat": ("alias", "expt_dp"),
    "dp_cp_ag": ("all_gather", "dp-cp"), "expt_dp_ag": ("all_gather", "expert-dp"),
}


def collection_class():
    from megatron.core.process_groups_config import ProcessGroupCollection
    return ProcessGroupCollection


def planned_collection(applied=None, *, from_plan: bool = False, all_gather: bool = False,
                       parallel_state=None) -> Any:
    """The run's ``ProcessGroupCollection`` on the plan (see the module docstring); ``applied``: the applied plan
    (None: :func:`~het_plugin.megatron.mcore.current_plan`); ``all_gather``: also the all-gather groups
    (``dp_cp_ag``/``expt_dp_ag``, megatron-core 0.19's ``--create-all-gather-group``) on the plan's data-parallel
    groups. Every rank calls it (groups are created collectively)."""
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
    with applied.guarding("het_plugin's planned ProcessGroupCollection"):
        return _from_plan(applied, cls, names, all_gather)


def _from_plan(applied, cls, names: list[str], all_gather: bool) -> Any:
    import torch.distributed as dist
    plan, me = applied.plan, applied.rank
    made: dict[tuple, Any] = {}

    def create(ranks, desc):
        key = tuple(ranks)
        if key not in made:
            def make(spec):
                order = list(spec.torch_ranks) if not spec.sort_ranks else sorted(spec.ranks)
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
        elif how[0] == "world":
            values[name] = mine([list(range(plan.world_size))], desc)
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
