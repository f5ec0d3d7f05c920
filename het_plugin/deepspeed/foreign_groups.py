"""Refuse a permuted plan when the script already built Megatron-style groups in launch order.

Megatron-DeepSpeed (microsoft/Megatron-DeepSpeed at f4157be: megatron/initialize.py ``_initialize_distributed``)
calls ``deepspeed.init_distributed()`` and then its own ``megatron.core.parallel_state.initialize_model_parallel``,
whose tensor, pipeline and data-parallel groups are contiguous ranges of *launch* ranks
(megatron/core/parallel_state.py). ``GPTModelPipe`` (megatron/model/gpt_model.py) then builds a
``PipeModelDataParallelTopology`` from those degrees and passes it to DeepSpeed's ``PipelineModule``. The hook can
replace that topology and split, but the model's tensor-parallel layers all-reduce on the mpu's groups and its
data loader reads the mpu's data-parallel rank: under a plan that moves ranks, a pipeline of the plan would mix
samples and its tensor slices would reduce with the wrong peers. So such a plan is refused, naming the fix; an
identity placement (homogeneous, or a heterogeneous layer split alone) is fine.
"""
from __future__ import annotations

import sys

from ..core.errors import ConfigError
from ..core.plan import Plan
from .config import SECTION

MEGATRON_STATES = ("megatron.core.parallel_state", "megatron.mpu")


def check_no_launch_order_groups(plan: Plan, source: str = "<config>") -> None:
    if plan.is_identity:
        return
    for name in MEGATRON_STATES:
        state = sys.modules.get(name)
        check = getattr(state, "model_parallel_is_initialized", None)
        if callable(check) and check():
            raise ConfigError(
                f"the plan places ranks in another order than the launch ({list(plan.rank_of_logical)}), but {name} "
                "already built its tensor/pipeline/data-parallel groups in launch order (Megatron-DeepSpeed's "
                "initialize_model_parallel); its layers and data loader would disagree with the plan's pipeline",
                source=source, field=f"{SECTION}.plan",
                fix="launch the ranks in the plan's order (order the hostfile so that launch rank i is the plan's "
                    "rank_of_logical[i]) and re-wrap, or use Megatron-LM with het_plugin's --heterogeneous-nic")
