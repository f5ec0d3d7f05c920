"""A toy GPT trained with DeepSpeed's pipeline engine through het_plugin (CPU or GPU).

A plain DeepSpeed script: no het_plugin name in it. The config is one wrapped by ``het-plugin wrap-config``;
het_plugin's import hook (het_plugin_deepspeed.pth, installed with the package) finds it on the command line
(``--deepspeed_config``) when the PipelineModule is built and applies the plan there and in
``deepspeed.initialize``. Without a "heterogeneous" section it is plain DeepSpeed. The explicit equivalent is
``het_plugin.deepspeed.PipelineModule(..., config=...)`` and ``het_plugin.deepspeed.initialize``.

CPU:  ./run_cpu.sh              (torchrun, 4 ranks, gloo)
GPU:  ./launch_gpu.sh           (deepspeed --hostfile ... train.py --deepspeed_config wrapped.json)
"""
from __future__ import annotations

import argparse
import os


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", required=True, help="a config wrapped by het-plugin wrap-config")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (must match the wrapped config)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--cpu", action="store_true", help="DeepSpeed's CPU accelerator with gloo")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        skip_cpu_shm_build()
    import torch
    import deepspeed
    from deepspeed.pipe import LayerSpec

    deepspeed.init_distributed(dist_backend="gloo" if args.cpu else None)

    class Embed(torch.nn.Embedding):
        pass

    class Block(torch.nn.Module):
        """Pre-norm MLP block with a residual: the layer het_plugin's plan counts (--layer-pattern Block)."""

        def __init__(self, hidden: int):
            super().__init__()
            self.norm = torch.nn.LayerNorm(hidden)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                           torch.nn.Linear(4 * hidden, hidden))

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    class Head(torch.nn.Linear):
        pass

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))

    layers = [LayerSpec(Embed, args.vocab, args.hidden)] + \
        [LayerSpec(Block, args.hidden) for _ in range(args.layers)] + [LayerSpec(Head, args.hidden, args.vocab)]
    # partition_method="uniform": DeepSpeed 0.19.8's default 'parameters' gives numpy layer boundaries, which
    # seed_layers=True passes to random.seed (a TypeError on Python 3.11) -- plain DeepSpeed, or a homogeneous plan.
    model = deepspeed.pipe.PipelineModule(layers=layers, num_stages=args.pp, loss_fn=loss_fn, seed_layers=True,
                                          partition_method="uniform")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer)

    device = engine.device
    generator = torch.Generator().manual_seed(1234 + model.mpu().get_data_parallel_rank())

    def batches():
        while True:
            tokens = torch.randint(0, args.vocab, (engine.train_micro_batch_size_per_gpu(), args.seq + 1),
                                   generator=generator)
            yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    data = batches()
    for step in range(args.steps):
        loss = engine.train_batch(data)
        if engine.global_rank == 0:
            print(f"step {step} loss {float(loss):.6f}", flush=True)
    # Leave no communicator threads running at interpreter exit (gloo can abort the process there otherwise),
    # and destroy only after every rank is done: a peer may still be sending to a rank that tears down.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def skip_cpu_shm_build() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory all-reduce op at start-up (~30 s, only used for
    inference); mark it unavailable so the CPU example starts quickly."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


if __name__ == "__main__":
    main()
