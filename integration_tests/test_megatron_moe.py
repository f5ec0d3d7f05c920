"""Megatron-Core's MoE with expert parallelism trained through het_plugin.megatron on CPU/gloo.

4 ranks, tp=1 pp=1 (dp=4), expert_model_parallel_size=2: 4 experts (2 per rank, SequentialMLP on the local
spec), top-2 routing with the load-balancing aux loss, the alltoall token dispatcher (all_to_all_single
with uneven splits over the expert-parallel group: gloo has it). The CUDA-only bits of the MoE layer are
bent by the test-only ``enable_moe_cpu_shims`` (integration_tests/support/megatron_cpu.py).

On a homogeneous cluster het_plugin must be invisible: Megatron's own groups, expert groups included, and
bit-identical losses. On an IB + RoCE cluster launched interleaved, every group Megatron creates, the
expert groups (expert-parallel, expert-tensor-parallel, expert-data-parallel, ...) included, must be the
plan's, and the model must train.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.plan import Plan
from integration_tests.support.launch import run_ranks
from integration_tests.test_megatron import PROCESS_GROUP_KIND, _expected_members

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ranks" / "megatron_train_ep_vpp.py"
DATA = HERE / "data"
HOMOGENEOUS_4 = DATA / "megatron-homogeneous-4.yaml"
IB_ROCE_4 = DATA / "megatron-ib-roce-4.yaml"
STEPS = 3
MOE = ["--tp", "1", "--pp", "1", "--ep", "2", "--experts", "4", "--dispatcher", "alltoall", "--layers", "2",
       "--steps", str(STEPS)]

# parallel_state's expert process groups -> the plan's expert group kind (expert tp = tp = 1 here; gtp_remat = 1
# from megatron-core 0.19, so the *_WITH_GTP_REMAT / *_WITH_EGTP groups are the plain ones). The dense groups
# keep test_megatron's mapping.
EXPERT_GROUP_KIND = {
    "_EXPERT_MODEL_PARALLEL_GROUP": "expert-ep", "_EXPERT_TENSOR_PARALLEL_GROUP": "expert-tp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "expert-tp-ep",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "expert-tp-ep-pp",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": "expert-tp-ep-pp",
    "_EXPERT_DATA_PARALLEL_GROUP": "expert-dp", "_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expert-dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "expert-dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": "expert-dp",
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "expert-dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "expert-dp",
}
# Present on 0.16 and 0.19 whenever ep > 1: the groups the MoE layer and DDP use.
MOE_GROUPS = {"_EXPERT_MODEL_PARALLEL_GROUP", "_EXPERT_TENSOR_PARALLEL_GROUP",
              "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP",
              "_EXPERT_DATA_PARALLEL_GROUP_GLOO"}


def expected_members(plan: Plan, name: str, rank: int) -> list[int]:
    if name in EXPERT_GROUP_KIND:
        return plan.group_of(EXPERT_GROUP_KIND[name], rank).ranks
    assert name in PROCESS_GROUP_KIND, f"Megatron built a group this test does not know: {name}"
    return _expected_members(plan, name, rank)


@pytest.fixture(scope="module")
def baseline():
    """Megatron-Core alone: its own groups for tp=1 pp=1 ep=2 on 4 ranks."""
    return run_ranks(SCRIPT, 4, MOE + ["--baseline"], ranks_per_node=2, timeout=150)


@pytest.fixture(scope="module")
def homogeneous():
    """Through het_plugin on 2 identical IB nodes (2 ranks each)."""
    return run_ranks(SCRIPT, 4, MOE + ["--cluster", str(HOMOGENEOUS_4)], ranks_per_node=2, timeout=150)


@pytest.fixture(scope="module")
def hetero():
    """Through het_plugin on 2 IB + 2 RoCE nodes launched interleaved (ib, roce, ib, roce): permuted ranks."""
    return run_ranks(SCRIPT, 4, MOE + ["--cluster", str(IB_ROCE_4)], ranks_per_node=1, timeout=150,
                     env={"HET_PLUGIN_GLOO_IFNAMES": "ib=lo,roce=lo,socket=lo,local=lo"})


def _agreed_plan(outs) -> Plan:
    plan = Plan.from_dict(outs[0].result["plan"])
    assert {o.result["plan_hash"] for o in outs} == {plan.hash}
    assert (plan.tp, plan.pp, plan.dp, plan.dims.ep, plan.dims.etp) == (1, 1, 4, 2, 1)
    return plan


def test_homogeneous_moe_is_megatrons_own(homogeneous, baseline):
    plan = _agreed_plan(homogeneous)
    assert plan.homogeneous and plan.is_identity
    for ours, ref in zip(homogeneous, baseline):
        rank = ours.rank
        groups = ours.result["process_groups"]
        assert MOE_GROUPS <= set(groups), f"rank {rank}: {sorted(groups)}"
        # Every process group, expert groups included, is Megatron's own, members in the same order ...
        assert groups == ref.result["process_groups"], f"rank {rank}"
        # ... and the plan's (Megatron numbers experts tp-cp-ep-dp-pp: ep neighbours share a node here).
        for name, members in groups.items():
            assert members == expected_members(plan, name, rank), f"rank {rank} {name}"
        assert groups["_EXPERT_MODEL_PARALLEL_GROUP"] == [rank - rank % 2, rank - rank % 2 + 1]
        # Same groups, same code, same data: the arithmetic is the same, so the losses are bit-identical.
        assert ours.result["losses"] == ref.result["losses"], f"rank {rank}"
    assert len(baseline[0].result["losses"]) == STEPS


def test_hetero_moe_groups_follow_the_plan(hetero):
    plan = _agreed_plan(hetero)
    assert not plan.is_identity, "the test cluster must make het_plugin permute ranks"
    assert {k for k in plan.groups if k.startswith("expert-")} == {
        "expert-tp", "expert-ep", "expert-tp-ep", "expert-tp-ep-pp", "expert-dp"}
    cluster = load_cluster(IB_ROCE_4)
    for o in hetero:
        rank, groups = o.rank, o.result["process_groups"]
        assert MOE_GROUPS <= set(groups), f"rank {rank}: {sorted(groups)}"
        for name, members in groups.items():
            assert members == expected_members(plan, name, rank), f"rank {rank} {name}"
        # The expert-parallel all-to-all stays on one fabric (Megatron's own numbering would pair ib-0 with roce-0).
        assert {cluster.node_of(r).cluster for r in groups["_EXPERT_MODEL_PARALLEL_GROUP"]} == \
            {cluster.node_of(rank).cluster}
    # The expert groups the plan lists are the ones Megatron created, with their members in group-rank order.
    made = {tuple(o.result["process_groups"]["_EXPERT_MODEL_PARALLEL_GROUP"]) for o in hetero}
    assert made == {tuple(g.ranks) for g in plan.groups["expert-ep"]} == {(0, 2), (1, 3)}
    made = {tuple(o.result["process_groups"]["_EXPERT_DATA_PARALLEL_GROUP"]) for o in hetero}
    assert made == {tuple(g.ranks) for g in plan.groups["expert-dp"]}


def test_hetero_moe_trains_as_megatron_does(hetero, baseline):
    ours = [o.result["losses"] for o in hetero]
    reference = baseline[0].result["losses"]
    assert all(len(l) == STEPS for l in ours)
    assert all(l == ours[0] for l in ours), "every rank reports the same global loss"
    assert all(math.isfinite(x) for x in ours[0])
    # The model learns: the batch of step 0 comes back at step 2 with a lower loss.
    assert ours[0][2] < ours[0][0]
    # The same function on a permuted placement (every weight, expert weights included, from its global
    # identity; each group's members in their logical order). Observed bit-identical; 1e-6 leaves room for
    # a reduction whose order follows the placement.
    for step, (a, b) in enumerate(zip(ours[0], reference)):
        assert math.isclose(a, b, rel_tol=1e-6), f"step {step}: {a} vs {b}"
