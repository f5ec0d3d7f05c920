"""Readable text report of a Plan (what ``het-plugin plan`` prints)."""
from __future__ import annotations

from .plan import Plan


def render_text(plan: Plan) -> str:
    lines = [f"het_plugin plan {plan.hash} for {plan.model.get('name')} on {plan.cluster_name} "
             f"({plan.world_size} ranks)",
             f"degrees: tp={plan.tp} cp={plan.cp} pp={plan.pp} dp={plan.dp}  micro-batch {plan.micro_batch_size} "
             f"x {plan.num_micro_batches}",
             f"layers per stage: {plan.layers_per_stage}"]
    for kind in ("tp", "dp", "pp", "embedding"):
        kinds = sorted({g.transport for g in plan.groups[kind]})
        lines.append(f"  {kind:10s} groups: {len(plan.groups[kind]):4d}  transport: {', '.join(kinds)}")
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
