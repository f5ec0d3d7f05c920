"""het_plugin.deepspeed.checkpoints without processes: what a saved checkpoint records (DeepSpeed's keys as 0.19.8
writes them into mp_rank_XX_model_states.pt, fabricated here with torch.save) and the refusal before the engine's
own load_checkpoint runs."""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from het_plugin.core.checkpoint_fit import DS_PER_RANK, DS_UNIVERSAL  # noqa: E402
from het_plugin.deepspeed.checkpoints import RECORD_KEY, install, plan_record, read_shape  # noqa: E402
from het_plugin.core.errors import ConfigError  # noqa: E402
from test_restart_replan import IB_ROCE_4, resolver  # noqa: E402


@pytest.fixture(scope="module")
def plans():
    a = resolver(IB_ROCE_4, 4, tp=1, pp=2)().plan
    return a, dataclasses.replace(a, layers_per_stage=list(reversed(a.layers_per_stage)))


def write_checkpoint(root, plan, tag="global_step2", zero=0, optimizer=True, latest="latest"):
    d = root / tag
    d.mkdir(parents=True)
    state = {"module": None, "optimizer": {"state": {}, "param_groups": []} if optimizer and not zero else None,
             "checkpoint_parallel_dimensions": {"pp": plan.pp, "tp": plan.tp}, "dp_world_size": plan.dp,
             "ds_config": {"zero_optimization": {"stage": zero}}, "global_steps": 2, RECORD_KEY: plan_record(plan)}
    torch.save(state, d / "mp_rank_00_model_states.pt")
    (root / latest).write_text(tag)


def test_read_shape_takes_deepspeeds_keys_and_the_plan_record(plans, tmp_path):
    a, _ = plans
    write_checkpoint(tmp_path, a)
    shape = read_shape(str(tmp_path))
    assert (shape.format, shape.pp, shape.tp, shape.dp, shape.zero_stage) == (DS_PER_RANK, a.pp, a.tp, a.dp, 0)
    assert list(shape.layers_per_stage) == a.layers_per_stage and shape.plan_hash == a.hash and shape.has_optimizer
    assert shape.iteration == 2 and shape.path.endswith("global_step2")
    assert not read_shape(str(tmp_path), load_optimizer_states=False).has_optimizer
    assert read_shape(str(tmp_path / "nothing")) is None
    assert read_shape(str(tmp_path), universal=True) is None          # no latest_universal tag


def test_a_universal_tag_is_read_as_universal(plans, tmp_path):
    a, _ = plans
    write_checkpoint(tmp_path, a, tag="global_step2_universal", zero=1, latest="latest_universal")
    assert read_shape(str(tmp_path), universal=True).format == DS_UNIVERSAL


class Engine:
    """The engine methods the wrappers call (DeepSpeed's signatures)."""

    def __init__(self, plan, universal=False):
        self.het_plan, self.global_rank, self.universal, self.calls = plan, 0, universal, []

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        self.calls.append(("save", dict(client_state)))

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        self.calls.append(("load", load_optimizer_states, load_module_only))
        return load_dir, {}

    def load_universal_checkpoint(self):
        return self.universal


def test_saves_record_the_plan_and_refused_loads_never_reach_deepspeed(plans, tmp_path):
    a, b = plans
    engine = Engine(b)
    install(engine)
    engine.save_checkpoint(str(tmp_path), client_state={"mine": 1})
    assert engine.calls[-1] == ("save", {"mine": 1, RECORD_KEY: plan_record(b)})
    write_checkpoint(tmp_path, a)
    with pytest.raises(ConfigError) as exc:
        engine.load_checkpoint(str(tmp_path))
    assert exc.value.field == "checkpoint.load_universal" and engine.calls[-1][0] == "save"
    engine.load_checkpoint(str(tmp_path), load_optimizer_states=False)          # the weights follow
    engine.load_checkpoint(str(tmp_path), None, True, True, True, True)          # load_module_only, positionally
    assert engine.calls[-2:] == [("load", False, False), ("load", True, True)]
    same = Engine(a)
    install(same)
    same.load_checkpoint(str(tmp_path))
    assert same.calls == [("load", True, False)]
