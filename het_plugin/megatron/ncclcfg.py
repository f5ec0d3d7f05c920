"""The plan's transports -> Megatron-Core's per-communicator NCCL config (``nccl_communicator_config_path``).

Megatron-Core reads a YAML mapping ``{pg_name: {net_name: IB|Socket, ...}}`` and passes it as each
group's ``ProcessGroupNCCL.Options.config``. Every rank writes its own file: for each group kind it holds
the net_name of *this rank's* group of that kind (the groups of one kind can sit on different fabrics).
NCCL reads NCCL_IB_HCA once per process, so a per-communicator ``net_name`` is the only per-group switch.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from ..netselect import nccl_net_name
from ..plan import Plan
from .groups import transport_of

# Megatron-Core 0.16 pg_name (get_nccl_options) -> the plan's group kind holding the same ranks.
# With ep == 1 the expert groups coincide with dense ones: ep_tp == tp, tp_ep_mp/tp_ep_pp == tp-pp,
# ep_dp == dp-cp.
PG_NAME_KIND = {
    "dp_cp": "dp-cp", "intra_dp_cp": "dp-cp", "dp": "dp", "cp": "cp", "hcp": "cp", "mp": "tp-pp",
    "tp": "tp", "pp": "pp", "embd": "embedding", "tp_dp_cp": "tp-dp-cp", "tp_dp": "tp-dp",
    "tp_cp": "tp-cp", "ep_tp": "tp", "tp_ep_mp": "tp-pp", "tp_ep_pp": "tp-pp", "ep_dp": "dp-cp",
    "intra_ep_dp": "dp-cp",
}


def nccl_config_for_rank(plan: Plan, rank: int, base: Optional[dict] = None) -> dict:
    """The config dict for ``rank``: the user's ``base`` entries kept, ``net_name`` set per group kind.

    Groups whose members share one node ('local') get no net_name: NCCL uses NVLink/shared memory.
    """
    out = {k: dict(v) for k, v in (base or {}).items()}
    for pg_name, kind in PG_NAME_KIND.items():
        if kind not in plan.groups:
            continue
        try:
            transport = plan.group_of(kind, rank).transport
        except KeyError:
            continue
        net = nccl_net_name(transport)
        if net is None:
            continue
        out.setdefault(pg_name, {})["net_name"] = net
    # One distributed-optimizer instance spans every rank (Megatron's default); more instances are not planned.
    net = nccl_net_name(transport_of(plan, range(plan.world_size)))
    if net is not None:
        out.setdefault("intra_dist_opt_instance", {})["net_name"] = net
    return out


def write_nccl_config(plan: Plan, rank: int, directory: Optional[str | Path] = None,
                      base_path: Optional[str | Path] = None) -> Path:
    """Write this rank's config file (merged over the user's own file, if any) and return its path."""
    import yaml

    base = None
    if base_path:
        with open(base_path) as f:
            base = yaml.safe_load(f) or {}
    directory = Path(directory or os.environ.get("HET_PLUGIN_RUN_DIR")
                     or Path(tempfile.gettempdir()) / f"het_plugin-{os.getuid()}")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"nccl-comm-{plan.hash}-rank{rank}.yaml"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(yaml.safe_dump(nccl_config_for_rank(plan, rank, base), sort_keys=True))
    tmp.replace(path)
    return path
