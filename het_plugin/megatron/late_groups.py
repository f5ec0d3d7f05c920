"""Groups Megatron makes after ``initialize_model_parallel``, on the plan's placement too.

Megatron does not create all its groups in the initialize window that :func:`~het_plugin.megatron.groups.
planned_groups` patches: Megatron-LM's ``get_model`` calls ``parallel_state.create_all_gather_groups``
(``--create-all-gather-group``; megatron-core 0.19, absent in 0.16) with a fresh ``RankGenerator``, model code
may build its own generator, and ``HyperCommGrid`` (megatron-core 0.16-0.19 hyper_comm_grid.py; Megatron-LM
main's RL inference shards) numbers ranks with ``np.arange`` and creates its groups through
``torch.distributed.new_subgroups_by_enumeration``. For the whole run after the window (until
``forget_plan``):

* ``RankGenerator.get_ranks`` maps Megatron's numbering through the plan (non-identity plans);
* ``parallel_state.create_group`` goes through the one group policy (backend, network, member order);
* ``HyperCommGrid.create_pg`` maps its enumeration through the plan and creates each group through the policy,
  and ``HyperCommGrid.get_rank_enum`` answers in launch ranks and remembers the lists it gave: a
  ``torch.distributed.new_group`` whose members lie inside one of them (Megatron-LM main's inference shards and
  MiMo make the embedding groups ``[first, last]`` and ``[first]`` of each pipeline list) is created through the
  policy too (:func:`planned_new_group`), so it gets the plan's network and member order; any other
  ``new_group`` is torch's own;
* ``parallel_state.destroy_model_parallel`` ends all of this with Megatron's groups.

On a homogeneous identity plan nothing is patched: Megatron's own groups and options.

A script that builds its own groups before Megatron-LM initialises anything (``pretrain(...,
skip_model_parallel_init=True, pg_collection=...)``, the MiMo pattern) would make them before any plan is applied:
:func:`install_start` (Megatron-LM with ``--heterogeneous-nic``, from ``parse_args``) lets the first
``HyperCommGrid.create_pg`` or ``parallel_state.create_group`` run the start-up first (the ranks agree on the plan;
``lm.start_explicit_groups``), so that group and every later one follow the plan.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Optional

from ..runtime.applied import AppliedPlan
from ..runtime.group_policy import spans_vendors
from ..runtime.patches import PATCHES
from .groups import option_notes, planned_create_group, planned_get_ranks

LABEL = "megatron.groups.run"
START_LABEL = "megatron.groups.start"     # the first group a script builds itself starts the plan


def install(applied: AppliedPlan, *, parallel_state=None, hyper_comm_grid: Any = None) -> bool:
    """Patch the creation paths above for the rest of the run; False where the plan changes nothing."""
    uninstall()
    if applied.policy.native_network and applied.plan.is_identity:
        return False
    parallel_state, hyper_comm_grid = _modules(parallel_state, hyper_comm_grid)
    if spans_vendors(applied.plan):
        from .. import comm  # noqa: F401   registers het_shim (a script's groups may be the first ones made)
    if not applied.plan.is_identity:
        PATCHES.apply(parallel_state.RankGenerator, "get_ranks", planned_get_ranks(applied), label=LABEL)
    create_group = planned_create_group(applied)
    PATCHES.apply(parallel_state, "create_group", lambda orig: _own(applied, create_group(orig)), label=LABEL)
    PATCHES.apply(parallel_state, "destroy_model_parallel", _ending, label=LABEL)
    grid = getattr(hyper_comm_grid, "HyperCommGrid", None)
    if grid is not None:
        PATCHES.apply(grid, "create_pg", planned_create_pg(applied, hyper_comm_grid.dist), label=LABEL)
        if hasattr(grid, "get_rank_enum"):
            PATCHES.apply(grid, "get_rank_enum", planned_rank_enum(applied), label=LABEL)
            PATCHES.apply(hyper_comm_grid.dist, "new_group", planned_new_group(applied), label=LABEL)
    return True


@contextlib.contextmanager
def own_creation(applied: AppliedPlan) -> Iterator[None]:
    """het_plugin creates a group through the policy already: :func:`planned_new_group` passes it through (kept on
    the applied plan, like its option notes: no module state)."""
    applied.__dict__["_own_creation"] = applied.__dict__.get("_own_creation", 0) + 1
    try:
        yield
    finally:
        applied.__dict__["_own_creation"] -= 1


def _own(applied: AppliedPlan, fn):
    def call(*args, **kwargs):
        with own_creation(applied):
            return fn(*args, **kwargs)
    return call


def uninstall() -> int:
    return PATCHES.undo(LABEL)


def _modules(parallel_state=None, hyper_comm_grid=None):
    if parallel_state is None:
        from megatron.core import parallel_state
    if hyper_comm_grid is None:
        try:
            from megatron.core import hyper_comm_grid
        except ImportError:
            hyper_comm_grid = None
    return parallel_state, hyper_comm_grid


def install_start(start: Callable[[], Optional[AppliedPlan]], *, parallel_state=None,
                  hyper_comm_grid: Any = None) -> None:
    """Until a plan is applied: the first ``HyperCommGrid.create_pg`` / ``parallel_state.create_group`` (collective
    calls: every rank makes them in the same order) calls ``start()`` (the start-up), then makes its group, under
    the plan's run-long patches where the plan applies. Taken away by :func:`uninstall_start` (the start-up does
    it first thing)."""
    parallel_state, hyper_comm_grid = _modules(parallel_state, hyper_comm_grid)
    grid = getattr(hyper_comm_grid, "HyperCommGrid", None)
    sites = [(parallel_state, "create_group")] + ([(grid, "create_pg")] if grid is not None else [])
    for owner, name in sites:
        PATCHES.apply(owner, name, _starting(start, owner, name), label=START_LABEL)


def uninstall_start() -> int:
    return PATCHES.undo(START_LABEL)


def _starting(start, owner, name):
    def make(orig):
        def first_group(*args, **kwargs):
            start()                        # takes this patch away; installs the plan's where it applies
            uninstall_start()
            return getattr(owner, name)(*args, **kwargs)
        return first_group
    return make



def _ending(orig_destroy):
    """Megatron's groups destroyed: the plan's placement ends with them (a later initialize is someone else's)."""
    def destroy_model_parallel(*args, **kwargs):
        try:
            return orig_destroy(*args, **kwargs)
        finally:
            uninstall()
    return destroy_model_parallel


def planned_create_pg(applied: AppliedPlan, dist_module):
    """``make`` for HyperCommGrid.create_pg: its ``new_subgroups_by_enumeration`` call is answered by
    :func:`planned_subgroups` for the duration of the call."""
    def make(orig_create_pg):
        def create_pg(self, dims, *args, **kwargs):
            with PATCHES.temporarily("megatron.groups.hyper", [(dist_module, "new_subgroups_by_enumeration",
                                                                 lambda orig: planned_subgroups(applied))]):
                with own_creation(applied):
                    return orig_create_pg(self, dims, *args, **kwargs)
        return create_pg
    return make


def planned_rank_enum(applied: AppliedPlan):
    """``make`` for HyperCommGrid.get_rank_enum: the lists callers build their own groups from (Megatron-LM main's
    inference shards make the embedding groups from the pp enumeration with ``dist.new_group``) in launch ranks."""
    perm = applied.plan.rank_of_logical
    given = enumerated(applied)

    def make(orig):
        def get_rank_enum(self, *args, **kwargs):
            lists = [[perm[r] for r in ranks] for ranks in orig(self, *args, **kwargs)]
            for ranks in lists:
                members = frozenset(ranks)
                for r in members:
                    given.setdefault(r, set()).add(members)
            return lists
        return get_rank_enum
    return make


def enumerated(applied: AppliedPlan) -> dict:
    """The member sets ``get_rank_enum`` gave out under ``applied``, by member rank (kept on it: they end with the
    plan): a ``new_group`` looks up only the lists its first rank is in, not every list (each rank makes every
    group, so a scan of all lists would be quadratic in the world size)."""
    return applied.__dict__.setdefault("_rank_enum_lists", {})


# new_group's arguments the policy decides (the caller's backend, options and timeout are its inputs)
POLICY_ARGS = ("backend", "pg_options", "timeout")


def _inside_a_list(ranks, given: dict) -> bool:
    """All of ``ranks`` lie in one list ``get_rank_enum`` gave out (``given``: :func:`enumerated`)."""
    ranks = list(ranks)
    if not ranks:                   # (the empty set lies in any list)
        return bool(given)
    wanted = set(ranks)
    return any(wanted <= members for members in given.get(ranks[0], ()))


def planned_new_group(applied: AppliedPlan):
    """``make`` for ``torch.distributed.new_group`` for the run: a group whose members all lie in one list
    ``get_rank_enum`` gave out is the caller's group over the plan's grid, so it is created through the one group
    policy (the caller's backend and options composed with the plan's network, members in logical order) and
    recorded. Every other call, and het_plugin's own creations (:func:`own_creation`), go to torch unchanged."""
    given = enumerated(applied)
    notes = option_notes(applied)

    def make(orig):
        def new_group(ranks=None, *args, **kwargs):
            if (args or ranks is None or "sort_ranks" in kwargs or applied.__dict__.get("_own_creation")
                    or not _inside_a_list(ranks, given)):
                return orig(ranks, *args, **kwargs)
            asked = {k: kwargs.pop(k, None) for k in POLICY_ARGS}
            desc = kwargs.get("group_desc") or "HYPER_COMM_GRID_RANKS"

            def build(spec):
                note = notes.check(desc, spec.ranks, asked["pg_options"], spec.net_name)
                if note:
                    logging.getLogger("het_plugin.megatron").warning("het_plugin: %s", note)
                members = list(spec.torch_ranks) if not spec.sort_ranks else sorted(spec.ranks)
                return orig(members, **kwargs, **spec.new_group_kwargs())

            return applied.create(build, [int(r) for r in ranks], backend=asked["backend"],
                                  pg_options=asked["pg_options"], desc=desc, timeout=asked["timeout"])
        return new_group
    return make


def planned_subgroups(applied: AppliedPlan):
    """torch's ``new_subgroups_by_enumeration`` with the plan's placement: each enumerated list is logical
    (HyperCommGrid's ``np.arange`` numbering), mapped to launch ranks, and created through the group policy."""
    import torch.distributed as dist
    perm = applied.plan.rank_of_logical
    notes = option_notes(applied)

    def new_subgroups_by_enumeration(ranks_per_subgroup_list, timeout=None, backend=None, pg_options=None,
                                     group_desc: Optional[str] = None):
        me = dist.get_rank()
        mine, groups = None, []
        for logical in ranks_per_subgroup_list:
            if max(logical) >= len(perm):
                raise RuntimeError(f"HyperCommGrid asks for rank {max(logical)}, the plan places {len(perm)}")
            physical = [perm[r] for r in logical]

            def make(spec):
                note = notes.check(group_desc or "HYPER_COMM_GRID", spec.ranks, pg_options, spec.net_name)
                if note:
                    logging.getLogger("het_plugin.megatron").warning("het_plugin: %s", note)
                ranks = list(spec.torch_ranks) if not spec.sort_ranks else sorted(spec.ranks)
                return dist.new_group(ranks=ranks, group_desc=group_desc, **spec.new_group_kwargs())

            group = applied.create(make, physical, backend=backend, pg_options=pg_options,
                                   desc=group_desc or "HYPER_COMM_GRID", timeout=timeout)
            groups.append(group)
            if me in physical:
                mine = group
        return mine, groups
    return new_subgroups_by_enumeration
