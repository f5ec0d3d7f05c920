"""The planned ProcessGroupCollection (issue 31, deliverable 2), on Megatron's real parallel_state and torch's fake
process group (one rank's view): every field of the installed release, equal group for group to Megatron's own
``use_mpu_process_groups()`` on homogeneous plans, and on the plan's placement on a heterogeneous one."""
from __future__ import annotations

import dataclasses

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import ModelSpec
from het_plugin.core.planner import make_plan
from het_plugin.megatron import collection as hcoll
from het_plugin.megatron import group_check
from het_plugin.megatron import applied_state
from het_plugin.megatron import mcore as core

ps = pytest.importorskip("megatron.core.parallel_state")
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402


@pytest.fixture
def world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank, size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    yield start
    core.forget_plan()
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def members(collection) -> dict:
    import torch.distributed as dist
    out = {}
    for f in dataclasses.fields(collection):
        value = getattr(collection, f.name, None)
        if isinstance(value, dist.ProcessGroup):
            value = dist.get_process_group_ranks(value)
        elif isinstance(value, list):
            value = [dist.get_process_group_ranks(g) for g in value]
        out[f.name] = value
    return out


def homogeneous(tmp_path, nodes, per_node, tp, pp, cp, ep, etp):
    path = tmp_path / "h.yaml"
    path.write_text(f"name: h\nclusters:\n  - name: ib\n    fabric: {{type: ib, gbps: 400}}\n    nodes:\n"
                    f"      - {{count: {nodes}, accelerator: H100, accelerators_per_node: {per_node}}}\n")
    dp = nodes * per_node // (tp * pp * cp)
    model = ModelSpec(name="m", num_layers=2 * pp, hidden_size=64, num_attention_heads=8, vocab_size=128,
                      seq_length=64, global_batch_size=dp, micro_batch_size=1)
    return make_plan(load_cluster(path), model, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)


@pytest.mark.parametrize("config", [(4, 2, 2, 2, 1, 1, None), (2, 4, 2, 1, 4, 1, None), (4, 2, 1, 2, 4, 2, 2),
                                    (2, 4, 2, 2, 1, 2, 1)])
def test_a_homogeneous_plans_collection_is_megatrons_own_group_for_group(tmp_path, world, config):
    plan = homogeneous(tmp_path, *config)
    tp, pp, cp, ep, etp = config[2:]
    world(plan.world_size - 3, plan.world_size)
    applied = core.build_groups(plan, dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                           context_parallel_size=cp, expert_model_parallel_size=ep,
                                           expert_tensor_parallel_size=etp, create_gloo_process_groups=False))
    own = members(ProcessGroupCollection.use_mpu_process_groups())
    fresh = hcoll.planned_collection(applied, from_plan=True)
    assert members(fresh) == own
    assert {f.name for f in dataclasses.fields(ProcessGroupCollection)} <= set(hcoll.FIELDS)
    assert members(hcoll.planned_collection(applied)) == own


def test_a_heterogeneous_plans_collection_is_the_plans_placement(plan8, world):
    world(1, plan8.world_size)
    applied = core.build_groups(plan8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                            create_gloo_process_groups=False))
    fresh = hcoll.planned_collection(applied, from_plan=True, all_gather=True)
    got = members(fresh)
    for field, kind in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("mp", "tp-pp"), ("tp_dp_cp", "tp-dp-cp")):
        assert got[field] == next(g.ranks for g in plan8.groups[kind] if 1 in g.ranks), field
    assert got == members(ProcessGroupCollection.use_mpu_process_groups()) | (
        {"dp_cp_ag": got["dp_cp"], "expt_dp_ag": got["expt_dp"]} if "dp_cp_ag" in got else {})
    assert group_check.check_groups(fresh) > 10
    planned = [r for r in applied.records if r.desc and r.desc.startswith("PLANNED_")]
    assert any(r.transport == "socket" for r in planned), "each group through the policy (pp crosses fabrics)"
    if "dp_cp_ag" in got:
        assert fresh.dp_cp_ag is not fresh.dp_cp, "the all-gather groups are communicators of their own"


def test_no_plan_no_collection_and_an_unknown_field_is_named(monkeypatch):
    with pytest.raises(ConfigError, match="initialize_model_parallel"):
        hcoll.planned_collection(None)

    @dataclasses.dataclass
    class Newer(ProcessGroupCollection):
        fancy_new_group: object = None
    monkeypatch.setattr(hcoll, "collection_class", lambda: Newer)
    monkeypatch.setattr(applied_state, "_current", object())
    with pytest.raises(ConfigError, match="fancy_new_group"):
        hcoll.planned_collection()


def test_gptmodel_takes_a_collection_and_gets_one(world, plan8):
    from megatron.core.models.gpt import GPTModel
    assert hcoll.collection_kwargs(lambda config: None) == {}, "a builder that takes none gets none"
    world(1, plan8.world_size)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    (plain,) = hcoll.collection_kwargs(GPTModel).values()           # no plan: Megatron's own
    assert members(plain) == members(ProcessGroupCollection.use_mpu_process_groups())
    ps.destroy_model_parallel()
    core.build_groups(plan8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                  create_gloo_process_groups=False))
    (planned,) = hcoll.collection_kwargs(GPTModel).values()
    assert members(planned)["pp"] == next(g.ranks for g in plan8.groups["pp"] if 1 in g.ranks)


@pytest.mark.parametrize("config", [(4, 2, 1, 1, 1, 1, None, 2), (4, 2, 1, 1, 1, 1, None, 4),
                                    (4, 2, 2, 1, 1, 2, 1, 2), (2, 4, 1, 2, 2, 1, None, 2)])
def test_a_homogeneous_plans_collection_under_optimizer_instances_is_megatrons_own(tmp_path, world, config):
    """num_distributed_optimizer_instances > 1: the partial fields (intra_dp_cp, intra_expt_dp, inter_dist_opt,
    intra_dist_opt) are cut as Megatron cuts them, member list for member list."""
    *shape, instances = config
    plan = homogeneous(tmp_path, *shape)
    tp, pp, cp, ep, etp = shape[2:]
    world(plan.world_size - 2, plan.world_size)
    applied = core.build_groups(plan, dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                           context_parallel_size=cp, expert_model_parallel_size=ep,
                                           expert_tensor_parallel_size=etp, create_gloo_process_groups=False,
                                           num_distributed_optimizer_instances=instances))
    own = members(ProcessGroupCollection.use_mpu_process_groups())
    assert own["inter_dist_opt"] is not None and len(own["intra_dp_cp"]) < len(own["dp_cp"])
    fresh = hcoll.planned_collection(applied, from_plan=True)
    assert members(fresh) == own
    assert hcoll.run_instances(ps) == instances
    with pytest.raises(ConfigError, match="does not divide"):
        hcoll.planned_collection(applied, from_plan=True, num_distributed_optimizer_instances=3)


def test_a_heterogeneous_plans_optimizer_instances_each_follow_the_plan(world):
    """IB + RoCE, launch interleaved (a permutation), tp=2: data parallelism spans the fabrics and the plan shards
    the optimizer in an instance per fabric; each instance's groups hold the plan's ranks of one fabric."""
    from megatron_common import DATA, MODEL
    plan = make_plan(load_cluster(DATA / "megatron-ib-roce-8.yaml"), MODEL, tp=2, pp=1)
    assert not plan.is_identity and plan.distributed_optimizer_instances == 2
    world(1, plan.world_size)
    applied = core.build_groups(plan, dict(tensor_model_parallel_size=2, create_gloo_process_groups=False,
                                           num_distributed_optimizer_instances=2))
    fresh = hcoll.planned_collection(applied, from_plan=True)
    got = members(fresh)
    assert got == members(ProcessGroupCollection.use_mpu_process_groups())
    dp_cp = next(g.ranks for g in plan.groups["dp-cp"] if 1 in g.ranks)
    block = next(b for b in (dp_cp[:2], dp_cp[2:]) if 1 in b)
    assert got["intra_dp_cp"] == block and got["intra_expt_dp"] == block
    cluster = lambda ranks: {plan.node_of(r).cluster for r in ranks}     # noqa: E731
    assert cluster(got["intra_dp_cp"]) == cluster(got["intra_dist_opt"]) == {plan.node_of(1).cluster}
    assert len(got["intra_dist_opt"]) == 4 and cluster(got["inter_dist_opt"]) == {"ib", "roce"}
    made = {r.desc: r for r in applied.records if r.desc in ("PLANNED_INTRA_DP_CP", "PLANNED_INTER_DIST_OPT")
            and 1 in r.ranks}
    assert made["PLANNED_INTRA_DP_CP"].transport in {"ib", "roce"} and made["PLANNED_INTER_DIST_OPT"].transport == "socket"
    assert group_check.check_groups(fresh) > 10
