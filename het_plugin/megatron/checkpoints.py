"""Before Megatron-LM loads a checkpoint (``--load``): does what it holds load under the plan about to run?

Megatron itself compares only (TP, PP) on resume, never the layer split, and its loaders fail deep inside
(``CheckpointingException: Global shape mismatch``) or, for per-rank formats, load the wrong layers without a
word. Every format keeps Megatron's own ``args`` with the checkpoint (``state_dict['args']``, in the common
state of ``torch_dist``, in each rank's file of ``torch``), and with them what decides it:

* the layer split (``pipeline_model_parallel_layout`` / ``decoder_first/last_pipeline_num_layers`` / the
  even split), the degrees and the world size;
* ``use_distributed_optimizer`` and, for ``torch_dist``, the optimizer's sharding type, which megatron.training
  records in the checkpoint's content metadata (``distrib_optim_sharding_type``: ``dp_reshardable`` by
  default, ``fully_reshardable`` with ``--dist-ckpt-optim-fully-reshardable``);
* the plan hash: het_plugin puts ``heterogeneous_plan_hash`` into ``args`` (args.py), so every checkpoint a
  planned run writes records the plan it was saved under, in Megatron's own file, with no file of ours.

:func:`check_resume` (pure) decides on two :class:`TrainingShape` values; :func:`read_checkpoint` reads the
saved one with Megatron's own readers. The rules (docs/checkpoints.md tables them, each with its test):

* ``torch_dist`` model weights are keyed by global layer: they load under any split, placement or world size.
* Distributed-optimizer state (``torch_dist``): ``fully_reshardable`` loads under any split; ``dp_reshardable``
  only under the same model-parallel split (TP, PP, EP and the layers of every stage; DP may change).
* The optimizer type must be the one saved (Megatron keys plain and distributed state differently).
* ``torch`` (legacy), ``torch_dcp`` and ``fsdp_dtensor`` key layers per stage: only the same split loads.

Every rank reads the same files and decides alike, so every rank stops with the same ConfigError before
anything loads (nothing waits on a rank that stopped).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from ..core.errors import ConfigError
from ..core.checkpoint_fit import MEGATRON, CheckpointShape

FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space")   # DistributedOptimizer's own list (0.19)
SPLIT_FREE_FORMATS = ("torch_dist",)             # weights keyed by global layer index
RESHARD_FLAG = "--dist-ckpt-optim-fully-reshardable"


@dataclass(frozen=True)
class TrainingShape:
    """What a checkpoint was saved with, or what the run about to load it runs with."""
    ckpt_format: str                 # torch_dist, torch, torch_dcp, fsdp_dtensor
    tp: int
    pp: int
    ep: int
    dp: int
    world_size: int
    layers: tuple[int, ...]          # transformer layers of each pipeline segment (pp * vpp, Megatron's order)
    distributed_optimizer: bool
    optim_sharding: Optional[str] = None     # distrib_optim_sharding_type (torch_dist with the distributed optimizer)
    plan_hash: Optional[str] = None
    iteration: Optional[int] = None

    @property
    def model_parallel(self) -> tuple:
        return (self.tp, self.pp, self.ep, self.layers)

    def describe(self) -> str:
        plan = f"plan {self.plan_hash}" if self.plan_hash else "no het_plugin plan"
        return (f"{plan}, layers per stage {list(self.layers)}, tp={self.tp} pp={self.pp} dp={self.dp}"
                + (f" ep={self.ep}" if self.ep > 1 else "") + f", world size {self.world_size}")


def check_resume(saved: TrainingShape, run: TrainingShape, *, load_optim: bool, where: str) -> list[str]:
    """Refuse (ConfigError naming the format and the fix) what cannot load; return notes on what changes."""
    moved = saved.model_parallel != run.model_parallel
    what = f"the checkpoint in {where}" + (f" (iteration {saved.iteration})" if saved.iteration is not None else "")
    back = f"resume under the split it was saved with ({saved.describe()})"
    if moved and saved.ckpt_format not in SPLIT_FREE_FORMATS:
        raise ConfigError(
            f"{what} is in Megatron's '{saved.ckpt_format}' format, which keys transformer layers by their index "
            f"within a stage: under this run's split ({run.describe()}) the stages would load other layers than "
            f"they hold (a '{saved.ckpt_format}' checkpoint loads only under its own split: {saved.describe()})",
            source=where, field="--ckpt-format",
            fix=f"{back} with --ckpt-format torch_dist and save once (or convert it: --ckpt-convert-format torch_dist "
                f"--ckpt-convert-save DIR), then resume from that under the new plan")
    if load_optim and saved.distributed_optimizer != run.distributed_optimizer:
        kinds = {True: "the distributed optimizer", False: "a plain optimizer"}
        flag = "add --use-distributed-optimizer" if saved.distributed_optimizer else "drop --use-distributed-optimizer"
        raise ConfigError(
            f"{what} holds the optimizer state of {kinds[saved.distributed_optimizer]}, but this run builds "
            f"{kinds[run.distributed_optimizer]} (Megatron keys the two differently: the load would fail inside "
            "its loader)", source=where, field="--use-distributed-optimizer",
            fix=f"{flag} to resume with the optimizer the checkpoint was saved with, or --no-load-optim "
                "(fresh optimizer state)")
    if load_optim and moved and saved.distributed_optimizer and saved.optim_sharding not in FULLY_RESHARDABLE:
        raise ConfigError(
            f"{what} holds distributed-optimizer state in the '{saved.optim_sharding}' format, which reshards "
            f"only over data-parallel ranks: it was saved with {saved.describe()}, this run has "
            f"{run.describe()}", source=where, field=RESHARD_FLAG,
            fix=f"{back} with {RESHARD_FLAG} and save once, then resume under the new plan (keep the flag: its "
                "checkpoints follow any later plan change); or --no-load-optim (fresh optimizer state)")
    if saved.plan_hash == run.plan_hash and not moved:
        return []
    how = "the same split" if not moved else "weights reshard by global layer" + (
        f", optimizer state is {saved.optim_sharding}" if load_optim and saved.distributed_optimizer else "")
    return [f"het_plugin: resuming {what}, saved under {saved.describe()}; this run: {run.describe()} ({how})"]


# ---- reading what a checkpoint holds (Megatron's own readers) -------------------------------------------------

def layers_of_args(args: Any) -> tuple[int, ...]:
    """Transformer layers of each pipeline segment, from Megatron's args (saved or current)."""
    num_layers, pp = int(args.num_layers), int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if layout is not None:
        return tuple(layout_counts(layout))
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    if first is None and last is None:
        # Megatron's even split counts the embedding and the loss as a layer each where asked, then builds one
        # layer less in the first (last) virtual stage of the first (last) pipeline stage (megatron-core
        # 0.16.1-0.19.2 transformer_block.py get_num_layers_to_build)
        embedding = bool(getattr(args, "account_for_embedding_in_pipeline_split", False))
        loss = bool(getattr(args, "account_for_loss_in_pipeline_split", False))
        segments = [(num_layers + embedding + loss) // pp // vpp] * (pp * vpp)
        segments[0] -= embedding
        segments[-1] -= loss
        return tuple(segments)
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    each = rest // middle_stages if middle_stages else 0
    stages = [each] * pp
    if first is not None:
        stages[0] = first
    if last is not None:
        stages[-1] = last
    if vpp == 1:
        return tuple(stages)
    # segments in the layout's order (virtual stage major), each stage's layers over its virtual stages
    return tuple(stages[r] // vpp for _ in range(vpp) for r in range(pp))


def layout_counts(layout: Any) -> list[int]:
    """Decoder layers per segment of a ``pipeline_model_parallel_layout`` (a string, or Megatron's object)."""
    rows = getattr(layout, "layout", None)
    if rows is None:
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
        rows = PipelineParallelLayerLayout.parse_str_to_list(str(layout))
    return [sum(1 for kind in row if getattr(kind, "name", str(kind)) == "decoder") for row in rows]


def shape_of_args(args: Any, *, ckpt_format: Optional[str] = None, optim_sharding: Optional[str] = None,
                  iteration: Optional[int] = None) -> TrainingShape:
    world = int(getattr(args, "world_size", 0) or 0)
    tp, pp = int(args.tensor_model_parallel_size), int(args.pipeline_model_parallel_size)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    dp = int(getattr(args, "data_parallel_size", 0) or (world // (tp * pp * cp) if world else 0))
    return TrainingShape(ckpt_format=ckpt_format or getattr(args, "ckpt_format", "torch_dist"), tp=tp, pp=pp,
                         ep=int(getattr(args, "expert_model_parallel_size", 1) or 1), dp=dp, world_size=world,
                         layers=layers_of_args(args),
                         distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
                         optim_sharding=optim_sharding, plan_hash=getattr(args, "heterogeneous_plan_hash", None),
                         iteration=iteration)


def current_sharding(args: Any) -> Optional[str]:
    """The sharding type this run would save its distributed-optimizer state in (megatron.training's rule)."""
    if not getattr(args, "use_distributed_optimizer", False):
        return None
    return "fully_reshardable" if getattr(args, "dist_ckpt_optim_fully_reshardable", False) else "dp_reshardable"


@dataclass(frozen=True)
class CheckpointDir:
    path: str
    iteration: Optional[int]       # None: a release checkpoint


def checkpoint_dir(load_dir: str, args: Any) -> Optional[CheckpointDir]:
    """The directory Megatron will load from (its tracker file, or --ckpt-step), None where there is none."""
    tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    release = text == "release"
    iteration = None if release else int(text)
    if getattr(args, "ckpt_step", None):
        iteration, release = int(args.ckpt_step), False
    path = os.path.join(load_dir, "release" if release else f"iter_{iteration:07d}")
    return CheckpointDir(path, iteration) if os.path.isdir(path) else None


_LEGACY_DIR = re.compile(r"^mp_rank_\d\d")


def read_checkpoint(found: CheckpointDir) -> TrainingShape:
    """What the checkpoint holds: its saved args, the format, the optimizer's sharding type."""
    from megatron.core import dist_checkpointing
    names = sorted(os.listdir(found.path))
    if dist_checkpointing.check_is_distributed_checkpoint(found.path):
        common = dist_checkpointing.load_common_state_dict(found.path)
        meta = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
        saved = common.get("args")
        if saved is None:
            raise ConfigError(f"{found.path} holds no saved arguments: het_plugin cannot tell its layer split",
                              source=found.path, field="--load", fix="load it without --heterogeneous-nic")
        return shape_of_args(saved, ckpt_format="torch_dist", optim_sharding=meta.get("distrib_optim_sharding_type"),
                             iteration=found.iteration)
    legacy = [n for n in names if _LEGACY_DIR.match(n)]
    if legacy:
        import torch
        path = os.path.join(found.path, legacy[0], "model_optim_rng.pt")
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        return shape_of_args(state["args"], ckpt_format="torch", iteration=found.iteration)
    fmt = "torch_dcp" if ".metadata" in names else "unknown"
    raise ConfigError(f"{found.path} is a '{fmt}' checkpoint: het_plugin cannot read its split before loading, and "
                      "the format keys layers per stage", source=found.path, field="--ckpt-format",
                      fix="save in torch_dist (--ckpt-format torch_dist) to resume under another plan")


def load_optimizer(args: Any, found: CheckpointDir) -> bool:
    return not (getattr(args, "no_load_optim", False) or getattr(args, "finetune", False) or found.iteration is None)


def checkpoint_shape(args: Any, load_arg: str = "load"):
    """The checkpoint ``--load`` names as :mod:`het_plugin.core.checkpoint_fit` reads it (what re-planning on
    restart asks before it takes a plan); None without one."""
    load_dir = getattr(args, load_arg, None)
    found = checkpoint_dir(load_dir, args) if load_dir else None
    if found is None:
        return None
    saved = read_checkpoint(found)
    return CheckpointShape(framework=MEGATRON, path=found.path, format=saved.ckpt_format, world_size=saved.world_size,
                           tp=saved.tp, pp=saved.pp, dp=saved.dp, layers_per_stage=list(saved.layers),
                           distributed_optimizer=saved.distributed_optimizer, optimizer_sharding=saved.optim_sharding,
                           has_optimizer=load_optimizer(args, found), plan_hash=saved.plan_hash,
                           iteration=saved.iteration)


def check_before_load(args: Any, load_arg: str = "load") -> list[str]:
    """The check on Megatron-LM's args (every rank); the notes for rank 0. A no-op without a checkpoint."""
    load_dir = getattr(args, load_arg, None)
    found = checkpoint_dir(load_dir, args) if load_dir else None
    if found is None:
        return []
    saved = read_checkpoint(found)
    run = shape_of_args(args, ckpt_format=saved.ckpt_format, optim_sharding=current_sharding(args))
    return check_resume(saved, run, load_optim=load_optimizer(args, found), where=load_dir)
