"""Rank script: het_shim as the *default* group (init_process_group(backend="het_shim")).

A real cross-vendor job cannot build an NCCL/RCCL world communicator, so its world group must be a shim
group too; groups created without a backend then inherit het_shim and, when one vendor, run natively.
Vendors from HET_PLUGIN_VENDOR_MAP (the default group exists before any plan could be agreed).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from integration_tests.support.launch import arm_watchdog, report  # noqa: E402

arm_watchdog()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import het_plugin.comm as comm  # noqa: E402


def main():
    dist.init_process_group(comm.SHIM_BACKEND)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"world_backend": dist.get_backend(), "world_subgroups": [list(s) for s in dist.group.WORLD.layout.subgroups]}
    t = torch.arange(6, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(t)
    out["world_all_reduce"] = t.tolist()
    dist.barrier()
    halves = [dist.new_group(list(range(0, world // 2))), dist.new_group(list(range(world // 2, world)))]
    mine = halves[0] if rank < world // 2 else halves[1]
    out["half_backend"] = dist.get_backend(mine)
    out["half_subgroups"] = [list(s) for s in mine.layout.subgroups]
    x = torch.ones(4) * rank
    dist.all_reduce(x, group=mine)
    out["half_all_reduce"] = x.tolist()
    # a one-vendor group hands operations the shim does not implement to the native communicator
    y = torch.full((2,), float(rank + 1))
    dist.reduce(y, dst=0 if rank < world // 2 else world // 2, group=mine)
    out["half_reduce_at_root"] = y.tolist() if rank in (0, world // 2) else None
    try:
        dist.reduce(torch.ones(2), dst=0)
        out["world_reduce"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        out["world_reduce"] = f"{type(exc).__name__}: {exc}"
    gathered = [None] * world
    dist.all_gather_object(gathered, rank)
    out["all_gather_object"] = gathered
    report(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
