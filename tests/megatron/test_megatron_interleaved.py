"""Interleaved (virtual) pipelines through the Megatron-Core drop-in: the plan's vpp, Megatron's
virtual_pipeline_model_parallel_size, plan files, and the plan's own checks of its virtual split."""
from __future__ import annotations

import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.megatron import mcore as core
from het_plugin.megatron.mcore import resolve_megatron_plan
from het_plugin.megatron.pipeline_layout import layout_for_plan
from het_plugin.core.plan import Plan
from het_plugin.core.planner import make_plan

from megatron_common import DATA, MODEL

MODEL_16 = MODEL.model_copy(update={"global_batch_size": 16})     # 2 micro-batches of 2 per pipeline at dp 4


@pytest.fixture(scope="module")
def plan_vpp():
    return make_plan(load_cluster(DATA / "megatron-ib-roce-8.yaml"), MODEL_16, tp=1, pp=2, vpp=2)


def test_the_drop_in_plans_megatrons_virtual_size_and_passes_it_on(plan_vpp, monkeypatch):
    import torch.distributed as dist
    assert plan_vpp.vpp == 2 and not plan_vpp.is_identity and layout_for_plan(plan_vpp).count("|") == 3
    plan = resolve_megatron_plan(DATA / "megatron-ib-roce-8.yaml", model=MODEL_16, world_size=8, tp=1, pp=2, vpp=2)
    assert plan.hash == plan_vpp.hash
    calls = []
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(core, "original_initialize_model_parallel", lambda: lambda **kw: calls.append(kw))
    core.build_groups(plan_vpp, {"virtual_pipeline_model_parallel_size": 2})
    core.build_groups(plan_vpp, {})                     # None: the plan's
    assert [kw["virtual_pipeline_model_parallel_size"] for kw in calls] == [2, 2]


def test_a_virtual_size_the_plan_was_not_made_for_is_refused_with_the_fix(plan_vpp, plan8, tmp_path):
    with pytest.raises(ConfigError) as e:
        core.check_kwargs_fit(plan_vpp, {"virtual_pipeline_model_parallel_size": 4})
    assert e.value.field == "virtual_pipeline_model_parallel_size" and "--vpp 4" in e.value.fix
    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size=2 was passed, but the plan was made for 1 virtual stages"):
        core.check_kwargs_fit(plan8, {"virtual_pipeline_model_parallel_size": 2})
    # an identity plan with Megatron's own even split: Megatron interleaves it itself, as without het_plugin
    homogeneous = make_plan(load_cluster(DATA / "megatron-homogeneous-4.yaml"), MODEL_16.model_copy(
        update={"num_layers": 4}), tp=1, pp=2)
    core.check_kwargs_fit(homogeneous, {"virtual_pipeline_model_parallel_size": 2})
    # a plan file is the plan of its vpp
    path = tmp_path / "plan.json"
    plan_vpp.save(path)
    assert resolve_megatron_plan(path, world_size=8).vpp == 2
    with pytest.raises(ConfigError) as e:
        resolve_megatron_plan(path, world_size=8, vpp=3)
    assert e.value.field == "virtual_pipeline_model_parallel_size" and "--vpp 3" in e.value.fix


def test_the_plan_checks_its_virtual_split(plan_vpp):
    data = plan_vpp.to_dict()
    del data["hash"]
    first, last = plan_vpp.layers_per_stage
    assert plan_vpp.layers_per_virtual_stage != [[0, first], [1, last - 1]]
    for bad in ([[first, first], [1, last - 1]], [[first], [last]], [[0, first], [1, last - 1]]):
        with pytest.raises(ConfigError) as e:
            Plan.from_dict(dict(data, layers_per_virtual_stage=bad))
        assert e.value.field == "layers_per_virtual_stage"
    with pytest.raises(ConfigError) as e:
        Plan.from_dict(dict(data, vpp=1, layers_per_virtual_stage=[], overlap_p2p_comm=True))
    assert e.value.field == "overlap_p2p_comm"


def test_plans_written_before_the_interleaving_keys_keep_their_hash(plan8):
    """vpp, layers_per_virtual_stage and overlap_p2p_comm are hashed only when they differ from their defaults:
    a plan file without them (format 3 as first written) loads with its stored hash."""
    data = plan8.to_dict()
    for key in ("vpp", "layers_per_virtual_stage", "overlap_p2p_comm"):
        data.pop(key)
    assert Plan.from_dict(data).hash == plan8.hash == data["hash"]


def test_an_accepted_virtual_size_is_not_overridden_by_the_plans(tmp_path):
    """An identity plan with Megatron's even split accepts any vpp (plan.accepts_vpp); the config and the
    command line then keep the user's interleaving instead of being refused or set to the plan's vpp."""
    import argparse

    import torch
    from megatron.core.transformer import TransformerConfig

    from het_plugin.megatron.args import apply_plan_to_args
    from het_plugin.megatron.pipeline_layout import apply_plan_to_config
    homogeneous = make_plan(load_cluster(DATA / "megatron-homogeneous-4.yaml"),
                            MODEL_16.model_copy(update={"num_layers": 8}), tp=1, pp=2)
    interleaved = make_plan(load_cluster(DATA / "megatron-homogeneous-4.yaml"),
                            MODEL_16.model_copy(update={"num_layers": 8}), tp=1, pp=2, vpp=2)
    assert homogeneous.vpp == 1 and interleaved.vpp == 2 and homogeneous.accepts_vpp(2) and interleaved.accepts_vpp(4)
    for plan, vpp in ((homogeneous, 2), (interleaved, 4)):
        config = TransformerConfig(num_layers=8, hidden_size=32, num_attention_heads=4, pipeline_model_parallel_size=2,
                                   virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32)
        assert apply_plan_to_config(config, plan) is config
        args = argparse.Namespace(num_layers=8, num_virtual_stages_per_pipeline_rank=vpp,
                                  num_layers_per_virtual_pipeline_stage=None, overlap_p2p_comm=True)
        changes = apply_plan_to_args(args, plan)
        assert args.num_virtual_stages_per_pipeline_rank == vpp and not any("virtual" in c for c in changes)


def test_an_uneven_plan_still_refuses_another_virtual_size(plan_vpp):
    from het_plugin.megatron.pipeline_layout import apply_plan_to_config
    kwargs = {"num_layers": sum(plan_vpp.layers_per_stage), "tensor_model_parallel_size": 1,
              "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 4}
    assert not plan_vpp.accepts_vpp(4)
    with pytest.raises(ConfigError) as e:
        apply_plan_to_config(kwargs, plan_vpp)
    assert e.value.field == "virtual_pipeline_model_parallel_size" and "--vpp 4" in e.value.fix
