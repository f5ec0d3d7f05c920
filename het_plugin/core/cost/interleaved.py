"""Megatron's interleaved 1F1B schedule (virtual pipeline stages), simulated op by op.

With ``vpp`` virtual stages per pipeline rank the model is cut into ``pp * vpp`` chunks; chunk ``c`` of rank ``r``
is virtual stage ``g = c * pp + r``, so a micro-batch visits rank 0, 1, ..., pp-1, then rank 0 again (the
*wrap* hop from the last rank to the first) for each chunk. The order of each rank's forward and backward
chunks is Megatron-Core's ``forward_backward_pipelining_with_interleaving`` (0.16-0.19):

* the schedule table runs micro-batches in groups of ``N = microbatch_group_size_per_vp_stage`` (default
  ``pp``): for each group, chunk 0 of each micro-batch, then chunk 1, ...; Megatron requires ``pp <= N <= m``
  and ``m % N`` to be 0 or at least ``pp`` -- with the default, ``m`` a multiple of ``pp``;
* forward ``k`` runs table entry ``k``; backward ``k`` runs the same micro-batch on chunk ``vpp - 1 - c``;
* rank ``r`` first runs ``W = min(m * vpp, 2 (pp - r - 1) + (vpp - 1) N)`` warm-up forwards, then pairs
  (forward ``W + k``, backward ``k``), then the remaining backwards.

Point-to-point transfers: the warm-up and cool-down send and receive *blocking* (``send_forward_recv_forward``,
``send_backward_recv_backward``: the sender is busy for the transfer). In the steady state

* without ``overlap_p2p_comm`` one batched call after each (forward, backward) pair sends both results and
  receives both inputs of the next pair: the next forward waits for both;
* with ``overlap_p2p_comm`` (Megatron-LM's default for interleaving) each send is posted asynchronously right
  after its compute, and the rank then waits only for the *previous* send in the same direction
  (``send_next_wait_handle.wait()``): a transfer is hidden behind up to one forward-and-backward of compute,
  and a rank whose link is slower than that waits for it. Before the (blocking) cool-down it waits for the last
  steady backward's send;
* with ``overlap_p2p_comm_warmup_flush`` as well, the warm-up and cool-down post their sends the same way.

A directed link (one sender rank to one receiver rank) carries one transfer at a time. With ``vpp == 1`` use
:func:`het_plugin.core.cost.simulate_1f1b` (Megatron's non-interleaved schedule, a different warm-up).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


def schedule_table(m: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """Megatron's ``get_schedule_table``: (micro-batch, chunk) of every forward, in order."""
    table = []
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        table += [(i, c) for c in range(vpp) for i in range(lo, hi)]
    return table


def check_micro_batches(pp: int, m: int, group: Optional[int] = None) -> None:
    """Megatron's interleaved schedule's rule on the micro-batch count (ValueError, with the rule, otherwise)."""
    group = pp if group is None else group
    if not pp <= group <= m:
        raise ValueError(f"the interleaved schedule needs pp <= microbatch_group_size_per_vp_stage <= micro-batches: "
                         f"pp={pp}, group={group}, micro-batches={m}")
    rest = m % group
    if 0 < rest < pp:
        raise ValueError(f"the interleaved schedule needs micro-batches % {group} to be 0 or >= pp={pp}, got {m}")


def warmup_count(pp: int, rank: int, m: int, vpp: int, group: Optional[int] = None) -> int:
    """Warm-up forwards of ``rank`` (Megatron's ``get_pp_rank_microbatches``, interleaved)."""
    group = pp if group is None else group
    return min(m * vpp, 2 * (pp - rank - 1) + (vpp - 1) * group)


def interleaved_order(pp: int, rank: int, m: int, vpp: int, group: Optional[int] = None) -> list[tuple[str, int, int, str]]:
    """The ops of one rank, in order: (``"F"`` or ``"B"``, micro-batch, chunk, phase); phase is ``"warmup"``,
    ``"steady"`` or ``"cooldown"``."""
    group = pp if group is None else group
    table = schedule_table(m, vpp, group)
    total = m * vpp
    warm = warmup_count(pp, rank, m, vpp, group)

    def f(k):
        i, c = table[k]
        return i, c

    def b(k):
        i, c = table[k]
        return i, vpp - 1 - c

    ops = [("F", *f(k), "warmup") for k in range(warm)]
    for k in range(total - warm):
        ops += [("F", *f(warm + k), "steady"), ("B", *b(k), "steady")]
    ops += [("B", *b(k), "cooldown") for k in range(total - warm, total)]
    return ops


@dataclass
class InterleavedRun:
    finish: list[float]                     # per rank: when its last op (and its blocking sends) ended
    last_backward_start: list[list[float]]  # per rank and chunk: start of the chunk's last backward
    busy: list[float]                       # per rank: compute time


def simulate_interleaved(fwd: Sequence[Sequence[float]], bwd: Sequence[Sequence[float]], send: Sequence[float],
                         wrap_send: float, m: int, *, overlap_p2p_comm: bool = True, warmup_flush: bool = False,
                         group: Optional[int] = None) -> InterleavedRun:
    """Simulate Megatron's interleaved 1F1B.

    ``fwd[r][c]`` / ``bwd[r][c]``: one micro-batch's forward / backward of chunk ``c`` on rank ``r``.
    ``send[r]``: one activation or gradient between ranks ``r`` and ``r + 1`` (either direction; ``pp - 1``
    entries are read); ``wrap_send``: between the last rank and the first (chunk ``c`` of the last rank feeds
    chunk ``c + 1`` of the first). ``warmup_flush`` (Megatron's ``overlap_p2p_comm_warmup_flush``, with
    ``overlap_p2p_comm``): the warm-up and cool-down send asynchronously too, as the steady state does.
    """
    pp, vpp = len(fwd), len(fwd[0])
    if warmup_flush and not overlap_p2p_comm:
        raise ValueError("warmup_flush needs overlap_p2p_comm (Megatron: overlap_p2p_comm_warmup_flush)")
    if pp < 2 or vpp < 2 or any(len(row) != vpp for row in list(fwd) + list(bwd)) or len(bwd) != pp:
        raise ValueError("simulate_interleaved needs pp >= 2 ranks of vpp >= 2 chunks (fwd and bwd alike)")
    check_micro_batches(pp, m, group)
    G = pp * vpp
    orders = [interleaved_order(pp, r, m, vpp, group) for r in range(pp)]

    def hop(src: int, dst: int) -> float:
        return send[min(src, dst)] if abs(src - dst) == 1 else wrap_send     # pp == 2: the one pair

    arrive_f: dict[tuple[int, int], float] = {}     # (micro-batch, virtual stage) -> input activation arrives
    arrive_b: dict[tuple[int, int], float] = {}     # (micro-batch, virtual stage) -> output gradient arrives
    end_f: dict[tuple[int, int], float] = {}
    link_free: dict[tuple[int, int], float] = {}
    free = [0.0] * pp
    busy = [0.0] * pp
    ptr = [0] * pp
    last_send = [{"next": 0.0, "prev": 0.0} for _ in range(pp)]   # overlap: the pending send per direction
    held: list[list] = [[] for _ in range(pp)]                     # no overlap: steady sends wait for the pair
    last_b_start = [[0.0] * vpp for _ in range(pp)]

    def transfer(src: int, dst: int, t: float) -> float:
        start = max(t, link_free.get((src, dst), 0.0))
        end = start + hop(src, dst)
        link_free[(src, dst)] = end
        return end

    def post(r: int, kind: str, i: int, g: int, t: float) -> Optional[float]:
        """Send the result of op (kind, i, g) from rank r at time t; returns the arrival time (None: no send)."""
        if kind == "F":
            if g + 1 >= G:
                return None
            dst, key, box = (g + 1) % pp, (i, g + 1), arrive_f
        else:
            if g == 0:
                return None
            dst, key, box = (g - 1) % pp, (i, g - 1), arrive_b
        end = transfer(r, dst, t)
        box[key] = end
        pending.append(dst)
        return end

    def ready_time(r: int, op) -> Optional[float]:
        kind, i, c, phase = op
        g = c * pp + r
        if kind == "F":
            t = 0.0 if g == 0 else arrive_f.get((i, g))
            if t is None:
                return None
            if phase == "steady" and not overlap_p2p_comm:
                # the batched call before this pair also received the pair's backward input (the last
                # virtual stage's backward needs none: it starts from its own forward)
                _, bi, bc, _ = orders[r][ptr[r] + 1]
                bg = bc * pp + r
                if bg != G - 1:
                    tb = arrive_b.get((bi, bg))
                    if tb is None:
                        return None
                    t = max(t, tb)
            return t
        return end_f.get((i, g)) if g == G - 1 else arrive_b.get((i, g))

    pending = list(range(pp))
    while pending:
        r = pending.pop()
        while ptr[r] < len(orders[r]):
            op = orders[r][ptr[r]]
            kind, i, c, phase = op
            ready = ready_time(r, op)
            if ready is None:
                break
            g = c * pp + r
            if (phase == "cooldown" and overlap_p2p_comm and not warmup_flush
                    and ptr[r] > 0 and orders[r][ptr[r] - 1][3] != "cooldown"):
                # Megatron waits for the last steady backward's send before the blocking cool-down
                free[r] = max(free[r], last_send[r]["prev"])
                last_send[r]["prev"] = 0.0
            start = max(free[r], ready)
            dur = fwd[r][c] if kind == "F" else bwd[r][c]
            end = start + dur
            busy[r] += dur
            if kind == "F":
                end_f[(i, g)] = end
            else:
                last_b_start[r][c] = start
            free[r] = end
            direction = "next" if kind == "F" else "prev"
            if phase != "steady" and not warmup_flush:      # blocking send
                arrival = post(r, kind, i, g, free[r])
                if arrival is not None:
                    free[r] = arrival
            elif overlap_p2p_comm:                # posted now; wait for the previous one of this direction
                arrival = post(r, kind, i, g, end)
                free[r] = max(end, last_send[r][direction])
                last_send[r][direction] = arrival if arrival is not None else 0.0
            elif kind == "F":                     # batched with the pair's backward
                held[r].append((kind, i, g))
            else:
                ends = [post(r, k2, i2, g2, end) for k2, i2, g2 in held[r] + [(kind, i, g)]]
                held[r].clear()
                free[r] = max([end] + [e for e in ends if e is not None])
            ptr[r] += 1
    if any(ptr[r] < len(orders[r]) for r in range(pp)):
        raise RuntimeError("interleaved simulation deadlocked (a bug)")
    finish = [max(free[r], max(last_send[r].values())) for r in range(pp)]
    return InterleavedRun(finish, last_b_start, busy)
