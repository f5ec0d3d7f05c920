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

from dataclasses import dataclass
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


# ---- NCCL's multi-network (cross-data-center) communicators ----------------------------------------------
# NCCL_ALLNET_ENABLE (every network plugin loaded per communicator; collNet ignored then), fabric IDs in
# NCCL_IB_HCA (``device:port:fabricId``, read as dcId * NCCL_IB_FABRICID_MAXRAIL + railId), NCCL_SCATTER_XDC
# (default 1: each ring/tree crosses between data centers on other nodes) and the rings ordered by data center:
# NVIDIA/nccl branch ``cross-dc``, commit 18a07eee (2025-03-20; makefiles/version.mk 2.26.2; pull request #1659,
# still open in June 2026): src/include/net.h ``NCCL_PARAM(AllNet, "ALLNET_ENABLE", 0)``, src/plugin/net.cc
# ncclNetInit ("NCCL_ALLNET_ENABLE=1, ignore CollNet"), src/transport/net_ib.cc ncclIbgetNetPath and
# ``IB_FABRICID_MAXRAIL``, src/graph/connect.cc connectRings / ``SCATTER_XDC``. No release tag carries any of it:
# ``git grep`` of src/ at every tag up to v2.30.7-1 (2026-06-04) finds none of these names. RCCL: none either
# (ROCm/rccl develop of 2024-10-24, tracking NCCL 2.21.5); RCCL follows NCCL's releases.
ALLNET_RELEASE: Optional[Version] = None     # first NCCL release with multi-network communicators: none yet
CROSS_DC_BASE: Version = (2, 26, 2)          # the version a build of the cross-dc branch reports
CURRENT_RELEASE: Version = (2, 30, 7)        # the newest release read (v2.30.7-1): the planner's default
CROSS_DC_TAG = "cross-dc"


@dataclass(frozen=True)
class NcclBuild:
    """The NCCL a plan is made for: its version and whether it is a build of the cross-dc branch (which
    reports the version it branched from, so the version alone cannot tell)."""
    version: Version = CURRENT_RELEASE
    cross_dc: bool = False
    rccl: bool = False

    @property
    def multinet(self) -> bool:
        """Whether one communicator can join networks (IB and RoCE, or two fabrics over TCP)."""
        if self.rccl:
            return False
        if self.cross_dc:
            return True
        return ALLNET_RELEASE is not None and tuple(self.version) >= ALLNET_RELEASE

    @property
    def text(self) -> str:
        return version_text(self.version) + (f"+{CROSS_DC_TAG}" if self.cross_dc else "") + (" (RCCL)" if self.rccl else "")


def parse_build(text: Optional[str]) -> NcclBuild:
    """'2.30.7', '2.26.2+cross-dc', 'cross-dc' (the branch build), 'rccl:2.21.5'; None or '' -> the current
    release. Raises ValueError naming the accepted forms."""
    if text is None or not str(text).strip():
        return NcclBuild()
    raw = str(text).strip().lower()
    rccl = raw.startswith("rccl:")
    if rccl:
        raw = raw[len("rccl:"):]
    base, plus, tag = raw.partition("+")
    if base == CROSS_DC_TAG and not plus:
        return NcclBuild(CROSS_DC_BASE, True, rccl)
    if plus and tag != CROSS_DC_TAG:
        raise ValueError(f"{text!r}: the only build tag known is '+{CROSS_DC_TAG}' (NVIDIA/nccl's cross-dc branch); "
                         "want e.g. 2.30.7, 2.26.2+cross-dc or rccl:2.21.5")
    try:
        version = parse_version(base)
    except ValueError:
        raise ValueError(f"{text!r} is not an NCCL build (want e.g. 2.30.7, 2.26.2+cross-dc or rccl:2.21.5)") from None
    return NcclBuild(version, bool(plus), rccl)
