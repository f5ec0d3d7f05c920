"""Per-communicator network choice: the plan's transport of a group -> what its communicator uses.

NCCL: a per-communicator ``net_name`` in the group's ``ProcessGroupNCCL.Options`` (NCCL reads
``NCCL_IB_HCA`` once per process, so switching environment variables per group does not work for NCCL);
:func:`nccl_options` builds every such options object (the group policy and the shim's vendor subgroups call it). Only 'Socket' is forced (groups that cross
fabrics): an RDMA group keeps NCCL's own choice -- its default order is an external network plugin, then
IB, then Socket (NVIDIA/nccl v2.30.7-1 src/plugin/net.cc ncclNetInit: the first plugin that initialises
and whose name matches ``netName`` case-insensitively, any when unset) -- because the RDMA network is not
called 'IB' everywhere: current RCCL registers 'IB-CAST' / 'ROCM-IB' on AMD AINIC hosts (ROCm/rocm-systems
projects/rccl src/plugin/net.cc), AWS's libfabric plugin and HPC-X/SHARP register their own. A cluster
file may name its fabric's network (``fabric.nccl_net``); that name is then forced on its RDMA groups.

gloo: ``new_group`` ignores ``pg_options``, but gloo reads ``GLOO_SOCKET_IFNAME`` each time a group is
created. ``HET_PLUGIN_GLOO_IFNAMES`` maps transports to interfaces, e.g.
``ib=fab0,roce=fab0,socket=eth0,local=lo`` (the emulator sets it per rank); :func:`gloo_network`
applies it around one group's creation.
"""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence

from .nccl_options import copied
from ..core.errors import ConfigError
from ..core.nccl_version import version_text
# The names per transport are pure data, shared with the pre-flight's rules: core.ranks.transport.
from ..core.ranks.transport import ENV_GLOO_IFNAMES, RDMA_TRANSPORTS, SHIM_BACKEND, SOCKET_NET, SOCKET_TRANSPORTS, nccl_net_name  # noqa: F401
from . import nccl_version      # its loaded_nccl_version is looked up at each call (tests replace it)

# A leaf below both the group policy (runtime.group_policy) and the shim (comm.shim): it imports no other
# runtime or comm module but nccl_version and nccl_options (leaves too).


def gloo_ifnames(env: Optional[dict] = None) -> dict[str, str]:
    text = (env if env is not None else os.environ).get(ENV_GLOO_IFNAMES, "")
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = item.partition("=")
        if not value:
            raise ValueError(f"{ENV_GLOO_IFNAMES}: {item!r} is not transport=ifname")
        out[key.strip()] = value.strip()
    return out


@contextlib.contextmanager
def gloo_network(transport: str) -> Iterator[Optional[str]]:
    """Set GLOO_SOCKET_IFNAME for the group being created, if a mapping for its transport exists."""
    ifname = gloo_ifnames().get(transport)
    with ifname_set(ifname):
        yield ifname


@contextlib.contextmanager
def ifname_set(ifname: Optional[str]) -> Iterator[None]:
    """GLOO_SOCKET_IFNAME = ``ifname`` for the duration (None: leave it as it is)."""
    if ifname is None:
        yield
        return
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old


def world_group_options(net_name: str = "Socket"):
    """``pg_options`` for ``init_process_group('nccl', ...)`` when the world group spans fabrics: the world
    communicator gets its own network (``net_name``), every other communicator keeps its own. None where this
    torch has no NCCL."""
    return nccl_options(net_name)


def network_of(plan, members: Sequence[int], transport: Optional[str] = None) -> Optional[str]:
    """The one network choice: the NCCL net_name forced on a communicator over ``members`` (physical ranks),
    or None where NCCL keeps its own (RDMA without a declared network, or inside a node)."""
    transport = plan.transport_of(members) if transport is None else transport
    rdma = plan.rdma_net_of(members) if transport in RDMA_TRANSPORTS else None
    return nccl_net_name(transport, rdma)


# Torch added ProcessGroupNCCL.Options.config (the ncclConfig_t binding, net_name among its fields) in 2.1
# (pytorch/pytorch v2.1.0 torch/csrc/distributed/c10d/init.cpp); NCCL reads config.netName from 2.17
# (NVIDIA/nccl v2.17.1-1 src/init.cc). Older builds have no per-communicator network.
OPTIONS_CONFIG_FIX = ("use torch >= 2.1 built with NCCL >= 2.17 (RCCL of ROCm >= 5.6), whose "
                      "ProcessGroupNCCL.Options has config.net_name")


def nccl_options(net_name: Optional[str], options: Any = None, *, timeout: Optional[timedelta] = None) -> Any:
    """Every NCCL options object het_plugin builds or changes: a copy of the framework's own (Megatron passes its
    per-group config, one object to several groups: runtime.nccl_options) or new ones, ``config.net_name`` =
    ``net_name`` when given; None where this torch has no NCCL (a CPU build: nothing to select). A build whose
    Options has no ``config`` is refused."""
    if options is None:
        import torch.distributed as tdist
        pg_nccl = getattr(tdist, "ProcessGroupNCCL", None)
        if pg_nccl is None:
            return None
        options = pg_nccl.Options()
    elif timeout is not None or net_name is not None:
        options = copied(options)     # never write on the caller's object: frameworks share one among groups
    if timeout is not None:
        options._timeout = timeout
    if net_name is not None:
        config = getattr(options, "config", None)
        if config is None:
            raise ConfigError(f"this torch's ProcessGroupNCCL.Options has no 'config', so a communicator cannot be "
                              f"given the network {net_name!r} (torch {_torch_version()}, NCCL {_nccl_version()})",
                              field="torch", fix=OPTIONS_CONFIG_FIX)
        config.net_name = net_name
    return options


def with_net_name(options: Any, net_name: str) -> Any:
    """NCCL options selecting ``net_name`` (:func:`nccl_options`; kept for callers of the old name)."""
    return nccl_options(net_name, options)


def _torch_version() -> str:
    try:
        import torch
        return str(torch.__version__)
    except ImportError:
        return "not installed"


def _nccl_version() -> str:
    return version_text(nccl_version.loaded_nccl_version())
