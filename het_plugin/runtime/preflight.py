"""The mixed-NIC pre-flight inside the adapters: after the ranks agree on a plan, before any group exists.

Both adapters call :func:`check_network` through :meth:`AppliedPlan.begin`, right after plan agreement.
When the world group runs NCCL (or RCCL, torch's ``nccl`` backend), every rank sends the NCCL settings of its own environment to rank 0 (a launcher may give each node its own: the per-node lines
of ``het-plugin check --format env``), rank 0 runs :func:`het_plugin.core.nccl_env.preflight` over the plan's
groups, the nodes' NICs (the cluster file's ``nics``, or discovery's) and those environments, adds the world
group's check (:func:`het_plugin.core.nccl_env.world_refusal`) and a refusal for ranks of one node whose NCCL
settings differ (NCCL reads them per process), and every rank raises the same ConfigError -- the text of
``het-plugin check``. Each rank also sends the NCCL/RCCL version its torch loaded (``torch.cuda.nccl.version()``)
and the version-dependent rules follow each node's. A ``het_shim`` world is checked too (its vendor
subgroups are NCCL/RCCL communicators); under gloo nothing runs, and a homogeneous identity plan (het_plugin a
no-op) is never checked.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping, Optional

from ..core.nccl_env import (
    NET_NAME_UNREADABLE,
    GroupUse,
    Preflight,
    Refusal,
    check_launch,
    world_refusal,
    world_warning,
)
from .exchange import Exchange
from .netselect import SHIM_BACKEND
from . import nccl_version      # its loaded_nccl_version is looked up at each call (tests replace it)

log = logging.getLogger("het_plugin")

# What NCCL reads from the environment that the checks look at.
NCCL_KEYS = ("NCCL_NET", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX", "NCCL_IGNORE_NET_MISMATCH",
             "NCCL_COMM_SPLIT_SHARE_RESOURCES", "NCCL_IB_MERGE_NICS")
VERSION_KEY = "het_plugin:nccl_version"    # in the gathered entry beside the settings (no NCCL variable has it)


def checked_backend(backend: str) -> bool:
    """The world backends whose launch runs NCCL/RCCL communicators: nccl, mixed ('cpu:gloo,cuda:nccl'), het_shim."""
    text = backend.lower()
    return "nccl" in text or SHIM_BACKEND in text


def world_backend() -> str:
    """The default group's backend ('nccl', 'gloo', 'cpu:gloo,cuda:nccl', ...): where the check decides to run."""
    import torch.distributed as tdist
    return str(tdist.get_backend())


def world_net_name() -> Optional[str]:
    """The ``net_name`` the world group's NCCL options carry (init_process_group's ``pg_options``); None when
    unset; NET_NAME_UNREADABLE when this torch does not show them (the check then warns instead of refusing:
    never verified on a GPU build, so a world group made right must not be refused for it)."""
    try:
        import torch
        from torch.distributed import distributed_c10d
        backend = distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
        return backend.options.config.net_name or None
    except Exception:            # noqa: BLE001 - a build or backend that does not show them
        return NET_NAME_UNREADABLE


def nccl_settings(env: Mapping[str, str]) -> dict[str, str]:
    return {k: env[k] for k in NCCL_KEYS if k in env}


def check_network(plan, rank: int, *, cluster=None, native_network: bool = False, store=None,
                  env: Optional[Mapping[str, str]] = None, timeout_s: Optional[float] = None) -> Optional[Preflight]:
    """Refuse (ConfigError on every rank) a launch whose NCCL environment contradicts the plan; None when the
    check does not apply (not NCCL, one rank, het_plugin a no-op, or no torch.distributed job and no ``store``).
    ``cluster``: where the nodes' NICs are listed (None: a plan file; nodes are then unchecked, the
    environment-only checks still run)."""
    if native_network or plan.world_size <= 1:
        return None
    if store is None:
        import torch.distributed as tdist
        if not (tdist.is_available() and tdist.is_initialized()):
            return None                  # no job to check (as AppliedPlan.guarding: nothing without a store)
    backend = world_backend()
    if not checked_backend(backend):
        return None
    env = os.environ if env is None else env
    if store is None:
        from torch.distributed import distributed_c10d
        store = distributed_c10d._get_default_store()
    return exchange_check(plan, rank, store=store, cluster=cluster, env=env, backend=backend,
                          net_name=world_net_name(), timeout_s=timeout_s)


def exchange_check(plan, rank: int, *, store, cluster=None, env: Optional[Mapping[str, str]] = None,
                   backend: str = "nccl", net_name: Optional[str] = None,
                   timeout_s: Optional[float] = None) -> Preflight:
    """The check's store exchange, once it applies: every rank's NCCL settings to rank 0, its verdict to every
    rank (:meth:`Exchange.decide`: a few requests per rank, linear on rank 0). Needs no process group, so the
    start-up benchmark runs it as it is."""
    env = os.environ if env is None else env
    ex = Exchange(store, "preflight", index=rank, members=range(plan.world_size), what="the NCCL pre-flight",
                  timeout=timeout_s)
    version = nccl_version.loaded_nccl_version()
    reply = ex.decide({**nccl_settings(env), VERSION_KEY: list(version) if version else None},
                      judge=lambda entries: judge(plan, cluster, {e.rank: e.value for e in entries}, backend, net_name),
                      stops=lambda reply: reply.error is not None or bool((reply.value or {}).get("refusals")))
    if reply.error is not None:
        reply.raise_error("")
    result = Preflight({}, [Refusal(**r) for r in reply.value["refusals"]], reply.value["warnings"])
    if rank == 0:
        for w in result.warnings:
            log.warning("het_plugin pre-flight: %s", w)
    result.raise_if_refused()
    return result


def judge(plan, cluster, settings: Mapping[int, Mapping[str, str]], backend: str,
          net_name: Optional[str]) -> dict:
    """Rank 0: every rank's NCCL settings -> the refusals and warnings every rank raises (JSON-able)."""
    node_env: dict[str, dict[str, str]] = {}
    first_rank: dict[str, int] = {}
    refusals: list[Refusal] = []
    node_version: dict[str, Optional[tuple]] = {}
    settings = {r: dict(v) for r, v in settings.items()}
    for rank in sorted(settings):
        node = plan.node_of(rank).name
        version = settings[rank].pop(VERSION_KEY, None)
        if node not in node_env:
            node_env[node], first_rank[node] = dict(settings[rank]), rank
            node_version[node] = tuple(version) if version else None
            continue
        differ = [k for k in NCCL_KEYS if settings[rank].get(k) != node_env[node].get(k)]
        if differ and not any(r.field == differ[0] and node in r.nodes for r in refusals):
            k = differ[0]
            refusals.append(Refusal(k, f"ranks {first_rank[node]} and {rank} on node {node} have different {k} "
                                       f"({node_env[node].get(k)!r} and {settings[rank].get(k)!r}); NCCL reads it in "
                                       "each process, so the node's ranks would disagree about its NICs",
                                    f"give every rank of {node} the same {k} (`het-plugin check --format env --node "
                                    f"{node}` prints its line)", (node,)))
    result = check_launch(plan, {}, cluster=cluster, node_env=node_env, node_version=node_version)
    everyone = list(range(plan.world_size))
    world = GroupUse("world group", tuple(dict.fromkeys(plan.node_of(r).name for r in everyone)),
                     plan.rule_transport(everyone))
    nets = {n: e.get("NCCL_NET") for n, e in node_env.items()}
    wr = world_refusal(world, backend, net_name, nets)
    ww = world_warning(world, backend, net_name, nets)
    refusals = result.refusals + refusals + ([wr] if wr is not None else [])
    return {"refusals": [{"field": r.field, "problem": r.problem, "fix": r.fix, "nodes": list(r.nodes)}
                         for r in refusals],
            "warnings": list(result.warnings) + ([ww] if ww else [])}
