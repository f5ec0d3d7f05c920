"""The Plan: plain, serializable data that every adapter consumes.

It holds the degrees, the placement (logical rank -> physical launch rank), every group with its
transport, the layers per pipeline stage, and the predictor's numbers for the plan and for the
framework-default baseline. ``Plan.hash`` is a stable content hash: every rank computes (or loads)
a plan and the adapters compare hashes across ranks before building any group.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Optional, Sequence

from .errors import ConfigError
from .topology import ParallelDims

FORMAT_VERSION = 1


@dataclass
class GroupPlan:
    ranks: list[int]          # physical launch ranks, in the framework's order (pipeline order for 'pp')
    transport: str            # one of placement.TRANSPORTS


@dataclass
class NodePlan:
    name: str
    cluster: str
    fabric: str
    accelerator: str
    vendor: str
    first_rank: int
    num_ranks: int


@dataclass
class Prediction:
    """What the cost model expects for one iteration (see het_plugin.cost)."""
    iteration_s: float
    tokens_per_s: float
    tflops_per_device: float
    pipeline_s: float = 0.0            # the simulated 1F1B schedule, compute + exposed p2p
    dp_exposed_s: float = 0.0          # gradient reduction not hidden behind backward
    optimizer_s: float = 0.0
    bubble_fraction: float = 0.0
    stage_compute_s: list[float] = field(default_factory=list)   # fwd+bwd of one micro-batch per stage
    memory_gib_per_stage: list[float] = field(default_factory=list)
    capacity_gib_per_stage: list[float] = field(default_factory=list)
    description: str = ""

    @property
    def fits(self) -> bool:
        return all(m <= c for m, c in zip(self.memory_gib_per_stage, self.capacity_gib_per_stage))


@dataclass
class Plan:
    cluster_name: str
    cluster_digest: str
    model: dict[str, Any]
    world_size: int
    tp: int
    cp: int
    pp: int
    dp: int
    micro_batch_size: int
    num_micro_batches: int
    rank_of_logical: list[int]
    layers_per_stage: list[int]
    groups: dict[str, list[GroupPlan]]
    nodes: list[NodePlan]
    ep: int = 1
    order: str = "tp-cp-ep-dp-pp"
    overlap_grad_reduce: bool = True
    distributed_optimizer: bool = False
    homogeneous: bool = False
    prediction: Optional[Prediction] = None
    baseline: Optional[Prediction] = None
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    format_version: int = FORMAT_VERSION

    # ---- derived --------------------------------------------------------------------------
    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, ep=self.ep)

    @property
    def logical_of_physical(self) -> list[int]:
        inv = [0] * self.world_size
        for logical, phys in enumerate(self.rank_of_logical):
            inv[phys] = logical
        return inv

    @property
    def is_identity(self) -> bool:
        return all(i == r for i, r in enumerate(self.rank_of_logical))

    def coord(self, physical_rank: int) -> dict[str, int]:
        return self.dims.coord(self.logical_of_physical[physical_rank])

    def stage_of(self, physical_rank: int) -> int:
        return self.coord(physical_rank)["pp"]

    @cached_property
    def _rank_nodes(self) -> list[NodePlan]:
        return [n for n in sorted(self.nodes, key=lambda n: n.first_rank) for _ in range(n.num_ranks)]

    def node_of(self, physical_rank: int) -> NodePlan:
        if not 0 <= physical_rank < len(self._rank_nodes):
            raise IndexError(physical_rank)
        return self._rank_nodes[physical_rank]

    @cached_property
    def _transport_by_members(self) -> dict[frozenset, str]:
        out: dict[frozenset, str] = {}
        for groups in self.groups.values():
            for g in groups:
                out.setdefault(frozenset(g.ranks), g.transport)
        return out

    def transport_of(self, ranks: Sequence[int]) -> str:
        """Transport of a group of physical ranks: the plan's own entry when it lists the group, else (the
        world group, groups a framework adds) from the node table: one node 'local', several vendors
        'host-staged', one RDMA cluster its fabric, otherwise 'socket' (the node table does not carry the
        links between clusters, so RDMA across clusters is never assumed)."""
        found = self._transport_by_members.get(frozenset(ranks))
        if found is not None:
            return found
        members = {n.name: n for n in (self.node_of(r) for r in ranks)}.values()
        if len(members) <= 1:
            return "local"
        if len({n.vendor for n in members}) > 1:
            return "host-staged"
        if len({n.cluster for n in members}) == 1 and next(iter(members)).fabric in ("ib", "roce"):
            return next(iter(members)).fabric
        return "socket"

    def vendor_of(self, physical_rank: int) -> str:
        return self.node_of(physical_rank).vendor

    def group_of(self, kind: str, physical_rank: int) -> GroupPlan:
        for g in self.groups[kind]:
            if physical_rank in g.ranks:
                return g
        raise KeyError(f"rank {physical_rank} is in no {kind!r} group")

    @property
    def speedup(self) -> Optional[float]:
        if self.prediction and self.baseline and self.prediction.iteration_s > 0:
            return self.baseline.iteration_s / self.prediction.iteration_s
        return None

    # ---- serialization --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hash"] = self.hash
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<plan>") -> "Plan":
        if not isinstance(data, dict) or "rank_of_logical" not in data:
            raise ConfigError("not a plan file (no 'rank_of_logical')", source=source,
                              fix="write one with `het-plugin plan -o plan.json`")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ConfigError(f"plan format_version {version}, this het_plugin reads {FORMAT_VERSION}",
                              source=source, field="format_version", fix="re-create the plan with this version")
        data = dict(data)
        stored_hash = data.pop("hash", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown plan keys {unknown}", source=source, fix="re-create the plan")
        data["groups"] = {k: [GroupPlan(**g) for g in v] for k, v in data["groups"].items()}
        data["nodes"] = [NodePlan(**n) for n in data["nodes"]]
        for key in ("prediction", "baseline"):
            if data.get(key) is not None:
                data[key] = Prediction(**data[key])
        plan = cls(**data)
        if stored_hash is not None and stored_hash != plan.hash:
            raise ConfigError("the plan's content does not match its hash (edited by hand?)", source=source,
                              field="hash", fix="re-create the plan with `het-plugin plan -o`, or delete the hash key")
        return plan

    def canonical_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), default=_json_default)

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    def save(self, path: str | Path) -> None:
        from .yamlio import dump_data
        dump_data(json.loads(json.dumps(self.to_dict(), default=_json_default)), path)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        from .yamlio import read_data
        return cls.from_dict(read_data(path), str(path))


def _json_default(o):
    if isinstance(o, float):
        return repr(o)
    raise TypeError(type(o))


def looks_like_plan(path: str | Path) -> bool:
    """Plan files and cluster files share suffixes; a plan has 'rank_of_logical'."""
    from .yamlio import read_data
    data = read_data(path)
    return isinstance(data, dict) and "rank_of_logical" in data
