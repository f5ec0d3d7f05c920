"""Per-communicator network choice: the plan's transport of a group -> what its communicator uses.

NCCL: a per-communicator ``net_name`` ('IB' or 'Socket') in the group's ``ProcessGroupNCCL.Options``
(NCCL reads ``NCCL_IB_HCA`` once per process, so switching environment variables per group does not
work for NCCL); het_plugin.runtime.group_policy sets it at each group's creation.

gloo: ``new_group`` ignores ``pg_options``, but gloo reads ``GLOO_SOCKET_IFNAME`` each time a group is
created. ``HET_PLUGIN_GLOO_IFNAMES`` maps transports to interfaces, e.g.
``ib=fab0,roce=fab0,socket=eth0,local=lo`` (the emulator sets it per rank); :func:`gloo_network`
applies it around one group's creation.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

ENV_GLOO_IFNAMES = "HET_PLUGIN_GLOO_IFNAMES"

# Groups whose transport is 'host-staged' (spanning vendors) are created with this backend, which
# ``import het_plugin.comm`` registers (imported only when such a group exists).
SHIM_BACKEND = "het_shim"

NCCL_NET_NAME = {"ib": "IB", "roce": "IB", "socket": "Socket", "host-staged": "Socket"}


def nccl_net_name(transport: str) -> Optional[str]:
    """NCCL's net_name for a transport; None for 'local' (NVLink/shared memory: NCCL needs no NIC)."""
    return NCCL_NET_NAME.get(transport)


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
    from .group_policy import with_net_name
    return with_net_name(None, net_name)
