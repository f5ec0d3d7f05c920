"""Megatron-LM's command line: the ``--heterogeneous-nic`` flags and the plan applied to ``args``.

Megatron-LM builds one strict ``argparse`` parser (``allow_abbrev=False``, unknown flags are errors)
and lets the training script add its own flags through ``extra_args_provider(parser) -> parser``.
:func:`chain_extra_args_provider` keeps the script's provider and adds het_plugin's flags after it.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Optional, Sequence

from ..errors import ConfigError
from ..plan import Plan

FLAG = "--heterogeneous-nic"
PLAN_OUT_FLAG = "--heterogeneous-plan-out"
DISCOVER = "discover"          # the value of a bare --heterogeneous-nic

Provider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add het_plugin's flags to a Megatron-LM parser (idempotent: a patched tree adds them already)."""
    if FLAG in parser._option_string_actions:
        return parser
    group = parser.add_argument_group("heterogeneous cluster (het_plugin)")
    group.add_argument(FLAG, nargs="?", const=DISCOVER, default=None, metavar="FILE",
                       help="plan placement, layer split and per-communicator transports for a heterogeneous "
                            "cluster. FILE: a cluster file, or a plan file from `het-plugin plan -o`; "
                            "no value: discover the cluster (NICs and accelerators of every node)")
    group.add_argument(PLAN_OUT_FLAG, default=None, metavar="FILE",
                       help="save the plan used (rank 0) to FILE (.json or .yaml)")
    return parser


def chain_extra_args_provider(user_provider: Optional[Provider] = None) -> Provider:
    """An ``extra_args_provider`` that runs the script's own provider, then adds het_plugin's flags."""
    if getattr(user_provider, "__het_plugin_chained__", False):
        return user_provider

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if user_provider is not None:
            parser = user_provider(parser)
        return add_arguments(parser)

    provider.__het_plugin_chained__ = True
    provider.__wrapped__ = user_provider
    return provider


def option_given(argv: Sequence[str], option: str) -> bool:
    """True when ``option`` (e.g. --tensor-model-parallel-size) is on the command line itself."""
    return any(a == option or a.startswith(option + "=") for a in argv)


# Megatron-LM flags that split the pipeline themselves: het_plugin sets the split from the plan.
SPLIT_OPTIONS = {"pipeline_model_parallel_layout": "--pipeline-model-parallel-layout",
                 "decoder_first_pipeline_num_layers": "--decoder-first-pipeline-num-layers",
                 "decoder_last_pipeline_num_layers": "--decoder-last-pipeline-num-layers"}
# Interleaved (virtual) pipelines: taken as given where the plan's split is Megatron's even one.
VIRTUAL_OPTIONS = {"num_layers_per_virtual_pipeline_stage": "--num-layers-per-virtual-pipeline-stage",
                   "num_virtual_stages_per_pipeline_rank": "--num-virtual-stages-per-pipeline-rank"}


def check_compatible(args: Any) -> None:
    """Reject Megatron-LM options het_plugin cannot honour, naming the flag and the fix."""
    for attr, flag in SPLIT_OPTIONS.items():
        if getattr(args, attr, None) is not None:
            raise ConfigError(f"{flag} is set, but {FLAG} sets the pipeline split from the plan",
                              source="command line", field=flag, fix=f"drop {flag}")


def order_of(args: Any) -> str:
    """Megatron-LM's rank order (initialize.py passes 'tp-cp-ep-pp-dp' with --use-tp-pp-dp-mapping)."""
    return "tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp"


def degrees_given(args: Any, argv: Sequence[str]) -> dict[str, Optional[int]]:
    """The degrees the user passed (None where Megatron's default would apply: the planner chooses)."""
    return {
        "tp": args.tensor_model_parallel_size if option_given(argv, "--tensor-model-parallel-size") else None,
        "pp": args.pipeline_model_parallel_size if option_given(argv, "--pipeline-model-parallel-size") else None,
        "cp": getattr(args, "context_parallel_size", None) or 1,
        "micro_batch_size": args.micro_batch_size if option_given(argv, "--micro-batch-size") else None,
        "ep": getattr(args, "expert_model_parallel_size", None) or 1,
        "etp": getattr(args, "expert_tensor_parallel_size", None),
        "order": order_of(args),
    }


def apply_plan_to_args(args: Any, plan: Plan) -> list[str]:
    """Write the plan into Megatron-LM's args (before validate_args); returns what changed, for the log."""
    from .pipeline_layout import layout_for_plan
    changes = []

    def put(name, value):
        if getattr(args, name, None) != value:
            changes.append(f"{name}={value}")
            setattr(args, name, value)

    put("tensor_model_parallel_size", plan.tp)
    put("pipeline_model_parallel_size", plan.pp)
    put("context_parallel_size", plan.cp)
    put("micro_batch_size", plan.micro_batch_size)
    put("global_batch_size", plan.micro_batch_size * plan.dp * plan.num_micro_batches)
    layout = layout_for_plan(plan)
    if layout is not None:
        virtual = [flag for attr, flag in VIRTUAL_OPTIONS.items() if getattr(args, attr, None) is not None]
        if virtual:
            raise ConfigError(f"{virtual[0]} asks for an interleaved pipeline, but the plan splits the layers "
                              f"unevenly ({plan.layers_per_stage}), which het_plugin does not express with virtual "
                              "stages yet", source="command line", field=virtual[0],
                              fix=f"drop {virtual[0]}, or fix --pipeline-model-parallel-size to one that splits "
                                  "the layers evenly")
        put("pipeline_model_parallel_layout", layout)
    if plan.overlap_grad_reduce:
        put("overlap_grad_reduce", True)
    if plan.distributed_optimizer:        # the plan's memory estimate assumed sharded optimizer state
        put("use_distributed_optimizer", True)
    return changes
