"""One rank of a DeepSpeed pipeline run that saves or resumes a checkpoint (issue 21: checkpoints across plans).

The model of ``deepspeed_pipe.py`` (InProj, 8 Blocks, Head; MSE loss) under a wrapped config, trained with torch's
SGD. ``--save-dir D --save-at K``: save after iteration K (training goes on); ``--load-dir D``: resume from D first
(``--no-load-optim``: ``load_optimizer_states=False``), then train ``--steps`` iterations on the batches that follow
the checkpoint's. ``--zero 1``: ZeRO stage 1 (the optimizer state partitioned over the data-parallel ranks);
``--adam``: torch's Adam instead of SGD (what ``ds_to_universal`` converts: it reads ``exp_avg`` and ``exp_avg_sq``);
``--universal``: load with ``"checkpoint": {"load_universal": true}`` (a ``ds_to_universal`` conversion).
Reports the losses, or the refusal (its field, problem and fix) when het_plugin refuses the load.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from integration_tests.support.deepspeed_cpu import init_gloo  # noqa: E402
from integration_tests.support.launch import arm_watchdog, report  # noqa: E402

HIDDEN, BLOCKS, MICRO, ACCUM = 16, 8, 2, 2


def main() -> None:
    arm_watchdog()
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--save-dir")
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--load-dir")
    p.add_argument("--no-load-optim", action="store_true")
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--universal", action="store_true")
    p.add_argument("--adam", action="store_true")
    args = p.parse_args()

    import torch
    import torch.distributed as tdist
    init_gloo()
    from deepspeed.pipe import LayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    import het_plugin.deepspeed as hds
    from het_plugin.errors import ConfigError
    from integration_tests.support.deepspeed_layers import Block, Head, InProj

    world = tdist.get_world_size()
    dp = world // args.pp
    layers = [LayerSpec(InProj, HIDDEN, HIDDEN)] + [LayerSpec(Block, HIDDEN) for _ in range(BLOCKS)] + \
        [LayerSpec(Head, HIDDEN, HIDDEN)]
    topo = PipeModelDataParallelTopology(num_pp=args.pp, num_mp=1, num_dp=dp)
    config = json.loads(Path(args.config).read_text())
    if args.zero:
        config.update(zero_optimization={"stage": args.zero}, zero_allow_untested_optimizer=True)
    if args.universal:
        config["checkpoint"] = {"load_universal": True}
    model = hds.PipelineModule(layers=layers, topology=topo, config=config, loss_fn=torch.nn.MSELoss(),
                               seed_layers=True, base_seed=1234)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01) if args.adam else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=args.momentum)
    engine, _, _, _ = hds.initialize(model=model, optimizer=optimizer, config=config)
    data_id = model.mpu().get_data_parallel_rank()
    done = 0
    out = {"rank": tdist.get_rank(), "plan_hash": model.het_plan.hash, "parts": list(model.parts)}
    if args.load_dir:
        try:
            engine.load_checkpoint(args.load_dir, load_optimizer_states=not args.no_load_optim)
        except ConfigError as exc:
            report({**out, "refused": {"field": exc.field, "problem": exc.problem, "fix": exc.fix}})
            return
        done = engine.global_steps

    def batches():
        gen = torch.Generator().manual_seed(1000 + data_id)
        while True:
            x = torch.randn(MICRO, HIDDEN, generator=gen)
            yield x, torch.sin(x.flip(-1))

    it = batches()
    for _ in range(done * ACCUM):            # the batches the checkpoint's iterations consumed
        next(it)
    losses = []
    for step in range(1, args.steps + 1):
        losses.append(float(engine.train_batch(it)))
        if args.save_dir and step == args.save_at:
            engine.save_checkpoint(args.save_dir)
    report({**out, "losses": losses, "resumed_at": done})


if __name__ == "__main__":
    main()
    import torch.distributed as _dist
    if _dist.is_initialized():
        _dist.barrier()
        _dist.destroy_process_group()
