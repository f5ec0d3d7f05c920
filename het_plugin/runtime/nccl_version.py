"""The NCCL (or RCCL) version this process loaded, for the pre-flight's version-dependent rules
(het_plugin.core.nccl_version holds the rules and thresholds)."""
from __future__ import annotations

from typing import Optional

from ..core.nccl_version import Version, normalize


def loaded_nccl_version() -> Optional[Version]:
    """(major, minor, patch) of the NCCL/RCCL torch loaded (``torch.cuda.nccl.version()``, torch/cuda/nccl.py);
    None without torch or on a build with no NCCL."""
    try:
        import torch
        return normalize(torch.cuda.nccl.version())
    except Exception:        # noqa: BLE001 - no torch, a CPU build (no torch._C._nccl_version), no library
        return None
