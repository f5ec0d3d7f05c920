"""The topology objects a script builds itself answer with the plan's coordinates.

DeepSpeed scripts build a ``PipeModelDataParallelTopology`` (or ``PipeDataParallelTopology`` /
``ProcessTopology``), hand it to ``PipelineModule(topology=...)`` and often read coordinates from it too:
``topo.get_coord(rank).data`` as the data rank that picks the samples (Megatron-DeepSpeed's ``GPTModelPipe``
builds one from its degrees). het_plugin gives DeepSpeed a :class:`~het_plugin.deepspeed.process_topology.PlanTopology`;
the script's own object would still describe the launch order, so the stages of one pipeline would read
different samples. DeepSpeed 0.19.8's ``ProcessTopology`` (runtime/pipe/topology.py) answers every query
(``get_rank``, ``get_coord``, ``get_axis_list``, ``get_axis_comm_lists``, ``filter_match``) from its one dict
``mapping`` (coordinate -> global rank), so rewriting that dict in place makes the script's object the plan's.

* :func:`track` (installed with the import hook, when ``deepspeed`` loads): every topology the script creates
  (not DeepSpeed's or het_plugin's own) is remembered (weakly) with the line that built it; one built while a
  permuting plan is applied is adopted at once.
* :func:`check` (on every rank, inside the plan agreement): each remembered topology that describes this run's
  ranks (axes among pipe/data/model, as many coordinates as ranks) must have the plan's degrees, else a
  ConfigError names its class, degrees and the line that built it, and the fix.
* :func:`adopt` (after agreement, before DeepSpeed builds its grid): rewrite their mappings to the plan's.

Topologies over other axes or another number of ranks are not about this run and are left alone. Arithmetic on
launch ranks (``rank % dp``) cannot be seen: docs/deepspeed.md's migration notes name it.
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Optional

from ..core.errors import ConfigError
from ..core.plan import Plan
from ..runtime.patches import PATCHES

AXES = {"pipe": "pp", "data": "dp", "model": "tp"}
FIX = ("read the data rank from DeepSpeed's grid (engine.grid.get_data_parallel_rank(), "
       "model.mpu().get_data_parallel_rank()) or deepspeed.utils.groups, not from a topology of your own; or build "
       "the topology with the plan's degrees (PipeModelDataParallelTopology(num_pp={pp}, num_mp={tp}, num_dp={dp})), "
       "which het_plugin then places as the plan does")
# Process state: the topologies the script built (weak references and their creation lines), and the plan once
# one that moves ranks is applied (topologies built afterwards are adopted on creation).
_state: dict[str, Any] = {"built": [], "plan": None}


def track(label: str) -> None:
    """Remember the topologies the script builds from now on (idempotent; the import hook's patch, under its
    ``label``, so that the hook's ``uninstall`` takes it away; DeepSpeed must be importable)."""
    from deepspeed.runtime.pipe.topology import ProcessTopology
    PATCHES.apply(ProcessTopology, "__init__", remembering, label=label)


def remembering(original):
    """``ProcessTopology.__init__`` that remembers (and, under an applied plan, places) what the script builds."""
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        site = _script_site(self)
        if site is None or type(self).__module__.startswith("het_plugin."):
            return                                   # DeepSpeed's own default topology, or the plan's
        _state["built"] = [(ref, s) for ref, s in _state["built"] if ref() is not None]
        _state["built"].append((weakref.ref(self), site))
        plan = _state["plan"]
        if plan is not None:
            check_one(self, site, plan, "<config>")
            _rewrite(self, plan)
    return __init__


def _script_site(topology) -> Optional[str]:
    """``file:line`` of the code that built ``topology`` (past the constructors of its classes); None when
    DeepSpeed itself built it (its default when a PipelineModule or grid gets none)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_locals.get("self") is topology:
        frame = frame.f_back
    if frame is None or frame.f_globals.get("__name__", "").split(".")[0] == "deepspeed":
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _describes_run(topology, world_size: int) -> bool:
    axes = list(topology.get_axis_names())
    return set(axes) <= set(AXES) and topology.world_size() == world_size


def _degrees(topology) -> dict[str, int]:
    return {AXES[a]: max(topology.get_dim(a), 1) for a in AXES}


def _plan_degrees(plan: Plan) -> dict[str, int]:
    return {"pp": plan.pp, "dp": plan.dp, "tp": plan.tp}


def check_one(topology, site: str, plan: Plan, source: str) -> None:
    """A ConfigError unless ``topology`` (built at ``site``) can answer with the plan's coordinates."""
    if not _describes_run(topology, plan.world_size):
        return
    have = _degrees(topology)
    want = _plan_degrees(plan)
    if have != want:
        shape = ", ".join(f"{a}={topology.get_dim(a)}" for a in topology.get_axis_names())
        raise ConfigError(f"the {type(topology).__name__}({shape}) built at {site} describes the {plan.world_size} "
                          f"launched ranks with degrees pp={have['pp']}, dp={have['dp']}, tp={have['tp']}, but the "
                          f"plan has pp={plan.pp}, dp={plan.dp}, tp={plan.tp} and places ranks in the order "
                          f"{list(plan.rank_of_logical)}: coordinates read from it would not be the ones DeepSpeed "
                          "trains with", source=source, field="topology",
                          fix=FIX.format(pp=plan.pp, tp=plan.tp, dp=plan.dp))


def check(plan: Plan, given=None, source: str = "<config>") -> None:
    """Every topology the script built (and ``given``, the one handed to PipelineModule) can take the plan."""
    if plan.is_identity:
        return
    for topology, site in _live(given):
        check_one(topology, site, plan, source)


def adopt(plan: Plan, given=None) -> None:
    """Place every topology the script built (and ``given``) as the plan does; later ones on creation."""
    if plan.is_identity:
        return
    for topology, _ in _live(given):
        if _describes_run(topology, plan.world_size) and _degrees(topology) == _plan_degrees(plan):
            _rewrite(topology, plan)          # (the others were refused by check, inside the plan agreement)
    _state["plan"] = plan


def _live(given) -> list[tuple[Any, str]]:
    found = [(ref(), site) for ref, site in _state["built"]]
    found = [(t, site) for t, site in found if t is not None]
    if given is not None and not type(given).__module__.startswith("het_plugin.") \
            and all(t is not given for t, _ in found):
        found.append((given, "the topology= handed to PipelineModule"))
    return found


def _rewrite(topology, plan: Plan) -> None:
    """Each coordinate maps to the rank the plan gives it (done once per object)."""
    if getattr(topology, "het_plan_hash", None) == plan.hash:
        return
    rank_at = {tuple(plan.coord(r)[k] for k in ("pp", "dp", "tp")): r for r in range(plan.world_size)}
    topology.mapping = {coord: rank_at[(getattr(coord, "pipe", 0), getattr(coord, "data", 0),
                                        getattr(coord, "model", 0))]
                        for coord in topology.mapping}
    topology.het_plan_hash = plan.hash


def forget() -> None:
    """Drop what was remembered and the applied plan (tests; a process that builds a second model)."""
    _state["built"] = []
    _state["plan"] = None


def forget_plan() -> None:
    """``het_plugin.deepspeed.forget_plan()``: the plan stops applying in this process. For a process that trains
    several configurations in turn, the next perhaps without het_plugin: without it, a topology the next one
    builds would still be placed as the last plan placed it (the plan stays applied for the process, so that the
    topologies a script builds after ``initialize`` follow it)."""
    forget()
