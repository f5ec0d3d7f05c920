"""One rank of a DeepSpeed pipeline training run (pp x mp x dp) on CPU/gloo.

``--config FILE``: a wrapped config; the model is built with het_plugin.deepspeed.PipelineModule and
the engine with het_plugin.deepspeed.initialize. ``--baseline``: DeepSpeed's own PipelineModule with
PipeModelDataParallelTopology and deepspeed.initialize (no het_plugin at all).
Reports losses, the layer split, the topology's groups, the groups each rank is in, and the bytes this rank
sent on each emulated interface while training (eth0, fab0; 0 outside the emulator).
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
BLOCKS = 8
MICRO = 2
ACCUM = 2


def main() -> None:
    arm_watchdog()
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--mp", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--micro", type=int, default=MICRO, help="train_micro_batch_size_per_gpu of the config")
    p.add_argument("--slow-device", help="ranks the plan puts on this accelerator sleep --layer-delay-ms in each "
                                         "Block's forward (a slower device; for the measured-profile test)")
    p.add_argument("--layer-delay-ms", type=float, default=0.0)
    p.add_argument("--clip", type=float, help="gradient_clipping of the config (DeepSpeed's default: 1.0)")
    p.add_argument("--tied", action="store_true", help="the first and last layers are one TiedLayerSpec('io', "
                                                           "InProj) (as GPT pipelines tie embedding and output layer)")
    p.add_argument("--data-rank", choices=["grid", "topology"], default="grid",
                   help="where the script reads its data rank: DeepSpeed's grid, or the topology object it built")
    p.add_argument("--checkpoint-interval", type=int, default=0, help="activation_checkpoint_interval")
    p.add_argument("--no-seed-layers", action="store_true", help="seed_layers=False (layers from torch's own RNG)")
    p.add_argument("--parts", help="baseline only: force DeepSpeed's layer boundaries, e.g. 0,6,10 (what the plan "
                                   "splits), instead of partition_method='uniform'")
    args = p.parse_args()
    hidden, micro = args.hidden, args.micro

    import torch
    import torch.distributed as tdist
    init_gloo()
    import deepspeed
    from deepspeed.pipe import LayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from integration_tests.support.deepspeed_layers import Block, Head, InProj

    world = tdist.get_world_size()
    dp = world // (args.pp * args.mp)
    layers = [LayerSpec(InProj, hidden, hidden)] + [LayerSpec(Block, hidden) for _ in range(BLOCKS)] + \
        [LayerSpec(Head, hidden, hidden)]
    if args.tied:
        from deepspeed.pipe import TiedLayerSpec
        layers[0] = layers[-1] = TiedLayerSpec("io", InProj, hidden, hidden)
    topo = PipeModelDataParallelTopology(num_pp=args.pp, num_mp=args.mp, num_dp=dp)
    # partition_method as the baseline's: a homogeneous plan keeps the script's own (DeepSpeed 0.19.8's default,
    # 'parameters', gives numpy boundaries, which seed_layers=True hands to random.seed: a TypeError).
    common = dict(loss_fn=torch.nn.MSELoss(), seed_layers=not args.no_seed_layers, base_seed=1234,
                  partition_method="uniform", activation_checkpoint_interval=args.checkpoint_interval)
    if args.no_seed_layers:
        torch.manual_seed(1234)          # as scripts do: one seed on every rank, then each builds its own stage
    if args.baseline:
        config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": ACCUM,
                  "train_batch_size": micro * ACCUM * dp, "steps_per_print": 10 ** 6}
        if args.clip is not None:
            config["gradient_clipping"] = args.clip
        cls = deepspeed.pipe.PipelineModule if args.parts is None else forced_split([int(x) for x in args.parts.split(",")])
        model = cls(layers=layers, topology=topo, **common)
        init = deepspeed.initialize
    else:
        import het_plugin.deepspeed as hds
        config = json.loads(Path(args.config).read_text())
        if args.clip is not None:
            config["gradient_clipping"] = args.clip
        model = hds.PipelineModule(layers=layers, topology=topo, config=config, **common)
        init = hds.initialize
    plan = getattr(model, "het_plan", None)
    if args.slow_device and plan is not None:
        me = tdist.get_rank()
        node = next(n for n in plan.nodes if n.first_rank <= me < n.first_rank + n.num_ranks)
        Block.delay_s = args.layer_delay_ms / 1e3 if node.accelerator == args.slow_device else 0.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, _, _, _ = init(model=model, optimizer=optimizer, config=config)

    grid = model.mpu()
    data_id = grid.get_data_parallel_rank() if args.data_rank == "grid" else topo.get_coord(tdist.get_rank()).data
    tied_before = tied_weight(model)

    def batches():
        gen = torch.Generator().manual_seed(1000 + data_id)
        while True:
            x = torch.randn(micro, hidden, generator=gen)
            yield x, torch.sin(x.flip(-1))

    it = batches()
    before = tx_bytes()
    losses = [float(engine.train_batch(it)) for _ in range(args.steps)]
    after = tx_bytes()
    topology = model.topology()
    rank = tdist.get_rank()
    plan = getattr(model, "het_plan", None)
    report({
        "rank": rank,
        "losses": losses,
        "model_parallel_rank": grid.get_model_parallel_rank(),
        "grad_norm": engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None,
        "parts": list(model.parts),
        "stage": grid.get_stage_id(),
        "data_id": data_id,
        "mapping": sorted([list(c), r] for c, r in topology.mapping.items()),
        "comm_lists": {a: topology.get_axis_comm_lists(a) for a in ("pipe", "data", "model")},
        "dp_group": tdist.get_process_group_ranks(grid.get_data_parallel_group()),
        "pp_group": tdist.get_process_group_ranks(grid.get_pipe_parallel_group()),
        "slice_group": tdist.get_process_group_ranks(grid.get_slice_parallel_group()),
        "next_rank": grid.stage_to_global(grid.get_stage_id() + 1) if not grid.is_last_stage else None,
        "plan_hash": plan.hash if plan else None,
        "records": [[g.ranks, g.transport, g.gloo_ifname] for g in (model.het_applied.records if getattr(model, "het_applied", None) else [])],
        "gloo_ifname_after": os.environ.get("GLOO_SOCKET_IFNAME"),
        "tx": {k: after[k] - before[k] for k in after},
        "tied": [tied_before, tied_weight(model)],
        "groups_data_rank": deepspeed.utils.groups._get_data_parallel_rank(),     # what deepspeed.utils.groups says
    })


def tied_weight(model):
    """The tied layer's weight on this rank (None where the stage holds no copy)."""
    tied = getattr(model, "tied_modules", {})
    return tied["io"].weight.detach().flatten().tolist() if "io" in tied else None


def forced_split(parts):
    """DeepSpeed's own PipelineModule with given layer boundaries (a baseline with the plan's split)."""
    import deepspeed

    class ForcedSplit(deepspeed.pipe.PipelineModule):
        def _partition_layers(self, method="uniform"):
            self.parts = list(parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])
    return ForcedSplit


def tx_bytes() -> dict:
    out = {}
    for ifname in ("eth0", "fab0"):
        p = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes")
        out[ifname] = int(p.read_text()) if p.exists() else 0
    return out


if __name__ == "__main__":
    main()
    import torch.distributed as _dist
    if _dist.is_initialized():      # no gloo threads left at interpreter exit (they can abort the process)
        _dist.barrier()             # ... nor a peer still sending to a rank that is tearing down
        _dist.destroy_process_group()
