"""The Plan: plain, serializable data that every adapter consumes.

It holds the degrees, the placement (logical rank -> physical launch rank), every group with its
transport, the layers per pipeline stage, the node table and the link kinds between clusters (what the
transport rule reads at run time), and the predictor's numbers for the plan and for the
framework-default baseline. ``Plan.hash`` is a stable content hash: every rank computes (or loads)
a plan and the adapters compare hashes across ranks before building any group.

The groups are stored for readers of the file, but they are derived data: the degrees and the
permutation fix every group's members, the node table and links fix its transport. Loading a plan
checks both (a hand-edited group list is refused), and look-ups are indexed once.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from . import plan_format
from .errors import ConfigError
from .plan_format import FORMAT_VERSION, looks_like_plan  # noqa: F401  (read from here by the launch, the CLI, tests)
from .ranks.dims import DEFAULT_ORDER, ParallelDims
from .ranks.transport import Member, transport_rule
from .ranks.batches import ReplicaBatches

@dataclass
class GroupPlan:
    ranks: list[int]          # physical launch ranks, in the framework's order (pipeline order for 'pp')
    transport: str            # one of transport.TRANSPORTS


@dataclass
class LinkPlan:
    """The link between two clusters, as the transport rule needs it (kind only: ib, roce, ethernet)."""
    between: list[str]
    kind: str


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
    """What the cost model expects for one iteration (see het_plugin.core.cost)."""
    iteration_s: float
    tokens_per_s: float
    tflops_per_device: float
    pipeline_s: float = 0.0            # the simulated 1F1B schedule, compute + exposed p2p
    dp_exposed_s: float = 0.0          # gradient reduction not hidden behind backward
    optimizer_s: float = 0.0
    bubble_fraction: float = 0.0
    alltoall_s: float = 0.0            # MoE token dispatch + combine of the stage spending most in it (blocking)
    stage_compute_s: list[float] = field(default_factory=list)   # fwd+bwd of one micro-batch per stage
    memory_gib_per_stage: list[float] = field(default_factory=list)
    capacity_gib_per_stage: list[float] = field(default_factory=list)
    description: str = ""
    # Heterogeneous data parallelism: each replica's pipeline (its own devices, its own micro-batch count),
    # in dp order; [] when every replica runs the same devices with the same count (then pipeline_s is theirs).
    replica_pipeline_s: list[float] = field(default_factory=list)
    shape: str = ""                    # how a heterogeneous plan spreads over its domains (planner.SHAPE_*)
    # Where its compute lies outside the measured profile (compute_curve.Extrapolation lines: a micro-batch size
    # beyond the measured ones, a TP degree not measured, a device type with no entry); [] = all measured or no
    # format-2 profile. Hashed only when set.
    extrapolated: list[str] = field(default_factory=list)

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
    # Pipeline stages in the embedding group (ModelSpec.embedding_stages): [0, pp-1] when the output layer is
    # tied to the embedding or MTP runs on the last stage, else [0].
    embedding_stages: list[int] = field(default_factory=lambda: [0])
    ep: int = 1
    etp: int = 0                      # expert tensor parallel size (0 in a hand-written plan: = tp)
    order: str = DEFAULT_ORDER        # Megatron's rank order ('tp-cp-ep-pp-dp' with --use-tp-pp-dp-mapping)
    links: list[LinkPlan] = field(default_factory=list)
    # Interleaved (virtual) pipeline: virtual stages per pipeline rank (Megatron's
    # virtual_pipeline_model_parallel_size; 1: not interleaved), and each stage's layers split over its virtual
    # stages ([] when vpp == 1). Megatron's layout puts virtual stage c of rank r at segment c*pp + r.
    vpp: int = 1
    layers_per_virtual_stage: list[list[int]] = field(default_factory=list)
    overlap_p2p_comm: bool = False    # pipeline send/receive overlapped with compute (interleaved schedule only)
    # Heterogeneous data parallelism: micro-batches (of micro_batch_size) that data-parallel replica d runs per
    # iteration, for d in 0..dp-1 ([]: every replica runs num_micro_batches, the frameworks' even split). They
    # add up to dp * num_micro_batches, so the global batch and the training math are unchanged; every rank of
    # a replica (all its pipeline stages, TP and CP ranks) shares the count.
    replica_micro_batches: list[int] = field(default_factory=list)
    # Cluster -> the NCCL network (plugin name) its RDMA fabric declares (cluster file ``fabric.nccl_net``); a
    # cluster not listed keeps NCCL's default choice for its RDMA groups (het_plugin.runtime.netselect).
    nccl_nets: dict[str, str] = field(default_factory=dict)
    overlap_grad_reduce: bool = True
    distributed_optimizer: bool = False
    homogeneous: bool = False
    prediction: Optional[Prediction] = None
    baseline: Optional[Prediction] = None
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # The content digest (:attr:`content_digest`) of the plan ``prediction`` was computed for ("" in plans written
    # before it): a plan edited afterwards (layers moved, the optimizer switched) no longer matches, and its
    # prediction is reported stale instead of shown as this plan's (issue 21).
    predicted_for: str = ""
    # Nodes of the cluster file the plan leaves out (it is for the kept nodes in ``nodes``), why, and the best plan
    # with every node (het_plugin.core.subsets); {} = every node is used. price_per_hour: what the plan's devices
    # cost per hour at the cluster file's prices (None: no prices). Both written and hashed only when set.
    left_out: dict[str, Any] = field(default_factory=dict)
    price_per_hour: Optional[float] = None
    format_version: int = FORMAT_VERSION

    # ---- derived --------------------------------------------------------------------------
    @cached_property
    def dims(self) -> ParallelDims:
        return ParallelDims(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, ep=self.ep, etp=self.etp or None,
                            order=self.order)

    @cached_property
    def logical_of_physical(self) -> list[int]:
        inv = [0] * self.world_size
        for logical, phys in enumerate(self.rank_of_logical):
            inv[phys] = logical
        return inv

    @property
    def is_identity(self) -> bool:
        return all(i == r for i, r in enumerate(self.rank_of_logical))

    @property
    def virtual_layers(self) -> list[list[int]]:
        """Layers of each virtual stage, per pipeline rank (``[[n] for n in layers_per_stage]`` when vpp == 1)."""
        if self.vpp == 1 and not self.layers_per_virtual_stage:
            return [[n] for n in self.layers_per_stage]
        return [list(row) for row in self.layers_per_virtual_stage]

    def accepts_vpp(self, vpp: Optional[int]) -> bool:
        """Whether a launch asking for ``vpp`` virtual stages per pipeline rank (None: whatever the plan says)
        runs this plan: its own vpp, or, on an identity plan whose split is the framework's even one, any vpp
        (Megatron then interleaves its own even split, as without het_plugin)."""
        if vpp is None or vpp == self.vpp:
            return True
        even = len({n for row in self.virtual_layers for n in row}) == 1
        return self.is_identity and even

    @property
    def replica_split(self):
        """The replica split as one value (:class:`het_plugin.core.ranks.batches.ReplicaBatches`)."""
        return ReplicaBatches.of(self.replica_micro_batches, self.dp, self.num_micro_batches, self.micro_batch_size)

    @property
    def global_batch_size(self) -> int:
        return self.replica_split.global_batch_size

    @property
    def replica_counts(self) -> list[int]:
        """Micro-batches per iteration of each data-parallel replica (the even split when not set)."""
        return list(self.replica_micro_batches) or [self.num_micro_batches] * self.dp

    @property
    def uneven_replicas(self) -> bool:
        return len(set(self.replica_counts)) > 1

    def replica_of(self, physical_rank: int) -> int:
        """The data-parallel replica (dp coordinate) of a physical rank."""
        return self.coord(physical_rank)["dp"]

    def replica_samples(self, replica: int) -> tuple[int, int]:
        """[start, stop) of the replica's samples within the global batch: replicas in dp order, each a
        contiguous range, so the samples of one iteration are those of the even split, in the same order."""
        return self.replica_split.samples(replica)

    def replica_weight(self, replica: int) -> float:
        """The replica's share of the global batch: its gradient (a mean over its own samples) times this,
        summed over replicas, is the gradient of the global batch's mean. 1/dp on the even split."""
        return self.replica_split.weight(replica)

    def coord(self, physical_rank: int) -> dict[str, int]:
        return self.dims.coord(self.logical_of_physical[physical_rank])

    def stage_of(self, physical_rank: int) -> int:
        return self.coord(physical_rank)["pp"]

    def stage_ranks(self, stage: int) -> list[int]:
        """Physical ranks holding pipeline stage ``stage`` (all its TP, CP and DP replicas)."""
        return self.dims.placed_stage(stage, self.rank_of_logical)

    @cached_property
    def _rank_nodes(self) -> list[NodePlan]:
        return [n for n in sorted(self.nodes, key=lambda n: n.first_rank) for _ in range(n.num_ranks)]

    def node_of(self, physical_rank: int) -> NodePlan:
        if not 0 <= physical_rank < len(self._rank_nodes):
            raise IndexError(physical_rank)
        return self._rank_nodes[physical_rank]

    @cached_property
    def _link_kinds(self) -> dict[frozenset, str]:
        kinds = {frozenset((n.cluster,)): n.fabric for n in self.nodes}
        kinds.update({frozenset(link.between): link.kind for link in self.links})
        return kinds

    def link_kind(self, a: str, b: str) -> str:
        """Kind of the link between clusters a and b (a == b: the cluster's fabric). A pair the plan does
        not list is Ethernet, as in cluster files."""
        return self._link_kinds.get(frozenset((a, b)), "ethernet")

    @cached_property
    def _transport_by_members(self) -> dict[frozenset, str]:
        out: dict[frozenset, str] = {}
        for groups in self.groups.values():
            for g in groups:
                out.setdefault(frozenset(g.ranks), g.transport)
        return out

    def transport_of(self, ranks: Sequence[int]) -> str:
        """Transport of a communicator over physical ``ranks``: the plan's entry when it lists the group,
        else (the world group, groups a framework adds) the transport rule over the node table and links."""
        found = self._transport_by_members.get(frozenset(ranks))
        if found is not None:
            return found
        return self.rule_transport(ranks)

    def rule_transport(self, ranks: Sequence[int]) -> str:
        """het_plugin.core.ranks.transport's rule over this plan's nodes (what the planner used for every group)."""
        members = (self.node_of(r) for r in ranks)
        return transport_rule((Member(n.name, n.cluster, n.vendor) for n in members), self.link_kind)

    def rdma_net_of(self, ranks: Sequence[int]) -> Optional[str]:
        """The NCCL network the clusters of ``ranks`` declare for their RDMA fabric; None when none is declared
        (or they differ, which only a group crossing fabrics can see: that one is a Socket group)."""
        names = {self.nccl_nets.get(self.node_of(r).cluster) for r in ranks}
        return names.pop() if len(names) == 1 else None

    def vendor_of(self, physical_rank: int) -> str:
        return self.node_of(physical_rank).vendor

    @cached_property
    def _group_index(self) -> dict[tuple[str, int], GroupPlan]:
        return {(kind, r): g for kind, groups in self.groups.items() for g in groups for r in g.ranks}

    def group_of(self, kind: str, physical_rank: int) -> GroupPlan:
        try:
            return self._group_index[(kind, physical_rank)]
        except KeyError:
            raise KeyError(f"rank {physical_rank} is in no {kind!r} group") from None

    def derived_groups(self, kind: str) -> list[list[int]]:
        """Members of every ``kind`` group as the degrees and the permutation make them."""
        return self.dims.placed_groups(kind, self.rank_of_logical, self.embedding_stages)

    def check_consistent(self, source: str = "<plan>") -> None:
        """The stored groups and transports must be what the degrees, permutation, nodes and links say."""
        if sorted(self.rank_of_logical) != list(range(self.world_size)):
            raise ConfigError("rank_of_logical is not a permutation of the ranks", source=source,
                              field="rank_of_logical", fix="re-create the plan with `het-plugin plan -o`")
        stages = self.embedding_stages
        if not stages or stages != sorted(set(stages)) or stages[0] != 0 or stages[-1] >= self.pp:
            raise ConfigError(f"embedding_stages {stages} must be ascending pipeline stages starting with 0, "
                              f"below pp={self.pp}", source=source, field="embedding_stages",
                              fix="re-create the plan with `het-plugin plan -o`")
        check_virtual_split(self.layers_per_stage, self.vpp, self.layers_per_virtual_stage, source)
        check_replica_split(self.replica_micro_batches, self.dp, self.num_micro_batches, source, vpp=self.vpp,
                            dims=self.dims)
        if self.overlap_p2p_comm and self.vpp == 1:
            raise ConfigError("overlap_p2p_comm is set, but Megatron overlaps pipeline send/receive only in the "
                              "interleaved schedule (vpp > 1)", source=source, field="overlap_p2p_comm",
                              fix="set overlap_p2p_comm to false, or re-plan with `het-plugin plan --vpp N`")
        unknown = sorted(set(self.nccl_nets) - {n.cluster for n in self.nodes})
        if unknown:
            raise ConfigError(f"nccl_nets names clusters {unknown} that the node table does not have", source=source,
                              field="nccl_nets", fix="re-create the plan with `het-plugin plan -o`")
        if sum(n.num_ranks for n in self.nodes) != self.world_size:
            raise ConfigError(f"the node table holds {sum(n.num_ranks for n in self.nodes)} ranks, the plan "
                              f"{self.world_size}", source=source, field="nodes",
                              fix="re-create the plan with `het-plugin plan -o`")
        for kind, groups in self.groups.items():
            want = self.derived_groups(kind)
            if [g.ranks for g in groups] != want:
                raise ConfigError(f"the {kind!r} groups do not follow from the degrees and rank_of_logical",
                                  source=source, field=f"groups.{kind}",
                                  fix="re-create the plan with `het-plugin plan -o` (do not edit groups by hand)")
            for g in groups:
                rule = self.rule_transport(g.ranks)
                if g.transport != rule:
                    raise ConfigError(f"group {g.ranks} says transport {g.transport!r}, its nodes and links "
                                      f"give {rule!r}", source=source, field=f"groups.{kind}",
                                      fix="re-create the plan with `het-plugin plan -o`")

    @property
    def content_digest(self) -> str:
        """A hash of everything the prediction is computed from (the plan less its predictions and notes)."""
        return plan_format.content_digest(asdict(self))

    def stamp_prediction(self) -> "Plan":
        """Record that ``prediction`` is this plan's (the planner, once the plan is complete)."""
        self.predicted_for = self.content_digest if self.prediction is not None else ""
        return self

    @property
    def prediction_stale(self) -> bool:
        """The plan changed after its prediction was computed (edited by hand): the numbers are another plan's."""
        return bool(self.prediction is not None and self.predicted_for and self.predicted_for != self.content_digest)

    @property
    def current_prediction(self) -> Optional[Prediction]:
        """The prediction, or None when it is stale (what readers that compare against it should use)."""
        return None if self.prediction_stale else self.prediction

    @property
    def speedup(self) -> Optional[float]:
        if self.current_prediction and self.baseline and self.prediction.iteration_s > 0:
            return self.baseline.iteration_s / self.prediction.iteration_s
        return None

    # ---- serialization (the file format: het_plugin.core.plan_format) ------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key, unset in plan_format.WRITTEN_ONLY_WHEN_SET.items():
            if d[key] == unset:
                del d[key]
        d["hash"] = self.hash
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<plan>") -> "Plan":
        data, stored_hash = plan_format.plan_fields(data, {f.name for f in fields(cls)}, source)
        try:
            data["groups"] = {k: [GroupPlan(**g) for g in v] for k, v in data["groups"].items()}
            data["nodes"] = [NodePlan(**n) for n in data["nodes"]]
            data["links"] = [LinkPlan(**link) for link in data.get("links", [])]
            for key in ("prediction", "baseline"):
                if data.get(key) is not None:
                    data[key] = Prediction(**data[key])
            plan = cls(**data)
        except (TypeError, KeyError, AttributeError) as exc:
            # a plan edited by hand: a group or node with a key the format does not have, or one missing
            raise ConfigError(f"not a valid plan file: {type(exc).__name__}: {exc}", source=source,
                              fix="re-create the plan with `het-plugin plan CLUSTER -o PLAN` instead of editing it") \
                from None
        plan_format.check_hash(stored_hash, plan.hash, source)
        plan.check_consistent(source)
        return plan

    def canonical_json(self) -> str:
        return plan_format.canonical_json(asdict(self))

    @property
    def hash(self) -> str:
        return plan_format.digest(self.canonical_json())

    def to_json(self) -> str:
        """The whole plan as JSON (what a plan file holds; :meth:`from_dict` reads it back)."""
        return plan_format.to_json(self.to_dict())

    def save(self, path: str | Path) -> None:
        plan_format.save(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(plan_format.load(path), str(path))


def check_virtual_split(layers_per_stage: Sequence[int], vpp: int, layers_per_virtual_stage: Sequence[Sequence[int]],
                        source: str = "<plan>") -> None:
    """The virtual split must be ``vpp`` counts (>= 1 each) per pipeline rank adding up to the rank's layers."""
    fix = "re-create the plan with `het-plugin plan --vpp N -o`"
    if not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1:
        raise ConfigError(f"vpp={vpp!r} is not a positive integer", source=source, field="vpp", fix=fix)
    if vpp == 1 and not layers_per_virtual_stage:
        return
    rows = [list(r) for r in layers_per_virtual_stage]
    if (len(rows) != len(layers_per_stage) or any(len(r) != vpp for r in rows)
            or any(not isinstance(n, int) or n < 1 for r in rows for n in r)
            or [sum(r) for r in rows] != list(layers_per_stage)):
        raise ConfigError(f"layers_per_virtual_stage {rows} must hold, for each of the {len(layers_per_stage)} "
                          f"pipeline stages, vpp={vpp} counts of at least 1 adding up to its layers "
                          f"{list(layers_per_stage)}", source=source, field="layers_per_virtual_stage", fix=fix)


# Groups that run a collective per micro-batch (the MoE token all-to-all, expert-TP): their members must run the
# same number of micro-batches, or the replica with more waits forever in its extra ones.
PER_MICRO_BATCH_KINDS = ("expert-tp", "expert-ep", "expert-tp-ep")


def replica_split_conflict(dims: ParallelDims, counts: Sequence[int]) -> Optional[tuple[str, list[int], list[int]]]:
    """The first per-micro-batch group (kind, logical members, their counts) whose members belong to replicas with
    different counts; None when the split keeps every such group on one count."""
    if len(set(counts)) <= 1:
        return None
    for kind, members, replicas in _joining_groups(dims):
        if len({counts[d] for d in replicas}) > 1:
            dp_of = _dp_coordinate(dims)
            return kind, list(members), [counts[dp_of(r)] for r in members]
    return None


def _dp_coordinate(dims: ParallelDims) -> Callable[[int], int]:
    """A logical rank's dp coordinate (``dims.coord(r)["dp"]`` without the dict)."""
    names, sizes = dims.names, dims.sizes()
    stride = math.prod(sizes[:names.index("dp")])
    return lambda r: (r // stride) % dims.dp


@lru_cache(maxsize=64)
def _joining_groups(dims: ParallelDims) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]:
    """The per-micro-batch groups that join more than one replica, as (kind, logical members, the replicas'
    dp coordinates), in :data:`PER_MICRO_BATCH_KINDS` and Megatron's group order; of groups joining the same
    replicas only the first (it conflicts exactly when they do). The planner asks once per degree combination."""
    dp_of = _dp_coordinate(dims)
    out, seen = [], set()
    for kind in PER_MICRO_BATCH_KINDS:
        for members in dims.groups(kind):
            replicas = tuple(sorted({dp_of(r) for r in members}))
            if len(replicas) > 1 and replicas not in seen:
                seen.add(replicas)
                out.append((kind, tuple(members), replicas))
    return tuple(out)


def check_replica_split(replica_micro_batches: Sequence[int], dp: int, num_micro_batches: int,
                        source: str = "<plan>", *, vpp: int = 1, dims: Optional[ParallelDims] = None) -> None:
    """Per-replica micro-batch counts: none (the even split), or dp counts of at least 1 adding up to
    dp * num_micro_batches (the global batch every replica agreed on); uneven ones only without interleaving
    and where no expert group joins replicas of different counts (``dims``)."""
    counts = list(replica_micro_batches)
    if not counts:
        return
    ReplicaBatches.of(counts, dp, num_micro_batches, 1, source)      # the split's own rules: count, sum
    if len(set(counts)) > 1 and vpp > 1:
        raise ConfigError(f"replica_micro_batches {counts} are uneven with an interleaved pipeline (vpp={vpp}): "
                          "Megatron's interleaved schedule groups micro-batches by pipeline size, and a replica with "
                          "fewer would fail alone while the others wait", source=source, field="replica_micro_batches",
                          fix="use equal counts with vpp > 1 (remove replica_micro_batches), or vpp=1")
    conflict = replica_split_conflict(dims, counts) if dims is not None else None
    if conflict is not None:
        kind, members, have = conflict
        raise ConfigError(f"replica_micro_batches {counts}: the {kind} group of logical ranks {members} joins replicas "
                          f"running {have} micro-batches, and it runs a collective every micro-batch (a replica with "
                          "more would wait forever)", source=source, field="replica_micro_batches",
                          fix="give the replicas an expert group joins the same count, or use the even split")
