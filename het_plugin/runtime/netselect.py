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

# The names per transport are pure data, shared with the pre-flight's rules: core.ranks.transport.
from ..core.ranks.transport import ENV_GLOO_IFNAMES, NCCL_NET_NAME, SHIM_BACKEND, nccl_net_name  # noqa: F401


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
