"""``het-plugin profile`` on every rank of a launch (torchrun, deepspeed, the emulator): measure this cluster
and write a format-2 profile (rank 0).

Order: the cluster (file or discovery over the bootstrap store) and every refusal (world size, TP, memory)
before any process group; then the compute rounds (one rank group per device type at a time, all device
types at once), the optimizer and fixed per-iteration work, the links one at a time; then every rank's
records go to rank 0 over the store (:class:`het_plugin.runtime.exchange.Exchange`), which writes the file.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from importlib.metadata import version
from typing import Callable, Optional

from ...core.inputs.cluster import Cluster, load_cluster
from ...core.errors import ConfigError, HetPluginError
from ...core.inputs.model import ModelSpec
from ...core.inputs.profile import Profile
from ...core.files import check_writable
from ...core.launch import DISCOVER
from ...discovery import env_store, gather_discovery
from ...runtime.exchange import Exchange, first_error, timeout_s as resolve_timeout
from ...runtime.netselect import gloo_network
from . import records as rec
from .settings import (
    Settings,
    check_memory,
    compute_jobs,
    device_types,
    link_jobs,
    memory_need_bytes,
    run_dtype_bytes,
)

LOSS_ALLREDUCES = 20        # repetitions of the world's one-number all-reduce (the per-iteration loss)


@dataclass
class Outcome:
    """What rank 0 wrote (other ranks: ``profile`` None)."""
    rank: int
    profile: Optional[Profile]
    seconds: float


class ProfileFailed(HetPluginError, RuntimeError):
    """A rank failed while measuring (named with its error)."""


def _log(rank: int) -> Callable[[str], None]:
    def log(text: str) -> None:
        print(f"profile [rank {rank}]: {text}", file=sys.stderr, flush=True)
    return log


def load_cluster_arg(arg: str, store, rank: int, world: int, timeout_s: Optional[float]) -> Cluster:
    """A cluster file, or ``discover``: every rank's node gathered over the bootstrap store."""
    if arg in DISCOVER:
        return gather_discovery(store, rank, world, timeout_s=timeout_s).cluster
    try:
        return load_cluster(arg)
    except ConfigError as exc:          # a file-level problem (missing, not YAML): name the argument
        if exc.field:
            raise
        raise ConfigError(exc.problem, source=exc.source, field="CLUSTER", fix=exc.fix) from None


_START_CHECKS = (("on_gpu", "accelerator", "launch the profile on nodes where torch sees the accelerators on every "
                  "rank (or on CPU everywhere, e.g. CUDA_VISIBLE_DEVICES=)"),
                 ("megatron", "--layers", "pass --layers torch (or install megatron-core on every node)"))


def _judge_start(views) -> None:
    """Rank 0, before any process group: a rank that refused stops every rank with its reason; views that
    differ (backend, whose layers) stop every rank naming the ranks."""
    refused = first_error(views)
    if refused is not None:
        if refused.error.get("config"):
            refused.raise_error()
        raise ProfileFailed(f"rank {refused.rank} cannot profile: {refused.error['problem']}")
    for key, field, fix in _START_CHECKS:
        seen = sorted({bool(e.value[key]) for e in views})
        if len(seen) > 1:
            ranks = [e.rank for e in views if e.value[key]]
            raise ConfigError(f"ranks disagree on {key}: ranks {ranks} say yes, the others no; every rank must run "
                              "the same backend and layers", field=field, fix=fix)


def profile_launch(cluster_arg: str, model: ModelSpec, settings: Settings, output: str, *,
                   timeout_s: Optional[float] = None) -> Outcome:
    """Run on every rank of the launch (WORLD_SIZE/RANK/MASTER_ADDR from the launcher; alone without one)."""
    import torch
    import torch.distributed as dist


    start = time.monotonic()
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = int(os.environ.get("RANK", "0") or 0)
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    wait_s = resolve_timeout(timeout_s)
    if world > 1:
        store, rank, world = env_store(wait_s)
    else:
        store = dist.HashStore()
    log = _log(rank)
    on_gpu = torch.cuda.is_available()
    ready = Exchange(store, "profile-start", index=rank, members=range(world), timeout=wait_s,
                     what="the start of profiling (every rank's checks)")
    try:                            # every refusal on every rank before any process group, all ranks told
        cluster = load_cluster_arg(cluster_arg, store, rank, world, wait_s)
        if cluster.world_size != world:
            raise ConfigError(f"the cluster has {cluster.world_size} ranks but the launch started {world}",
                              source=cluster.source, field="cluster",
                              fix="launch one rank per accelerator of the cluster file (torchrun --nproc-per-node = "
                                  "accelerators_per_node on each node), or profile with a file that describes this "
                                  "launch")
        rounds = compute_jobs(cluster, model, settings) if settings.compute else []
        devices = device_types(cluster)
        check_memory(model, rounds, {d.name: d.memory_gib for d in devices}, run_dtype_bytes(model, on_gpu))
        ljobs = link_jobs(cluster) if settings.links and world > 1 else []
        megatron = use_megatron(settings.layers, on_gpu, world, rounds)
        if rank == 0:
            check_output(output)
    except Exception as exc:
        try:                        # the others stop with this rank's reason, not at a timeout
            ready.decide(error=exc, judge=_judge_start)
        except Exception:           # noqa: BLE001 - this rank's own error is the clearer message
            pass
        raise
    # What every rank must decide alike (backend, whose layers, hence which groups): each rank's own view,
    # agreed before any process group exists. Rank 0 judges every view and publishes one verdict (linear).
    verdict = ready.decide({"on_gpu": on_gpu, "megatron": megatron}, judge=_judge_start)
    if verdict.error is not None:
        if verdict.error.get("config"):
            verdict.raise_error("")
        raise ProfileFailed(verdict.error["problem"].removeprefix(f"{ProfileFailed.__name__}: "))
    if rank == 0:
        log(f"{cluster.name}: {world} ranks, device types {[d.name for d in devices]}; {len(rounds)} compute "
            f"points ({'Megatron-Core' if megatron else 'plain torch'} layers), {len(ljobs)} links x "
            f"{len(settings.message_sizes)} message sizes; window {settings.window_s:g} s")

    vendors = {n.vendor for n in cluster.nodes}
    backend = "nccl" if on_gpu else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=wait_s))
    mine: list[rec.Record] = []
    error: Optional[BaseException] = None
    try:
        mine = _measure(cluster, model, settings, rounds, devices, ljobs, rank, local_rank, backend, log, megatron,
                        wait_s, cross_vendor=len(vendors) > 1)
    except Exception as exc:        # every rank reports; rank 0 names them all
        error = exc
        try:
            dist.destroy_process_group()        # the peers' pending collectives fail now, not at their timeout
        except Exception:
            pass
    ex = Exchange(store, "profile", index=rank, members=range(world), timeout=wait_s,
                  what="the end of profiling (every rank's measurements)")
    entries = ex.gather([rec.to_json(r) for r in mine] if error is None else None, error=error)
    if dist.is_initialized():
        dist.destroy_process_group()
    if entries is None:
        if error is not None:
            raise error
        return Outcome(rank, None, time.monotonic() - start)
    # a rank's refusal (a ConfigError) is the reason; its peers' broken collectives only follow from it
    failed = next((e for e in entries if e.error is not None and e.error.get("config")), None) or first_error(entries)
    if failed is not None:
        if failed.error.get("config"):
            failed.raise_error()
        bad = "; ".join(f"rank {e.rank}: {e.error['problem']}" for e in entries if e.error is not None)
        hint = (" (the layers were Megatron-Core's; --layers torch times plain blocks of the model's shape "
                "instead)" if megatron else "")
        raise ProfileFailed(f"profiling failed: {bad}{hint}")
    records = [rec.from_json(d) for e in entries for d in e.value]
    layers_note = (f"Megatron-Core {_megatron_version()} (a one-layer GPTModel, local spec)" if megatron else
                   "plain torch blocks of the model's shape, TP as Megatron-Core splits them (het_plugin.tools.profiler."
                   "layers)") + f", in {'the model dtype on CUDA' if on_gpu else 'fp32 on CPU'}"
    profile = rec.build_profile(records, description=(
        f"het-plugin profile: {model.name} on {cluster.name} ({world} ranks, {backend}); layers: {layers_note}; "
        f"window {settings.window_s:g} s per point{'; --quick' if settings.quick else ''}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"))
    profile.save(output)
    return Outcome(rank, profile, time.monotonic() - start)


def check_output(path: str) -> None:
    """Rank 0 writes the profile: a name whose format it knows, in a folder it can write (checked first)."""
    if not str(path).endswith((".yaml", ".yml", ".json")):
        raise ConfigError(f"cannot tell the format of {path!r}", field="-o/--output",
                          fix="use a name ending in .yaml or .json")
    check_writable(path, "-o/--output", "profile")


def use_megatron(layers: str, on_gpu: bool, world: int, rounds) -> bool:
    """Whose layers are timed: ``megatron`` (refused where Megatron-Core is missing or its TP groups cannot be
    the measuring ones), ``torch``, or ``auto``: Megatron-Core's on CUDA where it can, else the plain ones."""
    from . import megatron_layers
    if layers == "torch":
        return False
    ranks = [job.ranks for jobs in rounds for job in jobs]
    if layers == "megatron":
        if not megatron_layers.importable():
            raise ConfigError("--layers megatron, but megatron.core is not importable here", field="--layers",
                              fix="install megatron-core (pip install het_plugin[megatron]) or pass --layers torch")
        if not megatron_layers.aligned(world, ranks):
            raise ConfigError("--layers megatron: a measuring TP group is not one of Megatron's (runs of tp "
                              "consecutive ranks from a multiple of tp)", field="--layers",
                              fix="give every node a multiple of the TP degrees (--tp), or pass --layers torch")
        return True
    return on_gpu and megatron_layers.importable() and megatron_layers.aligned(world, ranks)


def _megatron_version() -> str:
    try:
        return version("megatron-core")
    except Exception:
        return "(version unknown)"


def _measure(cluster: Cluster, model: ModelSpec, settings: Settings, rounds, devices, ljobs, rank: int,
             local_rank: int, backend: str, log, megatron: bool = False, wait_s: float = 300.0,
             cross_vendor: bool = False) -> list[rec.Record]:
    import torch.distributed as dist

    from . import compute, links

    dev = compute.local_device(model, local_rank)
    out: list[rec.Record] = []
    bound = timedelta(seconds=wait_s)           # every group's waits, as the exchanges' (--timeout)
    lockstep = dist.new_group(backend="gloo", timeout=bound) if backend != "gloo" else None

    def barrier() -> None:
        dist.barrier(group=lockstep)

    # TP groups (collective creation: every rank, same order), then the link groups
    tp_groups: dict[tuple[str, int], object] = {}
    for jobs in rounds:
        for job in jobs:
            key = (job.device, job.tp)
            if job.tp > 1 and key not in tp_groups:
                with gloo_network("local"):
                    tp_groups[key] = dist.new_group(list(job.ranks), backend=backend, timeout=bound)
    groups = links.LinkGroups(ljobs, backend, bound)
    modules = compute.Modules(megatron)
    megatron_tp = None
    for i, jobs in enumerate(rounds):
        if megatron and jobs[0].tp != megatron_tp:       # every rank: Megatron's groups for this TP degree
            from . import megatron_layers
            megatron_tp = jobs[0].tp
            megatron_layers.set_tp(megatron_tp, wait_s)
        if rank == 0:
            j = jobs[0]
            log(f"compute {i + 1}/{len(rounds)}: {j.kind} tp={j.tp} micro-batch {j.micro_batch_size} on "
                f"{', '.join(job.device for job in jobs)}")
        barrier()
        job = next((job for job in jobs if rank in job.ranks), None)
        if job is not None:
            need = memory_need_bytes(model, job.kind, job.micro_batch_size, job.tp, run_dtype_bytes(model, dev.is_cuda))
            r = compute.measure_fitting(job, model, dev, need, job.ranks.index(rank),
                                        tp_groups.get((job.device, job.tp)), settings.window_s, settings.warmup,
                                        modules)
            if rank == job.ranks[0]:
                out.append(r)
                log(f"{job.device} {job.kind} tp={job.tp} micro-batch {job.micro_batch_size}: forward "
                    f"{r.forward_s * 1e3:.3f} ms, backward {r.backward_s * 1e3:.3f} ms")
    modules.key = modules.module = None
    if megatron_tp is not None:
        from . import megatron_layers
        megatron_layers.shutdown()
    if settings.compute:
        if rank == 0:
            log("optimizer step and per-iteration fixed work")
        barrier()
        reporter = {d.node_ranks[0]: d for d in devices}
        parts = 0.0
        if rank in reporter:
            d = reporter[rank]
            r = compute.measure_optimizer(d.name, model, dev, 1, settings.window_s, settings.warmup)
            out.append(r)
            parts = compute.overhead_parts(model, dev, settings.window_s, settings.warmup)
            log(f"{d.name} optimizer {r.seconds_per_param * 1e9:.3f} ns/parameter")
            slot = compute.slot_record(d.name, model, dev, min(settings.micro_batch_sizes), settings.window_s,
                                       settings.warmup)
            out.append(slot)
            log(f"{d.name} pipeline slot {slot.seconds * 1e6:.1f} us")
        barrier()
        # across vendors NCCL and RCCL cannot form one world communicator: time it on gloo there
        loss_s = compute.loss_allreduce_s(dev, LOSS_ALLREDUCES, group=lockstep if cross_vendor else None)
        if rank in reporter:
            o = compute.overhead_record(reporter[rank].name, parts, loss_s)
            out.append(o)
            log(f"{o.device} fixed per-iteration work {o.seconds * 1e3:.3f} ms")
    if ljobs:
        out += links.measure_links(rank, ljobs, groups, settings.message_sizes, settings.window_s, settings.quick,
                                   barrier, log if rank == 0 else (lambda s: None), log)
    barrier()
    return out
