"""Gathering every rank's node view over the bootstrap store, so all ranks hold one cluster description.

A store, not a collective: every rank publishes its view (or the error it hit), rank 0 builds the
cluster file and publishes it (or the error), and every rank reads that one result. A rank that failed
therefore stops every rank with the same message instead of leaving the others waiting, and the store
traffic grows linearly with the number of ranks.
"""
from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping, Optional

from ..cluster import Cluster, cluster_from_dict
from ..errors import ConfigError, HetPluginError
from .build import (SOURCE, LinksArg, LinksFile, RankView, build_cluster_data, links_setting, unknown_speed)
from .node import discover_node

_calls = itertools.count()


class DiscoveryError(HetPluginError, RuntimeError):
    """Gathering failed for a reason that is not a bad input (a rank crashed or never reported)."""


@dataclass
class Discovery:
    """The gathered result: the cluster file (a dict), what was assumed, and the validated Cluster."""
    data: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    cluster: Optional[Cluster] = None
    view: Optional[RankView] = None     # this rank's own report


def env_store(timeout_s: float = 300.0):
    """The torchrun-style bootstrap store (MASTER_ADDR/PORT, RANK, WORLD_SIZE): (store, rank, world_size).

    Rank 0 hosts it unless torchrun's agent does. For use before ``init_process_group``; pass the same
    store to ``init_process_group(store=...)`` afterwards rather than rendezvousing twice on one port.
    """
    from torch.distributed import rendezvous
    return next(rendezvous("env://", timeout=timedelta(seconds=timeout_s)))


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


def _error(exc: BaseException, prefix: str = "") -> dict[str, Any]:
    if isinstance(exc, ConfigError):
        return {"config": True, "problem": prefix + exc.problem, "source": exc.source, "field": exc.field,
                "fix": exc.fix}
    return {"config": False, "problem": f"{prefix}{type(exc).__name__}: {exc}"}


def _raise(err: dict[str, Any]):
    if err.get("config"):
        raise ConfigError(err["problem"], source=err.get("source"), field=err.get("field"), fix=err.get("fix"))
    raise DiscoveryError(err["problem"])


def gather_discovery(store=None, rank: Optional[int] = None, world_size: Optional[int] = None, *,
                     local_rank: Optional[int] = None, sysfs_root=None, node_name: Optional[str] = None,
                     links: LinksArg = None, unknown_ethernet_gbps: Optional[float] = None,
                     timeout_s: float = 300.0, env: Mapping[str, str] | None = None,
                     torch_module=None, key: Optional[str] = None) -> Discovery:
    """Discover this node, gather all ranks' views, and return the cluster every rank agrees on.

    ``key`` names this gather in the store; by default the n-th call in this process, which matches
    across ranks as long as every rank calls discovery the same number of times.
    """
    env = os.environ if env is None else env
    rank, world_size, local_rank = _resolve_ranks(rank, world_size, local_rank, env)
    store = _resolve_store(store, world_size)
    # torchrun's agent store outlives a restart: keep a restarted job from reading the last attempt's keys.
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"het_plugin/discover/{attempt}/{key if key is not None else next(_calls)}"
    own: Optional[RankView] = None
    try:
        node = discover_node(sysfs_root, name=node_name, env=env, torch_module=torch_module,
                             device_index=local_rank or 0)
        own = RankView(rank, local_rank, node)
        payload: dict[str, Any] = {"view": own.to_dict(), "links": links_setting(links, env),
                                   "unknown_ethernet_gbps": unknown_speed(unknown_ethernet_gbps, env)}
    except Exception as exc:
        payload = {"error": _error(exc)}
    store.set(f"{prefix}/view/{rank}", json.dumps(payload))

    result_key = f"{prefix}/cluster"
    if rank == 0:
        store.set(result_key, json.dumps(_assemble(store, prefix, world_size, timeout_s)))
    else:
        try:
            store.wait([result_key], timedelta(seconds=timeout_s + 30))
        except Exception as exc:
            raise DiscoveryError(f"rank 0 never published the discovered cluster within {timeout_s + 30:.0f}s "
                                 f"(did rank 0 crash or hang?): {exc}") from None
    result = json.loads(store.get(result_key))
    store.set(f"{prefix}/done/{rank}", "1")
    if rank == 0:
        _wait_quietly(store, [f"{prefix}/done/{r}" for r in range(world_size)], min(timeout_s, 60.0))
    if "error" in result:
        _raise(result["error"])
    cluster = cluster_from_dict(result["data"], SOURCE)
    if own is not None and cluster.node_of(rank).name != own.node.name:
        raise DiscoveryError(f"rank {rank} is on {own.node.name!r} but the cluster puts it on "
                             f"{cluster.node_of(rank).name!r}")
    return Discovery(result["data"], result["notes"], cluster, own)


def discover_cluster(store=None, rank: Optional[int] = None, world_size: Optional[int] = None,
                     **kwargs) -> Cluster:
    """The cluster as discovered on every node; the same on every rank. See :func:`gather_discovery`."""
    return gather_discovery(store, rank, world_size, **kwargs).cluster


def _assemble(store, prefix: str, world_size: int, timeout_s: float) -> dict[str, Any]:
    """Rank 0: wait for every view, then build the cluster file, or describe why not."""
    keys = [f"{prefix}/view/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        return {"error": {"config": False, "problem": f"ranks {missing} never reported their node within "
                                                      f"{timeout_s:.0f}s (crashed or not started?)"}}
    payloads = [json.loads(store.get(k)) for k in keys]
    for k in keys:
        try:
            store.delete_key(k)
        except Exception:
            pass
    failed = [r for r, p in enumerate(payloads) if "error" in p]
    if failed:
        first = payloads[failed[0]]["error"]
        return {"error": dict(first, problem=f"rank(s) {failed} could not discover their node; rank {failed[0]}: "
                                             f"{first['problem']}")}
    for what in ("links", "unknown_ethernet_gbps"):
        values = [json.dumps(p[what], sort_keys=True) for p in payloads]
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            env_name = "HET_PLUGIN_LINKS" if what == "links" else "HET_PLUGIN_ETHERNET_GBPS"
            return {"error": {"config": True, "problem": f"ranks {differ} have a different {what} setting than rank 0",
                              "source": env_name, "field": None,
                              "fix": f"give every rank the same {env_name} (and the same file contents)"}}
    setting = payloads[0]["links"]
    notes: list[str] = []
    try:
        data = build_cluster_data([RankView.from_dict(p["view"]) for p in payloads],
                                  links=LinksFile.model_validate(setting) if setting else LinksFile(),
                                  unknown_ethernet_gbps=payloads[0]["unknown_ethernet_gbps"], notes=notes)
    except Exception as exc:
        return {"error": _error(exc)}
    return {"data": data, "notes": notes}


def _wait_quietly(store, keys: list[str], timeout_s: float) -> None:
    """Rank 0 may host the store: keep it up until every rank has read the result (best effort)."""
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:
        pass
