"""Rank script: tiny Megatron-Core GPT, pipeline stages on two (emulated) vendors, groups through het_shim.

    shim_megatron.py --cluster FILE          # het_plugin.megatron: host-staged groups use het_shim
    shim_megatron.py --baseline --split 2,2  # plain Megatron-Core groups (gloo), the same layer split
Reports losses, this rank's layers and, for the plugin run, which of its groups are het_shim groups.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from integration_tests.support.launch import arm_watchdog, report  # noqa: E402


def shim_groups() -> dict:
    from megatron.core import parallel_state as ps

    from het_plugin.comm import ShimProcessGroup
    out = {}
    for name, group in (("pp", ps._PIPELINE_MODEL_PARALLEL_GROUP), ("embedding", ps._EMBEDDING_GROUP),
                        ("dp", ps._DATA_PARALLEL_GROUP), ("tp", ps._TENSOR_MODEL_PARALLEL_GROUP)):
        if isinstance(group, ShimProcessGroup):
            out[name] = [list(s) for s in group.layout.subgroups]
    return out


def my_groups_tolerant() -> dict:
    """megatron_tiny.my_groups, but a middle pipeline stage has no embedding group (None in Megatron-Core)."""
    from megatron.core import parallel_state as ps
    names = {"tp": "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "pp": "_PIPELINE_GLOBAL_RANKS",
             "dp": "_DATA_PARALLEL_GLOBAL_RANKS", "embedding": "_EMBEDDING_GLOBAL_RANKS"}
    return {k: list(getattr(ps, v) or []) for k, v in names.items()}


def main() -> int:
    arm_watchdog()
    p = argparse.ArgumentParser()
    p.add_argument("--cluster")
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--split", help="layers per stage for the baseline, e.g. 2,2")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--vendor-from-env", action="store_true", help="no set_vendor_map: HET_PLUGIN_VENDOR(_MAP)")
    a = p.parse_args()
    import integration_tests.support.megatron_tiny as tiny
    from integration_tests.support.megatron_tiny import TinyGPT, shutdown, train
    tiny.my_groups = my_groups_tolerant
    if a.cluster and not a.vendor_from_env:
        # What the adapter should hand over from the plan: every launch rank's vendor.
        import het_plugin.comm as comm
        from het_plugin.cluster import load_cluster
        cluster = load_cluster(a.cluster)
        comm.set_vendor_map([cluster.nodes[cluster.rank_node[r]].accelerator.vendor
                             for r in range(cluster.world_size)])
    cfg = TinyGPT(num_layers=a.layers)
    split = [int(x) for x in a.split.split(",")] if a.split else None
    result = train(cfg, tp=1, pp=a.pp, steps=a.steps, cluster=a.cluster, use_plugin=not a.baseline,
                   layers_per_stage=split)
    out = result.to_dict()
    out["shim_groups"] = {} if a.baseline else shim_groups()
    report(out)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
