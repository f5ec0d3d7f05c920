"""Every configuration Megatron accepts gives Megatron's own groups on a homogeneous cluster: expert
parallelism (with expert-tensor-parallel sizes), context parallelism across nodes, and both rank orders.

Two checks per configuration: the plan's groups equal the installed Megatron's ``RankGenerator`` lists,
and Megatron's real ``initialize_model_parallel`` (on torch's fake process group, one rank's view)
creates exactly the same groups, in the same order, with and without het_plugin.
"""
from __future__ import annotations

import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.megatron import mcore as core
from het_plugin.core.inputs.model import ModelSpec
from het_plugin.core.planner import make_plan
from het_plugin.core.ranks.dims import EXPERT_KINDS, GROUP_KINDS

ps = pytest.importorskip("megatron.core.parallel_state")

DEFAULT, TP_PP_DP = "tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"
# (nodes, accelerators per node, tp, pp, cp, ep, etp): Megatron's own table up to 64 ranks (which has
# ep > 1 and tp*cp larger than a node), plus expert-TP sizes other than tp and CP rings over nodes.
CONFIGS = [
    (1, 8, 8, 1, 1, 1, None), (1, 8, 2, 2, 1, 1, None), (1, 8, 2, 4, 1, 1, None), (3, 8, 8, 3, 1, 1, None),
    (4, 8, 2, 4, 1, 1, None), (8, 8, 2, 1, 1, 4, None), (8, 8, 2, 2, 2, 4, None), (8, 8, 2, 1, 4, 8, None),
    (8, 8, 2, 2, 2, 8, None), (4, 8, 4, 1, 4, 2, 1), (2, 4, 2, 1, 4, 1, None), (4, 2, 1, 2, 4, 2, 2),
    (2, 8, 4, 2, 1, 4, 1), (4, 4, 2, 2, 2, 2, 4),
]


def _cluster(tmp_path, nodes: int, per_node: int):
    path = tmp_path / "homogeneous.yaml"
    path.write_text(f"name: homogeneous-{nodes}x{per_node}\nclusters:\n  - name: ib\n"
                    "    fabric: {type: ib, gbps: 400}\n"
                    f"    nodes:\n      - {{count: {nodes}, accelerator: H100, accelerators_per_node: {per_node}}}\n")
    return load_cluster(path)


def megatron_accepts(nodes, per_node, tp, pp, cp, ep, etp, order) -> bool:
    """Megatron refuses an order not ending in pp whose expert data-parallel size differs from dp."""
    dp = nodes * per_node // (tp * pp * cp)
    return order.endswith("pp") or pp == 1 or tp * cp * dp // ((etp or tp) * ep) == dp


def _plan(tmp_path, nodes, per_node, tp, pp, cp, ep, etp, order):
    dp = nodes * per_node // (tp * pp * cp)
    model = ModelSpec(name="moe-ish", num_layers=2 * pp, hidden_size=64, num_attention_heads=8, vocab_size=128,
                      seq_length=64, global_batch_size=dp, micro_batch_size=1)
    return make_plan(_cluster(tmp_path, nodes, per_node), model, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)


@pytest.mark.parametrize("order", [DEFAULT, TP_PP_DP])
@pytest.mark.parametrize("nodes,per_node,tp,pp,cp,ep,etp", CONFIGS)
def test_the_plan_is_megatrons_numbering(tmp_path, nodes, per_node, tp, pp, cp, ep, etp, order):
    if not megatron_accepts(nodes, per_node, tp, pp, cp, ep, etp, order):
        with pytest.raises(ConfigError, match="does not end in pp"):
            _plan(tmp_path, nodes, per_node, tp, pp, cp, ep, etp, order)
        return
    plan = _plan(tmp_path, nodes, per_node, tp, pp, cp, ep, etp, order)
    assert plan.homogeneous and plan.is_identity and plan.order == order
    dims = plan.dims
    decoder = ps.RankGenerator(tp=tp, ep=1, dp=plan.dp, pp=pp, cp=cp, order=order)
    expert = ps.RankGenerator(tp=dims.etp, ep=ep, dp=dims.expert_dp, pp=pp, cp=1, order=order)
    for kind in GROUP_KINDS:
        assert [g.ranks for g in plan.groups[kind]] == decoder.get_ranks(kind), kind
    experts = [k for k in plan.groups if k.startswith("expert-")]
    assert sorted(experts) == (sorted(EXPERT_KINDS) if (ep, dims.etp) != (1, tp) else [])
    for kind in experts:
        assert [g.ranks for g in plan.groups[kind]] == expert.get_ranks(kind[len("expert-"):]), kind


@pytest.fixture
def fake_world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int, world: int):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _megatron_alone(kwargs, monkeypatch) -> list[tuple[list[int], str]]:
    made = []
    original = ps.create_group

    def recording(ranks=None, *args, group_desc=None, **kw):
        made.append((list(ranks) if ranks is not None else None, group_desc))
        return original(ranks, *args, group_desc=group_desc, **kw)

    with monkeypatch.context() as m:
        m.setattr(ps, "create_group", recording)
        ps.initialize_model_parallel(**kwargs)
    ps.destroy_model_parallel()
    return made


# ep with pp and CP across nodes; expert TP other than tp; both orders where Megatron takes them.
SAME_GROUPS = [(CONFIGS[6], DEFAULT), (CONFIGS[13], DEFAULT), (CONFIGS[2], TP_PP_DP), (CONFIGS[9], TP_PP_DP),
               (CONFIGS[11], TP_PP_DP), (CONFIGS[10], DEFAULT)]


@pytest.mark.parametrize("config,order", SAME_GROUPS)
def test_megatron_creates_the_same_groups_with_and_without_het_plugin(tmp_path, fake_world, monkeypatch, config,
                                                                     order):
    nodes, per_node, tp, pp, cp, ep, etp = config
    assert megatron_accepts(nodes, per_node, tp, pp, cp, ep, etp, order)
    plan = _plan(tmp_path, nodes, per_node, tp, pp, cp, ep, etp, order)
    rank = plan.world_size - 3
    fake_world(rank, plan.world_size)
    kwargs = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                  expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, order=order,
                  create_gloo_process_groups=False)
    alone = _megatron_alone(kwargs, monkeypatch)
    applied = core.build_groups(plan, kwargs)
    assert [(r.ranks, r.desc) for r in applied.records] == alone
    assert len(alone) > 10


def test_arguments_that_disagree_with_the_plan_are_refused_by_name(tmp_path):
    plan = _plan(tmp_path, 2, 8, 2, 2, 1, 2, None, DEFAULT)
    with pytest.raises(Exception, match="expert_model_parallel_size=4 was passed, but the plan was made for 2"):
        core.check_kwargs_fit(plan, {"expert_model_parallel_size": 4})
    with pytest.raises(Exception, match="order='tp-cp-ep-pp-dp' was passed, but the plan was made for 'tp-cp-ep-dp-pp'"):
        core.check_kwargs_fit(plan, {"expert_model_parallel_size": 2, "order": TP_PP_DP})
    core.check_kwargs_fit(plan, {"expert_model_parallel_size": 2, "order": "tp-cp-ep-dp-pp",
                                 "virtual_pipeline_model_parallel_size": 2})      # identity: Megatron's own
