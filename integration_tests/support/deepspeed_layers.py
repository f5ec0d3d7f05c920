"""The tiny layers the DeepSpeed rank scripts build their pipelines from (test-only).

Module-level classes, so DeepSpeed's ``LayerSpec`` and het_plugin's layer pattern (which counts layers by
class name: ``Block``) see the same names in every script. Import after the rank's DeepSpeed environment is
set (``deepspeed_cpu.init_gloo``); only torch is imported here.
"""
from __future__ import annotations

import time

import torch


class InProj(torch.nn.Linear):
    """The input projection: a layer kind of its own (not counted as a ``Block``)."""


class Block(torch.nn.Module):
    """One counted layer: tanh(Wx + b). ``delay_s``: a sleep in each forward, set by a rank script to act as a
    slower device (the measured-profile tests)."""
    delay_s = 0.0

    def __init__(self, hidden: int):
        super().__init__()
        self.fc = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        if self.delay_s:
            time.sleep(self.delay_s)
        return torch.tanh(self.fc(x))


class Head(torch.nn.Linear):
    """The output projection."""


def block_pipeline(config: dict, num_stages: int, blocks: int = 8, hidden: int = 16):
    """het_plugin.deepspeed.PipelineModule over ``blocks`` Blocks with an MSE loss
    (integration_tests/data/ds_tiny_model.yaml describes this model: 8 blocks of 16)."""
    from deepspeed.pipe import LayerSpec

    import het_plugin.deepspeed as hds
    return hds.PipelineModule(layers=[LayerSpec(Block, hidden) for _ in range(blocks)], num_stages=num_stages,
                              config=config, loss_fn=torch.nn.MSELoss())
