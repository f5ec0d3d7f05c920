"""Megatron's partial distributed optimizer (``--num-distributed-optimizer-instances``), as the cost model reads it.

With ``I`` instances Megatron-Core splits every data-parallel (dp x cp) group, in its rank order, into ``I``
consecutive blocks (megatron-core 0.19.2 parallel_state.py, ``intra_partial_data_parallel_size = dp*cp // I``,
the INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP groups) and joins the blocks' members at the same position in an
inter-instance group (distributed_data_parallel.py ``inter_dist_opt_group``). Each rank keeps optimizer state for
1/(dp*cp/I) of the parameters; the gradients are reduce-scattered inside an instance, the shards all-reduced
across the instances, and the parameters all-gathered inside it again. One instance per fabric keeps the two
big collectives on RDMA and puts on the slow link only each rank's shard, on every node's NIC at once.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from ..inputs.cluster import Cluster
from .analysis import Analysis, _collective_path
from .network import Network


def instance_blocks(members: Sequence[int], instances: int) -> tuple[list[list[int]], list[list[int]]]:
    """A data-parallel group's members (its rank order) -> (the instances' blocks, the inter-instance groups)."""
    if instances < 1 or len(members) % instances:
        raise ValueError(f"{instances} optimizer instances do not divide a data-parallel group of {len(members)}")
    size = len(members) // instances
    blocks = [list(members[i * size:(i + 1) * size]) for i in range(instances)]
    across = [list(members[j::size]) for j in range(size)]
    return blocks, across


def instance_options(dp_cp: int, fabrics: int) -> list[int]:
    """Instance counts the planner tries for a dp x cp of ``dp_cp`` over ``fabrics`` clusters: one instance per
    fabric, and two (an instance per half of each), where they divide it."""
    return [i for i in dict.fromkeys((fabrics, 2 * fabrics)) if 1 < i < dp_cp and dp_cp % i == 0]


def with_instances(cluster: Cluster, analysis: Analysis, instances: int, net: Optional[Network] = None) -> Analysis:
    """The analysis with each stage's instance and inter-instance paths (``instances`` 1: as it is)."""
    if instances == 1:
        return analysis if analysis.instances == 1 else replace(analysis, instances=1)
    dims = analysis.placement.dims
    net = net if net is not None else Network(cluster)
    S = dims.stage_size
    node_of_logical = analysis.node_of_logical
    cache: dict = {}
    stages = []
    for s, st in enumerate(analysis.stages):
        base = s * S
        inside, across = [], []
        # (the paths are shared objects of the network's cache: one already kept is skipped by identity, and only
        # a new object is compared field by field with the kept ones)
        kept: tuple[set, set] = (set(), set())
        for j in range(dims.tp):
            members = node_of_logical[base + j:base + S:dims.tp]
            blocks, crossing = instance_blocks(members, instances)
            for target, groups, ids in ((inside, blocks, kept[0]), (across, crossing, kept[1])):
                for g in groups:
                    key = tuple(g)
                    if key not in cache:
                        cache[key] = _collective_path(net, g)[0] if len(g) > 1 else None
                    path = cache[key]
                    if path is None or id(path) in ids:
                        continue
                    ids.add(id(path))
                    if path not in target:
                        target.append(path)
        stages.append(replace(st, instance_paths=tuple(inside), cross_instance_paths=tuple(across)))
    return replace(analysis, stages=stages, instances=instances)


def instance_span(cluster: Cluster, analysis_or_nodes, instances: int, dims=None) -> Optional[str]:
    """Why ``instances`` would put one optimizer instance across fabrics (its reduce-scatter and all-gather then
    cross the slow link): the first such instance, in words; None when every instance stays in one cluster."""
    if isinstance(analysis_or_nodes, Analysis):
        node_of_logical, dims = analysis_or_nodes.node_of_logical, analysis_or_nodes.placement.dims
    else:
        node_of_logical = analysis_or_nodes
    S = dims.stage_size
    nodes = cluster.nodes
    for s in range(dims.pp):
        for j in range(dims.tp):
            members = node_of_logical[s * S + j:(s + 1) * S:dims.tp]
            blocks, _ = instance_blocks(members, instances)
            for i, block in enumerate(blocks):
                clusters = sorted({nodes[n].cluster for n in block})
                if len(clusters) > 1:
                    return (f"with {instances} distributed-optimizer instances, instance {i} of stage {s}'s "
                            f"data-parallel group spans clusters {' and '.join(clusters)}: its reduce-scatter and "
                            "all-gather would cross the link between them")
    return None
