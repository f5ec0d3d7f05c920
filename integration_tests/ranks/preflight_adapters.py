"""Rank script for integration_tests/test_preflight_adapters.py: start an adapter on gloo with the world
backend het_plugin's pre-flight sees faked (test-only, the narrowest point: het_plugin.runtime.preflight's
``world_backend`` and ``world_net_name``, what torch would say under NCCL).

    HET_TEST_FAKE_BACKEND=nccl HET_TEST_WORLD_NET=Socket python preflight_adapters.py --framework megatron ...

Reports ``{"rank", "error" (the ConfigError's text or None), "new_groups" (torch.distributed.new_group calls
made before it returned or raised), "groups" (groups het_plugin recorded)}``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from integration_tests.support.launch import arm_watchdog, report  # noqa: E402

RANK = int(os.environ["RANK"])


def fake_backend() -> None:
    backend = os.environ.get("HET_TEST_FAKE_BACKEND")
    if not backend:
        return
    from het_plugin.runtime import preflight
    preflight.world_backend = lambda: backend
    preflight.world_net_name = lambda: os.environ.get("HET_TEST_WORLD_NET") or None


def count_new_groups() -> list:
    import torch.distributed as dist
    calls = []
    original = dist.new_group

    def new_group(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.new_group = new_group
    return calls


def run_megatron(a) -> int:
    from integration_tests.support.megatron_tiny import TinyGPT
    from het_plugin.megatron import current_plan, initialize_model_parallel
    cfg = TinyGPT(num_layers=4)
    initialize_model_parallel(1, 2, cluster=a.cluster, model=cfg.model_spec(), micro_batch_size=cfg.micro_batch_size)
    return len(current_plan().records)


def run_deepspeed(a) -> int:
    from integration_tests.support.deepspeed_layers import block_pipeline
    config = json.loads(Path(a.config).read_text())
    model = block_pipeline(config, num_stages=2)
    return len(model.het_applied.records)


def main() -> int:
    arm_watchdog()
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=["megatron", "deepspeed"], required=True)
    p.add_argument("--cluster")
    p.add_argument("--config", help="a wrapped DeepSpeed config")
    a = p.parse_args()
    import torch.distributed as dist
    if a.framework == "deepspeed":
        from integration_tests.support.deepspeed_cpu import init_gloo
        init_gloo()
    else:
        dist.init_process_group("gloo", rank=RANK, world_size=int(os.environ["WORLD_SIZE"]))
    fake_backend()
    calls = count_new_groups()
    from het_plugin.core.errors import ConfigError
    error, groups = None, None
    try:
        groups = run_megatron(a) if a.framework == "megatron" else run_deepspeed(a)
    except ConfigError as exc:
        error = str(exc)
    report({"rank": RANK, "error": error, "new_groups": len(calls), "groups": groups})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
