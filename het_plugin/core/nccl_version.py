"""The NCCL (or RCCL) version the pre-flight rules are gated on, and the versions each rule depends on.

Pure (the rules and thresholds); the version itself is read at run time by
het_plugin.runtime.nccl_version.loaded_nccl_version: the library torch loaded, ``torch.cuda.nccl.version()``
(pytorch/pytorch torch/cuda/nccl.py: ``torch._C._nccl_version()``, i.e. ``ncclGetVersion`` of the loaded
libnccl / librccl, as (major, minor, patch[, suffix])). RCCL carries the NCCL version it tracks. A CPU build
has none: the rules then say what each version would do instead of deciding for one.

Where each threshold was read (NVIDIA/nccl tags, grep of ``src/``):

* ``NCCL_IB_GID_INDEX`` defaults to -1 (pick a RoCE v2 GID) from v2.21.5-1 (src/transport/net_ib.cc
  ``NCCL_PARAM(IbGidIndex, "IB_GID_INDEX", -1)``); up to v2.20.3-1 the default is 0, which on most RoCE NICs
  is a RoCE v1 / link-local GID, so routed RoCE fails;
* "Attempted to connect incompatible devices" (an IB and a RoCE port in one connection fail at connect)
  appears in v2.26.2-1 (src/transport/net_ib.cc); before, nothing stops it and the connection may hang;
* ``NCCL_IGNORE_NET_MISMATCH`` appears in v2.30.3-1 (src/init.cc, default 1: "Detected mixed local Net device
  counts across ranks ... Ignoring"; 0 makes init fail); before it there is no such variable and no check;
* ``NCCL_IB_MERGE_NICS`` (ports of one NIC fused into one network device, default 1) from v2.20.3-1.
"""
from __future__ import annotations

from typing import Optional, Sequence

Version = tuple[int, int, int]

GID_AUTO = (2, 21, 0)             # NCCL_IB_GID_INDEX=-1 by default (automatic RoCE v2 GID)
CONNECT_CHECK = (2, 26, 0)        # IB+RoCE in one connection: "Attempted to connect incompatible devices"
NET_MISMATCH_VAR = (2, 30, 0)     # NCCL_IGNORE_NET_MISMATCH exists (default 1: accept mixed NIC counts)
MERGE_NICS = (2, 20, 0)           # NCCL_IB_MERGE_NICS (dual-port NICs count once)


def normalize(value: object) -> Optional[Version]:
    """A version given as a tuple (torch's, maybe with a suffix), an int (NCCL_VERSION_CODE) or 'X.Y.Z'."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 10000:                    # NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z from 2.9
            return (value // 10000, value // 100 % 100, value % 100)
        return (value // 1000, value // 100 % 10, value % 100)
    if isinstance(value, str):
        return parse_version(value)
    if isinstance(value, Sequence):
        nums = [int(v) for v in list(value)[:3] if isinstance(v, int) or str(v).isdigit()]
        if len(nums) >= 2:
            return (nums[0], nums[1], nums[2] if len(nums) > 2 else 0)
    raise ValueError(f"{value!r} is not an NCCL version (want e.g. (2, 21, 5) or '2.21.5')")


def parse_version(text: str) -> Version:
    """'2.21.5', '2.21.5-1' or '2.21' -> (2, 21, 5)."""
    parts = text.strip().split("-", 1)[0].split(".")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{text!r} is not an NCCL version (want e.g. 2.21.5)") from None
    if len(nums) not in (2, 3):
        raise ValueError(f"{text!r} is not an NCCL version (want e.g. 2.21.5)")
    return (nums[0], nums[1], nums[2] if len(nums) == 3 else 0)


def version_text(version: Optional[Version]) -> str:
    return "unknown" if version is None else ".".join(str(v) for v in version)


def at_least(version: Optional[Version], threshold: Version) -> Optional[bool]:
    """True / False; None when the version is unknown."""
    return None if version is None else tuple(version) >= threshold
