"""After the model and optimizer are built: every group the run uses is checked against the plan.

Megatron is moving to explicit process groups (a ``ProcessGroupCollection`` handed to the model, the optimizer and
the schedules); a group made outside het_plugin's reach -- a script's own ``dist.new_group`` lists, a module grid
of a multi-module (MiMo) topology, or a path het_plugin does not patch -- would keep its own numbering and
silently gather, reduce or pipeline among the wrong ranks. (A script that builds its groups itself through
Megatron's paths, ``pretrain(..., skip_model_parallel_init=True)``, is served: late_groups and
``lm.start_explicit_groups``.) The check compares each group of the collection (and Megatron's gloo twins) with
the plan's group of the same kind holding this rank, and stops every rank (the applied plan's guard) naming the
first group that differs: in Megatron-LM on the collection pretrain passes, before the model is built and after.

Fields (megatron-core 0.16.1 and 0.19.2 process_groups_config.py) are compared with the plan's kinds: equal
(:data:`EQUAL`), or inside a plan group (:data:`WITHIN`: sub-groups Megatron derives, and the embedding groups,
which follow the script's ``get_embedding_ranks``). Fields with no plan counterpart (``intra_dist_opt``, the GTP
rematerialisation groups het_plugin refuses) are not compared. A homogeneous identity plan is Megatron's own
numbering: nothing to check.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

from ..core.errors import ConfigError
from .applied_state import current_plan
from ..runtime.patches import PATCHES

LABEL = "megatron.group_check"

EQUAL = {"tp": "tp", "pp": "pp", "mp": "tp-pp", "cp": "cp", "tp_cp": "tp-cp", "tp_dp_cp": "tp-dp-cp", "dp": "dp",
         "dp_cp": "dp-cp", "dp_cp_ag": "dp-cp", "ep": "expert-ep", "expt_tp": "expert-tp", "tp_ep": "expert-tp-ep",
         "tp_ep_pp": "expert-tp-ep-pp", "expt_dp": "expert-dp", "expt_dp_ag": "expert-dp",
         "dp_gloo": "dp", "dp_cp_gloo": "dp-cp", "expt_dp_gloo": "expert-dp"}
WITHIN = {"embd": "pp", "pos_embd": "pp", "hcp": "cp", "intra_dp_cp": "dp-cp", "intra_expt_dp": "expert-dp",
          "inter_dist_opt": "expert-dp", "intra_dp_cp_gloo": "dp-cp", "intra_expt_dp_gloo": "expert-dp"}
# Without expert parallelism of its own (ep=1, etp=tp) a plan has no expert kinds: Megatron's expert groups are
# then the decoder's (its expert RankGenerator has cp=1 and data-parallel size dp*cp).
EXPERT_AS_DECODER = {"expert-tp": "tp", "expert-tp-ep": "tp", "expert-tp-ep-pp": "tp-pp", "expert-dp": "dp-cp"}

FIX_ORDER = ("build the groups through Megatron's own paths, which follow the plan: parallel_state."
             "initialize_model_parallel, parallel_state.create_group, a HyperCommGrid over every rank (its create_pg "
             "and get_rank_enum), or take het_plugin.megatron.planned_collection(from_plan=True) as the "
             "pg_collection -- or launch the nodes in the plan's order (launch.node_order) so the plan is Megatron's "
             "numbering")


FIX_MODULES = ("a multi-module topology (MiMo: a HyperCommGrid per module, each with its own degrees) is not one "
               "model over the world, which is what het_plugin's plan places: run it without --heterogeneous-nic, "
               "or give every module the plan's grid over every rank")


def plan_group(plan, kind: str, rank: int) -> Optional[list[int]]:
    """The plan's group of ``kind`` holding ``rank`` (None: the plan has no such group, e.g. size 1)."""
    if kind not in plan.groups:
        kind = EXPERT_AS_DECODER.get(kind, kind)
        if kind not in plan.groups:
            return None
    return next((list(g.ranks) for g in plan.groups[kind] if rank in g.ranks), None)


def mismatches(plan, rank: int, groups: dict[str, Any], ranks_of: Callable[[Any], Sequence[int]]) -> list[str]:
    """One line per group of ``groups`` (field -> group, or a list of groups) that does not match the plan."""
    out = []
    for name, value in groups.items():
        for group in (value if isinstance(value, (list, tuple)) else [value]):
            members = _members(group, ranks_of)
            if members is None or len(members) <= 1:
                continue
            field = name.rsplit(":", 1)[-1]          # 'language:tp' from a multi-module collection
            kind = EQUAL.get(field) or WITHIN.get(field)
            if kind is None:
                continue
            want = plan_group(plan, kind, rank)
            if want is None:
                continue
            ok = sorted(members) == sorted(want) if field in EQUAL else set(members) <= set(want)
            if not ok:
                relation = "the plan's" if field in EQUAL else "inside the plan's"
                out.append(f"{name}: ranks {sorted(members)}, {relation} {kind} group of rank {rank} is "
                           f"{sorted(want)}")
    return out


def _members(group, ranks_of) -> Optional[list[int]]:
    import torch.distributed as dist
    if not isinstance(group, dist.ProcessGroup):    # None, a non-member sentinel, a setting
        return None
    return [int(r) for r in ranks_of(group)]


def collection_groups(pg_collection: Any) -> dict[str, Any]:
    """The groups a ProcessGroupCollection holds (fields not set are left out); a MultiModuleProcessGroupCollection
    (MiMo, 0.19) gives each module's as ``module:field``."""
    modules = getattr(pg_collection, "module_pgs", None)
    if isinstance(modules, dict):
        return {f"{m}:{name}": g for m, sub in modules.items() for name, g in collection_groups(sub).items()}
    names = [f.name for f in dataclasses.fields(pg_collection)] if dataclasses.is_dataclass(pg_collection) else []
    names += [n for n in getattr(pg_collection, "__dict__", {}) if n not in names]   # e.g. dp_cp_ag set on 0.16
    return {name: getattr(pg_collection, name) for name in names if getattr(pg_collection, name, None) is not None}


def gloo_extras(parallel_state) -> dict[str, Any]:
    """Megatron's gloo twins (not in the collection; the distributed optimizer's CPU paths use them)."""
    out = {}
    for name, getter, kwargs in (("dp_gloo", "get_data_parallel_group_gloo", {}),
                                 ("dp_cp_gloo", "get_data_parallel_group_gloo", {"with_context_parallel": True}),
                                 ("expt_dp_gloo", "get_expert_data_parallel_group_gloo", {})):
        fn = getattr(parallel_state, getter, None)
        try:
            group = fn(**kwargs) if fn is not None else None
        except (AssertionError, RuntimeError, TypeError):
            group = None
        if group is not None:
            out[name] = group
    return out


def check_groups(pg_collection: Any = None, *, applied=None, extras: Optional[dict[str, Any]] = None,
                 parallel_state=None, what: str = "after the model and optimizer were built") -> int:
    """Compare the run's groups with the plan (``pg_collection``: the run's, None: Megatron's globals through
    ``ProcessGroupCollection.use_mpu_process_groups()``; ``extras``: more named groups). Every rank stops with
    a ConfigError naming the first group that differs; returns how many groups were compared."""
    applied = current_plan() if applied is None else applied
    if applied is None:
        raise ConfigError(f"the run's process groups ({what}) were not made by het_plugin: --heterogeneous-nic is on "
                          "but no plan was applied in this process (skip_model_parallel_init with lazy_mpu_init, "
                          "or groups made before het_plugin's start-up)",
                          field="skip_model_parallel_init", fix=FIX_ORDER)
    plan = applied.plan
    if plan.homogeneous and plan.is_identity:
        return 0
    import torch.distributed as dist
    if parallel_state is None:
        from megatron.core import parallel_state
    if pg_collection is None:
        from megatron.core.process_groups_config import ProcessGroupCollection
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    groups = {**collection_groups(pg_collection), **gloo_extras(parallel_state), **(extras or {})}
    bad = mismatches(plan, applied.rank, groups, dist.get_process_group_ranks)
    with applied.guarding(f"het_plugin's group check {what}"):
        if bad:
            name = bad[0].split(" ", 1)[0].rstrip(":")
            raise ConfigError(f"{len(bad)} of the run's process groups do not follow the plan (they would "
                              f"communicate among the wrong ranks): {'; '.join(bad[:4])}"
                              f"{' ...' if len(bad) > 4 else ''}", field=name,
                              fix=FIX_MODULES if ":" in name else FIX_ORDER)
    return len(groups)


def install(training_module, start: Optional[Callable[[], Any]] = None) -> None:
    """Megatron-LM: ``initialize_megatron(skip_model_parallel_init=True)`` (pretrain's call, before any model) runs
    het_plugin's start-up ``start`` after Megatron's own initialisation where no plan was applied yet (the script
    built its groups before any plan, or none: the check below then judges them); then check after
    ``setup_model_and_optimizer`` (the ``pg_collection`` pretrain passes: the caller's, or Megatron's globals)."""
    if getattr(training_module, "initialize_megatron", None) is not None and start is not None:
        PATCHES.apply(training_module, "initialize_megatron", functools.partial(_starting_on_skip, start),
                      label=LABEL)
    if getattr(training_module, "setup_model_and_optimizer", None) is not None:
        PATCHES.apply(training_module, "setup_model_and_optimizer", _checked_setup, label=LABEL)


def _starting_on_skip(start, initialize):
    def initialize_megatron(*args, **kwargs):
        result = initialize(*args, **kwargs)
        import torch.distributed as dist
        # with lazy_mpu_init Megatron returns before the world group exists: the check after setup judges
        if kwargs.get("skip_model_parallel_init") and current_plan() is None and dist.is_initialized():
            start()
        return result
    return functools.update_wrapper(initialize_megatron, initialize)


def _checked_setup(setup):
    def setup_model_and_optimizer(*args, **kwargs):
        given = kwargs.get("pg_collection")
        if given is not None:                # the caller's collection, complete already: before any model is built
            check_groups(given, what="before the model is built")
        result = setup(*args, **kwargs)
        check_groups(given)                  # and the groups made while building (all-gather groups, ...)
        return result
    return functools.update_wrapper(setup_model_and_optimizer, setup)
