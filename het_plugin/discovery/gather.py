"""Gathering every rank's node view over the bootstrap store, so all ranks hold one cluster description.

Over :class:`het_plugin.runtime.exchange.Exchange` (a store, not a collective): every rank publishes
its view (or the error it hit), rank 0 builds the cluster file and publishes it (or the error), and
every rank reads that one result. A rank that failed therefore stops every rank with the same message
instead of leaving the others waiting, and the store traffic grows linearly with the number of ranks.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping, Optional

from ..core.inputs.cluster import Cluster, cluster_from_dict
from ..core.errors import ConfigError, HetPluginError
from ..runtime.exchange import Entry, Exchange, ExchangeTimeout, first_error, timeout_s as resolve_timeout
from .build import (SOURCE, LinksArg, LinksFile, RankView, build_cluster_data, links_setting, unknown_speed)
from .node import discover_node

class DiscoveryError(HetPluginError, RuntimeError):
    """Gathering failed for a reason that is not a bad input (a rank crashed or never reported)."""


@dataclass
class Discovery:
    """The gathered result: the cluster file (a dict), what was assumed, and the validated Cluster."""
    data: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    cluster: Optional[Cluster] = None
    view: Optional[RankView] = None     # this rank's own report


def env_store(timeout_s: Optional[float] = None):
    """The torchrun-style bootstrap store (MASTER_ADDR/PORT, RANK, WORLD_SIZE): (store, rank, world_size).

    Rank 0 hosts it unless torchrun's agent does. For use before ``init_process_group``; pass the same
    store to ``init_process_group(store=...)`` afterwards rather than rendezvousing twice on one port.
    """
    from torch.distributed import rendezvous
    return next(rendezvous("env://", timeout=timedelta(seconds=resolve_timeout(timeout_s))))


def _resolve_ranks(rank, world_size, local_rank, env) -> tuple[int, int, Optional[int]]:
    if rank is None or world_size is None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            rank = int(env.get("RANK", 0)) if rank is None else rank
            world_size = int(env.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if local_rank is None and env.get("LOCAL_RANK", "").strip():
        local_rank = int(env["LOCAL_RANK"])
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world size {world_size}", source=SOURCE, field="rank",
                          fix="pass rank and world_size as the launcher set them (RANK, WORLD_SIZE)")
    return rank, world_size, local_rank


def _resolve_store(store, world_size: int):
    if store is not None:
        return store
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    if world_size == 1:
        return dist.HashStore()
    raise DiscoveryError("discovery needs the job's bootstrap store: call torch.distributed.init_process_group "
                         "first, or pass store= (het_plugin.discovery.env_store() makes one from the torchrun "
                         "environment)")


def gather_discovery(store=None, rank: Optional[int] = None, world_size: Optional[int] = None, *,
                     local_rank: Optional[int] = None, sysfs_root=None, node_name: Optional[str] = None,
                     links: LinksArg = None, unknown_ethernet_gbps: Optional[float] = None,
                     timeout_s: Optional[float] = None, env: Mapping[str, str] | None = None,
                     torch_module=None, key: Optional[str] = None) -> Discovery:
    """Discover this node, gather all ranks' views, and return the cluster every rank agrees on.

    ``key`` names this gather in the store; by default the n-th call in this process, which matches
    across ranks as long as every rank calls discovery the same number of times. Every wait is bounded
    by ``timeout_s`` (default: ``HET_PLUGIN_TIMEOUT``).
    """
    env = os.environ if env is None else env
    rank, world_size, local_rank = _resolve_ranks(rank, world_size, local_rank, env)
    store = _resolve_store(store, world_size)
    own: Optional[RankView] = None
    payload: Optional[dict[str, Any]] = None
    error: Optional[BaseException] = None
    try:
        node = discover_node(sysfs_root, name=node_name, env=env, torch_module=torch_module,
                             device_index=local_rank or 0)
        own = RankView(rank, local_rank, node)
        payload = {"view": own.to_dict(), "links": links_setting(links, env),
                   "unknown_ethernet_gbps": unknown_speed(unknown_ethernet_gbps, env)}
    except Exception as exc:
        error = exc
    ex = Exchange(store, "discover", index=rank, members=range(world_size), key=key, timeout=timeout_s, env=env,
                  what="cluster discovery")
    try:
        try:
            entries = ex.gather(payload, error=error)
        except ExchangeTimeout as exc:          # rank 0: tell the others now, not after their own timeout
            ex.broadcast(error=DiscoveryError(str(exc)))
            raise
        assembled, failure = (_assemble(entries) if entries is not None else (None, None))
        answer = ex.broadcast(assembled, error=failure)
    except ExchangeTimeout as exc:
        raise DiscoveryError(str(exc)) from None
    ex.done()
    if answer.error is not None:
        if answer.error.get("config"):
            answer.raise_error("")
        raise DiscoveryError(answer.error["problem"])
    result = answer.value
    cluster = cluster_from_dict(result["data"], SOURCE)
    if own is not None and cluster.node_of(rank).name != own.node.name:
        raise DiscoveryError(f"rank {rank} is on {own.node.name!r} but the cluster puts it on "
                             f"{cluster.node_of(rank).name!r}")
    return Discovery(result["data"], result["notes"], cluster, own)


def discover_cluster(store=None, rank: Optional[int] = None, world_size: Optional[int] = None,
                     **kwargs) -> Cluster:
    """The cluster as discovered on every node; the same on every rank. See :func:`gather_discovery`."""
    return gather_discovery(store, rank, world_size, **kwargs).cluster


def _assemble(entries: list[Entry]) -> tuple[Optional[dict[str, Any]], Optional[BaseException]]:
    """Rank 0: every view -> (the cluster file and notes, None), or (None, why not)."""
    failed = first_error(entries)
    if failed is not None:
        bad = [e.rank for e in entries if e.error is not None]
        err = dict(failed.error, problem=f"rank(s) {bad} could not discover their node; rank {failed.rank}: "
                                         f"{failed.error['problem']}")
        return None, (ConfigError(err["problem"], source=err.get("source"), field=err.get("field"),
                                  fix=err.get("fix")) if err.get("config") else DiscoveryError(err["problem"]))
    payloads = [e.value for e in entries]
    for what in ("links", "unknown_ethernet_gbps"):
        differ = [r for r, p in enumerate(payloads) if p[what] != payloads[0][what]]
        if differ:
            env_name = "HET_PLUGIN_LINKS" if what == "links" else "HET_PLUGIN_ETHERNET_GBPS"
            return None, ConfigError(f"ranks {differ} have a different {what} setting than rank 0", source=env_name,
                                     fix=f"give every rank the same {env_name} (and the same file contents)")
    setting = payloads[0]["links"]
    notes: list[str] = []
    try:
        data = build_cluster_data([RankView.from_dict(p["view"]) for p in payloads],
                                  links=LinksFile.model_validate(setting) if setting else LinksFile(),
                                  unknown_ethernet_gbps=payloads[0]["unknown_ethernet_gbps"], notes=notes)
    except Exception as exc:
        return None, exc
    return {"data": data, "notes": notes}, None


def gather_launch(*, sysfs_root=None, node_name: Optional[str] = None, links: LinksArg = None,
                  unknown_ethernet_gbps: Optional[float] = None, timeout_s: Optional[float] = None) -> tuple[int, "Discovery"]:
    """The CLI's gather before any process group: under torchrun the bootstrap store (WORLD_SIZE > 1), alone
    without one. Returns (this rank, the gathered discovery); every wait is bounded by ``timeout_s``."""
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    store, rank = None, int(os.environ.get("RANK", "0") or 0)
    if world_size > 1:
        store, rank, world_size = env_store(timeout_s)
    found = gather_discovery(store, rank, world_size, sysfs_root=sysfs_root, node_name=node_name, links=links,
                             unknown_ethernet_gbps=unknown_ethernet_gbps, timeout_s=timeout_s)
    return rank, found
