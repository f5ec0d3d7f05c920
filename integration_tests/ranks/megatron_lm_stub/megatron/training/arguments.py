"""TEST ONLY: Megatron-LM's parse_args/validate_args, cut down to the flags het_plugin reads or sets."""
import argparse
import os


def add_megatron_arguments(parser):
    g = parser.add_argument_group(title='network size')
    g.add_argument('--num-layers', type=int, default=None)
    g.add_argument('--hidden-size', type=int, default=None)
    g.add_argument('--ffn-hidden-size', type=int, default=None)
    g.add_argument('--num-attention-heads', type=int, default=None)
    g.add_argument('--group-query-attention', action='store_true')
    g.add_argument('--num-query-groups', type=int, default=1)
    g.add_argument('--seq-length', type=int, default=None)
    g.add_argument('--max-position-embeddings', type=int, default=None)
    g.add_argument('--vocab-size', type=int, default=None)
    g.add_argument('--swiglu', action='store_true')
    g.add_argument('--untie-embeddings-and-output-weights', action='store_true')
    g.add_argument('--bf16', action='store_true')
    g.add_argument('--fp16', action='store_true')
    g = parser.add_argument_group(title='training')
    g.add_argument('--micro-batch-size', type=int, default=None)
    g.add_argument('--global-batch-size', type=int, default=None)
    g = parser.add_argument_group(title='distributed')
    g.add_argument('--tensor-model-parallel-size', type=int, default=1)
    g.add_argument('--pipeline-model-parallel-size', type=int, default=1)
    g.add_argument('--context-parallel-size', type=int, default=1)
    g.add_argument('--expert-model-parallel-size', type=int, default=1)
    g.add_argument('--decoder-first-pipeline-num-layers', type=int, default=None)
    g.add_argument('--decoder-last-pipeline-num-layers', type=int, default=None)
    g.add_argument('--pipeline-model-parallel-layout', type=str, default=None)
    g.add_argument('--num-layers-per-virtual-pipeline-stage', type=int, default=None)
    g.add_argument('--num-virtual-stages-per-pipeline-rank', type=int, default=None)
    g.add_argument('--overlap-grad-reduce', action='store_true', default=False)
    g.add_argument('--use-tp-pp-dp-mapping', action='store_true', default=False)
    g.add_argument('--nccl-communicator-config-path', type=str, default=None)
    g.add_argument('--distributed-backend', default='nccl', choices=['nccl', 'gloo'])
    return parser


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    """Parse all arguments (the body of Megatron-LM core_v0.16's parse_args, less yaml and MSC)."""
    parser = argparse.ArgumentParser(description='Megatron-LM Arguments', allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args()
    else:
        args = parser.parse_args()
    args.rank = int(os.getenv('RANK', '0'))
    args.world_size = int(os.getenv("WORLD_SIZE", '1'))
    return args


def validate_args(args, defaults={}):
    """The checks of Megatron-LM's validate_args that the pipeline split and batch sizes go through."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    model_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    assert args.world_size % model_size == 0, f'world size {args.world_size} not divisible by {model_size}'
    args.data_parallel_size = args.world_size // model_size
    assert args.micro_batch_size is not None and args.micro_batch_size > 0
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.pipeline_model_parallel_layout is not None:
        num_stages = PipelineParallelLayerLayout.get_num_stages_from_str(args.pipeline_model_parallel_layout)
        assert num_stages % args.pipeline_model_parallel_size == 0
        args.virtual_pipeline_model_parallel_size = num_stages // args.pipeline_model_parallel_size
        if args.virtual_pipeline_model_parallel_size == 1:
            args.virtual_pipeline_model_parallel_size = None
    else:
        args.virtual_pipeline_model_parallel_size = None
        if args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None:
            assert args.num_layers % args.pipeline_model_parallel_size == 0, \
                'number of layers should be divisible by the pipeline parallel size'
    return args
