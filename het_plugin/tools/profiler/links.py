"""Timing the links: latency (ping-pong), acknowledged point-to-point transfers by message size with 1..N
senders of a node at once, in both directions, and all-reduce over the link's two nodes.

Every group is created under the transport the plan's rule gives it (gloo: the interface
``HET_PLUGIN_GLOO_IFNAMES`` maps it to, as het_plugin.runtime.group_policy does for training; NCCL: the
per-communicator ``net_name``), so a fabric tier is measured on the fabric. A group spanning vendors
('host-staged') is a gloo group on host memory: the network part of the shim's transfers.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...runtime.netselect import gloo_network, nccl_net_name, with_net_name
from ...core.ranks.transport import Transport
from .records import AllReduceRecord, LatencyRecord, Record, TransferRecord
from .settings import LATENCY_BYTES, LinkJob, sender_counts

PING_PONGS = 20
MAX_REPEATS = 1000


class LinkGroups:
    """Every link job's group, created by all ranks in job order (group creation is collective)."""

    def __init__(self, jobs: list[LinkJob], backend: str, timeout=None):
        self.groups, self.devices = [], []
        for job in jobs:
            host = backend != "nccl" or job.transport == Transport.HOST_STAGED
            if host:
                with gloo_network(job.transport):
                    g = dist.new_group(list(job.members), backend="gloo", timeout=timeout)
            else:
                net = nccl_net_name(job.transport)
                options = with_net_name(None, net) if net else None
                g = dist.new_group(list(job.members), backend="nccl", pg_options=options, timeout=timeout)
            self.groups.append(g)
            self.devices.append(torch.device("cpu") if host else torch.device("cuda", torch.cuda.current_device()))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def latency_s(rank: int, a: int, b: int, group, device) -> Optional[float]:
    """One-way latency between ranks ``a`` and ``b`` (the median of PING_PONGS round trips, halved); the
    others return None."""
    if rank not in (a, b):
        return None
    buf = torch.zeros(LATENCY_BYTES, dtype=torch.uint8, device=device)
    peer = b if rank == a else a
    trips = []
    for i in range(PING_PONGS + 2):
        t0 = time.perf_counter()
        if rank == a:
            dist.send(buf, peer, group=group)
            dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group)
            dist.send(buf, peer, group=group)
        _sync(device)
        if i >= 2:
            trips.append(time.perf_counter() - t0)
    return statistics.median(trips) / 2


def transfer_s(rank: int, src: int, dst: int, nbytes: int, group, device, window_s: float) -> Optional[float]:
    """Seconds per message of ``nbytes`` from ``src`` to ``dst`` and its one-byte acknowledgement, measured on
    the sender over about ``window_s`` (records.link_gbps takes the latencies off); the receiver returns None.
    The sender picks the count from one probe and tells the receiver."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ack = torch.zeros(1, dtype=torch.uint8, device=device)
    count = torch.zeros(1, dtype=torch.int64)
    if rank == src:
        dist.send(buf, dst, group=group)           # warm-up (connection, buffers)
        dist.recv(ack, dst, group=group)
        t0 = time.perf_counter()
        dist.send(buf, dst, group=group)
        dist.recv(ack, dst, group=group)
        _sync(device)
        probe = time.perf_counter() - t0
        count[0] = max(1, min(MAX_REPEATS, math.ceil(window_s / max(probe, 1e-7))))
        dist.send(count.to(device), dst, group=group)
        t0 = time.perf_counter()
        for _ in range(int(count.item())):
            dist.send(buf, dst, group=group)
            dist.recv(ack, dst, group=group)
        _sync(device)
        return (time.perf_counter() - t0) / int(count.item())
    for _ in range(2):
        dist.recv(buf, src, group=group)
        dist.send(ack, src, group=group)
    got = count.to(device)
    dist.recv(got, src, group=group)
    for _ in range(int(got.item())):
        dist.recv(buf, src, group=group)
        dist.send(ack, src, group=group)
    return None


def allreduce_s(nbytes: int, group, device, window_s: float) -> float:
    """Seconds per all-reduce of ``nbytes`` (fp32) over ``group``; every member runs the same count."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    dist.all_reduce(x, group=group)
    _sync(device)
    t0 = time.perf_counter()
    dist.all_reduce(x, group=group)
    _sync(device)
    probe = time.perf_counter() - t0
    count = torch.tensor([max(1, min(MAX_REPEATS, math.ceil(window_s / max(probe, 1e-7))))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    n = int(count.item())
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x, group=group)
    _sync(device)
    return (time.perf_counter() - t0) / n


def measure_links(rank: int, jobs: list[LinkJob], groups: LinkGroups, sizes: tuple[int, ...], window_s: float,
                  quick: bool, barrier: Callable[[], None],
                  progress: Callable[[str], None] = lambda s: None,
                  report: Callable[[str], None] = lambda s: None) -> list[Record]:
    """Every rank calls this with the same jobs; each point starts after ``barrier()`` (all ranks), so only one
    link is busy at a time. Returns this rank's records; ``progress`` gets each link as it starts (rank 0),
    ``report`` each one-sender transfer this rank timed."""
    out: list[Record] = []
    for j, (job, group, device) in enumerate(zip(jobs, groups.groups, groups.devices)):
        progress(f"link {j + 1}/{len(jobs)}: {job.label} ({job.transport} group, ranks {list(job.members)})")
        barrier()
        lat = latency_s(rank, job.senders[0], job.receivers[0], group, device)
        if lat is not None and rank == job.senders[0]:
            out.append(LatencyRecord(job.key, job.cluster, lat))
            if job.back_key != job.key:
                out.append(LatencyRecord(job.back_key, job.cluster, lat))
        k = len(job.senders)
        for key, src, dst in ((job.key, job.senders, job.receivers), (job.back_key, job.receivers, job.senders)):
            for c in sender_counts(k, quick):
                for nbytes in sizes:
                    barrier()
                    if rank in src[:c]:
                        i = src.index(rank)
                        t = transfer_s(rank, rank, dst[i], nbytes, group, device, window_s)
                        out.append(TransferRecord(key, job.cluster, c, nbytes, t))
                        if c == 1:
                            report(f"{key}{' in ' + job.cluster if job.cluster else ''}: {nbytes:,} bytes and "
                                   f"the reply in {t * 1e3:.3f} ms ({nbytes * 8 / t / 1e9:.4g} Gbit/s with the "
                                   "latencies)")
                    elif rank in dst[:c]:
                        i = dst.index(rank)
                        transfer_s(rank, src[i], rank, nbytes, group, device, window_s)
        for nbytes in sizes:
            barrier()
            if rank in job.members:
                t = allreduce_s(nbytes, group, device, window_s)
                if rank == job.members[0]:
                    for key in dict.fromkeys((job.key, job.back_key)):
                        out.append(AllReduceRecord(key, job.cluster, len(job.members), nbytes, t))
    return out
