"""The pipeline schedule: 1F1B simulated op by op (and Megatron's interleaved 1F1B through
:mod:`.interleaved`), the sends between stages.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..inputs.model import ModelSpec
from ..inputs.profile import Profile
from .analysis import Analysis
from .network import Tier, _hops_s
from .stage import StageModel, _dp_reduce_s
from .interleaved import simulate_interleaved

# ---- 1F1B simulation ------------------------------------------------------------------------------


def one_f_one_b_order(pp: int, stage: int, m: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved schedule for one stage: warm-up forwards, 1F1B pairs, cool-down."""
    warmup = min(pp - stage - 1, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(m - warmup, m)]
    return ops


def simulate_1f1b(fwd: Sequence[float], bwd: Sequence[float], send: Sequence[float], m: int,
                  send_back: Optional[Sequence[float]] = None, record: Optional[list] = None) -> list[float]:
    """Finish time of every stage's last backward.

    ``send[s]`` is the time to move one activation (forward) or gradient (backward) between stages s and
    s+1; the sender is busy for it (Megatron's p2p calls block) and the receiver may start when it ends.
    ``send_back[s]``: the gradient's time from s+1 to s where it differs (a link measured per direction).
    ``record``: gets every span as ``(stage, "forward" | "backward" | "send", start, end, micro_batch)`` (the
    timeline draws them).
    """
    pp = len(fwd)
    back = send if send_back is None else send_back
    if record is None:
        return _finish_times(fwd, bwd, send, back, m)
    orders = [one_f_one_b_order(pp, s, m) for s in range(pp)]
    end_f = [[-1.0] * m for _ in range(pp)]
    end_b = [[-1.0] * m for _ in range(pp)]
    arrive_f = [[-1.0] * m for _ in range(pp)]     # activation of micro-batch i arrives at stage s
    arrive_b = [[-1.0] * m for _ in range(pp)]     # gradient of micro-batch i arrives at stage s
    free = [0.0] * pp
    ptr = [0] * pp
    pending = list(range(pp))
    while pending:
        s = pending.pop()
        while ptr[s] < len(orders[s]):
            kind, i = orders[s][ptr[s]]
            if kind == "F":
                ready = 0.0 if s == 0 else arrive_f[s][i]
                if ready < 0:
                    break
                start = max(free[s], ready)
                end = start + fwd[s]
                end_f[s][i] = end
                free[s] = end
                if record is not None:
                    record.append((s, "forward", start, end, i))
                if s + 1 < pp:
                    if record is not None:
                        record.append((s, "send", end, end + send[s], i))
                    free[s] += send[s]
                    arrive_f[s + 1][i] = free[s]
                    pending.append(s + 1)
            else:
                ready = end_f[s][i] if s == pp - 1 else arrive_b[s][i]
                if ready < 0:
                    break
                start = max(free[s], ready)
                end = start + bwd[s]
                end_b[s][i] = end
                free[s] = end
                if record is not None:
                    record.append((s, "backward", start, end, i))
                if s > 0:
                    if record is not None:
                        record.append((s, "send", end, end + back[s - 1], i))
                    free[s] += back[s - 1]
                    arrive_b[s - 1][i] = free[s]
                    pending.append(s - 1)
            ptr[s] += 1
    if any(ptr[s] < len(orders[s]) for s in range(pp)):
        raise RuntimeError("1F1B simulation deadlocked (a bug)")
    return [max(end_b[s][m - 1], free[s]) for s in range(pp)]


def _stage_ops(pp: int, stage: int, m: int) -> list[int]:
    """:func:`one_f_one_b_order` as integers: ``i`` the forward of micro-batch i, ``~i`` its backward."""
    warmup = min(pp - stage - 1, m)
    ops = list(range(warmup))
    for i in range(m - warmup):
        ops += (warmup + i, ~i)
    ops += [~i for i in range(m - warmup, m)]
    return ops


def _finish_times(fwd: Sequence[float], bwd: Sequence[float], send: Sequence[float], back: Sequence[float],
                  m: int) -> list[float]:
    """:func:`simulate_1f1b` without the spans, for the search (its hottest loop on big micro-batch counts): the
    same additions and maxima on the same values (each op's times depend only on the ops before it, so the
    order the stages are advanced in does not change them), with less bookkeeping per op. A stage runs as far as
    its inputs allow, then its neighbours that it gave an input to."""
    pp = len(fwd)
    orders = [_stage_ops(pp, s, m) for s in range(pp)]
    arrive_f = [[-1.0] * m for _ in range(pp)]     # activation of micro-batch i arrives at stage s
    arrive_b = [[-1.0] * m for _ in range(pp)]     # its gradient arrives (the last stage: its forward ends)
    free = [0.0] * pp
    ptr = [0] * pp
    last_b = [-1.0] * pp                           # the end of each stage's last backward
    pending = list(range(pp))
    while pending:
        s = pending.pop()
        ops, k = orders[s], ptr[s]
        n = len(ops)
        if k == n:
            continue
        t, f, b = free[s], fwd[s], bwd[s]
        mine_f, mine_b = arrive_f[s], arrive_b[s]
        out_f = arrive_f[s + 1] if s + 1 < pp else arrive_b[s]
        out_b = arrive_b[s - 1] if s > 0 else None
        hop_f = send[s] if s + 1 < pp else None
        hop_b = back[s - 1] if s > 0 else None
        gave_next = gave_prev = False
        while k < n:
            op = ops[k]
            if op >= 0:
                ready = mine_f[op] if s else 0.0
                if ready < 0:
                    break
                end = max(t, ready) + f
                if hop_f is None:
                    t = out_f[op] = end
                else:
                    t = end
                    t += hop_f
                    out_f[op] = t
                    gave_next = True
            else:
                ready = mine_b[~op]
                if ready < 0:
                    break
                end = max(t, ready) + b
                last_b[s] = end
                t = end
                if hop_b is not None:
                    t += hop_b
                    out_b[~op] = t
                    gave_prev = True
            k += 1
        ptr[s], free[s] = k, t
        if gave_next:
            pending.append(s + 1)
        if gave_prev:
            pending.append(s - 1)
    if any(ptr[s] < len(orders[s]) for s in range(pp)):
        raise RuntimeError("1F1B simulation deadlocked (a bug)")
    return [max(last_b[s], free[s]) for s in range(pp)]


def wrap_send_s(model: ModelSpec, analysis: Analysis, mb: int, profile: Optional[Profile] = None) -> float:
    """One activation (or gradient) from the last stage to the first: the interleaved schedule's extra hop."""
    dims = analysis.placement.dims
    act_msg = mb * model.seq_length * model.hidden_size * model.dtype_bytes / (dims.tp * dims.cp)
    return _hops_s(analysis.wrap_hops, act_msg, profile)


def _virtual_times(sts: list[StageModel], virtual_layers: Sequence[Sequence[int]]) -> tuple[list, list]:
    """Forward and backward of one micro-batch of each virtual stage (chunk): its layers, plus the first stage's
    fixed part (embedding) on its first chunk and the last stage's (output layer, loss, MTP) on its last."""
    pp = len(sts)
    fwd, bwd = [], []
    first, at = {}, 0                      # chunk c of rank r is virtual stage c * pp + r (Megatron's order)
    for c in range(len(virtual_layers[0])):
        for r in range(pp):
            first[r, c] = at
            at += virtual_layers[r][c]
    for r, (st, row) in enumerate(zip(sts, virtual_layers)):
        if st.layer_deltas:
            own = [st.own_layers(first[r, c], n) for c, n in enumerate(row)]
            f, b = [x for x, _ in own], [y for _, y in own]
        else:
            f = [n * st.layer_fwd_s for n in row]
            b = [n * st.layer_bwd_s for n in row]
        c = 0 if r == 0 else len(row) - 1 if r == pp - 1 else None
        if c is not None:
            f[c] += st.fixed_fwd_s
            b[c] += st.fixed_bwd_s
        fwd.append(f)
        bwd.append(b)
    return fwd, bwd


def _interleaved_pipeline(sts: list[StageModel], virtual_layers: Sequence[Sequence[int]], m: int,
                          overlap_p2p_comm: bool, wrap_send: float, dp: int, overlap_grad_reduce: bool,
                          distributed_optimizer: bool, profile: Optional[Profile]) -> tuple[list[float], list[float]]:
    """Each stage's finish of the interleaved schedule and the end of its gradient reduction: with overlap, each
    chunk's share (by parameters) starts at its last backward's start and the shares run one after another."""
    fwd, bwd = _virtual_times(sts, virtual_layers)
    # every chunk's forward and backward is a slot of the schedule (its own forward_step, p2p and hooks)
    fwd = [[t + st.slot_s for t in row] for st, row in zip(sts, fwd)]
    bwd = [[t + st.slot_s for t in row] for st, row in zip(sts, bwd)]
    run = simulate_interleaved(fwd, bwd, [max(st.send_s, st.back_s) for st in sts], wrap_send, m,
                               overlap_p2p_comm=overlap_p2p_comm)
    ends = []
    pp = len(sts)
    for r, (st, row) in enumerate(zip(sts, virtual_layers)):
        n = sum(row)
        red = _dp_reduce_s(st, n, dp, distributed_optimizer, profile)
        if not overlap_grad_reduce or red <= 0:
            ends.append(run.finish[r] + red)
            continue
        params = [k * st.params_per_layer for k in row]
        params[0 if r == 0 else -1] += st.fixed_params if r in (0, pp - 1) else 0.0
        total = sum(params) or 1.0
        done = 0.0
        for c in sorted(range(len(row)), key=lambda c: run.last_backward_start[r][c]):
            done = max(done, run.last_backward_start[r][c]) + red * params[c] / total
        ends.append(max(run.finish[r], done))
    return run.finish, ends
