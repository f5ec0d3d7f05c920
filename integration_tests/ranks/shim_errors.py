"""Rank script: wrongly declared vendor maps and unsupported operations give clear errors, never a hang.

Every scenario creates one het_shim group over all ranks; each rank reports the error it got.
The last scenario ("absent") has rank 3 skip the group creation, so it must run last.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from integration_tests.support.launch import arm_watchdog, report  # noqa: E402

arm_watchdog()

import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import het_plugin.comm as comm  # noqa: E402


def attempt(make):
    try:
        make()
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 - the test inspects type and message
        return {"error": type(exc).__name__, "message": str(exc), "is_config_error": isinstance(exc, ValueError)}


def new_shim():
    return dist.new_group(list(range(dist.get_world_size())), backend=comm.SHIM_BACKEND)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}

    # ranks disagree: rank 0 believes 2+2 contiguous, the others 2+2 interleaved
    comm.set_vendor_map(["nvidia", "nvidia", "amd", "amd"] if rank == 0 else ["nvidia", "amd", "nvidia", "amd"])
    out["disagree"] = attempt(new_shim)

    # the map names a rank the job does not have
    comm.set_vendor_map({0: "nvidia", 1: "nvidia", 2: "amd", 3: "amd", 7: "amd"})
    out["outside"] = attempt(new_shim)

    # only rank 1 declares a map; the others rely on HET_PLUGIN_VENDOR
    comm.set_vendor_map(["nvidia", "nvidia", "amd", "amd"] if rank == 1 else None)
    os.environ[comm.ENV_VENDOR] = "nvidia" if rank < 2 else "amd"
    out["partial"] = attempt(new_shim)
    del os.environ[comm.ENV_VENDOR]

    # rank 2 says (HET_PLUGIN_VENDOR) it is amd; the map says nvidia
    comm.set_vendor_map(["nvidia", "nvidia", "nvidia", "amd"])
    if rank == 2:
        os.environ[comm.ENV_VENDOR] = "amd"
    out["contradicts"] = attempt(new_shim)
    os.environ.pop(comm.ENV_VENDOR, None)

    # a well-formed map: the group works, unsupported calls name the operation and a workaround
    comm.set_vendor_map(["nvidia", "nvidia", "nvidia", "amd"])
    shim = new_shim()
    t = torch.ones(world * 2)
    out["all_to_all"] = attempt(lambda: dist.all_to_all_single(torch.empty_like(t), t, group=shim))
    out["band"] = attempt(lambda: dist.all_reduce(torch.ones(4, dtype=torch.int64), op=dist.ReduceOp.BAND,
                                                  group=shim))
    out["gather"] = attempt(lambda: dist.gather(torch.ones(2), [torch.ones(2)] * world if rank == 0 else None,
                                                group_dst=0, group=shim))
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x, group=shim)                      # still usable after the refused calls
    out["after"] = x.tolist()

    # a member never creates the group: the others get an error naming it within the timeout
    if rank != world - 1:
        out["absent"] = attempt(new_shim)
    report(out)
    dist.destroy_process_group() if rank != world - 1 else None


if __name__ == "__main__":
    main()
