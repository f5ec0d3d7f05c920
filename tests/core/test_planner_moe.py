"""The planner with mixture-of-experts models: ep searched among the divisors of num_moe_experts, every expert
group kept inside one domain (one fabric, one vendor), ep refused with the field and the fix."""
from pathlib import Path

import pytest

from het_plugin.cli import main
from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.model import ModelSpec, preset_model
from het_plugin.core.planner import make_plan
from het_plugin.core.ranks.dims import Degrees

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def cluster(name):
    return load_cluster(EXAMPLES / "clusters" / f"{name}.yaml")


def domains_of(plan, ranks):
    return {(plan.node_of(r).cluster, plan.node_of(r).accelerator) for r in ranks}


@pytest.fixture(scope="module", params=["holmes-ib-roce", "hethub-mix"])
def mixtral_plan(request):
    return make_plan(cluster(request.param), preset_model("mixtral-8x7b"), ep=None, micro_batch_size=1)


def test_mixtral_plans_with_expert_groups_inside_one_domain(mixtral_plan):
    plan = mixtral_plan
    assert plan.ep > 1 and 8 % plan.ep == 0 and plan.dims.etp in (1, plan.tp)
    for kind in ("expert-ep", "expert-tp-ep", "expert-tp", "expert-dp"):
        assert plan.groups[kind], kind
    for kind in ("expert-ep", "expert-tp-ep", "expert-tp"):
        for g in plan.groups[kind]:
            assert len(domains_of(plan, g.ranks)) == 1, (kind, g)
    # the expert gradients' reduction spans domains only where the dense one does (data parallelism across
    # domains, issue 12), on the transport the rule gives
    dense_spans = any(len(domains_of(plan, g.ranks)) > 1 for g in plan.groups["dp"])
    for g in plan.groups["expert-dp"]:
        assert len(domains_of(plan, g.ranks)) == 1 or dense_spans, g
        assert g.transport == plan.rule_transport(g.ranks)
    # the all-to-all runs on the node's own links or one domain's fabric, never across a slow link or vendors
    # (on the HETHUB-like mix the planner now takes data parallelism across the vendors with ep8 etp2: two nodes)
    assert {g.transport for g in plan.groups["expert-ep"]} <= {"local", "ib", "roce"}
    assert plan.prediction.alltoall_s > 0
    assert plan.speedup is not None and plan.speedup > 1


def test_ep_one_stays_the_default_for_existing_callers():
    plan = make_plan(cluster("holmes-ib-roce"), preset_model("mixtral-8x7b"), micro_batch_size=1)
    assert (plan.ep, plan.dims.etp) == (1, plan.tp)
    assert "expert-ep" not in plan.groups and plan.prediction.alltoall_s == 0


def test_a_dense_model_searches_no_expert_sizes():
    a = make_plan(cluster("holmes-ib-roce"), preset_model("gpt-7.5b"), ep=None)
    b = make_plan(cluster("holmes-ib-roce"), preset_model("gpt-7.5b"))
    assert a.hash == b.hash and a.ep == 1


def test_ep_that_does_not_divide_the_experts_is_refused():
    with pytest.raises(ConfigError) as info:
        make_plan(cluster("holmes-ib-roce"), preset_model("mixtral-8x7b"), ep=3)
    err = info.value
    assert err.field == "ep (expert_model_parallel_size)"
    assert "does not divide num_moe_experts=8" in err.problem and "[1, 2, 4, 8]" in err.fix
    # Megatron's own names when the degrees come from its arguments
    with pytest.raises(ConfigError) as info:
        Degrees(64, ep=3, num_experts=8, names={"ep": "expert_model_parallel_size"})
    assert info.value.field == "expert_model_parallel_size"
    assert "expert_model_parallel_size in [1, 2, 4, 8]" in info.value.fix


def uneven_cluster():
    """3 IB nodes + 1 RoCE node of 8: a 16-rank expert group would have to straddle the two fabrics."""
    return cluster_from_dict({"name": "uneven", "clusters": [
        {"name": "ib", "fabric": {"type": "ib", "gbps": 800},
         "nodes": [{"count": 3, "accelerator": "H100", "accelerators_per_node": 8}]},
        {"name": "roce", "fabric": {"type": "roce", "gbps": 400},
         "nodes": [{"count": 1, "accelerator": "H100", "accelerators_per_node": 8}]}],
        "links": [{"between": ["ib", "roce"], "gbps": 25}]})


def small_moe(**kw):
    base = dict(name="small-moe", num_layers=4, hidden_size=512, num_attention_heads=8, vocab_size=1000,
                seq_length=512, global_batch_size=64, num_moe_experts=16, moe_router_topk=2)
    base.update(kw)
    return ModelSpec(**base)


def test_an_expert_group_across_domains_is_never_planned():
    with pytest.raises(ConfigError) as info:
        make_plan(uneven_cluster(), small_moe(), ep=16, etp=1, tp=1)
    err = info.value
    assert err.field == "ep (expert_model_parallel_size)"
    assert "spans ib/H100 and roce/H100" in err.problem and "smaller ep" in err.fix
    plan = make_plan(uneven_cluster(), small_moe(), ep=None)
    for g in plan.groups.get("expert-tp-ep", []):
        assert len(domains_of(plan, g.ranks)) == 1, g
    assert plan.ep <= 8


def test_the_report_shows_where_ep_lives(capsys):
    rc = main(["plan", str(EXAMPLES / "clusters" / "holmes-ib-roce.yaml"), "--model", "mixtral-8x7b",
               "--micro-batch-size", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    degrees = next(line for line in out.splitlines() if line.startswith("degrees:"))
    assert " ep=" in degrees and " etp=" in degrees
    assert "expert parallelism (where EP lives):" in out and "expert-ep=local" in out
    assert "stays inside one domain" in out
    assert "expert all-to-all" in out and "of the iteration" in out
    assert "speed-up over the baseline" in out


def test_fixed_ep_from_the_command_line(capsys):
    rc = main(["plan", str(EXAMPLES / "clusters" / "holmes-ib-roce.yaml"), "--model", "deepseek-moe-16b",
               "--ep", "16", "--etp", "1", "--pp", "2", "--micro-batch-size", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "ep=16 etp=1" in out
    # 16 ranks are two nodes: the all-to-all runs over each cluster's own fabric, never the 25 GbE link
    line = next(line for line in out.splitlines() if line.strip().startswith("transports: expert-ep="))
    assert "expert-ep=ib/roce" in line
