"""An interleaved (virtual) pipeline trained through het_plugin.megatron on CPU/gloo.

4 ranks, pp=2 x dp=2, virtual_pipeline_model_parallel_size=2, a 4-layer tiny GPT: each rank holds two
model chunks of one layer (stage 0 layers 1 and 3, stage 1 layers 2 and 4), each chunk in its own DDP
wrapper, trained by Megatron's interleaved 1F1B schedule.

On a homogeneous cluster het_plugin must be invisible: Megatron's own groups and chunks, bit-identical
losses. On a heterogeneous cluster whose plan splits the layers evenly (two IB islands joined by Ethernet,
launched interleaved: the ranks are permuted) every group Megatron creates is the plan's, each rank holds
the virtual stages of its planned pipeline stage, and the model trains as Megatron's own run does. On an
IB + RoCE cluster the plan's split is uneven (more layers on the H100 stage): a 6-layer model whose virtual
stages het_plugin lays out itself (pipeline_model_parallel_layout of pp * vpp segments).
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
TWO_IB_ISLANDS_4 = DATA / "megatron-two-ib-islands-4-1gbe.yaml"     # a plan that permutes (issue 30)
IB_ROCE_4 = DATA / "megatron-ib-roce-4-1gbe.yaml"
GLOO_IFNAMES = {"HET_PLUGIN_GLOO_IFNAMES": "ib=lo,roce=lo,socket=lo,local=lo"}
STEPS = 3
PP, VPP, LAYERS = 2, 2, 4
UNEVEN_LAYERS = 6
INTERLEAVED = ["--tp", "1", "--pp", str(PP), "--vpp", str(VPP), "--steps", str(STEPS)]
SCHEDULE = "forward_backward_pipelining_with_interleaving"


def chunks_of(virtual_layers: list[list[int]], stage: int) -> list[list[int]]:
    """The global layers of each model chunk of pipeline rank ``stage``, for ``virtual_layers[rank][chunk]``
    layers per virtual stage: Megatron runs virtual stage c of rank r as the model's segment c * pp + r."""
    pp, vpp = len(virtual_layers), len(virtual_layers[0])
    first, held = 1, {}
    for k in range(pp * vpp):
        n = virtual_layers[k % pp][k // pp]
        held[(k % pp, k // pp)] = list(range(first, first + n))
        first += n
    return [held[(stage, c)] for c in range(vpp)]


def megatron_chunks(stage: int) -> list[list[int]]:
    """Megatron's even interleaved split of LAYERS layers."""
    return chunks_of([[LAYERS // (PP * VPP)] * VPP] * PP, stage)


@pytest.fixture(scope="module")
def baseline():
    """Megatron-Core alone: its own groups and its even interleaved split."""
    return run_ranks(SCRIPT, 4, INTERLEAVED + ["--layers", str(LAYERS), "--baseline"], ranks_per_node=2, timeout=150)


@pytest.fixture(scope="module")
def homogeneous():
    """Through het_plugin on 2 identical IB nodes (2 ranks each)."""
    return run_ranks(SCRIPT, 4, INTERLEAVED + ["--layers", str(LAYERS), "--cluster", str(HOMOGENEOUS_4)],
                     ranks_per_node=2, timeout=150)


@pytest.fixture(scope="module")
def hetero_even():
    """Through het_plugin on two IB islands joined by Ethernet, launched interleaved (a, b, a, b)."""
    return run_ranks(SCRIPT, 4, INTERLEAVED + ["--layers", str(LAYERS), "--cluster", str(TWO_IB_ISLANDS_4)],
                     ranks_per_node=1, timeout=150, env=GLOO_IFNAMES)


@pytest.fixture(scope="module")
def hetero_uneven():
    """Through het_plugin on 2 IB (H100) + 2 RoCE (A100) nodes launched interleaved: an uneven plan."""
    return run_ranks(SCRIPT, 4, INTERLEAVED + ["--layers", str(UNEVEN_LAYERS), "--cluster", str(IB_ROCE_4)],
                     ranks_per_node=1, timeout=150, env=GLOO_IFNAMES)


@pytest.fixture(scope="module")
def baseline_uneven():
    """The same 6-layer model and data on Megatron-Core alone (pp=2, its even non-interleaved split)."""
    return run_ranks(SCRIPT, 4, ["--tp", "1", "--pp", str(PP), "--layers", str(UNEVEN_LAYERS), "--steps", str(STEPS),
                                 "--baseline"], ranks_per_node=2, timeout=150)


def _agreed_plan(outs) -> Plan:
    plan = Plan.from_dict(outs[0].result["plan"])
    assert {o.result["plan_hash"] for o in outs} == {plan.hash}
    assert (plan.tp, plan.pp, plan.dp, plan.vpp) == (1, PP, 2, VPP)
    return plan


def _check_groups_and_chunks(outs, plan: Plan) -> None:
    """Every process group is the plan's; each rank holds its planned stage's virtual stages."""
    for o in outs:
        rank, r = o.rank, o.result
        assert r["schedule"] == SCHEDULE
        unmapped = set(r["process_groups"]) - set(PROCESS_GROUP_KIND)
        assert not unmapped, f"Megatron built groups this test does not know: {unmapped}"
        for name, members in r["process_groups"].items():
            assert members == _expected_members(plan, name, rank), f"rank {rank} {name}"
        assert r["stage"] == plan.stage_of(rank)
        assert r["chunk_layer_numbers"] == chunks_of(plan.virtual_layers, r["stage"]), f"rank {rank}"
        assert r["overlap_p2p_comm"] == plan.overlap_p2p_comm


def _check_trains_as(outs, reference_outs) -> None:
    ours = [o.result["losses"] for o in outs]
    reference = reference_outs[0].result["losses"]
    assert all(len(l) == STEPS for l in ours)
    assert all(l == ours[0] for l in ours), "every rank reports the same global loss"
    assert all(math.isfinite(x) for x in ours[0])
    assert ours[0][2] < ours[0][0], "the batch of step 0 comes back at step 2 with a lower loss"
    # The same function on another placement and split (observed bit-identical; 1e-6 leaves room for a
    # reduction whose order follows the placement).
    for step, (a, b) in enumerate(zip(ours[0], reference)):
        assert math.isclose(a, b, rel_tol=1e-6), f"step {step}: {a} vs {b}"


def test_baseline_is_an_interleaved_pipeline(baseline):
    for o in baseline:
        r = o.result
        assert r["schedule"] == SCHEDULE
        assert r["chunk_layer_numbers"] == megatron_chunks(r["stage"]), f"rank {o.rank}"


def test_homogeneous_interleaved_is_megatrons_own(homogeneous, baseline):
    plan = _agreed_plan(homogeneous)
    assert plan.homogeneous and plan.is_identity
    for ours, ref in zip(homogeneous, baseline):
        r, b = ours.result, ref.result
        assert r["schedule"] == SCHEDULE
        assert set(r["process_groups"]) == set(b["process_groups"]), f"rank {ours.rank}"
        for name, members in r["process_groups"].items():
            assert members == b["process_groups"][name], f"rank {ours.rank} {name}"
        assert (r["stage"], r["chunk_layer_numbers"]) == (b["stage"], b["chunk_layer_numbers"]), f"rank {ours.rank}"
        # What het_plugin sets on a homogeneous cluster are scheduling choices (overlap of the pipeline's
        # send/receive and of the gradient reduction, where the plan assumed them), not the computation.
        assert r["overlap_p2p_comm"] == plan.overlap_p2p_comm
        # Same groups, chunks and data: the same arithmetic, so the losses are bit-identical.
        assert r["losses"] == b["losses"], f"rank {ours.rank}"


def test_hetero_even_split_groups_and_chunks_follow_the_plan(hetero_even):
    plan = _agreed_plan(hetero_even)
    assert not plan.homogeneous and not plan.is_identity, "the test cluster must make het_plugin permute ranks"
    assert plan.virtual_layers == [[LAYERS // (PP * VPP)] * VPP] * PP, "identical islands: Megatron's even split"
    _check_groups_and_chunks(hetero_even, plan)
    cluster = load_cluster(TWO_IB_ISLANDS_4)
    for o in hetero_even:
        groups = o.result["process_groups"]
        # Each stage on one island: data parallelism stays on InfiniBand, only the pipeline crosses Ethernet.
        assert {cluster.node_of(x).cluster for x in groups["_DATA_PARALLEL_GROUP"]} == {cluster.node_of(o.rank).cluster}
        assert len({cluster.node_of(x).cluster for x in groups["_PIPELINE_MODEL_PARALLEL_GROUP"]}) == 2
    # Megatron's own numbering would put stage 1 on ranks 2 and 3 (a-1, b-1): the placement moved it.
    assert sorted(o.rank for o in hetero_even if o.result["stage"] == 1) != [2, 3]


def test_hetero_even_split_trains_as_megatron_does(hetero_even, baseline):
    _check_trains_as(hetero_even, baseline)


def test_hetero_uneven_split_groups_and_virtual_stages_follow_the_plan(hetero_uneven):
    plan = _agreed_plan(hetero_uneven)
    assert not plan.is_identity, "the test cluster must make het_plugin permute ranks"
    assert len(set(plan.layers_per_stage)) > 1, f"an uneven split: {plan.layers_per_stage}"
    assert [sum(row) for row in plan.virtual_layers] == plan.layers_per_stage
    assert all(n >= 1 for row in plan.virtual_layers for n in row)
    _check_groups_and_chunks(hetero_uneven, plan)
    # Every layer is held exactly once, on the stage the plan gives it.
    held = sorted(n for o in hetero_uneven if o.result["process_groups"]["_DATA_PARALLEL_GROUP"][0] == o.rank
                  for n in o.result["layer_numbers"])
    assert held == list(range(1, UNEVEN_LAYERS + 1))


def test_hetero_uneven_split_trains_as_megatron_does(hetero_uneven, baseline_uneven):
    _check_trains_as(hetero_uneven, baseline_uneven)
