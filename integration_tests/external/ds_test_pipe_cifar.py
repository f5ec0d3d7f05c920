"""Reproduction of DeepSpeed's ``TestPipeCifar10.test_pipe_base`` pipeline run (microsoft/DeepSpeed at commit
38327e07f6cd39b63418f60cedd1651b0be3e7c3: tests/unit/runtime/pipe/test_pipe.py with ``train_cifar`` of
tests/unit/alexnet_model.py), written for this test suite: DeepSpeed's tests are not in the wheel, the tests run
offline, and they are not copied here.

What it keeps: the config is a dict inside the script (``config_dict``, including its misspelt
``grandient_accumulation_steps``, which DeepSpeed ignores, and the ``local_rank`` key ``train_cifar`` adds) passed as
``deepspeed.initialize(config=...)``; an explicit ``topology=PipeDataParallelTopology(num_pp=2, num_dp=2)``;
``PipelineModule(layers=net.to_layers(), topology=topo, loss_fn=CrossEntropyLoss())`` (DeepSpeed's default
partition_method); ``set_random_seed(123)``, ``model.eval()`` (dropout off), ``training_data=trainset`` and
``engine.train_batch()`` per step, losses averaged over ranks. What differs: the script calls
``deepspeed.init_distributed()`` itself (DistributedTest did), torch's Adam (``"torch_adam": true``: DeepSpeed's
fused Adam is a JIT build on CPU), a seed before the net is built, 3 steps instead of 100, the :mod:`small_alexnet` net, and synthetic tensors of
CIFAR-10's shape instead of the download. The hard-coded config can only reach het_plugin through
``HET_PLUGIN_DEEPSPEED_CONFIG``; no het_plugin name appears here.
"""
import copy
import sys

import deepspeed
import deepspeed.comm as dist
import deepspeed.runtime.utils as ds_utils
import torch
import torch.nn as nn
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from small_alexnet import AlexNet, synthetic_cifar

config_dict = {
    "train_batch_size": 4,
    "grandient_accumulation_steps": 1,
    "steps_per_print": 20,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 3e-7,
                                             "torch_adam": True}},
    "zero_optimization": {"stage": 0},
    "fp16": {"enabled": False},
    "pipeline": {"seed_layers": True, "activation_checkpoint_interval": 1},
}


def train_cifar(model, config, num_steps, seed=123):
    ds_utils.set_random_seed(seed)
    model.eval()
    trainset = synthetic_cifar()
    config["local_rank"] = dist.get_rank()
    engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=[p for p in model.parameters()],
                                           training_data=trainset)
    losses = [engine.train_batch().item() for _ in range(num_steps)]
    loss_tensor = torch.tensor(losses)
    dist.all_reduce(loss_tensor)
    return (loss_tensor / dist.get_world_size()).tolist()


if __name__ == "__main__":
    deepspeed.init_distributed(dist_backend="gloo")
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.manual_seed(0)             # the same initial weights on every rank and in every run
    init_net = AlexNet()
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    test_model = PipelineModule(layers=copy.deepcopy(init_net).to_layers(), topology=topo, loss_fn=nn.CrossEntropyLoss())
    losses = train_cifar(test_model, config=copy.deepcopy(config_dict), num_steps=steps)
    if dist.get_rank() == 0:
        print("LOSSES", losses)
