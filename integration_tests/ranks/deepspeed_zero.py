"""One rank of plain data-parallel ZeRO training on CPU/gloo (no pipeline).

``--config FILE``: a wrapped config through het_plugin.deepspeed.initialize; ``--baseline``: the same
config without the section through deepspeed.initialize. Reports losses (averaged over ranks) and the
data-parallel group's members in group-rank order.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from integration_tests.support.deepspeed_cpu import init_gloo  # noqa: E402
from integration_tests.support.launch import arm_watchdog, report  # noqa: E402

HIDDEN = 16
MICRO = 2


def main() -> None:
    arm_watchdog()
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=os.environ.get("DS_TEST_CONFIG"), help="default: $DS_TEST_CONFIG")
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    import torch
    import torch.distributed as tdist
    init_gloo()
    import deepspeed

    config = json.loads(Path(args.config).read_text())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if args.baseline:
        import het_plugin.deepspeed as hds
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=hds.strip_section(config))
    else:
        import het_plugin.deepspeed as hds
        engine, _, _, _ = hds.initialize(model=model, optimizer=optimizer, config=config)

    rank = tdist.get_rank()
    gen = torch.Generator().manual_seed(1000 + rank)      # data by launch rank: the same in both runs
    losses = []
    for _ in range(args.steps):
        x = torch.randn(MICRO, HIDDEN, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x), torch.sin(x.flip(-1)))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        tdist.all_reduce(mean)
        losses.append(float(mean) / tdist.get_world_size())
    plan = getattr(engine, "het_plan", None)
    report({"rank": rank, "losses": losses,
            "dp_group": tdist.get_process_group_ranks(engine.optimizer.dp_process_group),
            "dp_rank": tdist.get_rank(engine.optimizer.dp_process_group),
            "plan_order": plan.groups["dp"][0].ranks if plan else None,
            "accelerators": [plan.node_of(r).accelerator for r in range(plan.world_size)] if plan else None,
            "zero_stage": engine.zero_optimization_stage()})


if __name__ == "__main__":
    main()
    import torch.distributed as _dist
    if _dist.is_initialized():      # no gloo threads left at interpreter exit (they can abort the process)
        _dist.barrier()             # ... nor a peer still sending to a rank that is tearing down
        _dist.destroy_process_group()
