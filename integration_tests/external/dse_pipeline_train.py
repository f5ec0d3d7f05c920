"""Reproduction of DeepSpeedExamples ``training/pipeline_parallelism/train.py`` (microsoft/DeepSpeedExamples at
commit 83757d9c937daabd1089a08051061706cb73900d), its pipeline path (``train_pipe``), written for this test suite:
the original is not in the deepspeed wheel and the tests run offline, and it is not copied here.

What it keeps, as the original does it: its command line (``--local_rank``, ``-s/--steps``,
``-p/--pipeline-parallel-size``, ``--backend``, ``--seed`` and ``deepspeed.add_config_arguments``, so the config
arrives as ``--deepspeed_config FILE``); ``deepspeed.init_distributed(dist_backend=args.backend)`` called by the
script, then ``torch.cuda.set_device(LOCAL_RANK)``; the seeds; ``PipelineModule(layers=join_layers(net),
loss_fn=CrossEntropyLoss(), num_stages=args.pipeline_parallel_size, partition_method='parameters',
activation_checkpoint_interval=0)`` over AlexNet's ``features``, ``avgpool``, a flatten lambda and ``classifier``;
``deepspeed.initialize(args=args, model=net, model_parameters=..., training_data=trainset)``; ``engine.train_batch()``
per step. What differs: the AlexNet is :mod:`small_alexnet`'s (no torchvision here) and the CIFAR-10 download is
synthetic tensors of CIFAR's shape. No het_plugin name appears: the hook does everything.
"""
import argparse
import os

import deepspeed
import torch
from deepspeed.pipe import PipelineModule
from small_alexnet import AlexNet, synthetic_cifar


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=100, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="nccl", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def join_layers(vision_model):
    return [*vision_model.features, vision_model.avgpool, lambda x: torch.flatten(x, 1), *vision_model.classifier]


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = AlexNet(num_classes=10)
    net = PipelineModule(layers=join_layers(net), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method=part, activation_checkpoint_interval=0)
    trainset = synthetic_cifar()
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=trainset)
    for _ in range(args.steps):
        engine.train_batch()


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(args.local_rank)
    train_pipe(args)
