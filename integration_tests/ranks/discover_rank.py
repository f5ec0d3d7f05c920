"""One rank of a discovery gather: init gloo, discover_cluster over the default store, report.

Each rank's HET_PLUGIN_SYSFS_ROOT / HET_PLUGIN_NODE_NAME say which (fabricated) node it is on.
Reports the cluster file every rank built, its digest, this rank's node, and the digests all ranks
hold (gathered with a gloo collective after discovery, which also shows the group still works).
A discovery error is reported as {"error": ...} and the rank exits 3.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from integration_tests.support.launch import arm_watchdog, report  # noqa: E402


def main() -> int:
    arm_watchdog()
    import torch.distributed as dist

    from het_plugin.discovery import gather_discovery
    from het_plugin.core.errors import HetPluginError

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        found = gather_discovery(timeout_s=float(os.environ.get("HET_TEST_DISCOVER_TIMEOUT", "60")))
    except HetPluginError as exc:
        report({"rank": rank, "error": str(exc), "type": type(exc).__name__})
        dist.destroy_process_group()
        return 3
    cluster = found.cluster
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, cluster.digest)
    report({"rank": rank, "data": found.data, "notes": found.notes, "digest": cluster.digest,
            "all_digests": digests, "my_node": cluster.node_of(rank).name,
            "my_cluster": cluster.node_of(rank).cluster, "local_rank": cluster.local_rank(rank)})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
