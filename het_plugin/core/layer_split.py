"""Exact uneven pipeline partition: integer layers per stage minimising the slowest stage.

Each stage ``s`` has a cost table ``cost[s][n]``: its time when it holds ``n`` transformer layers (its
fixed costs -- embedding on the first stage, output layer and loss on the last -- included), and a
memory cap ``max_layers[s]``. The answer minimises ``max_s cost[s][n_s]`` subject to ``sum n_s =
num_layers`` and ``min_layers <= n_s <= max_layers[s]``. Costs only need to be non-decreasing in ``n``
(the predictor's are: linear compute plus the gradient reduction that overlap cannot hide), so the
optimum is found exactly by a binary search over the candidate bottlenecks (every table entry): for a
bound T each stage takes the most layers whose cost stays <= T, and T is feasible when those add up to
``num_layers``. Among optimal splits, layers are then taken back from the currently most expensive
stage first, which makes the second-slowest stage as fast as possible and gives faster stages at least
as many layers as slower ones with the same fixed cost.

Empty stages: Megatron-Core's ``pipeline_model_parallel_layout`` accepts a stage without decoder layers
(its validator only counts layers; its printer even shows "(empty stage)"), but
``num_layers_in_first/last_pipeline_stage`` must be > 0, and DeepSpeed's ``PipelineModule`` partitions its
layer-spec list (embedding and head included), so a zero-layer stage there holds only the embedding or
the head. The default is therefore ``min_layers=1``; callers may pass 0.
"""
from __future__ import annotations

import bisect
import heapq
from typing import Optional, Sequence


def linear_costs(fixed: Sequence[float], per_layer: Sequence[float], num_layers: int) -> list[list[float]]:
    """Cost tables ``fixed[s] + n * per_layer[s]`` for n = 0..num_layers."""
    return [[f + n * p for n in range(num_layers + 1)] for f, p in zip(fixed, per_layer)]


def exact_partition(num_layers: int, costs: Sequence[Sequence[float]], max_layers: Optional[Sequence[int]] = None,
                    min_layers: int = 1) -> Optional[list[int]]:
    """Layers per stage minimising the slowest stage's cost, or None when no split satisfies the caps."""
    p = len(costs)
    if p == 0:
        return None
    caps = [min(num_layers, int(c)) for c in (max_layers if max_layers is not None else [num_layers] * p)]
    if any(c < min_layers for c in caps) or sum(caps) < num_layers or min_layers * p > num_layers:
        return None
    tables = []
    for s in range(p):
        row, top = [], float("-inf")
        for n in range(caps[s] + 1):       # a running maximum: callers' tables may wobble by rounding
            top = max(top, float(costs[s][n]))
            row.append(top)
        tables.append(row)

    def most_layers(T: float) -> Optional[list[int]]:
        out = []
        for s in range(p):
            n = bisect.bisect_right(tables[s], T) - 1     # largest n with cost <= T
            if n < min_layers:
                return None
            out.append(n)
        return out if sum(out) >= num_layers else None

    candidates = sorted({tables[s][n] for s in range(p) for n in range(min_layers, caps[s] + 1)})
    lo, hi = 0, len(candidates) - 1
    if most_layers(candidates[hi]) is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if most_layers(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    counts = most_layers(candidates[lo])
    assert counts is not None
    # Give back the excess from the most expensive stage first (ties: the later stage, which holds the
    # output layer and usually has the least memory headroom).
    excess = sum(counts) - num_layers
    heap = [(-tables[s][counts[s]], -s) for s in range(p) if counts[s] > min_layers]
    heapq.heapify(heap)
    while excess:
        _, neg_s = heapq.heappop(heap)
        s = -neg_s
        counts[s] -= 1
        excess -= 1
        if counts[s] > min_layers:
            heapq.heappush(heap, (-tables[s][counts[s]], -s))
    return counts


def bottleneck(costs: Sequence[Sequence[float]], counts: Sequence[int]) -> float:
    return max(costs[s][n] for s, n in enumerate(counts))


def virtual_split(layers_per_stage: Sequence[int], vpp: int) -> list[list[int]]:
    """Each stage's layers over its ``vpp`` virtual stages (an interleaved pipeline), as evenly as possible.

    Where a stage's layers do not divide by ``vpp``, the extra layers go to the virtual stages that hold
    neither the embedding (virtual stage 0 of the first stage) nor the output layer and loss (the last virtual
    stage of the last stage), earliest first. An even stage keeps Megatron's own even split. Every virtual
    stage gets at least one layer: a stage needs ``vpp`` layers or more.
    """
    if vpp < 1:
        raise ValueError(f"vpp must be >= 1, got {vpp}")
    pp = len(layers_per_stage)
    out = []
    for s, n in enumerate(layers_per_stage):
        if n < vpp:
            raise ValueError(f"stage {s} has {n} layers, fewer than its {vpp} virtual stages")
        base, extra = divmod(n, vpp)
        row = [base] * vpp
        order = list(range(vpp))
        if s == 0:                        # the embedding's virtual stage takes an extra layer last
            order = order[1:] + order[:1]
        if s == pp - 1:                   # ... and so does the output layer's
            order = [c for c in order if c != vpp - 1] + [vpp - 1]
        for c in order[:extra]:
            row[c] += 1
        out.append(row)
    return out
