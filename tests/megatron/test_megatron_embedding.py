"""Embedding groups: tied, untied and MTP in the plan and the cost model, and the script's own
``get_embedding_ranks`` followed through the plan's permutation.

Megatron-Core's real ``initialize_model_parallel`` runs here in one process on torch's fake process group
(what Megatron-LM's ``--fake-process-group`` uses): every rank's view of every group is built without peers.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.megatron import mcore as core
from het_plugin.megatron.pipeline_layout import layout_for_plan, layout_string
from het_plugin.core.inputs.model import ModelSpec
from het_plugin.core.planner import make_plan

from megatron_common import DATA, MODEL

UNTIED = MODEL.model_copy(update={"tie_embeddings": False})
MTP = MODEL.model_copy(update={"tie_embeddings": False, "mtp_layers": 1})


def pretrain_gpt_embedding_ranks(untied: bool, mtp: bool):
    """Shaped like Megatron-LM's pretrain_gpt.get_embedding_ranks: first stage, the last unless untied,
    the MTP stage (the last, with het_plugin's layout); sorted."""
    def get_embedding_ranks(pp_ranks):
        ranks = [pp_ranks[0]]
        if len(pp_ranks) > 1:
            if not untied:
                ranks.append(pp_ranks[-1])
            if mtp:
                ranks.append(pp_ranks[-1])
        return sorted(set(ranks))
    return get_embedding_ranks


@pytest.fixture
def fake_world():
    """torch.distributed on the fake backend as rank ``rank`` of ``world``; torn down after the test."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int, world: int):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _plan(model: ModelSpec):
    return make_plan(load_cluster(DATA / "megatron-ib-roce-8.yaml"), model, tp=2, pp=2)


def _embedding_groups(applied):
    return sorted(r.ranks for r in applied.records if r.desc == "EMBEDDING_GROUP")


@pytest.mark.parametrize("model,untied,mtp,stages", [(MODEL, False, False, [0, 1]), (UNTIED, True, False, [0]),
                                                     (MTP, True, True, [0, 1])], ids=["tied", "untied", "mtp"])
def test_the_scripts_embedding_groups_are_the_plans(fake_world, model, untied, mtp, stages, caplog):
    plan = _plan(model)
    assert not plan.is_identity and plan.embedding_stages == stages
    fake_world(5, 8)
    with caplog.at_level(logging.WARNING, logger="het_plugin.megatron"):
        applied = core.build_groups(plan, {"create_gloo_process_groups": False,
                                           "get_embedding_ranks": pretrain_gpt_embedding_ranks(untied, mtp)})
    assert _embedding_groups(applied) == sorted(g.ranks for g in plan.groups["embedding"])
    assert {plan.stage_of(r) for g in _embedding_groups(applied) for r in g} == set(stages)
    assert "embedding groups" not in caplog.text


def test_megatron_cores_default_callback_on_an_untied_model_is_followed_and_reported(fake_world, caplog):
    plan = _plan(UNTIED)
    fake_world(0, 8)
    with caplog.at_level(logging.WARNING, logger="het_plugin.megatron"):
        applied = core.build_groups(plan, {"create_gloo_process_groups": False})
    made = _embedding_groups(applied)
    assert {plan.stage_of(r) for g in made for r in g} == {0, 1}, "Megatron-Core's default: first and last stage"
    assert "hold pipeline stages [0, 1], the plan assumed [0]" in caplog.text
    assert "--untie-embeddings-and-output-weights" in caplog.text


def test_a_callback_sees_megatrons_numbering_and_its_answer_is_placed(fake_world):
    """``min(pp_ranks)`` is the first stage in Megatron's numbering, not after a permutation: the callback is
    given logical ranks and its answer mapped, so it still picks the first stage."""
    plan = _plan(MODEL)
    pipelines = [g.ranks for g in plan.groups["pp"]]
    assert any(min(p) != p[0] for p in pipelines), "the test needs a pipeline whose first stage is not its lowest rank"
    fake_world(3, 8)
    applied = core.build_groups(plan, {"create_gloo_process_groups": False,
                                       "get_embedding_ranks": lambda pp_ranks: [min(pp_ranks)]})
    assert _embedding_groups(applied) == sorted([p[0]] for p in pipelines)


def test_the_wrapper_is_left_out_on_an_identity_plan_and_not_applied_twice():
    plan = make_plan(load_cluster(DATA / "megatron-homogeneous-4.yaml"), MODEL, tp=2, pp=2)
    assert plan.is_identity

    def cb(pp_ranks):
        return pp_ranks[:1]
    assert core.through_plan(plan, cb) is cb
    permuted = _plan(MODEL)
    once = core.through_plan(permuted, cb)
    assert once is not cb and core.through_plan(permuted, once) is once


def test_cost_model_charges_the_embedding_all_reduce_only_when_stages_share_the_embedding():
    tied, untied, mtp = _plan(MODEL), _plan(UNTIED), _plan(MTP)
    assert tied.embedding_stages == [0, 1] and untied.embedding_stages == [0] and mtp.embedding_stages == [0, 1]
    assert [len(g.ranks) for g in untied.groups["embedding"]] == [1] * 4
    from het_plugin.core import cost
    from het_plugin.core.ranks.placement import place
    from het_plugin.core.ranks.dims import ParallelDims
    cluster = load_cluster(DATA / "megatron-ib-roce-8.yaml")
    placement = place(cluster, ParallelDims(tp=2, pp=2, dp=2))
    p_tied, p_untied, p_mtp = (cost.predict(cluster, m, placement, [3, 2], 2) for m in (MODEL, UNTIED, MTP))
    assert p_tied.dp_exposed_s > p_untied.dp_exposed_s, "tied: the first/last-stage all-reduce is charged"
    assert p_mtp.stage_compute_s[1] > p_untied.stage_compute_s[1], "MTP runs on the last stage"
    assert p_mtp.stage_compute_s[0] == p_untied.stage_compute_s[0]
    assert p_mtp.memory_gib_per_stage[1] > p_untied.memory_gib_per_stage[1]


def test_mtp_goes_into_the_layout_megatron_validates():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    layout = PipelineParallelLayerLayout(layout_string([3, 2], 2), 2)
    layout.validate_layer_layout(5, 2)
    assert layout.layout[1][0].count(LayerType.mtp) == 2 and layout.layout[0][0].count(LayerType.mtp) == 0
    plan = _plan(MTP)
    uneven = replace(plan, layers_per_stage=[4, 1])
    assert layout_for_plan(uneven).endswith("tmL")


def test_the_model_reads_mtp_and_untied_embeddings_from_megatron_arguments():
    from types import SimpleNamespace
    from het_plugin.megatron.modelspec import model_from_args
    args = SimpleNamespace(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=1,
                           global_batch_size=8, untie_embeddings_and_output_weights=True, mtp_num_layers=2)
    m = model_from_args(args)
    assert (m.tie_embeddings, m.mtp_layers, m.embedding_stages(4)) == (False, 2, (0, 3))
    assert model_from_args(SimpleNamespace(**{**vars(args), "mtp_num_layers": None})).embedding_stages(4) == (0,)
