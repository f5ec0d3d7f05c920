"""How ``het-plugin check --format env --multinet`` introduces NCCL's multi-network settings (text only; the
settings and checks are het_plugin.core.multinet_env)."""
from __future__ import annotations

from typing import Optional

from ..core.multinet_env import ALLNET, IB_HCA, SCATTER


def header(build_text: Optional[str], fabric_ids: dict) -> str:
    """Comment lines before the export lines: what the three variables do, each fabric's ID, which NCCL."""
    ids = ", ".join(f"{c}={i}" for c, i in fabric_ids.items()) or "none (no RDMA fabric)"
    lines = [
        "# NCCL multi-network communicators (NVIDIA/nccl cross-dc branch; no release has them yet):",
        f"#   {ALLNET}=1 loads every network per communicator (RDMA inside a fabric, Socket between; CollNet off)",
        f"#   {IB_HCA} device:port:fabricId gives each fabric its own rail ({ids})",
        f"#   {SCATTER}=1 spreads the crossings between fabrics over the nodes",
    ]
    if build_text:
        lines.append(f"#   checked for NCCL {build_text}")
    return "\n".join(lines) + "\n"
