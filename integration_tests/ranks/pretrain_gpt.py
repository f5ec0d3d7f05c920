# Written for het_plugin's tests after the shape of Megatron-LM core_v0.19 pretrain_gpt.py (not a copy).
"""Pretrain GPT on Megatron's mock data: a plain Megatron-LM training script.

It is what a user runs with torchrun, nothing of het_plugin and nothing of the CPU test shims in it:
the same file runs unmodified on a GPU machine::

    torchrun --nproc-per-node 4 integration_tests/ranks/pretrain_gpt.py \\
        --num-layers 5 --hidden-size 32 --num-attention-heads 4 --seq-length 16 \\
        --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 \\
        --tokenizer-type NullTokenizer --vocab-size 128 --mock-data --transformer-impl local \\
        --pipeline-model-parallel-size 2 --train-iters 3 --lr 1e-3 --eval-iters 0 \\
        --heterogeneous-nic cluster.yaml

The model comes from the command line as in megatron-core 0.19's pretrain_gpt.py: ``gpt_config_from_args``
describes it and ``pretrain`` builds it (the GPTModelConfig builder) from the config container; the
batches come from ``MockGPTDataset``. ``--heterogeneous-nic`` reaches het_plugin only through the import
hook that ``pip install het_plugin`` ships (het_plugin_megatron.pth).
"""
from functools import partial
from typing import List, Optional

import torch

from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from megatron.training import get_args, get_timers, inprocess_restart, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

BATCH_KEYS = ["attention_mask", "labels", "loss_mask", "position_ids", "tokens"]


def get_batch(data_iterator, vp_stage: Optional[int] = None):
    """This micro-batch on this rank: read on tensor-parallel rank 0, broadcast to the others."""
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return [None] * len(BATCH_KEYS)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {k: (batch[k].cuda(non_blocking=True) if batch.get(k) is not None else None)
                 for k in BATCH_KEYS}
        batch["cu_seqlens"] = None
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return [batch.get(k) for k in BATCH_KEYS]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of the token losses, the number of tokens, and the 'lm loss' Megatron reports."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if args.check_for_nan_in_loss_and_grad:
        get_rerun_state_machine().validate_result(
            result=loss, rejection_func=torch.isnan, message="found NaN in local forward loss calculation",
            tolerance=0.0, fatal=True)
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """One micro-batch through this stage's part of the model."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    attention_mask, labels, loss_mask, position_ids, tokens = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)


def core_gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's mock GPT data (random tokens; --mock-data)."""
    args = get_args()
    assert args.mock_data, "this script trains on Megatron's mock data: pass --mock-data"
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        core_gpt_dataset_config_from_args(args),
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


def get_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """The ranks holding word embeddings: the first stage, and the last unless the output layer is untied."""
    embedding_ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1 and not get_args().untie_embeddings_and_output_weights:
        embedding_ranks.append(pp_ranks[-1])
    return sorted(set(embedding_ranks))


if __name__ == "__main__":
    # Temporary for transition to core datasets (as in Megatron-LM's pretrain_gpt.py).
    train_valid_test_datasets_provider.is_distributed = True

    # Optionally enable in-process restart on pretrain (--inprocess-restart).
    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)

    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(
        full_config,
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        store=store,
        get_embedding_ranks=get_embedding_ranks,
    )
