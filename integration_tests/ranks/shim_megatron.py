"""Rank script: tiny Megatron-Core GPT, pipeline stages on two (emulated) vendors, groups through het_shim.

    shim_megatron.py --cluster FILE          # het_plugin.megatron: host-staged groups use het_shim
    shim_megatron.py --baseline --split 2,2  # plain Megatron-Core groups (gloo), the same layer split
Reports losses, this rank's layers and, for the plugin run, which of its groups are het_shim groups and
their vendor subgroups (the vendor map comes from the plan, handed over by het_plugin.megatron).
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


def main() -> int:
    arm_watchdog()
    p = argparse.ArgumentParser()
    p.add_argument("--cluster")
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--split", help="layers per stage for the baseline, e.g. 2,2")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pp", type=int, default=2)
    a = p.parse_args()
    from integration_tests.support.megatron_tiny import TinyGPT, shutdown, train
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
