"""Megatron-LM's pipeline-split flags under a plan: whose split is it?

A homogeneous identity plan is Megatron's own numbering and groups, so the user's split stands as given
(``--pipeline-model-parallel-layout``, ``--decoder-first/last-pipeline-num-layers``,
``--account-for-embedding/loss-in-pipeline-split``): het_plugin writes no layout beside them (Megatron-LM's
``validate_args`` takes a layout with none of the others). Under a heterogeneous plan the split is the plan's:
each flag is refused by name. The account flags are refused too rather than silently reinterpreted: Megatron
counts the embedding and the loss as one decoder layer each (megatron-core 0.16.1-0.19.2 transformer_block.py
``get_num_layers_to_build``), while het_plugin's split already charges the first stage with the embedding's cost
and the last with the output layer's and the loss's (core/layer_split.py), at their predicted time.
"""
from __future__ import annotations

from typing import Any

from ..core.errors import ConfigError
from .pipeline_layout import layout_for_plan

FLAG = "--heterogeneous-nic"
LAYOUT_OPTIONS = {"pipeline_model_parallel_layout": "--pipeline-model-parallel-layout",
                  "decoder_first_pipeline_num_layers": "--decoder-first-pipeline-num-layers",
                  "decoder_last_pipeline_num_layers": "--decoder-last-pipeline-num-layers"}
ACCOUNT_OPTIONS = {"account_for_embedding_in_pipeline_split": "--account-for-embedding-in-pipeline-split",
                   "account_for_loss_in_pipeline_split": "--account-for-loss-in-pipeline-split"}


def given(args: Any, plan: Any = None) -> list[str]:
    """The split flags the command line sets (a layout equal to ``plan``'s is het_plugin's own, written before)."""
    ours = None
    if plan is not None:
        ours = layout_for_plan(plan)
    out = [flag for attr, flag in LAYOUT_OPTIONS.items() if getattr(args, attr, None) is not None
           and not (attr == "pipeline_model_parallel_layout" and ours is not None
                    and str(getattr(args, attr)) == str(ours))]
    return out + [flag for attr, flag in ACCOUNT_OPTIONS.items() if getattr(args, attr, False)]


def users_split(args: Any, plan: Any) -> bool:
    """True where the command line's split stands (a homogeneous identity plan and a split flag given): the plan's
    layout is then not written. False where the plan's split goes to Megatron. Raises for a split flag under a
    heterogeneous plan, naming it."""
    flags = given(args, plan)
    if not flags:
        return False
    if plan.homogeneous and plan.is_identity:
        return True
    flag = flags[0]
    if flag in ACCOUNT_OPTIONS.values():
        why = ("Megatron would count the embedding and the loss as one decoder layer each; het_plugin's split already "
               "puts the embedding's cost on the first stage and the output layer's and loss's on the last, at their "
               "predicted time")
    else:
        why = "the plan sets the pipeline split from each stage's accelerators and links"
    raise ConfigError(f"{flag} is set, but {FLAG} places a heterogeneous cluster: {why}", source="command line",
                      field=flag, fix=f"drop {flag} (the plan's layer split is in the start-up summary), or run "
                                      "without --heterogeneous-nic")
