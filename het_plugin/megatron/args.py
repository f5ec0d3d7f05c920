"""Megatron-LM's command line: the ``--heterogeneous-nic`` flags and the plan applied to ``args``.

Megatron-LM builds one strict ``argparse`` parser (``allow_abbrev=False``, unknown flags are errors)
and lets the training script add its own flags through ``extra_args_provider(parser) -> parser``.
:func:`chain_extra_args_provider` keeps the script's provider and adds het_plugin's flags after it.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Optional, Sequence

from ..core.errors import ConfigError
from ..core.plan import Plan
from ..runtime.exchange import check_timeout
from . import launch_state
from .dist_opt import ARG as INSTANCES, apply_instances
from .mcore import profile_settings
from .pipeline_layout import layout_for_plan
from .settings import TAKE_FLAG, planned_settings, take_plan_settings
from .split_flags import users_split

FLAG = "--heterogeneous-nic"
PLAN_OUT_FLAG = "--heterogeneous-plan-out"
TIMEOUT_FLAG = "--heterogeneous-timeout"
PROFILE_OUT_FLAG = "--heterogeneous-profile-out"
PROFILE_INTERVAL_FLAG = "--heterogeneous-profile-interval"
REPLAN_FLAG = "--heterogeneous-replan-on-restart"
USE_ALL_NODES_FLAG = "--heterogeneous-use-all-nodes"
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
    group.add_argument(TIMEOUT_FLAG, type=float, default=None, metavar="SECONDS",
                       help="bound on every wait of het_plugin at start-up (plan check, discovery, group creation): "
                            "a rank that fails or disappears stops every rank within it (default: "
                            "HET_PLUGIN_TIMEOUT, else 300)")
    group.add_argument(PROFILE_OUT_FLAG, default=None, metavar="FILE",
                       help="time each pipeline stage's forward and backward per micro-batch and the iteration "
                            "while training; rank 0 writes them as a measured profile to FILE (.yaml or .json) every "
                            f"{PROFILE_INTERVAL_FLAG} iterations and at exit, for `het-plugin plan --profile FILE`")
    group.add_argument(PROFILE_INTERVAL_FLAG, type=int, default=None, metavar="N",
                       help=f"iterations between writes of {PROFILE_OUT_FLAG} (default 100)")
    group.add_argument(REPLAN_FLAG, action="store_true",
                       help=f"with {PROFILE_OUT_FLAG}: the next start of this command (a restart, torchrun's elastic "
                            "restarts too) re-plans from the profile this run wrote, for the nodes it starts on, and "
                            "takes the new plan when it predicts a gain and the checkpoint in --load loads under it")
    group.add_argument(USE_ALL_NODES_FLAG, action="store_true", default=None,
                       help="plan with every node launched, even where the planner predicts a faster plan without "
                            "some (default: with a cluster file or discovery, a launch including nodes the best plan "
                            "leaves out stops before any group, naming them; HET_PLUGIN_USE_ALL_NODES=1 asks the "
                            "same from the environment)")
    group.add_argument(TAKE_FLAG, action="store_true",
                       help="also turn on the training settings the plan assumed (--use-distributed-optimizer "
                            "where its memory fit needs it, --overlap-grad-reduce on a heterogeneous cluster); "
                            "without it the command line's settings stand and rank 0 names what the plan assumed")
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
# Interleaved (virtual) pipelines: the number of virtual stages per rank goes to the planner; the plan's split
# (uneven where stages differ) reaches Megatron as a layout of pp * vpp segments, which replaces these flags
# (Megatron's validate_args takes at most one of them and --pipeline-model-parallel-layout).
VIRTUAL_OPTIONS = {"num_layers_per_virtual_pipeline_stage": "--num-layers-per-virtual-pipeline-stage",
                   "num_virtual_stages_per_pipeline_rank": "--num-virtual-stages-per-pipeline-rank"}
NO_OVERLAP_P2P = "--no-overlap-p2p-communication"


def check_compatible(args: Any) -> None:
    """Reject Megatron-LM options het_plugin cannot honour, naming the flag and the fix."""
    # the split flags (SPLIT_OPTIONS) are the plan's to judge: split_flags.users_split in apply_plan_to_args
    if getattr(args, "heterogeneous_timeout", None) is not None:
        check_timeout(args.heterogeneous_timeout, TIMEOUT_FLAG, "command line")
    if (getattr(args, "heterogeneous_profile_out", None) is not None
            or getattr(args, "heterogeneous_profile_interval", None) is not None):
        launch_profile_settings(args)         # a bad name or interval stops every rank alike, before planning


def launch_profile_settings(args: Any):
    """``--heterogeneous-profile-out`` / ``--heterogeneous-profile-interval`` as ProfileSettings (None without)."""
    path = getattr(args, "heterogeneous_profile_out", None)
    every = getattr(args, "heterogeneous_profile_interval", None)
    try:
        settings = profile_settings(path, every, launch_state.current().source, field=PROFILE_OUT_FLAG,
                                    every_field=PROFILE_INTERVAL_FLAG)
    except ConfigError as exc:
        raise ConfigError(exc.problem, source="command line", field=exc.field, fix=exc.fix) from None
    if settings is not None and getattr(args, "heterogeneous_replan_on_restart", False):
        settings.replan_on_restart = True       # write the plan run beside the profile: the next start's old plan
    return settings


def order_of(args: Any) -> str:
    """Megatron-LM's rank order (initialize.py passes 'tp-cp-ep-pp-dp' with --use-tp-pp-dp-mapping)."""
    return "tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp"


def virtual_stages(args: Any, pp: Optional[int]) -> Optional[int]:
    """Virtual stages per pipeline rank the command line asks for (None: not interleaved), from
    --num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-pipeline-stage (the latter needs the
    pipeline size, as in Megatron: layers / (pp * layers per virtual stage))."""
    stages = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    vs, vl = VIRTUAL_OPTIONS["num_virtual_stages_per_pipeline_rank"], VIRTUAL_OPTIONS["num_layers_per_virtual_pipeline_stage"]
    if stages is not None and per_stage is not None:
        raise ConfigError(f"{vl} and {vs} are both set (Megatron takes one)", source="command line", field=vl,
                          fix=f"keep {vs} only")
    if stages is not None:
        if stages < 1:
            raise ConfigError(f"{vs} {stages} is not a positive integer", source="command line", field=vs,
                              fix="give 1 or more")
        return stages
    if per_stage is None:
        return None
    layers = getattr(args, "num_layers", None)
    if pp is None:
        raise ConfigError(f"{vl} {per_stage} means layers / (pipeline size x {per_stage}) virtual stages, but the "
                          "pipeline size is the planner's to choose here", source="command line", field=vl,
                          fix=f"use {vs} N (het_plugin splits each stage's layers over its N virtual stages), or "
                              "give --pipeline-model-parallel-size")
    if per_stage < 1 or not layers or layers % (pp * per_stage):
        raise ConfigError(f"{vl} {per_stage} does not divide the {layers} layers into {pp} pipeline stages of "
                          f"equal virtual stages", source="command line", field=vl,
                          fix=f"use {vs} N: het_plugin splits each stage's layers (even or not) over N virtual stages")
    return layers // (pp * per_stage)


def degrees_given(args: Any, argv: Sequence[str]) -> dict[str, Optional[int]]:
    """The degrees the user passed (None where Megatron's default would apply: the planner chooses)."""
    pp = args.pipeline_model_parallel_size if option_given(argv, "--pipeline-model-parallel-size") else None
    return {
        "tp": args.tensor_model_parallel_size if option_given(argv, "--tensor-model-parallel-size") else None,
        "pp": pp,
        "cp": getattr(args, "context_parallel_size", None) or 1,
        "micro_batch_size": args.micro_batch_size if option_given(argv, "--micro-batch-size") else None,
        "ep": getattr(args, "expert_model_parallel_size", None) or 1,
        "etp": getattr(args, "expert_tensor_parallel_size", None),
        "order": order_of(args),
        "vpp": virtual_stages(args, pp),
        # Megatron-LM overlaps pipeline p2p in the interleaved schedule unless told not to
        "overlap_p2p_comm": False if option_given(argv, NO_OVERLAP_P2P) else None,
    }


def apply_plan_to_args(args: Any, plan: Plan) -> list[str]:
    """Write the plan into Megatron-LM's args (before validate_args); returns what changed, for the log."""
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
    if (getattr(args, "expert_tensor_parallel_size", None) or plan.tp) != (plan.etp or plan.tp):
        put("expert_tensor_parallel_size", plan.etp or plan.tp)
    user_vpp = virtual_stages(args, plan.pp)
    if users_split(args, plan):
        pass                              # a homogeneous plan: the command line's own split stands
    elif user_vpp in (None, plan.vpp) or not plan.accepts_vpp(user_vpp):
        # (otherwise an identity plan with Megatron's own even split: the command line's interleaving stands)
        layout = layout_for_plan(plan)
        if layout is not None:
            # the layout carries the virtual stages (pp * vpp segments); Megatron takes no VPP flag beside it
            for attr in VIRTUAL_OPTIONS:
                put(attr, None)
            put("pipeline_model_parallel_layout", layout)
        elif plan.vpp > 1:                # an even interleaved split: Megatron's own, from the count alone
            put("num_layers_per_virtual_pipeline_stage", None)
            put("num_virtual_stages_per_pipeline_rank", plan.vpp)
        if plan.vpp > 1:
            put("overlap_p2p_comm", plan.overlap_p2p_comm)
    if take_plan_settings(args):          # only on request: the optimizer and overlap are the user's (settings.py)
        for name, value in planned_settings(plan).items():
            put(name, value)
    before = getattr(args, INSTANCES, 1)
    apply_instances(args, plan)           # after the settings: only with the distributed optimizer on; rank 0's
    if getattr(args, INSTANCES, 1) != before:     # line on what is kept or left comes from settings.offer
        changes.append(f"{INSTANCES}={getattr(args, INSTANCES)}")
    args.heterogeneous_plan_hash = plan.hash      # saved with Megatron's args in every checkpoint (checkpoints.py)
    return changes
