"""DeepSpeed variant of the end-to-end benchmark's training run (called by e2e_worker.run_config).

The same tiny GPT shape (e2e_setup.TinyShape) as a DeepSpeed PipelineModule, PP=2 x DP=2, gloo on CPU
(DS_ACCELERATOR=cpu, the shared-memory op build skipped as integration_tests/support/deepspeed_cpu.py does,
a torch SGD optimizer from the client like the Megatron runs). Two configurations:

* ``3-ds``: DeepSpeed as users run it today: PipeModelDataParallelTopology (launch order), uniform
  partition, every group on Ethernet.
* ``4-ds``: het_plugin: the config wrapped with the benchmark's plan (``hds.wrap``), the plan's placement
  and layer split (``hds.PipelineModule``), per-group transports (``hds.initialize``).

DeepSpeed's pipeline send/recv use the world group (Ethernet here) in both; gradient reduction is not
overlapped with backward in either (DeepSpeed's pipeline engine reduces after the last micro-batch).
The embedding and the output layer are not tied (a TiedLayerSpec would add a cross-stage group that
the Megatron runs do not have either way; 33k parameters).

bench_hetdp.py runs the same ``train`` for its configurations (``pp`` 1 or 2, with or without a plan; an uneven
plan's per-rank accumulation steps and loss weights come from het_plugin.deepspeed) with ``replica_data``: each
replica reads its share of one global batch per step (:func:`replica_range`), so the losses compare across
configurations; ``train`` also serves its single-rank compute profile (hetdp_profile.py).
"""
from __future__ import annotations

import os
import time

_READY = False


def _init() -> None:
    """deepspeed.init_distributed on the existing gloo world group, once per process."""
    global _READY
    if _READY:
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_SIZE", "1")
    from integration_tests.support.deepspeed_cpu import init_gloo
    init_gloo()
    _READY = True


def _layers(shape: dict):
    import torch
    from torch import nn
    from deepspeed.pipe import LayerSpec

    h, s = shape["hidden_size"], shape["seq_length"]

    class Embedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(shape["vocab_size"], h)
            self.pos = nn.Embedding(s, h)

        def forward(self, tokens):
            return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))

    class Block(nn.Module):
        """Pre-norm GPT layer: causal self-attention and a GELU MLP."""

        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(h, shape["num_attention_heads"], shape["ffn_hidden_size"],
                                                    dropout=0.0, activation="gelu", batch_first=True,
                                                    norm_first=True)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(s), persistent=False)

        def forward(self, x):
            return self.layer(x, src_mask=self.mask, is_causal=True)

    class Output(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(h)
            self.proj = nn.Linear(h, shape["vocab_size"], bias=False)

        def forward(self, x):
            return self.proj(self.norm(x))

    def loss_fn(logits, labels):
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    specs = [LayerSpec(Embedding)] + [LayerSpec(Block) for _ in range(shape["num_layers"])] + [LayerSpec(Output)]
    return specs, loss_fn


def _batches(shape: dict, micro_batch: int, data_id: int):
    import torch
    gen = torch.Generator().manual_seed(shape["seed"] + data_id)
    while True:
        seq = torch.randint(0, shape["vocab_size"], (micro_batch, shape["seq_length"] + 1), generator=gen)
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _replica_batches(shape: dict, step: int, start: int, stop: int, micro_batch: int):
    """Samples [start, stop) of the step's global batch, in micro-batches: the global batches of the Megatron runs
    (integration_tests/support/megatron_tiny.py ``_batches``: two fixed ones, alternating), so that every
    configuration, whatever its replicas' shares, trains on the same samples."""
    import torch
    gen = torch.Generator().manual_seed(shape["seed"] * 1000 + step % 2)
    data = torch.randint(0, shape["vocab_size"], (shape["global_batch_size"], shape["seq_length"] + 1), generator=gen)
    for seq in data[start:stop].split(micro_batch):
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def replica_range(plan, replica: int, global_batch: int, dp: int) -> tuple[int, int]:
    """[start, stop) of a replica's samples in each global batch: the plan's uneven share, else the even one."""
    if plan is not None and plan.uneven_replicas:
        return plan.replica_samples(replica)
    per = global_batch // dp
    return replica * per, (replica + 1) * per


def train(shape: dict, cfg: dict, steps: int) -> tuple[list[float], list[float], dict]:
    """Train ``steps`` steps of ``3-ds`` (cfg["plan"] None) or ``4-ds``: this rank's step times, the losses,
    and where this rank ended up (layer split, stage, data-parallel group, het_plugin's group records)."""
    _init()
    import torch
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    world = dist.get_world_size()
    pp = cfg["pp"]
    dp = world // pp
    specs, loss_fn = _layers(shape)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=1, num_dp=dp)
    common = dict(layers=specs, topology=topo, loss_fn=loss_fn, seed_layers=True, base_seed=shape["seed"],
                  activation_checkpoint_interval=0)
    base = {"steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if cfg["plan"]:
        import het_plugin.deepspeed as hds
        config = hds.wrap(base, cluster=cfg["plan"], pp=pp, layer_pattern="Block")
        model = hds.PipelineModule(config=config, layer_pattern="Block", **common)
        init = hds.initialize
    else:
        mb = cfg["micro_batch_size"]
        config = dict(base, train_micro_batch_size_per_gpu=mb, train_batch_size=shape["global_batch_size"],
                      gradient_accumulation_steps=shape["global_batch_size"] // (mb * dp))
        model = deepspeed.pipe.PipelineModule(partition_method="uniform", **common)
        init = deepspeed.initialize
    optimizer = torch.optim.SGD(model.parameters(), lr=shape["lr"])
    engine, _, _, _ = init(model=model, optimizer=optimizer, config=config)
    micro, replica = engine.train_micro_batch_size_per_gpu(), model.mpu().get_data_parallel_rank()
    data = _batches(shape, micro, replica)
    span = replica_range(getattr(model, "het_plan", None), replica, shape["global_batch_size"], dp)
    times, losses = [], []
    for step in range(steps):
        if cfg.get("replica_data"):          # the step's global batch, this replica's share of it
            data = _replica_batches(shape, step, *span, micro)
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine.train_batch(data)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    grid = model.mpu()
    layout = {"parts": list(model.parts), "stage": grid.get_stage_id(), "replica": replica, "samples": list(span),
              "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
              "dp_group": dist.get_process_group_ranks(grid.get_data_parallel_group()),
              "groups": [[g.ranks, g.transport, g.gloo_ifname] for g in (model.het_applied.records if getattr(model, "het_applied", None) else [])]}
    del engine
    return times, losses, layout
