"""Timing the model's layer kinds, the optimizer step and the per-iteration fixed work on this rank.

Each point: ``warmup`` untimed repetitions, then one short probe that sets how many repetitions fill the
window (the TP group takes the largest count, so its collectives pair up), then that many, forward and
backward timed apart; the result is the window's mean. On CUDA every timestamp waits for the device.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...core.cost.network import FRAMEWORK_OVERHEAD_GIB
from ...core.inputs.model import ModelSpec
from . import layers, megatron_layers
from .records import ComputeRecord, OptimizerRecord, OverheadRecord, SlotRecord, window_mean
from .settings import OPTIMIZER_MAX_PARAMS, ComputeJob
from ...core.errors import ConfigError

MAX_REPEATS = 10_000


@dataclass
class Device:
    """Where this rank computes: the torch device, its dtype, and how to wait for it."""
    torch_device: "torch.device"
    dtype: "torch.dtype"

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)

    def now(self) -> float:
        self.sync()
        return time.perf_counter()


def local_device(model: ModelSpec, local_rank: int) -> Device:
    """CUDA device ``local_rank`` in the model's dtype when there is one; else the CPU in fp32."""
    if torch.cuda.is_available():
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return Device(dev, {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[model.dtype])
    return Device(torch.device("cpu"), torch.float32)


def agreed_count(probe_s: float, window_s: float, group, device=None) -> int:
    """Repetitions that fill ``window_s`` after a probe of ``probe_s``; the largest over ``group`` (None: this
    rank alone), so ranks that run collectives together run the same number."""
    count = max(1, min(MAX_REPEATS, math.ceil(window_s / max(probe_s, 1e-7))))
    if group is not None:
        t = torch.tensor([count], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        count = int(t.item())
    return count


def time_fwd_bwd(forward: Callable, backward: Callable, dev: Device, window_s: float, warmup: int,
                 group) -> tuple[float, float]:
    """Mean (forward, backward) seconds over a window; ``forward()`` returns what ``backward(out)`` takes."""
    for _ in range(warmup):
        backward(forward())
    t0 = dev.now()
    out = forward()
    backward(out)
    count = agreed_count(dev.now() - t0, window_s, group, dev.torch_device)
    fwd = bwd = 0.0
    for _ in range(count):
        t0 = dev.now()
        out = forward()
        t1 = dev.now()
        backward(out)
        t2 = dev.now()
        fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
    return window_mean(fwd, count), window_mean(bwd, count)


class Modules:
    """The module of the last (kind, tp) timed: the micro-batch sizes of one kind reuse it (building a large
    layer takes longer than timing it); built on the device itself, not copied there."""

    def __init__(self, megatron: bool = False):
        self.key, self.module, self.megatron = None, None, megatron

    def get(self, job: ComputeJob, model: ModelSpec, dev: Device, tp_rank: int, group):
        key = (job.kind, job.tp)
        if key != self.key:
            self.key, self.module = None, None
            torch.manual_seed(0)                # the TP ranks build the same router (same routing, same work)
            if self.megatron:
                self.module = megatron_layers.build(job.kind, model, job.tp, dev.dtype, dev.is_cuda)
            else:
                with dev.torch_device:
                    self.module = layers.build(job.kind, model, job.tp, tp_rank, group).to(dev.dtype)
            self.key = key
        return self.module


def measure_job(job: ComputeJob, model: ModelSpec, dev: Device, tp_rank: int, group, window_s: float,
                warmup: int, modules: Optional[Modules] = None) -> ComputeRecord:
    """One kind at one micro-batch size on this rank (a member of the job's TP group)."""
    module = (modules or Modules()).get(job, model, dev, tp_rank, group)
    mb, s, h = job.micro_batch_size, model.seq_length, model.hidden_size
    tokens = torch.randint(0, model.vocab_size, (mb, s), device=dev.torch_device)
    if job.kind == "embedding":
        grad = torch.randn(mb, s, h, device=dev.torch_device, dtype=dev.dtype)
        forward = lambda: module(tokens)                                    # noqa: E731
        backward = lambda out: out.backward(grad)                           # noqa: E731
    elif job.kind == "output":
        x = torch.randn(mb, s, h, device=dev.torch_device, dtype=dev.dtype, requires_grad=True)
        forward = lambda: module(x, tokens)                                 # noqa: E731
        backward = lambda loss: loss.backward()                             # noqa: E731
    else:
        x = torch.randn(mb, s, h, device=dev.torch_device, dtype=dev.dtype, requires_grad=True)
        grad = torch.randn(mb, s, h, device=dev.torch_device, dtype=dev.dtype)
        forward = lambda: module(x)                                         # noqa: E731
        backward = lambda out: out.backward(grad)                           # noqa: E731
    fwd, bwd = time_fwd_bwd(forward, backward, dev, window_s, warmup, group)
    module.zero_grad(set_to_none=True)
    return ComputeRecord(job.device, job.kind, job.tp, job.micro_batch_size, fwd, bwd)


def free_bytes(dev: Device) -> Optional[float]:
    """What this rank can still allocate: the GPU's free memory, or the host's available memory on a CPU
    (None where it cannot be read)."""
    if dev.is_cuda:
        return float(torch.cuda.mem_get_info(dev.torch_device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def refuse_if_short(job: ComputeJob, model: ModelSpec, dev: Device, need_bytes: float) -> None:
    """Before building a point: the device must have the estimate free now (the cluster file's memory was
    checked before the run; another process may hold part of it, or a CPU host has less)."""
    free = free_bytes(dev)
    if not dev.is_cuda:                 # the estimate's framework slack is a GPU's (context, communicators)
        need_bytes -= FRAMEWORK_OVERHEAD_GIB * 2**30
    if free is not None and need_bytes > free:
        raise _short(job, model, f"needs about {need_bytes / 2**30:.1f} GiB but this {dev.torch_device.type} has "
                                 f"{free / 2**30:.1f} GiB free")


def _short(job: ComputeJob, model: ModelSpec, what: str):
    return ConfigError(f"{job.kind} of {model.name} at micro-batch {job.micro_batch_size} with tp={job.tp} on "
                       f"{job.device}: {what}", field="--micro-batch-sizes",
                       fix="measure smaller micro-batches (--micro-batch-sizes) or larger TP degrees (--tp), or "
                           "free the device's memory")


def out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def measure_fitting(job: ComputeJob, model: ModelSpec, dev: Device, need_bytes: float, *args, **kwargs):
    """:func:`measure_job`, refused (a ConfigError naming the size) when the memory is not there, before or
    during the point, instead of an allocator's crash."""
    refuse_if_short(job, model, dev, need_bytes)
    try:
        return measure_job(job, model, dev, *args, **kwargs)
    except RuntimeError as exc:
        if not out_of_memory(exc):
            raise
        raise _short(job, model, f"ran out of memory ({str(exc).splitlines()[0][:200]})") from None


def optimizer_params(model: ModelSpec, tp: int) -> int:
    """Parameters the optimizer step is timed over: one rank's share of the model, at most
    OPTIMIZER_MAX_PARAMS (the step is elementwise; more only takes longer to measure)."""
    return max(1, min(OPTIMIZER_MAX_PARAMS, model.total_params // tp))


def measure_optimizer(device_name: str, model: ModelSpec, dev: Device, tp: int, window_s: float,
                      warmup: int) -> OptimizerRecord:
    """Adam's step (fp32 master weights, as the frameworks keep them) over one tensor per layer."""
    total = optimizer_params(model, tp)
    pieces = max(1, min(model.num_layers, 32, total))
    params = [torch.nn.Parameter(torch.zeros(total // pieces, device=dev.torch_device)) for _ in range(pieces)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.Adam(params, lr=1e-4)
    step = lambda: opt.step()                       # noqa: E731
    seconds, _ = time_fwd_bwd(step, lambda _: None, dev, window_s, warmup, None)
    return OptimizerRecord(device_name, tp, seconds / (pieces * (total // pieces)))


def overhead_parts(model: ModelSpec, dev: Device, window_s: float, warmup: int) -> float:
    """This rank's part of the fixed per-iteration work: a micro-batch's tokens and labels made on the device
    (the data), and an optimizer step's fixed cost (an Adam step and zero_grad over one tiny tensor)."""
    p = torch.nn.Parameter(torch.zeros(8, device=dev.torch_device))
    p.grad = torch.zeros_like(p)
    opt = torch.optim.Adam([p], lr=1e-4)

    def once():
        torch.randint(0, model.vocab_size, (2, model.seq_length), device=dev.torch_device)
        opt.step()
        opt.zero_grad(set_to_none=False)
    seconds, _ = time_fwd_bwd(once, lambda _: None, dev, window_s, warmup, None)
    return seconds


def slot_record(device_name: str, model: ModelSpec, dev: Device, micro_batch_size: int, window_s: float,
                warmup: int) -> SlotRecord:
    """A pipeline slot's own work on this device (issue 23), what a 1F1B schedule does around each forward and
    backward of one micro-batch besides the stage's layers and the transfer: the receive buffer of an activation
    (sequence x micro-batch x hidden) made a leaf that wants its gradient, an output through autograd, a backward
    with its gradient and the buffer of the gradient sent back, the output freed after the send (Megatron's
    ``deallocate_output_tensor``). One op stands for the stage so that no layer's work is timed; the transfer's
    latency is the links' (the profile's ``latency_us``). A lower bound of a framework's slot (its hooks and loss
    scaling add launches), measured where the default was a guess."""
    shape = (model.seq_length, micro_batch_size, model.hidden_size)
    weight = torch.ones(1, device=dev.torch_device, dtype=dev.dtype, requires_grad=True)

    def forward():
        torch.empty(shape, device=dev.torch_device, dtype=dev.dtype).requires_grad_()     # the received input
        return weight * 2.0                          # the stage: one op, so that no layer's work is timed

    def backward(out):
        torch.autograd.backward(out, torch.ones_like(out))
        torch.empty(shape, device=dev.torch_device, dtype=dev.dtype)                      # the gradient sent back
        out.data = torch.empty((1,), device=dev.torch_device, dtype=dev.dtype)            # freed after the send
        weight.grad = None
    fwd, bwd = time_fwd_bwd(forward, backward, dev, window_s, warmup, None)
    return SlotRecord(device_name, (fwd + bwd) / 2)


def loss_allreduce_s(dev: Device, repeats: int, group=None) -> float:
    """Every rank at once: the one-number loss all-reduce over the world group each iteration ends with
    (``group``: a gloo world group, on host memory, where the accelerators' library cannot join the world)."""
    t = torch.ones(1, device="cpu" if group is not None else dev.torch_device)
    dist.all_reduce(t, group=group)
    t0 = dev.now()
    for _ in range(repeats):
        dist.all_reduce(t, group=group)
    return (dev.now() - t0) / repeats


def overhead_record(device_name: str, parts_s: float, allreduce_s: float) -> OverheadRecord:
    return OverheadRecord(device_name, parts_s + allreduce_s)

