"""hds.initialize: a pass-through without a section; with one, DeepSpeed gets the config without it."""
from __future__ import annotations

import argparse
import inspect
import json

import pytest

deepspeed = pytest.importorskip("deepspeed")

import het_plugin.deepspeed as hds  # noqa: E402
from het_plugin.core.inputs.cluster import cluster_from_dict  # noqa: E402
from het_plugin.core.errors import ConfigError  # noqa: E402
from het_plugin.core.ranks.placement import place  # noqa: E402
from het_plugin.core.planner import assemble_plan  # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims  # noqa: E402
from tests.deepspeed.test_deepspeed_config import DS, TINY, hetero_cluster  # noqa: E402


@pytest.fixture
def recorded(monkeypatch):
    calls = []

    def fake_initialize(*args, **kwargs):
        calls.append((args, kwargs))
        return (argparse.Namespace(), None, None, None)

    fake_initialize.__signature__ = inspect.signature(deepspeed.initialize)   # a stand-in with DeepSpeed's signature
    monkeypatch.setattr(deepspeed, "initialize", fake_initialize)
    return calls


@pytest.fixture
def plan():
    cluster = cluster_from_dict(hetero_cluster())
    return assemble_plan(cluster, TINY, place(cluster, ParallelDims(pp=2, dp=2)), [5, 3], 2)


def pipeline_model_with(plan):
    """A PipelineModule instance as hds.PipelineModule leaves it (building one needs a process group)."""
    model = object.__new__(hds.PipelineModule)
    from het_plugin.runtime.applied import AppliedPlan
    object.__setattr__(model, "het_plan", plan)
    object.__setattr__(model, "het_applied", AppliedPlan.start(plan, 0, "gloo"))
    return model


def test_without_section_it_is_deepspeed_initialize(recorded):
    model, opt, config = object(), object(), dict(DS)
    hds.initialize(None, model, opt, config=config)
    (args, kwargs), = recorded
    assert args == (None, model, opt) and kwargs == {"config": config} and kwargs["config"] is config


def test_section_is_stripped_and_args_config_replaced(recorded, plan, tmp_path):
    path = tmp_path / "wrapped.json"
    hds.write_config(hds.wrap(DS, plan), path)
    cli_args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    engine, *_ = hds.initialize(args=cli_args, model=pipeline_model_with(plan), optimizer=None)
    (args, kwargs), = recorded
    assert kwargs["config"] == DS
    assert kwargs["args"].deepspeed_config is None and kwargs["args"].local_rank == 0
    assert cli_args.deepspeed_config == str(path)          # the caller's namespace is untouched
    assert engine.het_plan is plan and engine.het_applied.plan is plan
    assert json.loads(path.read_text())[hds.SECTION]["plan_hash"] == plan.hash


def test_pipeline_model_must_come_from_het_plugin(recorded, plan):
    wrapped = hds.wrap(DS, plan)
    plain = object.__new__(deepspeed.pipe.PipelineModule)
    with pytest.raises(ConfigError, match="het_plugin.deepspeed.PipelineModule"):
        hds.initialize(model=plain, config=wrapped)
    other = assemble_plan(cluster_from_dict(hetero_cluster()), TINY,
                          place(cluster_from_dict(hetero_cluster()), ParallelDims(pp=2, dp=2)), [4, 4], 2)
    with pytest.raises(ConfigError, match="built with plan"):
        hds.initialize(model=pipeline_model_with(other), config=wrapped)
    with pytest.raises(ConfigError, match="data-parallel degree 2 but the config/topology implies 4"):
        hds.initialize(model=pipeline_model_with(plan), config=dict(wrapped, train_batch_size=16))
    assert recorded == []


def test_mpu_with_section_is_rejected(recorded, plan):
    with pytest.raises(ConfigError, match="mpu"):
        hds.initialize(model=object(), mpu=object(), config=hds.wrap(DS, plan))
