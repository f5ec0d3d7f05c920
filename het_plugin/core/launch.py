"""The plan a launch runs: one entry point for both adapters and the CLI.

A source is a Plan, a plan (as a dict or a file from ``het-plugin plan -o``), a cluster (object or
file), or nothing (discover the cluster on every rank). A plan is checked against the launch (world
size, the degrees the user fixed, the model); a cluster is checked against the launch and planned for
the model. Pure: discovery (which gathers over the job's store) is passed in by the adapters, and so is ``share_plan``,
how the ranks of one node plan once between them (``het_plugin.runtime.plan_once``): it gets the digest of
every planning input (:func:`planning_digest`) and the call that plans.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

from .. import __version__
from .inputs.cluster import Cluster, load_cluster
from .inputs.yamlio import validate
from .planner import make_plan, placeable_degrees
from .ranks.placement import check_world_size
from .errors import ConfigError
from .inputs.model import ModelSpec, load_model, preset_model
from .plan import Plan, looks_like_plan
from .ranks.dims import Degrees, parse_order
from .request import Launch, LaunchRequest, Schedule
from .subsets import check_launch_nodes, plan_nodes

PathLike = Union[str, Path]
ModelArg = Union[ModelSpec, dict, PathLike, None, Callable[[], ModelSpec]]
Source = Union[Plan, dict, Cluster, PathLike, None]

DISCOVER = ("discover", "auto")      # what the adapters call "find the cluster yourself"
SharePlan = Callable[[str, Callable[[], Plan]], Plan]


def model_from_arg(model: ModelArg) -> Optional[ModelSpec]:
    """A ModelSpec, a dict of its fields, a model file, a preset name, or a callable making one."""
    if callable(model) and not isinstance(model, ModelSpec):
        model = model()
    if model is None or isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        return validate(ModelSpec, model, "<model dict>")
    text = str(model)
    if Path(text).exists() or text.endswith((".yaml", ".yml", ".json")):
        return load_model(text)
    return preset_model(text)


def load_source(source: Source, what: str = "cluster") -> Union[Plan, Cluster, None]:
    """The object a source names: a Plan, a Cluster, or None (discover). Missing files name the field."""
    if source is None or isinstance(source, (Plan, Cluster)):
        return source
    if isinstance(source, dict):
        return Plan.from_dict(source)
    text = str(source)
    if text in DISCOVER:
        return None
    path = Path(text)
    if path.is_dir():
        raise ConfigError(f"{what} path is a directory, not a file", source=text, field=what,
                          fix="pass an existing cluster file inside it (see examples/clusters), not the folder, or "
                              "a plan file (`het-plugin plan -o`)")
    if not path.is_file():
        raise ConfigError(f"{what} file not found" if not path.exists() else f"{what} path is not a file",
                          source=text, field=what,
                          fix="pass an existing cluster file (see examples/clusters) or a plan file "
                              "(`het-plugin plan -o`)")
    return Plan.load(path) if looks_like_plan(path) else load_cluster(path)


def no_discovery() -> Cluster:
    """What a caller without ranks gets for "discover": discovery runs on ranks (het_plugin.discovery), and the
    pure core cannot reach it; the adapters pass ``discover=het_plugin.discovery.discover_cluster``."""
    raise ConfigError("no cluster given, and discovery runs only on the job's ranks", field="cluster",
                      fix="pass a cluster file or a plan file")


@dataclass(frozen=True)
class Resolved:
    """The plan a launch runs and the cluster it was made from (a cluster file or discovery; None for a plan
    file): the adapters' network pre-flight reads the nodes' NICs there (het_plugin.runtime.preflight)."""
    plan: Plan
    cluster: Optional[Cluster] = None


def resolve_plan(source: Source, request: Optional[LaunchRequest] = None, *, model: ModelArg = None,
                 discover: Callable[[], Cluster] = no_discovery, **keywords: Any) -> Plan:
    """The plan this launch runs (see the module docstring): :func:`resolve_launch` without the cluster."""
    return resolve_launch(source, request, model=model, discover=discover, **keywords).plan


def request_of(*, launch: Launch, degrees: Optional[Degrees] = None, micro_batch_size: Optional[int] = None,
               names: Optional[dict[str, str]] = None, vpp: Optional[int] = None,
               overlap_p2p_comm: Optional[bool] = None, use_all_nodes: bool = True,
               optimizer_instances: bool = True) -> LaunchRequest:
    """The request of :func:`resolve_launch`'s keyword form. ``degrees``: what the user fixed (None entries are
    the planner's to choose); ``names``: what the user calls tp/pp/dp/cp, for messages. ``vpp``: virtual
    pipeline stages per rank (an interleaved pipeline; None: 1, or what a plan file says) and
    ``overlap_p2p_comm`` (None: the planner's default, on with vpp > 1), taken as given."""
    return LaunchRequest(launch, degrees or Degrees(launch.world_size), Schedule(vpp, overlap_p2p_comm),
                         micro_batch_size, names=names or {}, use_all_nodes=use_all_nodes,
                         optimizer_instances=optimizer_instances)


def resolve_launch(source: Source, request: Optional[LaunchRequest] = None, *, model: ModelArg = None,
                   discover: Callable[[], Cluster] = no_discovery, profile: Any = None,
                   share_plan: Optional[SharePlan] = None, **keywords: Any) -> Resolved:
    """The plan this launch runs, with the cluster the plan was made from. ``request``: the launch's
    :class:`~het_plugin.core.request.LaunchRequest` (or its keyword form, :func:`request_of`: ``launch=``,
    ``degrees=``, ...). ``discover``: what finds the cluster when the source names none (on ranks:
    ``het_plugin.discovery.discover_cluster``). ``profile``: a measured profile the planner uses (re-planning on
    restart, :mod:`het_plugin.runtime.restart_replan`; not for a plan file). ``share_plan(digest, plan)``: where
    the search runs (None: here), see the module docstring. The request's ``use_all_nodes``: plan for every node
    of the cluster (True, what a launch of all of them needs); False: the planner may leave out node groups
    (:mod:`het_plugin.core.subsets`) -- the caller then checks the launch with :func:`subsets.check_launch_nodes`
    (a re-plan on restart plans for the nodes that came back)."""
    if request is None:
        request = request_of(**keywords)
    elif keywords:
        raise TypeError(f"resolve_launch: pass the request or its keywords, not both ({', '.join(keywords)})")
    degrees, names = request.degrees, dict(request.names)
    loaded = load_source(source)
    if isinstance(loaded, Plan):
        where = str(source) if isinstance(source, (str, Path)) else "<plan>"
        if loaded.left_out:         # a plan for the kept nodes: the launch must be those (issue 32)
            try:
                check_launch_nodes(loaded, request.launch.nodes, request.launch.world_size)
            except ConfigError as exc:
                raise ConfigError(exc.problem, source=where, field=exc.field, fix=exc.fix) from None
        check_plan_fits(loaded, request, model_from_arg(model), where)
        check_launch_settings(loaded, request.settings(), where, names)
        return Resolved(loaded)
    cluster = loaded if loaded is not None else discover()
    launch = request.launch
    check_world_size(cluster, launch.world_size, rank=launch.rank, local_world_size=launch.local_world_size)
    spec = model_from_arg(model)
    if spec is None:
        raise ConfigError("a cluster needs a model to plan for", field="model",
                          fix="pass a model (ModelSpec, model file or preset name), or a plan file")
    fixed = {k: getattr(degrees, k) for k in ("tp", "pp", "dp")}

    def search() -> Plan:
        # every subset of nodes is planned for with the planner's keyword form: its world size is the subset's
        return plan_nodes(cluster, spec, use_all_nodes=request.use_all_nodes, plan_fn=make_plan, profile=profile,
                          **request.planner_options())

    try:
        if share_plan is None:
            return refuse_left_out(Resolved(search(), cluster), request)
        digest = planning_digest(cluster, spec, degrees, micro_batch_size=request.micro_batch_size,
                                 vpp=request.schedule.vpp, overlap_p2p_comm=request.schedule.overlap_p2p_comm,
                                 profile=profile,
                                 **({} if request.optimizer_instances else {"optimizer_instances": False}),
                                 **({} if request.use_all_nodes else {"use_all_nodes": False}))
        return refuse_left_out(Resolved(share_plan(digest, search), cluster), request)
    except LeftOutRefused:
        raise
    except ConfigError as exc:
        if all(v is None for v in fixed.values()):
            raise
        ok = placeable_degrees(cluster, spec, degrees.cp)
        listed = ", ".join(f"tp={a} pp={b}" for a, b in ok[:12]) or "none"
        given = ", ".join(f"{k}={v}" for k, v in fixed.items() if v is not None)
        raise ConfigError(f"the degrees passed ({given}, cp={degrees.cp}) cannot be placed on {cluster.name}: "
                          f"{exc.problem}", source=exc.source, field=exc.field,
                          fix=f"{exc.fix + '; ' if exc.fix else ''}degrees this cluster can hold: {listed}") from None


class LeftOutRefused(ConfigError):
    """The launch started nodes the best plan leaves out (not re-worded as a degrees problem)."""


#: how each adapter's user asks for a plan with every node (what the refusal names)
USE_ALL_NODES_ASKS = ("--heterogeneous-use-all-nodes (Megatron-LM), use_all_nodes=True (Megatron-Core's "
                      "initialize_model_parallel, the DeepSpeed section: `het-plugin wrap-config --use-all-nodes`), "
                      "or HET_PLUGIN_USE_ALL_NODES=1 in the launch's environment")


def refuse_left_out(resolved: Resolved, request: LaunchRequest) -> Resolved:
    """A cluster file or discovery describes the nodes the launch started (its world size was checked): when the
    best plan over subsets leaves some out, those ranks would get no place in any group, so every rank stops here
    (inside the start-up's resolution, before any group) naming the nodes, the predicted gain and both fixes."""
    plan, cluster = resolved.plan, resolved.cluster
    if not plan.left_out or request.use_all_nodes:
        return resolved
    left, kept = plan.left_out["nodes"], [n.name for n in plan.nodes]
    every = plan.left_out.get("all_nodes", {}).get("iteration_s")
    mine = plan.prediction.iteration_s if plan.prediction else None
    gain = (f"; it predicts {mine:.4g} s/iteration against {every:.4g} s with every node ({every / mine:.2f}x)"
            if every and mine else "")
    raise LeftOutRefused(
        f"the best plan for {cluster.name} leaves out {len(left)} of its {len(left) + len(kept)} nodes "
        f"({' '.join(left)}){gain}, but this launch started every node", source=cluster.source, field="nodes",
        fix=f"launch only the kept {len(kept)} nodes ({' '.join(kept[:16])}{' ...' if len(kept) > 16 else ''}) "
            f"with the plan file of `het-plugin plan ... -o PLAN --hostfile-out HOSTS` (deepspeed --hostfile HOSTS, "
            f"torchrun --nnodes {len(kept)}; Megatron-LM: --heterogeneous-nic PLAN); or plan with every node: "
            + USE_ALL_NODES_ASKS)


def _plain(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return value


def planning_digest(cluster: Cluster, model: ModelSpec, degrees: Degrees, **settings: Any) -> str:
    """A content hash of everything :func:`resolve_launch` plans from (the cluster as the planner reads it, the
    model, the degrees, the settings, a profile): equal digests give equal plans, since the planner is
    deterministic. Two ranks with different inputs get different digests, so they never share a plan."""
    payload = {"cluster": cluster.digest, "model": _plain(model), "degrees": _plain(degrees),
               "settings": {k: _plain(v) for k, v in sorted(settings.items())}, "het_plugin": __version__}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


LAUNCH_DEGREES = ("tp", "pp", "dp", "cp", "ep", "etp", "order")


def check_launch_settings(plan: Plan, given: dict[str, Any], where: Optional[str], names: dict[str, str], *,
                          droppable: bool = True) -> None:
    """What a launch sets (degrees, ``order``, ``vpp``, ``overlap_p2p_comm``; None: not set) must be what
    ``plan`` was made for: the one check for a plan file (:func:`resolve_launch`) and for Megatron-Core's own
    arguments (``megatron.core.check_kwargs_fit``). ``names``: the launch's names for the fields.
    ``droppable``: leaving a setting out means "the plan's" (het_plugin's own arguments), not the
    framework's default (Megatron's ``initialize_model_parallel``: ep 1, etp = tp, its default order)."""
    drop = " (or drop it)" if droppable else ""
    dims = plan.dims
    for key in LAUNCH_DEGREES:
        value, planned = given.get(key), getattr(dims, key)
        if key == "order" and value is not None:
            value = "-".join(parse_order(value, given.get("ep") or 1))
        if value is not None and value != planned:
            name = names.get(key, key)
            raise ConfigError(f"{name}={value!r} was passed, but the plan was made for {planned!r}", source=where,
                              field=name, fix=f"pass {planned!r}{drop}, or re-plan with `het-plugin plan "
                                              f"--{key} {value}`")
    vpp = given.get("vpp")
    if not plan.accepts_vpp(vpp):
        name = names.get("vpp", "vpp")
        raise ConfigError(f"{name}={vpp} was passed, but the plan was made for {plan.vpp} virtual stages per "
                          "pipeline rank", source=where, field=name,
                          fix=f"pass {plan.vpp if droppable or plan.vpp > 1 else None}{drop}, or re-plan with "
                              f"`het-plugin plan --vpp {vpp}`")
    overlap = given.get("overlap_p2p_comm")
    if overlap is not None and plan.vpp > 1 and overlap != plan.overlap_p2p_comm:
        name = names.get("overlap_p2p_comm", "overlap_p2p_comm")
        raise ConfigError(f"{name}={overlap} was passed, but the plan assumed {plan.overlap_p2p_comm}",
                          source=where, field=name, fix="re-plan with the same setting, or drop it")


def check_plan_fits(plan: Plan, request: LaunchRequest, model: Optional[ModelSpec], where: str) -> None:
    """A plan file made for another launch would build wrong groups or split layers that do not exist."""
    launch, degrees, names = request.launch, request.degrees, dict(request.names)
    if plan.world_size != launch.world_size:
        raise ConfigError(f"the plan is for {plan.world_size} ranks, but {launch.world_size} were launched",
                          source=where, field="world_size",
                          fix=f"launch {plan.world_size} ranks, or re-plan for the nodes you launch")
    check_launch_settings(plan, {k: getattr(degrees, k) for k in LAUNCH_DEGREES}, where, names)
    if model is None:
        return
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        planned, given = plan.model.get(name), getattr(model, name)
        if planned != given:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"the plan was made for {name}={planned}, this run has {given}", source=where,
                              field=f"model.{name}", fix=f"re-plan for this model (`het-plugin plan` with its "
                                                         f"model file), or pass {flag} {planned}")



