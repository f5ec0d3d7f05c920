"""Discovery for the bare ``--heterogeneous-nic``: NICs from sysfs, accelerators from torch, gathered
over the bootstrap store into one cluster description that every rank shares.

- :func:`discover_node` -> :class:`NodeView` (this node).
- :func:`build_cluster_data` (per-rank or per-node views -> a valid cluster file as a dict);
  :func:`cluster_from_views` (the same views -> :class:`het_plugin.core.inputs.cluster.Cluster`).
- :func:`discover_cluster` (gather over the store -> :class:`het_plugin.core.inputs.cluster.Cluster`).

See docs/discovery.md for what is read, the overrides and the limits.
"""
from .accelerator import ENV_ACCELERATOR, ENV_ACCELERATOR_COUNT, AcceleratorInfo, from_device_name
from .build import (ENV_ETHERNET_GBPS, ENV_LINKS, LinksFile, RankView, build_cluster_data, cluster_from_views,
                    format_yaml, load_links)
from .gather import Discovery, DiscoveryError, discover_cluster, env_store, gather_discovery, gather_launch
from .node import ENV_FABRIC_NAME, ENV_NODE_NAME, NodeView, discover_node
from .sysfs import ENV_SYSFS_ROOT, EthernetNic, RdmaPort

__all__ = [
    "AcceleratorInfo", "Discovery", "DiscoveryError", "EthernetNic", "LinksFile", "NodeView", "RankView",
    "RdmaPort", "build_cluster_data", "cluster_from_views", "discover_cluster", "discover_node", "env_store",
    "format_yaml", "from_device_name", "gather_discovery", "gather_launch", "load_links",
    "ENV_ACCELERATOR", "ENV_ACCELERATOR_COUNT", "ENV_ETHERNET_GBPS", "ENV_FABRIC_NAME", "ENV_LINKS",
    "ENV_NODE_NAME", "ENV_SYSFS_ROOT",
]
