"""Planner search: Holmes-shaped plan, homogeneous no-op, fixed degrees, determinism, bad inputs."""
from pathlib import Path

import pytest

from het_plugin.core import planner
from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.planner import make_plan, uniform_layers

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RDMA_OR_LOCAL = {"local", "ib", "roce"}


def cluster(name):
    return load_cluster(EXAMPLES / "clusters" / f"{name}.yaml")


@pytest.fixture(scope="module", params=["gpt-7.5b", "gpt-39b"])
def holmes_plan(request):
    return make_plan(cluster("holmes-ib-roce"), preset_model(request.param))


def stage_cluster(plan, stage):
    ranks = [r for r in range(plan.world_size) if plan.stage_of(r) == stage]
    return {plan.node_of(r).cluster for r in ranks}


def _instance_blocks(plan, ranks):
    """A dp group's optimizer instances (Megatron: consecutive blocks of its members in logical order)."""
    logical = plan.logical_of_physical
    ordered = sorted(ranks, key=lambda r: logical[r])
    size = len(ordered) // plan.distributed_optimizer_instances
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def test_holmes_keeps_tp_and_the_gradient_reduction_inside_one_fabric(holmes_plan):
    """TP inside a node; the reduce-scatter and all-gather of the gradients inside one fabric: a DP group either
    stays in one, or (Megatron's partial distributed optimizer) each of its optimizer instances does."""
    for g in holmes_plan.groups["tp"]:
        assert g.transport in RDMA_OR_LOCAL and len({holmes_plan.node_of(r).name for r in g.ranks}) == 1, g
    for kind in ("dp", "dp-cp"):
        for g in holmes_plan.groups[kind]:
            for block in _instance_blocks(holmes_plan, g.ranks):
                assert len({holmes_plan.node_of(r).cluster for r in block}) == 1, (kind, g)
            if holmes_plan.distributed_optimizer_instances == 1:
                assert g.transport in RDMA_OR_LOCAL, (kind, g)


def test_holmes_crosses_ethernet_only_with_pipeline_traffic_or_the_shards(holmes_plan):
    crossing = {kind for kind, groups in holmes_plan.groups.items()
                if any(len({holmes_plan.node_of(r).cluster for r in g.ranks}) > 1 for g in groups)}
    assert crossing, "a 2-cluster plan must cross once"
    shards = {"dp", "dp-cp", "tp-dp", "tp-dp-cp"} if holmes_plan.distributed_optimizer_instances > 1 else set()
    assert all("pp" in kind.split("-") or kind == "embedding" or kind in shards for kind in crossing), crossing
    socket_kinds = {kind for kind, groups in holmes_plan.groups.items() if any(g.transport == "socket" for g in groups)}
    assert socket_kinds <= crossing


def test_holmes_gives_ib_stages_at_least_the_layers_of_roce_stages(holmes_plan):
    if holmes_plan.pp == 1:     # data parallel across the fabrics: only with an optimizer instance per fabric
        assert holmes_plan.distributed_optimizer_instances == 2
        holmes_plan = make_plan(cluster("holmes-ib-roce"), preset_model("gpt-7.5b"), pp=2)
    by_fabric = {"ib": [], "roce": []}
    for s, n in enumerate(holmes_plan.layers_per_stage):
        (c,) = stage_cluster(holmes_plan, s)
        by_fabric[c].append(n)
    assert by_fabric["ib"] and by_fabric["roce"]
    assert min(by_fabric["ib"]) >= max(by_fabric["roce"])


def test_holmes_plan_predicts_faster_than_the_framework_default(holmes_plan):
    assert holmes_plan.baseline is not None
    assert holmes_plan.prediction.iteration_s < holmes_plan.baseline.iteration_s
    assert holmes_plan.speedup > 1
    assert "framework default" in holmes_plan.baseline.description
    assert holmes_plan.prediction.fits


def test_alternatives_are_small_dicts_no_better_than_the_plan(holmes_plan):
    # the next best first, then the best of each other shape (a heterogeneous cluster)
    alts = holmes_plan.alternatives
    nxt = alts[:planner.NUM_ALTERNATIVES]
    assert len(nxt) >= 1
    times = [a["iteration_s"] for a in nxt]
    assert times == sorted(times)
    assert min(a["iteration_s"] for a in alts) >= round(holmes_plan.prediction.iteration_s, 6)
    assert {"tp", "pp", "dp", "micro_batch_size", "layers_per_stage", "shape", "replica_split"} <= set(alts[0])
    extra = [a["shape"] for a in alts[planner.NUM_ALTERNATIVES:]]
    assert len(extra) == len(set(extra)) and holmes_plan.prediction.shape not in extra


@pytest.mark.parametrize("model", ["gpt-7.5b", "gpt-39b", "llama2-7b"])
def test_homogeneous_cluster_gets_the_frameworks_default(model):
    m = preset_model(model)
    plan = make_plan(cluster("homogeneous-ib"), m)
    assert plan.is_identity and plan.homogeneous
    assert m.num_layers % plan.pp == 0
    assert plan.layers_per_stage == uniform_layers(m.num_layers, plan.pp)
    assert plan.speedup == pytest.approx(1.0)


def test_homogeneous_with_fixed_degrees_stays_identity_and_uniform():
    plan = make_plan(cluster("homogeneous-ib"), preset_model("gpt-39b"), tp=4, pp=4)
    assert (plan.tp, plan.pp, plan.dp) == (4, 4, 4)
    assert plan.is_identity and plan.layers_per_stage == [12, 12, 12, 12]


def test_fixed_degrees_and_micro_batch_are_respected():
    holmes = cluster("holmes-ib-roce")
    plan = make_plan(holmes, preset_model("gpt-7.5b"), tp=2, pp=4, micro_batch_size=2)
    assert (plan.tp, plan.pp, plan.dp, plan.micro_batch_size) == (2, 4, 8, 2)
    plan = make_plan(holmes, preset_model("gpt-7.5b"), dp=4)
    assert plan.dp == 4
    fixed_mb = preset_model("gpt-7.5b").model_copy(update={"micro_batch_size": 4})
    assert make_plan(holmes, fixed_mb).micro_batch_size == 4


def test_same_input_same_plan_hash():
    a = make_plan(cluster("holmes-ib-roce"), preset_model("gpt-7.5b"))
    b = make_plan(cluster("holmes-ib-roce"), preset_model("gpt-7.5b"))
    assert a.hash == b.hash


def test_hethub_mix_keeps_vendors_apart_and_gives_slower_devices_fewer_layers():
    plan = make_plan(cluster("hethub-mix"), preset_model("llama-140b"))
    for kind in ("tp", "dp"):
        for g in plan.groups[kind]:
            assert len({plan.vendor_of(r) for r in g.ranks}) == 1
    assert {g.transport for g in plan.groups["pp"]} == {"host-staged"}
    amd = [n for s, n in enumerate(plan.layers_per_stage) if plan.vendor_of(plan.rank_of_logical[s * plan.tp * plan.dp]) == "amd"]
    other = [n for s, n in enumerate(plan.layers_per_stage) if s not in (0, plan.pp - 1)
             and plan.vendor_of(plan.rank_of_logical[s * plan.tp * plan.dp]) == "other"]
    assert amd and other and max(amd) <= min(other)     # MI250X (191.5 TF) vs the 256 TF part
    assert plan.prediction.iteration_s < plan.baseline.iteration_s


def test_pp_larger_than_layers_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        make_plan(cluster("holmes-ib-roce"), preset_model("gpt-3.6b"), pp=32)
    assert err.value.field == "pp" and "30" in err.value.fix


def test_tp_that_does_not_fit_nodes_or_heads_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        make_plan(cluster("holmes-ib-roce"), preset_model("gpt-7.5b"), tp=3)
    assert err.value.field == "tp"
    with pytest.raises(ConfigError) as err:
        make_plan(cluster("holmes-ib-roce"), preset_model("gpt-7.5b").model_copy(update={"num_attention_heads": 4,
                                                                                          "hidden_size": 4096}), tp=8)
    assert err.value.field == "tp" and "heads" in str(err.value)


def test_no_valid_degree_combination_is_a_config_error():
    odd = preset_model("gpt-7.5b").model_copy(update={"global_batch_size": 7})
    with pytest.raises(ConfigError) as err:
        make_plan(cluster("holmes-ib-roce"), odd, tp=8, pp=1)
    assert err.value.field == "degrees" and "global_batch_size" in str(err.value)


def test_memory_that_cannot_hold_the_smallest_plan_is_a_config_error():
    tiny = cluster_from_dict({"clusters": [{"name": "c", "fabric": {"type": "ib", "gbps": 200}, "nodes": [
        {"count": 1, "accelerators_per_node": 8,
         "accelerator": {"name": "tiny", "vendor": "x", "memory_gib": 4, "peak_tflops": 100}}]}]})
    with pytest.raises(ConfigError) as err:
        make_plan(tiny, preset_model("gpt-7.5b"))
    assert "memory cannot hold even the smallest plan" in str(err.value)
    assert "memory_gib" in err.value.field and err.value.fix


def test_progress_is_reported_to_the_callback_and_nothing_is_printed(capsys):
    calls = []
    make_plan(cluster("holmes-ib-roce"), preset_model("gpt-7.5b"), progress=lambda *a: calls.append(a))
    assert calls, "the search reports each degree combination"
    total = calls[0][1]
    assert [c[0] for c in calls] == list(range(1, total + 1)) and {c[1] for c in calls} == {total}
    assert calls[-1][2] is not None and calls[-1][2] > 0        # best iteration time so far, in seconds
    make_plan(cluster("holmes-ib-roce"), preset_model("gpt-7.5b"))
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""


def _two_device_cluster():
    nodes = lambda acc: [{"count": 2, "accelerator": acc, "accelerators_per_node": 8,
                          "nics": [{"type": "ethernet", "gbps": 100}]}]
    return cluster_from_dict({"name": "a100-h100", "clusters": [
        {"name": "old", "fabric": {"type": "ib", "gbps": 800}, "nodes": nodes("A100-80")},
        {"name": "new", "fabric": {"type": "ib", "gbps": 800}, "nodes": nodes("H100")}],
        "links": [{"between": ["old", "new"], "gbps": 100}]})


def _layers_by_device(plan):
    out = {}
    stage_size = plan.tp * plan.cp * plan.dp
    for s, n in enumerate(plan.layers_per_stage):
        node = plan.node_of(plan.rank_of_logical[s * stage_size])
        out.setdefault(node.accelerator, []).append(n)
    return out


def test_faster_devices_get_more_layers():
    plan = make_plan(_two_device_cluster(), preset_model("gpt-7.5b"), tp=8, pp=2, micro_batch_size=1)
    by_device = _layers_by_device(plan)
    assert by_device["H100"][0] > by_device["A100-80"][0]


def test_a_measured_profile_changes_the_split():
    from het_plugin.core.inputs.profile import Profile
    prof = Profile()
    prof.add_compute("A100-80", "layer", 1, 8, 0.0001, 0.0002)     # "measured": ~3x faster than the H100 estimate
    plan = make_plan(_two_device_cluster(), preset_model("gpt-7.5b"), tp=8, pp=2, micro_batch_size=1, profile=prof)
    by_device = _layers_by_device(plan)
    assert by_device["A100-80"][0] > by_device["H100"][0]


def test_homogeneous_cluster_where_no_pp_divides_the_layers_still_gets_an_identity_plan():
    # 40 ranks, 24 layers, batch 96: no (pp, dp) the degrees allow has a pp dividing 24, so Megatron's uniform
    # default is impossible; this used to end in "memory cannot hold ... nan GiB".
    from het_plugin.core.inputs.model import ModelSpec
    cluster = cluster_from_dict({"clusters": [{"name": "c0", "fabric": {"type": "roce", "gbps": 100},
                                               "nodes": [{"count": 5, "accelerator": "other-vendor",
                                                          "accelerators_per_node": 8}]}]})
    model = ModelSpec(num_layers=24, hidden_size=512, num_attention_heads=8, vocab_size=1000, seq_length=256,
                      global_batch_size=96)
    plan = make_plan(cluster, model)
    assert plan.is_identity
    assert sum(plan.layers_per_stage) == 24 and 24 % plan.pp != 0


def test_plan_candidates_refuses_a_keyword_it_would_not_honour():
    """plan_candidates reads make_plan's degree keywords as one mapping: a schedule or NCCL keyword (which its 1F1B
    search would ignore) or a misspelt degree is an error, not silently dropped."""
    cluster = load_cluster(EXAMPLES / "clusters" / "h100-a100.yaml")
    model = preset_model("gpt-7.5b")
    for bad in ({"vpp": 2}, {"nccl": None}, {"tpp": 2}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            planner.plan_candidates(cluster, model, **bad)
    fixed = planner.plan_candidates(cluster, model, tp=2, micro_batch_size=1)
    assert fixed and all(c.placement.dims.tp == 2 and c.micro_batch_size == 1 for c in fixed)
