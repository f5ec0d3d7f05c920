"""The ``het_shim`` process group: collectives over ranks on different accelerator vendors.

NCCL and RCCL cannot share a communicator, so a group spanning vendors works in three hops:
inside each vendor subgroup with that vendor's native backend, between the subgroups' leaders through
host memory (CPU tensors over gloo/TCP), then back inside each subgroup. Tensors are cut into chunks
and the hops run as a pipeline (chunk i crosses between leaders while chunk i+1 is reduced inside the
subgroups and chunk i-1 is sent back down). A group whose members all have one vendor forwards every
call to the native backend.

Threads and streams (so that the shim cannot deadlock beside Megatron's own collectives, issued from the
main thread, with ``CUDA_DEVICE_MAX_CONNECTIONS=1``; NCCL needs the operations of different communicators
issued in the same order on every rank): every native (NCCL/RCCL) collective is issued on the caller's
thread -- the subgroup step down when the call is made, the step back up when the caller waits on the
returned work (as torch code does, in program order) -- and the native communicators are connected eagerly
when the group is created, on the creating thread. Only the host hop (gloo between the subgroup leaders) runs
on the group's worker thread, in submission order (every member submits the same sequence, so the hops
match up); it waits for the step down through a CUDA event (on a side stream of this group, so the caller's
stream is not held) and copies on its own stream: nothing waits for the whole device. Point-to-point calls
are issued directly (their peers do not follow the group's collective order).
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..core.errors import HetPluginError
from ..core.ranks.transport import Transport
from ..runtime.netselect import SHIM_BACKEND, gloo_network, nccl_options
from .shim_layout import ShimLayout, chunk_bounds, describe, stripe_pieces
from ..runtime.exchange import timeout_s
from .vendors import ShimOptions, agree_on_vendors
from .work import ShimWork

ENV_NATIVE = "HET_PLUGIN_SHIM_NATIVE"   # 'gloo' forces gloo inside subgroups even where NCCL/RCCL exists
ENV_MAX_STRIPES = "HET_PLUGIN_SHIM_MAX_STRIPES"

RedOp = dist.ReduceOp.RedOpType
SUPPORTED_REDUCE_OPS = (RedOp.SUM, RedOp.AVG, RedOp.MAX, RedOp.MIN, RedOp.PRODUCT)


class ShimUnsupportedError(HetPluginError, NotImplementedError):
    """An operation the cross-vendor shim does not implement; the message names a workaround."""


# ---- helpers over native backends -------------------------------------------------------------

def _op_kind(reduce_op) -> RedOp:
    return getattr(reduce_op, "op", reduce_op)


def _allreduce_opts(op: RedOp) -> dist.AllreduceOptions:
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp(op)
    return o


def _reduce_opts(op: RedOp, root: int) -> dist.ReduceOptions:
    o = dist.ReduceOptions()
    o.reduceOp = dist.ReduceOp(op)
    o.rootRank = root
    o.rootTensor = 0
    return o


def _bcast_opts(root: int) -> dist.BroadcastOptions:
    o = dist.BroadcastOptions()
    o.rootRank = root
    o.rootTensor = 0
    return o


def _gather_opts(root: int) -> dist.GatherOptions:
    o = dist.GatherOptions()
    o.rootRank = root
    return o


def _scatter_opts(root: int) -> dist.ScatterOptions:
    o = dist.ScatterOptions()
    o.rootRank = root
    return o


def _rs_opts(op: RedOp) -> dist.ReduceScatterOptions:
    o = dist.ReduceScatterOptions()
    o.reduceOp = dist.ReduceOp(op)
    return o


def _all_gather_base(pg, out: torch.Tensor, inp: torch.Tensor):
    fn = getattr(pg, "all_gather_single", None) or pg._allgather_base
    return fn(out, inp)


def _reduce_scatter_base(pg, out: torch.Tensor, inp: torch.Tensor, op: RedOp):
    fn = getattr(pg, "reduce_scatter_single", None) or pg._reduce_scatter_base
    return fn(out, inp, _rs_opts(op))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself when already in host memory, else a host copy (pinned where possible)."""
    if t.device.type == "cpu":
        return t
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    h.copy_(t)
    return h


def _host_buffer(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())


def _from_host(h: torch.Tensor, t: torch.Tensor) -> None:
    if h is not t:
        t.copy_(h)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D tensor with t's data: a view when t is contiguous, else a copy."""
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _writeback(flat: torch.Tensor, t: torch.Tensor) -> None:
    if not (t.is_contiguous() and flat.data_ptr() == t.data_ptr()):
        t.copy_(flat.view(t.shape))


def _make_native(kind: str, store, rank: int, size: int, timeout: timedelta, net_name: Optional[str] = None):
    """A vendor subgroup's native backend; NCCL's options come from the one builder (runtime.netselect)."""
    if kind == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if kind == "nccl":
        opts = nccl_options(net_name, timeout=timeout)
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(kind)


def _subgroup_net_name(options: Optional[ShimOptions], global_ranks: Sequence[int]) -> Optional[str]:
    """The NCCL net_name the group policy gives a vendor subgroup over ``global_ranks``; None: NCCL's choice."""
    if options is None or options.net_name_of is None:
        return None
    return options.net_name_of(global_ranks)


def _accelerated(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on the accelerator (its hops then synchronise through CUDA events)."""
    return t.device.type == "cuda"


def _device_native_kind() -> Optional[str]:
    """The native backend for accelerator tensors in this process (NCCL, which is RCCL on ROCm builds)."""
    if os.environ.get(ENV_NATIVE, "").strip().lower() == "gloo":
        return None
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return None


def _stripes(layout: ShimLayout) -> int:
    """Stripes per all-reduce: one per rail, or fewer with HET_PLUGIN_SHIM_MAX_STRIPES (1: leaders only)."""
    cap = os.environ.get(ENV_MAX_STRIPES, "").strip()
    return max(1, min(layout.num_stripes, int(cap))) if cap else layout.num_stripes


def _subgroup_network(options: Optional[ShimOptions], global_ranks: Sequence[int]):
    """gloo_network() for a vendor subgroup, from the transport the group's options give it; else a no-op."""
    if options is None or options.transport_of is None:
        return contextlib.nullcontext()
    return gloo_network(options.transport_of(global_ranks))


class ShimProcessGroup(dist.ProcessGroup):
    """A torch.distributed ProcessGroup; create with ``new_group(ranks, backend="het_shim")``."""

    def __init__(self, store, rank: int, size: int, global_ranks: Sequence[int], timeout: timedelta,
                 layout: ShimLayout, options: Optional[ShimOptions] = None):
        super().__init__(rank, size)
        self.layout = layout
        self.global_ranks = list(global_ranks)
        self._timeout = timeout
        self._sub = layout.subgroup_index(rank)
        members = layout.subgroups[self._sub]
        self._members = members
        self._local_rank = members.index(rank)
        self._is_leader = self._local_rank == 0
        # Native backends of this rank's vendor subgroup, per device type. A one-member subgroup of a
        # mixed group needs none; a single-vendor group always has them (they carry every call).
        self._native: dict[str, object] = {}
        if len(members) > 1 or layout.single_vendor:
            with _subgroup_network(options, [self.global_ranks[r] for r in members]):
                self._native["cpu"] = _make_native("gloo", dist.PrefixStore(f"het_shim/sub{self._sub}/cpu", store),
                                                   self._local_rank, len(members), timeout)
            device_kind = _device_native_kind()
            if device_kind:
                sub_ranks = [self.global_ranks[r] for r in members]
                self._native["cuda"] = _make_native(device_kind,
                                                    dist.PrefixStore(f"het_shim/sub{self._sub}/dev", store),
                                                    self._local_rank, len(members), timeout,
                                                    _subgroup_net_name(options, sub_ranks))
                # Connect now, on the creating thread (every member creates the group at the same point of its
                # program), not lazily at the first collective.
                connect = getattr(self._native["cuda"], "eager_connect_single_device", None)
                if connect is not None:
                    connect(torch.device("cuda", torch.cuda.current_device()))
        self._host = self._leaders = None
        self._rails: dict[int, object] = {}      # stripe -> host (gloo) group of its owners, where I am one
        self._worker = None
        self._sync_stream = self._copy_stream = None     # created on the first accelerator call (caller's thread)
        if not layout.single_vendor:
            with gloo_network(Transport.HOST_STAGED):
                self._host = dist.ProcessGroupGloo(dist.PrefixStore("het_shim/host", store), rank, size, timeout)
                # Every member creates its rails in stripe order, so no creation waits on a later one.
                for i, owners in enumerate(layout.rails):
                    if rank in owners:
                        self._rails[i] = dist.ProcessGroupGloo(dist.PrefixStore(f"het_shim/rail{i}", store),
                                                               owners.index(rank), len(owners), timeout)
            self._leaders = self._rails.get(0)       # rail 0 = the subgroup leaders
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="het_shim")

    # ---- identity ---------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - name fixed by the C++ ProcessGroup interface
        return SHIM_BACKEND

    # A het_shim group is never split from (its vendor subgroups are its own communicators).
    supports_splitting = False

    def _get_backend(self, device):
        """This group itself for a device with no registered backend. torch hands a Python ProcessGroup back as
        the group (distributed_c10d._new_process_group_helper: 'If the type is a subclass of ProcessGroup then
        return this process group immediately'), so nothing is registered per device, and
        ``init_process_group('het_shim', device_id=...)`` (DeepSpeed passes one on CUDA and ROCm) would stop at
        ``pg._get_backend(device_id).supports_splitting`` with "No backend type associated with device type"
        (pytorch/pytorch v2.13 torch/distributed/distributed_c10d.py). Answering with this group (no splitting)
        lets such a world be created: torch then neither connects eagerly nor splits groups from it."""
        try:
            return super()._get_backend(device)
        except RuntimeError:
            return self

    def __repr__(self) -> str:
        return f"ShimProcessGroup(rank={self.rank()}, size={self.size()}, {describe(self.layout, self.global_ranks)})"

    # ---- plumbing ---------------------------------------------------------------------------
    def _native_for(self, t: torch.Tensor):
        """This subgroup's native backend for t's device; None in a one-member subgroup."""
        if not self._native:
            return None
        pg = self._native.get(t.device.type)
        if pg is None:
            raise ShimUnsupportedError(
                f"het_shim has no native backend for {t.device.type} tensors in this process "
                f"(have: {sorted(self._native)}); move the tensor to one of those devices")
        return pg

    def _submit(self, job: Callable[[], None], tensors: Sequence[torch.Tensor]) -> ShimWork:
        """Run a host-only ``job`` on the worker thread (the barrier)."""
        return ShimWork(future=self._worker.submit(job), result=tensors)

    # The three steps of a hierarchical collective: ``down`` (native, caller's thread, now), the host hop
    # (gloo, worker thread, after :meth:`_await` of the marks), ``up`` (native, caller's thread, when the caller
    # waits: ShimWork's finish). A mark says "this data is ready": a CUDA event for accelerator tensors,
    # recorded on this group's side stream after it waited on the native work (the caller's stream is not
    # made to wait), or the native work itself for host tensors.
    def _streams(self, device):
        if self._sync_stream is None:
            self._sync_stream = torch.cuda.Stream(device)
            self._copy_stream = torch.cuda.Stream(device)
        return self._sync_stream, self._copy_stream

    def _mark(self, work, t: torch.Tensor):
        if not _accelerated(t):
            return ("work", work)
        side, _ = self._streams(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))      # the caller's work up to this call
        with torch.cuda.stream(side):
            if work is not None:
                work.wait()                                         # NCCL: the side stream waits for it
            event = torch.cuda.Event()
            event.record(side)
        return ("event", event)

    @staticmethod
    def _await(mark) -> None:
        """On the worker: until the marked data is ready (an event, not the whole device)."""
        kind, what = mark
        if what is None:
            return
        if kind == "event":
            what.synchronize()
        else:
            what.wait()

    def _host_copy(self, fn: Callable[[], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
        """On the worker: ``fn()`` (a host copy of device data) on this group's copy stream, then that stream's
        own synchronisation (pinned host memory is read right after)."""
        if not _accelerated(t):
            return fn()
        _, copy = self._streams(t.device)
        with torch.cuda.stream(copy):
            out = fn()
        copy.synchronize()
        return out

    def _staged(self, hop: Optional[Callable[[], object]], post: Callable[[object], None],
                result: Sequence[torch.Tensor], device: Optional[torch.device]) -> ShimWork:
        """The handle of a hierarchical collective: ``hop`` on the worker, ``post(hop's value)`` on the thread that
        waits (the caller's: native collectives stay on it, get_future included)."""
        future = self._worker.submit(self._on_device(hop, device)) if hop is not None else None

        def finish():
            post(future.result() if future is not None else None)
        return ShimWork(future=future, finish=finish, result=result, finish_on_caller=True)

    @staticmethod
    def _on_device(hop, device):
        if device is None:
            return hop

        def run():
            torch.cuda.set_device(device)
            return hop()
        return run

    def _check_op(self, name: str, op: RedOp, t: torch.Tensor) -> None:
        if op not in SUPPORTED_REDUCE_OPS:
            raise ShimUnsupportedError(
                f"het_shim {name}: reduce op {op.name} is not supported (supported: "
                f"{', '.join(o.name for o in SUPPORTED_REDUCE_OPS)}); for PREMUL_SUM scale the input and use SUM, for "
                f"BAND/BOR use MIN/MAX on 0/1 tensors")
        if op == RedOp.AVG and not (t.is_floating_point() or t.is_complex()):
            raise ShimUnsupportedError(f"het_shim {name}: AVG on {t.dtype} tensors is not supported; use SUM "
                                       "and divide by the group size")

    # ---- all_reduce -------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        t = _single(tensors, "all_reduce")
        op = _op_kind(opts.reduceOp)
        self._check_op("all_reduce", op, t)
        if self.layout.single_vendor:
            return self._native_allreduce(t, op)
        return self._hier_allreduce(t, op)

    def allreduce_coalesced(self, tensors, opts=None):
        op = _op_kind((opts or dist.AllreduceCoalescedOptions()).reduceOp)
        works = [self.allreduce([t], _allreduce_opts(op)) for t in tensors]
        return ShimWork(works=works, result=list(tensors))

    def _native_allreduce(self, t: torch.Tensor, op: RedOp):
        pg = self._native_for(t)
        native_avg = not (op == RedOp.AVG and isinstance(pg, dist.ProcessGroupGloo))   # gloo has no AVG
        buf = _contiguous(t)       # gloo would treat a strided view as dense memory
        work = pg.allreduce([buf], _allreduce_opts(op if native_avg else RedOp.SUM))
        if buf is t and native_avg:
            return work

        def finish():
            if not native_avg:
                buf.div_(self.size())
            if buf is not t:
                t.copy_(buf)
        return ShimWork(works=[work], finish=finish, result=[t])

    def _hier_allreduce(self, t: torch.Tensor, op: RedOp) -> ShimWork:
        """Striped: each piece is reduced to its stripe's owner in every subgroup, all-reduced among the
        owners through host memory, then broadcast by the owner. Pieces are issued back to back, so one
        piece crosses vendors while others are reduced or sent back inside the subgroups."""
        flat = _flat(t)
        lay = self.layout
        red = RedOp.SUM if op == RedOp.AVG else op
        native = self._native_for(flat)
        pieces = stripe_pieces(flat.numel(), _stripes(lay), flat.element_size())
        owner = [lay.stripe_owner(i, self._sub) for i, _, _ in pieces]
        local_root = [self._members.index(o) for o in owner]
        down = [native.reduce([flat[a:b]], _reduce_opts(red, r)) for (_, a, b), r in zip(pieces, local_root)] \
            if native else []
        mine = [k for k in range(len(pieces)) if owner[k] == self.rank()]
        marks = {k: self._mark(down[k] if down else None, flat) for k in mine}

        def hop():
            across = []
            for k in mine:
                i, a, b = pieces[k]
                self._await(marks[k])
                h = self._host_copy(lambda: _to_host(flat[a:b]), flat)
                across.append((k, self._rails[i].allreduce([h], _allreduce_opts(red)), h))
            out = {}
            for k, w, h in across:
                w.wait()
                out[k] = h
            return out

        def post(hosts):
            hosts = hosts or {}          # a rank that owns no piece (a tensor smaller than the stripes) hops nothing
            for w in down:
                w.wait()
            up = []
            for k, (i, a, b) in enumerate(pieces):
                piece = flat[a:b]
                if k in hosts:
                    _from_host(hosts[k], piece)
                    if op == RedOp.AVG:
                        piece.div_(self.size())
                if native:
                    up.append(native.broadcast([piece], _bcast_opts(local_root[k])))
            for w in up:
                w.wait()
            _writeback(flat, t)
        return self._staged(hop if mine else None, post, [t], flat.device if _accelerated(flat) else None)

    # ---- broadcast --------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        t = _single(tensors, "broadcast")
        root = opts.rootRank
        if not 0 <= root < self.size():
            raise ValueError(f"het_shim broadcast: root {root} is not a rank of this group (size {self.size()})")
        if self.layout.single_vendor:
            buf = _contiguous(t)
            work = self._native_for(t).broadcast([buf], _bcast_opts(root))
            return work if buf is t else ShimWork(works=[work], finish=lambda: t.copy_(buf), result=[t])
        return self._hier_broadcast(t, root)

    def _hier_broadcast(self, t: torch.Tensor, root: int) -> ShimWork:
        flat = _flat(t)
        lay = self.layout
        root_sub = lay.subgroup_index(root)
        native = self._native_for(flat)
        chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), flat.element_size())]
        device = flat.device if _accelerated(flat) else None
        if self._sub == root_sub:
            down = [native.broadcast([c], _bcast_opts(lay.local_rank(root))) for c in chunks] if native else []
            hop = None
            if self._is_leader:
                marks = [self._mark(down[i] if down else None, flat) for i in range(len(chunks))]

                def hop():
                    across = []
                    for i, c in enumerate(chunks):
                        self._await(marks[i])
                        h = self._host_copy(lambda c=c: _to_host(c), flat)
                        across.append((self._leaders.broadcast([h], _bcast_opts(root_sub)), h))
                    for w, _ in across:
                        w.wait()

            def post(_):
                for w in down:
                    w.wait()
                _writeback(flat, t)
            return self._staged(hop, post, [t], device)
        hop = None
        if self._is_leader:
            def hop():
                across = []
                for c in chunks:
                    h = _host_buffer(c)
                    across.append((self._leaders.broadcast([h], _bcast_opts(root_sub)), h))
                for w, _ in across:
                    w.wait()
                return [h for _, h in across]

        def post(hosts):
            up = []
            for i, c in enumerate(chunks):
                if hosts is not None:
                    _from_host(hosts[i], c)
                if native:
                    up.append(native.broadcast([c], _bcast_opts(0)))
            for w in up:
                w.wait()
            _writeback(flat, t)
        return self._staged(hop, post, [t], device)

    # ---- all_gather -------------------------------------------------------------------------
    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's parameter name
        n = self.size()
        if output.numel() != n * input.numel() or output.dtype != input.dtype:
            raise ValueError(f"het_shim all_gather_into_tensor: output must have group size ({n}) x input's "
                             f"elements and input's dtype; got {output.numel()} {output.dtype} for "
                             f"{input.numel()} {input.dtype}")
        if self.layout.single_vendor:
            return self._native_all_gather(output, input)
        return self._hier_all_gather(output, input)

    _allgather_base = all_gather_single

    def _native_all_gather(self, output: torch.Tensor, input: torch.Tensor):  # noqa: A002
        """Gloo wants the output as the inputs stacked along dim 0; any other shape goes through a view."""
        inp = _contiguous(input)
        out = _contiguous(output)
        stacked = out.view(self.size() * inp.shape[0], *inp.shape[1:]) if inp.dim() else out.view(self.size())
        work = _all_gather_base(self._native_for(inp), stacked, inp)
        if out is output:
            return work
        return ShimWork(works=[work], finish=lambda: output.copy_(out), result=[output])

    def allgather(self, output_tensors, input_tensors, opts=None):
        """The list form (``dist.all_gather``): gathered into one buffer, then split into the list."""
        inp = _single(input_tensors, "all_gather")
        outs = _single(output_tensors, "all_gather", what="output lists")
        if len(outs) != self.size() or any(o.numel() != inp.numel() or o.dtype != inp.dtype for o in outs):
            raise ValueError(f"het_shim all_gather: need {self.size()} output tensors shaped like the input")
        buf = torch.empty(self.size() * inp.numel(), dtype=inp.dtype, device=inp.device)
        work = self.all_gather_single(buf, inp)

        def finish():
            for o, part in zip(outs, buf.view(self.size(), -1)):
                o.copy_(part.view(o.shape))
        return ShimWork(works=[work], finish=finish, result=list(outs))

    def _hier_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> ShimWork:  # noqa: A002
        inp, out = _flat(input), _flat(output)
        lay, n, m = self.layout, self.size(), inp.numel()
        out2 = out.view(n, m)
        native = self._native_for(inp)
        members = list(self._members)
        bounds = chunk_bounds(m, inp.element_size() * n)
        rows = [torch.empty(n, b - a, dtype=inp.dtype, device=inp.device) for a, b in bounds]
        down = []
        for (a, b), r in zip(bounds, rows):
            if native is None:
                r[self.rank()].copy_(inp[a:b])
            elif self._is_leader:
                down.append(native.gather([[r[g] for g in members]], [inp[a:b]], _gather_opts(0)))
            else:
                down.append(native.gather([], [inp[a:b]], _gather_opts(0)))
        device = inp.device if _accelerated(inp) else None
        hop = None
        if self._is_leader:
            smax, subs = lay.max_subgroup, lay.subgroups
            marks = [self._mark(down[i] if down else None, inp) for i in range(len(rows))]

            def hop():
                across = []
                for i, r in enumerate(rows):
                    self._await(marks[i])
                    pack = torch.zeros(smax, r.shape[1], dtype=r.dtype)
                    pack[:len(members)] = self._host_copy(lambda r=r: _to_host(r[members]), inp)
                    big = torch.empty(len(subs), smax, r.shape[1], dtype=r.dtype)
                    across.append((_all_gather_base(self._leaders, big.view(-1), pack.view(-1)), big))
                for w, _ in across:
                    w.wait()
                return [big for _, big in across]

        def post(bigs):
            for w in down:
                w.wait()
            up = []
            for i, r in enumerate(rows):
                if bigs is not None:
                    for j, sub in enumerate(lay.subgroups):
                        r[list(sub)] = bigs[i][j, :len(sub)].to(r.device)
                if native:
                    up.append(native.broadcast([r], _bcast_opts(0)))
            for w in up:
                w.wait()
            for (a, b), r in zip(bounds, rows):
                out2[:, a:b] = r
            _writeback(out, output)
        return self._staged(hop, post, [output, input], device)

    # ---- reduce_scatter ---------------------------------------------------------------------
    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002
        opts = opts or dist.ReduceScatterOptions()
        n = self.size()
        op = _op_kind(opts.reduceOp)
        self._check_op("reduce_scatter", op, input)
        if input.numel() != n * output.numel() or output.dtype != input.dtype:
            raise ValueError(f"het_shim reduce_scatter_tensor: input must have group size ({n}) x output's "
                             f"elements and output's dtype; got {input.numel()} {input.dtype} for "
                             f"{output.numel()} {output.dtype}")
        if self.layout.single_vendor:
            return self._native_reduce_scatter(output, input, op)
        return self._hier_reduce_scatter(output, input, op)

    _reduce_scatter_base = reduce_scatter_single

    def _native_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: RedOp):  # noqa: A002
        n = self.size()
        pg = self._native_for(input)
        native_avg = not (op == RedOp.AVG and isinstance(pg, dist.ProcessGroupGloo))   # gloo has no AVG
        out = _contiguous(output)
        stacked = _contiguous(input).view(n * out.shape[0], *out.shape[1:]) if out.dim() else input.reshape(n)
        work = _reduce_scatter_base(pg, out, stacked, op if native_avg else RedOp.SUM)
        if out is output and native_avg:
            return work

        def finish():
            if not native_avg:
                out.div_(n)
            if out is not output:
                output.copy_(out)
        return ShimWork(works=[work], finish=finish, result=[output])

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """The list form (``dist.reduce_scatter``): one concatenated buffer through the tensor form."""
        out = _single(output_tensors, "reduce_scatter")
        ins = _single(input_tensors, "reduce_scatter", what="input lists")
        if len(ins) != self.size() or any(i.numel() != out.numel() or i.dtype != out.dtype for i in ins):
            raise ValueError(f"het_shim reduce_scatter: need {self.size()} input tensors shaped like the output")
        buf = torch.cat([i.reshape(-1) for i in ins])
        return self.reduce_scatter_single(out, buf, opts)

    def _hier_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: RedOp) -> ShimWork:  # noqa: A002
        inp, out = _flat(input), _flat(output)
        lay, n, m = self.layout, self.size(), out.numel()
        red = RedOp.SUM if op == RedOp.AVG else op
        inp2 = inp.view(n, m)
        native = self._native_for(inp)
        bounds = chunk_bounds(m, inp.element_size() * n)
        parts = [inp2[:, a:b].contiguous() for a, b in bounds]       # reduced in place at the leader
        down = [native.reduce([x], _reduce_opts(red, 0)) for x in parts] if native else []
        device = inp.device if _accelerated(inp) else None
        hop = None
        if self._is_leader:
            smax, subs = lay.max_subgroup, lay.subgroups
            marks = [self._mark(down[i] if down else None, inp) for i in range(len(parts))]

            def hop():
                across = []
                for i, x in enumerate(parts):
                    self._await(marks[i])
                    xh = self._host_copy(lambda x=x: _to_host(x), inp)
                    packed = torch.zeros(len(subs), smax, x.shape[1], dtype=x.dtype)
                    for j, sub in enumerate(subs):
                        packed[j, :len(sub)] = xh[list(sub)]
                    mine = torch.empty(smax, x.shape[1], dtype=x.dtype)
                    across.append((_reduce_scatter_base(self._leaders, mine.view(-1), packed.view(-1), red), mine))
                for w, mine in across:
                    w.wait()
                    if op == RedOp.AVG:
                        mine.div_(n)
                return [mine for _, mine in across]

        def post(mines):
            for w in down:
                w.wait()
            up = []
            for i, (a, b) in enumerate(bounds):
                if mines is not None:
                    mine = mines[i].to(out.device)
                    if native:
                        up.append(native.scatter([out[a:b]], [[mine[k] for k in range(len(self._members))]],
                                                 _scatter_opts(0)))
                    else:
                        out[a:b] = mine[0]
                else:
                    up.append(native.scatter([out[a:b]], [], _scatter_opts(0)))
            for w in up:
                w.wait()
            _writeback(out, output)
        return self._staged(hop, post, [output, input], device)

    # ---- barrier ----------------------------------------------------------------------------
    def barrier(self, opts=None):
        if self.layout.single_vendor:
            return self._native["cpu"].barrier()
        return self._submit(lambda: self._host.barrier().wait(), [])

    # ---- point to point ---------------------------------------------------------------------
    def send(self, tensors, dst_rank, tag=0):
        t = _single(tensors, "send")
        self._check_peer(dst_rank, "send")
        if self.layout.same_vendor(self.rank(), dst_rank):
            pg = self._native_for(t)
            return pg.send([_contiguous(t)], self.layout.local_rank(dst_rank), tag)
        h = _to_host(_contiguous(t))
        return ShimWork(works=[self._host.send([h], dst_rank, tag)], result=[t])

    def recv(self, tensors, src_rank, tag=0):
        t = _single(tensors, "recv")
        self._check_peer(src_rank, "recv")
        same = self.layout.same_vendor(self.rank(), src_rank)
        pg = self._native_for(t) if same else self._host
        peer = self.layout.local_rank(src_rank) if same else src_rank
        buf = (t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format))
        if not same:
            buf = _host_buffer(buf)
        work = pg.recv([buf], peer, tag)
        if buf is t:
            return work
        return ShimWork(works=[work], finish=lambda: t.copy_(buf), result=[t])

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size():
            raise ValueError(f"het_shim {what}: peer {peer} is not a rank of this group (size {self.size()})")
        if peer == self.rank():
            raise ValueError(f"het_shim {what}: peer {peer} is this rank itself")

    # ---- everything else: native in a one-vendor group, else a clear error --------------------
    def _unsupported(name: str, native: str, fix: str):  # noqa: N805 - class-body helper
        def method(self, *args, **kwargs):
            if self.layout.single_vendor:
                pg = self._native["cuda" if _any_device_tensor(args) and "cuda" in self._native else "cpu"]
                return getattr(pg, native)(*args, **kwargs)
            raise ShimUnsupportedError(f"het_shim does not support {name} (group {self.global_ranks} spans "
                                       f"vendors: {describe(self.layout, self.global_ranks)}); {fix}")
        method.__name__ = native
        return method

    reduce = _unsupported("reduce", "reduce", "use all_reduce (every rank gets the result)")
    gather = _unsupported("gather", "gather", "use all_gather_into_tensor and keep the part you need")
    scatter = _unsupported("scatter", "scatter", "use broadcast of the whole tensor and slice it")
    alltoall = _unsupported("all_to_all", "alltoall", "use all_gather_into_tensor and select, or keep "
                            "expert-parallel groups inside one vendor")
    all_to_all_single = _unsupported("all_to_all_single", "alltoall_base", "keep expert-parallel groups "
                                     "inside one vendor (the planner does this by default)")
    alltoall_base = all_to_all_single
    allgather_coalesced = _unsupported("all_gather_coalesced", "allgather_coalesced",
                                       "call all_gather once per tensor")
    recv_anysource = _unsupported("recv from any source", "recv_anysource", "receive from a named source rank")
    del _unsupported

    # Coalesced forms (torch's _coalescing_manager, Megatron's distributed optimizer): one call each.
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i) for o, i in zip(outputs, inputs)]
        return ShimWork(works=works, result=list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = _op_kind((opts or dist.ReduceScatterOptions()).reduceOp)
        works = [self.reduce_scatter_single(o, i, _rs_opts(op)) for o, i in zip(outputs, inputs)]
        return ShimWork(works=works, result=list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)

    abort = shutdown


def _single(tensors, name: str, what: str = "tensors"):
    if len(tensors) != 1:
        raise ShimUnsupportedError(f"het_shim {name}: exactly one {what[:-1]} per call (got {len(tensors)}); "
                                   "call once per tensor")
    return tensors[0]


def _any_device_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device.type != "cpu"
    if isinstance(obj, (list, tuple)):
        return any(_any_device_tensor(x) for x in obj)
    return False


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


# ---- registration -----------------------------------------------------------------------------

def create_shim_group(dist_opts, backend_opts=None) -> ShimProcessGroup:
    """The creator torch.distributed calls on each member when a het_shim group is created;
    ``backend_opts`` is the ``pg_options`` given to ``new_group`` (a :class:`ShimOptions`, or None)."""
    if backend_opts is not None and not isinstance(backend_opts, ShimOptions):
        raise TypeError(f"pg_options of a {SHIM_BACKEND} group must be het_plugin.comm.ShimOptions, "
                        f"got {type(backend_opts).__name__}")
    global_ranks = list(dist_opts.global_ranks_in_group) or list(range(dist_opts.group_size))
    world = dist.get_world_size() if dist.is_initialized() else dist_opts.group_size
    agree_timeout = timeout_s()
    if dist_opts.timeout:
        agree_timeout = min(agree_timeout, dist_opts.timeout.total_seconds())
    vendors = agree_on_vendors(dist_opts.store, group_rank=dist_opts.group_rank, global_ranks=global_ranks,
                               world_size=world, timeout_s=agree_timeout, options=backend_opts)
    return ShimProcessGroup(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, global_ranks,
                            dist_opts.timeout, ShimLayout(tuple(vendors)), backend_opts)


def register() -> None:
    """Make ``backend="het_shim"`` known to torch.distributed (idempotent)."""
    if SHIM_BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(SHIM_BACKEND, create_shim_group, extended_api=True, devices=["cpu", "cuda"])
