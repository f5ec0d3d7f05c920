"""Rank script: train the tiny GPT through het_plugin (or plain Megatron-Core) and report losses and groups.

    python megatron_train.py --tp 2 --pp 2 --cluster FILE         # through het_plugin.megatron
    python megatron_train.py --tp 2 --pp 1 --baseline             # Megatron-Core's own groups
Cluster file may also come from env HET_TEST_CLUSTER (lets ranks be given different files).
"""
import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from integration_tests.support.launch import arm_watchdog, report  # noqa: E402


def main() -> int:
    arm_watchdog()
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--cluster", default=os.environ.get("HET_TEST_CLUSTER"))
    p.add_argument("--plan")
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--even-data", action="store_true",
                   help="read the even split's samples whatever the plan (a script that ignores replica_share)")
    p.add_argument("--groups-only", action="store_true", help="initialise the groups, report them, stop")
    p.add_argument("--profile-out", help="het_plugin's measured profile (initialize_model_parallel(profile_out=))")
    p.add_argument("--slow-device", help="ranks on this accelerator sleep --layer-delay-ms in each layer's forward")
    p.add_argument("--layer-delay-ms", type=float, default=0.0)
    p.add_argument("--replan-on-restart", action="store_true",
                   help="initialize_model_parallel(replan_on_restart=True): re-plan from --profile-out's last run")
    a = p.parse_args()

    from integration_tests.support.megatron_tiny import (TinyGPT, init_distributed, my_groups, process_group_ranks,
                                                         shutdown, train)
    cfg = TinyGPT(num_layers=a.layers, global_batch_size=a.global_batch_size)
    if a.groups_only:
        # het_plugin's groups, then (after tearing them down) Megatron-Core's own for the same degrees.
        init_distributed()
        from het_plugin.megatron import current_plan, initialize_model_parallel
        plan = initialize_model_parallel(a.tp, a.pp, cluster=a.cluster, plan=a.plan, model=cfg.model_spec(),
                                         micro_batch_size=cfg.micro_batch_size)
        from megatron.core import parallel_state as ps
        applied = current_plan()
        planned, planned_pgs = my_groups(), process_group_ranks()
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(plan.tp, plan.pp)
        report({"rank": applied.rank, "plan": plan.to_dict(), "groups": planned, "megatron_groups": my_groups(),
                "process_groups": planned_pgs, "megatron_process_groups": process_group_ranks(),
                "created": [dataclasses.asdict(r) for r in applied.records]})
    else:
        result = train(cfg, tp=a.tp or 1, pp=a.pp or 1, steps=a.steps, cluster=a.cluster, plan=a.plan,
                       use_plugin=not a.baseline, replica_data=not a.even_data, profile_out=a.profile_out,
                       slow_device=a.slow_device, layer_delay_s=a.layer_delay_ms / 1e3,
                       replan_on_restart=a.replan_on_restart)
        report(result.to_dict())
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
