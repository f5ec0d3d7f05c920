"""One rank of DeepSpeed training with a plan's replica split (even or uneven), on CPU/gloo.

``--config FILE``: a wrapped config (the plan embedded). ``--mode pipe``: hds.PipelineModule + train_batch
(pp from the plan); ``--mode dp``: a plain module, engine(x) / backward / step per micro-batch (ZeRO stage
from the config). Data: ``training_data=`` (DeepSpeed's deepspeed_io path), a dataset whose samples can be
recognised, so each rank reports which samples its first layer read in each step. ``--dry N``: instead,
replica 0 gets a data iterator of N micro-batches (pipe mode). Plain SGD, so the parameters after the
steps and the reported losses can be compared between splits.
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

HIDDEN = 8
BLOCKS = 4


def main() -> None:
    arm_watchdog()
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=os.environ.get("DS_TEST_CONFIG"), help="default: $DS_TEST_CONFIG")
    p.add_argument("--mode", choices=["pipe", "dp"], required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--dry", type=int, default=None)
    p.add_argument("--bf16", action="store_true", help="bf16 training (DeepSpeed's bf16 section; bf16 samples)")
    p.add_argument("--loader", choices=["training_data", "strided", "replica", "deepspeed_io"],
                   default="training_data",
                   help="pipe mode: training_data= to initialize; or the script's own RepeatingLoader handed to "
                        "train_batch over a strided even split (sample i on data rank i %% dp), over "
                        "hds.replica_sampler, or over engine.deepspeed_io(dataset) (DeepSpeed's default sampler)")
    args = p.parse_args()

    import torch
    import torch.distributed as tdist
    init_gloo()
    import het_plugin.deepspeed as hds
    from deepspeed.pipe import LayerSpec

    seen: list[torch.Tensor] = []       # the inputs this rank's first layer read, in order

    from integration_tests.support.deepspeed_layers import Block
    from integration_tests.support.deepspeed_layers import InProj as PlainInProj

    class InProj(PlainInProj):
        def forward(self, x):
            seen.append(x.detach().clone())
            return super().forward(x)

    class Samples(torch.utils.data.Dataset):
        def __init__(self, n):
            gen = torch.Generator().manual_seed(7)
            self.x = torch.randn(n, HIDDEN, generator=gen)
            self.y = torch.sin(self.x.flip(-1))
            if args.bf16:
                self.x, self.y = self.x.bfloat16(), self.y.bfloat16()

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i], self.y[i]

    data = Samples(args.samples)
    index_of = {tuple(row.tolist()): i for i, row in enumerate(data.x)}
    config = json.loads(Path(args.config).read_text())
    if args.bf16:
        config["bf16"] = {"enabled": True}
    rank = tdist.get_rank()
    if args.mode == "pipe":
        pp = config["heterogeneous"]["pp"]
        layers = [LayerSpec(InProj, HIDDEN, HIDDEN)] + [LayerSpec(Block, HIDDEN) for _ in range(BLOCKS)]
        model = hds.PipelineModule(layers=layers, num_stages=pp, loss_fn=torch.nn.MSELoss(), config=config,
                                   seed_layers=True, base_seed=1234, layer_pattern="Block")
    else:
        torch.manual_seed(0)
        model = torch.nn.Sequential(InProj(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    training_data = data if args.dry is None and args.loader == "training_data" else None
    engine, _, loader, _ = hds.initialize(model=model, optimizer=optimizer, config=config,
                                          training_data=training_data)
    plan = engine.het_plan
    replica = plan.replica_of(rank)
    count = plan.replica_counts[replica]

    losses, consumed = [], []
    if args.mode == "pipe":
        it = None
        if args.loader != "training_data":
            from deepspeed.utils import RepeatingLoader
            dp_rank, dp = engine.grid.get_data_parallel_rank(), plan.dp
            if args.loader == "deepspeed_io":
                loader = engine.deepspeed_io(data)
            else:
                sampler = list(range(dp_rank, len(data), dp)) if args.loader == "strided" else \
                    hds.replica_sampler(engine, len(data))
                loader = torch.utils.data.DataLoader(data, batch_size=plan.micro_batch_size, sampler=sampler)
            it = iter(RepeatingLoader(loader))
        if args.dry is not None:
            # Replica 0 gets a finite iterator of --dry micro-batches (its share is count per step).
            micro = plan.micro_batch_size
            n = args.dry if replica == 0 else count * args.steps
            it = iter([(data.x[i * micro:(i + 1) * micro], data.y[i * micro:(i + 1) * micro]) for i in range(n)])
        for _ in range(args.steps):
            losses.append(float(engine.train_batch(it)))
            consumed.append(_indices(seen, index_of))
            seen.clear()
    else:
        batches = iter(loader)
        for _ in range(args.steps):
            total = torch.zeros(())
            for _ in range(count):
                x, y = next(batches)
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                total += loss.detach()
            tdist.all_reduce(total)            # the user's own global mean: sum of micro-batch means / all of them
            losses.append(float(total) / sum(plan.replica_counts))
            consumed.append(_indices(seen, index_of))
            seen.clear()
    params = {name: p.detach().float().flatten().tolist() for name, p in engine.module.named_parameters()}
    report({"rank": rank, "replica": replica, "count": count, "gas": engine.gradient_accumulation_steps(),
            "train_batch_size": engine.train_batch_size(), "losses": losses, "consumed": consumed,
            "params": params, "global_samples": engine.global_samples,
            "first_stage": args.mode == "dp" or engine.is_first_stage()})


def _indices(seen, index_of) -> list[int]:
    return [index_of[tuple(row.tolist())] for batch in seen for row in batch]


if __name__ == "__main__":
    main()
    import torch.distributed as _dist
    if _dist.is_initialized():      # no gloo threads left at interpreter exit (they can abort the process)
        _dist.barrier()             # ... nor a peer still sending to a rank that is tearing down
        _dist.destroy_process_group()
