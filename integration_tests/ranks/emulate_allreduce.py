"""Rank script: gloo across two emulated clusters. Each cluster's group is created under the interface its
transport names (het_plugin.runtime.netselect), the default group on Ethernet; reports per-interface byte counts."""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.runtime.netselect import gloo_network
from het_plugin.core.ranks.placement import cluster_transport
from integration_tests.support.launch import arm_watchdog, report


def tx_bytes(ifname: str) -> int:
    path = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes")
    return int(path.read_text()) if path.exists() else 0


def counters() -> dict:
    return {i: tx_bytes(i) for i in ("eth0", "fab0")}


def settle(group) -> None:
    """Let the last segments of a collective leave the shaper (a rank can finish before its own last send
    has drained), so byte counts are not attributed to the next phase."""
    dist.barrier(group=group)
    time.sleep(0.5)


def main() -> None:
    arm_watchdog()
    cluster = load_cluster(sys.argv[1])
    nbytes = int(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mine = None
    transports = {}
    for name in cluster.cluster_names:
        ranks = [r for r in range(world) if cluster.node_of(r).cluster == name]
        kind = cluster_transport(cluster, ranks)
        with gloo_network(kind):
            g = dist.new_group(ranks)
        transports[name] = kind
        if rank in ranks:
            mine = (g, name)
    n = nbytes // 4
    before = counters()
    x = torch.full((n,), float(rank + 1))
    dist.all_reduce(x, group=mine[0])
    members = [r for r in range(world) if cluster.node_of(r).cluster == mine[1]]
    ok_cluster = bool(torch.all(x == float(sum(r + 1 for r in members))))
    settle(mine[0])
    mid = counters()
    y = torch.full((n,), float(rank + 1))
    dist.all_reduce(y)
    ok_world = bool(torch.all(y == float(sum(range(1, world + 1)))))
    settle(None)
    after = counters()
    dist.barrier()
    dist.destroy_process_group()
    report({"rank": rank, "cluster": mine[1], "transport": transports[mine[1]], "ok_cluster": ok_cluster,
            "ok_world": ok_world,
            "cluster_group_tx": {k: mid[k] - before[k] for k in before},
            "default_group_tx": {k: after[k] - mid[k] for k in mid}})


if __name__ == "__main__":
    main()
