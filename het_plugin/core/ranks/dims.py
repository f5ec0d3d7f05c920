"""Logical parallel coordinates <-> logical ranks, exactly as Megatron-Core and DeepSpeed number them.

A *logical* rank is the rank a framework would give a coordinate on a homogeneous cluster:
Megatron-Core's ``RankGenerator`` with order ``tp-cp-ep-dp-pp`` (tp fastest) and DeepSpeed's
``PipeModelDataParallelTopology`` (axes pipe, data, model; model fastest) agree on it. A placement
(``het_plugin.core.ranks.placement``) maps logical ranks to the physical ranks the launcher started, so one
permutation serves both frameworks. Pure Python: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod
from typing import Callable, Optional, Sequence

from ..errors import ConfigError

ORDER = ("tp", "cp", "ep", "dp", "pp")        # Megatron's default order (tp fastest); DeepSpeed's too
DEFAULT_ORDER = "-".join(ORDER)

# Group kinds Megatron-Core builds from its decoder RankGenerator (plus 'embedding', derived from pp).
GROUP_KINDS = ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp", "tp-dp", "tp-dp-cp")
# ... and from its expert RankGenerator (tp = expert-tensor-parallel size, ep, dp = expert data parallel).
EXPERT_KINDS = ("expert-tp", "expert-ep", "expert-tp-ep", "expert-tp-ep-pp", "expert-dp")


def parse_order(order: str, ep: int = 1) -> tuple[str, ...]:
    """Megatron's order string -> its five names, as ``RankGenerator`` reads it: names left out are
    appended (allowed only for a size-1 name: ep > 1 must be placed explicitly)."""
    names = tuple(t.strip().lower() for t in str(order).split("-") if t.strip())
    unknown = [n for n in names if n not in ORDER]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"order {order!r} must name each of {', '.join(ORDER)} at most once")
    if ep > 1 and "ep" not in names:
        raise ValueError(f"order {order!r} leaves out ep, but ep={ep} (Megatron needs its place in the order)")
    return names + tuple(n for n in ORDER if n not in names)


def order_keeps_expert_dp(order: str, pp: int, dp: int, expert_dp: int) -> bool:
    """Megatron's rule: unless pp is the slowest name (or pp == 1), expert and dense data parallelism match."""
    return order.split("-")[-1] == "pp" or pp == 1 or expert_dp == dp


def check_expert_split(tp: int, cp: int, dp: int, pp: int, ep: int, etp: int, order: str, *,
                       name: Callable[[str], str] = lambda degree: degree, source: Optional[str] = None) -> None:
    """Megatron's two rules for the expert layers, written once (ParallelDims and a launch's Degrees both raise
    this ConfigError, in the launch's names where it has them): etp*ep divides the ranks of one pipeline stage,
    and with an order not ending in pp the expert data-parallel size equals dp."""
    stage = tp * cp * dp
    if stage % (etp * ep):
        raise ConfigError(f"{name('etp')}*{name('ep')} = {etp}*{ep} does not divide "
                          f"{name('tp')}*{name('cp')}*{name('dp')} = {stage} (the ranks of one pipeline stage, which "
                          "the expert layers split into etp x ep x expert-dp)", source=source, field=name("ep"),
                          fix="choose expert parallel sizes whose product divides tp*cp*dp")
    if not order_keeps_expert_dp(order, pp, dp, stage // (etp * ep)):
        raise ConfigError(f"{name('order')} {order} does not end in pp, so Megatron needs the expert data-parallel "
                          f"size tp*cp*dp/(etp*ep) = {stage // (etp * ep)} to equal dp = {dp}", source=source,
                          field=name("order"), fix="use the default order, or etp*ep = tp*cp")


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one plan (every degree known); coordinate <-> logical rank, and the groups.

    As Megatron-Core numbers ranks: ``dp`` is the dense layers' data-parallel size (world = tp*cp*dp*pp);
    the expert layers view the same ranks as etp x ep x expert-dp x pp (``etp`` defaults to ``tp``), and
    ``order`` says which coordinate varies fastest ('tp-cp-ep-dp-pp', or 'tp-cp-ep-pp-dp' for
    ``--use-tp-pp-dp-mapping``).
    """
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    order: str = DEFAULT_ORDER

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in ORDER + ("etp",):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        object.__setattr__(self, "order", "-".join(parse_order(self.order, self.ep)))
        check_expert_split(self.tp, self.cp, self.dp, self.pp, self.ep, self.etp, self.order)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def stage_size(self) -> int:
        """Ranks holding one pipeline stage (all its TP, CP and DP replicas)."""
        return self.tp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert layers."""
        return self.stage_size // (self.etp * self.ep)

    @property
    def names(self) -> tuple[str, ...]:
        """The five names in this order, fastest first."""
        return tuple(self.order.split("-"))

    @property
    def is_default_order(self) -> bool:
        return self.order == DEFAULT_ORDER

    def sizes(self) -> tuple[int, ...]:
        """Sizes of the dense layers' generator in ``order`` (ep is 1 there, as in Megatron)."""
        size = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        return tuple(size[n] for n in self.names)

    def expert_sizes(self) -> tuple[int, ...]:
        size = {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}
        return tuple(size[n] for n in self.names)

    def coord(self, logical_rank: int) -> dict[str, int]:
        out = {}
        r = logical_rank
        for name, size in zip(self.names, self.sizes()):
            out[name] = r % size
            r //= size
        return out

    def logical_rank(self, **coord: int) -> int:
        rank, stride = 0, 1
        for name, size in zip(self.names, self.sizes()):
            rank += coord.get(name, 0) * stride
            stride *= size
        return rank

    def canonical(self) -> "ParallelDims":
        """The same degrees in the default order (what the placement and the cost model reason in)."""
        return self if self.is_default_order else replace(self, order=DEFAULT_ORDER)

    def to_canonical(self) -> list[int]:
        """``out[r]``: the default-order logical rank of this order's logical rank ``r`` (same coordinate)."""
        if self.is_default_order:
            return list(range(self.world_size))
        canon = self.canonical()
        return [canon.logical_rank(**self.coord(r)) for r in range(self.world_size)]

    def placed_groups(self, kind: str, rank_of_logical: Sequence[int],
                      embedding_stages: Optional[Sequence[int]] = None) -> list[list[int]]:
        """Every ``kind`` group as physical ranks: each logical rank through the permutation."""
        return [[rank_of_logical[r] for r in g] for g in self.groups(kind, embedding_stages)]

    def stage_logical(self, stage: int) -> list[int]:
        """Logical ranks of pipeline stage ``stage`` (a contiguous block in the default order)."""
        if self.names[-1] == "pp":
            return list(range(stage * self.stage_size, (stage + 1) * self.stage_size))
        return masked_orthogonal_groups(self.sizes(), [n != "pp" for n in self.names])[stage]

    def placed_stage(self, stage: int, rank_of_logical: Sequence[int]) -> list[int]:
        """Physical ranks holding pipeline stage ``stage``."""
        return [rank_of_logical[r] for r in self.stage_logical(stage)]

    def groups(self, kind: str, embedding_stages: Optional[Sequence[int]] = None) -> list[list[int]]:
        """Logical rank lists of every group of ``kind`` (e.g. 'tp', 'dp-cp', 'tp-pp', 'expert-tp-ep'), in
        Megatron's order.

        'embedding' takes the members of each pipeline group at ``embedding_stages`` (default: Megatron-Core's
        first and last stage; see ``ModelSpec.embedding_stages`` for untied embeddings and MTP). 'expert-*'
        kinds are the expert generator's ('expert-tp' is the expert-tensor-parallel group)."""
        if kind == "embedding":
            stages = default_embedding_stages(self.pp) if embedding_stages is None else sorted(set(embedding_stages))
            if not stages or stages[0] != 0 or stages[-1] >= self.pp:
                raise ValueError(f"embedding stages {list(stages)} must include stage 0 and lie in 0..{self.pp - 1}")
            return [[g[s] for s in stages] for g in self.groups("pp")]
        if kind == "position_embedding":
            return [[g[0]] for g in self.groups("pp")]
        sizes = self.sizes()
        if kind.startswith("expert-"):
            kind, sizes = kind[len("expert-"):], self.expert_sizes()
        names = kind.split("-")
        unknown = [n for n in names if n not in ORDER]
        if unknown:
            raise ValueError(f"unknown group kind {kind!r}")
        mask = [n in names for n in self.names]
        return masked_orthogonal_groups(sizes, mask)


def default_embedding_stages(pp: int) -> tuple[int, ...]:
    """Megatron-Core's default embedding group: the first and the last pipeline stage."""
    return (0, pp - 1) if pp > 1 else (0,)


SEARCHED = ("tp", "pp", "dp")     # the degrees a planner may choose (ep too, when left None); cp is always given


@dataclass(frozen=True)
class Degrees:
    """The degrees a launch fixes, validated once against its world size (torchtitan's ParallelDims is
    the model): ``None`` leaves tp, pp or dp to the planner, ``-1`` infers one of them from the others
    (which must then be given). ``names`` maps a degree to what the user calls it (a flag, a config key)
    and ``source`` says where they came from, for the error message.

    Placeability on a cluster (TP and CP inside one node, ...) is the planner's and the placement's
    concern; this object only knows the arithmetic.

    Expert sizes: ``ep`` is taken as given (1: no expert parallelism, what a launch without
    ``--expert-model-parallel-size`` runs) unless it is None, which leaves it to the planner: the divisors of
    ``num_experts`` (1 for a dense model), each with ``etp`` in {1, tp} unless ``etp`` is given.
    ``num_experts`` (the model's num_moe_experts) also refuses an ep that does not divide it, as Megatron does.
    """
    world_size: int
    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None
    cp: int = 1
    ep: Optional[int] = 1              # None: the planner chooses
    etp: Optional[int] = None          # expert tensor parallel; None: = tp (searched with ep=None)
    order: str = DEFAULT_ORDER
    source: Optional[str] = field(default=None, compare=False)
    names: dict = field(default_factory=dict, compare=False, hash=False)
    num_experts: Optional[int] = field(default=None, compare=False)

    def __post_init__(self):
        if not _is_count(self.world_size):
            raise ConfigError(f"world size {self.world_size!r} is not a positive integer", source=self.source,
                              field="world_size", fix="launch at least one rank")
        for name in ("tp", "pp", "dp", "cp", "ep", "etp"):
            v = getattr(self, name)
            if v is None and name in SEARCHED + ("ep", "etp") or v == -1 and name in SEARCHED or _is_count(v):
                continue
            raise ConfigError(f"{self._name(name)}={v!r} is not a positive integer", source=self.source,
                              field=self._name(name), fix=f"give a positive integer{' (or leave it unset)' if name in SEARCHED else ''}")
        if self.num_experts and self.ep is not None and self.num_experts % self.ep:
            ok = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise ConfigError(f"{self._name('ep')}={self.ep} does not divide num_moe_experts={self.num_experts}: each "
                              f"expert-parallel rank holds num_moe_experts/ep whole experts (Megatron: "
                              "expert_model_parallel_size must divide --num-experts)", source=self.source,
                              field=self._name("ep") + ("" if self.names.get("ep") else
                                                        " (expert_model_parallel_size)"),
                              fix=f"use {self._name('ep')} in {ok}" + (
                                  "" if self.names.get("ep") else ", or leave it to the planner (None)"))
        try:
            parse_order(self.order, self.ep or 1)
        except ValueError as exc:
            raise ConfigError(str(exc), source=self.source, field=self._name("order"),
                              fix=f"use Megatron's '{DEFAULT_ORDER}' or 'tp-cp-ep-pp-dp'") from None
        infer = [n for n in SEARCHED if getattr(self, n) == -1]
        unset = [n for n in SEARCHED if getattr(self, n) is None]
        if len(infer) > 1 or (infer and unset):
            raise ConfigError(f"{self._name(infer[0])}=-1 asks to infer it, but {self._list(infer[1:] + unset)} "
                              "is not given", source=self.source, field=self._name(infer[0]),
                              fix="give every other degree, or leave the degrees to the planner (unset)")
        fixed = {n: getattr(self, n) for n in ("tp", "cp", "pp", "dp")
                 if _is_count(getattr(self, n)) and (n in SEARCHED or getattr(self, n) > 1)}
        product = prod(fixed.values())
        if self.world_size % product or (not infer and not unset and product != self.world_size):
            text = "*".join(fixed) + " = " + ("*".join(str(v) for v in fixed.values()) + " = " if len(fixed) > 1
                                              else "") + str(product)
            if unset or infer:
                problem = f"{text} does not divide the world size {self.world_size}"
                fix = f"choose degrees whose product divides {self.world_size}"
            else:
                problem = f"{text}, but the world size is {self.world_size}"
                fix = f"choose degrees whose product is {self.world_size}"
                others = product // fixed["dp"]
                if self.world_size % others == 0:
                    fix += f" ({self._name('dp')} = {self.world_size // others} with the others as given)"
            raise ConfigError(problem, source=self.source, field=self._list(list(fixed)), fix=fix)
        if infer:
            object.__setattr__(self, infer[0], self.world_size // product)
        if not unset and self.ep is not None:
            self._check_experts(self.tp, self.cp, self.dp, self.pp)

    def expert_options(self, tp: int) -> list[tuple[int, int]]:
        """(ep, etp) pairs to try with this tp: the given ones, or (ep None) every divisor of num_experts with
        etp in {1, tp} (etp = tp alone for a dense model)."""
        if self.ep is not None:
            return [(self.ep, self.etp or tp)]
        eps = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0] if self.num_experts else [1]
        etps = [self.etp] if self.etp is not None else sorted({1, tp}) if self.num_experts else [tp]
        return [(e, t) for e in eps for t in etps]

    def _expert_fit(self, tp: int, cp: int, dp: int, pp: int, ep: Optional[int] = None,
                    etp: Optional[int] = None) -> bool:
        """Whether these degrees keep Megatron's expert rules (:func:`check_expert_split`)."""
        ep = self.ep if ep is None else ep
        try:
            check_expert_split(tp, cp, dp, pp, ep, etp or self.etp or tp, "-".join(parse_order(self.order, ep)))
        except ValueError:      # a rule broken, or an order leaving ep out (it takes ep = 1 only)
            return False
        return True

    def _check_experts(self, tp: int, cp: int, dp: int, pp: int) -> None:
        check_expert_split(tp, cp, dp, pp, self.ep, self.etp or tp, "-".join(parse_order(self.order, self.ep)),
                           name=self._name, source=self.source)

    def _name(self, degree: str) -> str:
        return self.names.get(degree, degree)

    def _list(self, degrees: Sequence[str]) -> str:
        return ", ".join(self._name(d) for d in degrees)

    def exact(self) -> ParallelDims:
        """The full degrees (every searched degree given or inferred)."""
        missing = [n for n in SEARCHED + ("ep",) if getattr(self, n) is None]
        if missing:
            raise ValueError(f"degrees {missing} are left to the planner")
        return ParallelDims(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, ep=self.ep, etp=self.etp,
                            order=self.order)

    def candidates(self, tps: Sequence[int], max_pp: int) -> list[ParallelDims]:
        """Every full assignment with tp in ``tps`` and pp <= ``max_pp`` that keeps the fixed degrees and
        Megatron's expert rules (:meth:`check_expert_rules` says why none does)."""
        return [ParallelDims(tp=t, cp=self.cp, pp=p, dp=d, ep=e, etp=et, order=self.order)
                for t, p, d in self._assignments(tps, max_pp) for e, et in self.expert_options(t)
                if self._expert_fit(t, self.cp, d, p, e, et)]

    def check_expert_rules(self, tps: Sequence[int], max_pp: int) -> None:
        """Raise the expert rule's message when the degrees multiply out but no assignment meets it."""
        options = list(self._assignments(tps, max_pp))
        if options and self.ep is not None and not any(self._expert_fit(t, self.cp, d, p) for t, p, d in options):
            t, p, d = options[0]
            self._check_experts(t, self.cp, d, p)

    def _assignments(self, tps: Sequence[int], max_pp: int):
        for t in ([self.tp] if self.tp is not None else tps):
            if self.world_size % (t * self.cp):
                continue
            rest = self.world_size // (t * self.cp)
            for p in range(1, rest + 1):
                if rest % p or p > max_pp or (self.pp is not None and p != self.pp):
                    continue
                if self.dp is not None and rest // p != self.dp:
                    continue
                yield t, p, rest // p


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def masked_orthogonal_groups(sizes: tuple[int, ...], mask: list[bool]) -> list[list[int]]:
    """Same enumeration as Megatron-Core's ``generate_masked_orthogonal_rank_groups``."""
    strides = [prod(sizes[:i]) for i in range(len(sizes))]
    masked = [(s, st) for s, st, m in zip(sizes, strides, mask) if m]
    unmasked = [(s, st) for s, st, m in zip(sizes, strides, mask) if not m]
    group_size = prod(s for s, _ in masked)
    world = prod(sizes)
    out = []
    for gi in range(world // group_size):
        base = _offset(gi, unmasked)
        out.append([base + _offset(ri, masked) for ri in range(group_size)])
    return out


def _offset(index: int, dims: list[tuple[int, int]]) -> int:
    off = 0
    for size, stride in dims:
        off += (index % size) * stride
        index //= size
    return off


def format_ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8": runs of consecutive ranks, for messages and summaries."""
    ranks = sorted(set(ranks))
    if not ranks:
        return "none"
    out, start = [], ranks[0]
    prev = start
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)
