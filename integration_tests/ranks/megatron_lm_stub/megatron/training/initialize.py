"""TEST ONLY: Megatron-LM's initialize_megatron, cut down (no CUDA): parse, validate, init, mpu groups."""
from datetime import timedelta

import torch

import megatron.training as training
from megatron.core import mpu
from megatron.training.arguments import parse_args, validate_args


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False):
    args = parse_args(extra_args_provider, ignore_unknown_args)
    validate_args(args, args_defaults)
    training._GLOBAL_ARGS = args
    _initialize_distributed()


def _initialize_distributed():
    args = training.get_args()
    torch.distributed.init_process_group(backend=args.distributed_backend, world_size=args.world_size,
                                         rank=args.rank, timeout=timedelta(minutes=2))
    if mpu.model_parallel_is_initialized():
        print("model parallel is already initialized")
    else:
        mpu.initialize_model_parallel(
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            nccl_communicator_config_path=args.nccl_communicator_config_path,
            order='tp-cp-ep-dp-pp' if not args.use_tp_pp_dp_mapping else 'tp-cp-ep-pp-dp',
        )
