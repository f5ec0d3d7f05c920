"""Rank script: the tiny GPT with expert parallelism (a MoE) or an interleaved pipeline, through het_plugin
or plain Megatron-Core; reports losses, layers and every process group parallel_state holds.

    python megatron_train_ep_vpp.py --ep 2 --experts 4 --cluster FILE          # MoE through het_plugin.megatron
    python megatron_train_ep_vpp.py --pp 2 --vpp 2 --layers 4 --baseline       # Megatron-Core's own groups
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from integration_tests.support.launch import arm_watchdog, report  # noqa: E402


def main() -> int:
    arm_watchdog()
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--vpp", type=int)
    p.add_argument("--experts", type=int, help="num_moe_experts (default: dense MLP)")
    p.add_argument("--dispatcher", default="allgather", help="moe_token_dispatcher_type")
    p.add_argument("--cluster")
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--layers-per-stage", help="the baseline's split, e.g. 3,1")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()

    from integration_tests.support.megatron_tiny import TinyGPT, shutdown, train
    cfg = TinyGPT(num_layers=a.layers, num_moe_experts=a.experts, moe_token_dispatcher_type=a.dispatcher)
    split = [int(n) for n in a.layers_per_stage.split(",")] if a.layers_per_stage else None
    result = train(cfg, tp=a.tp, pp=a.pp, ep=a.ep, vpp=a.vpp, steps=a.steps, cluster=a.cluster,
                   use_plugin=not a.baseline, layers_per_stage=split).to_dict()
    if not a.baseline:
        from het_plugin.megatron import current_plan
        result["plan"] = current_plan().plan.to_dict()      # the plan this rank applied
    report(result)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
