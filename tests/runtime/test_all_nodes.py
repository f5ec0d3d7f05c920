"""Issue 32, the adapters' side: a launch of every node of a cluster whose best plan leaves nodes out stops before
any group (in the start-up's resolution, :func:`het_plugin.core.launch.resolve_launch`), naming the nodes and both
fixes; the user's ask (flag, keyword, section option, ``HET_PLUGIN_USE_ALL_NODES=1``) plans with every node; a plan
file that left nodes out runs on a launch of its kept nodes only."""
from pathlib import Path

import pytest

from het_plugin.core import subsets
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.launch import LeftOutRefused, resolve_launch
from het_plugin.core.request import LaunchRequest
from het_plugin.runtime import restart_replan
from het_plugin.runtime.all_nodes import ENV, use_all_nodes

CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"
OLD = CLUSTERS / "h100-old-ethernet.yaml"       # 8 H100 nodes on IB + 2 V100 nodes behind 25 GbE: 80 ranks
V100 = {"name": "V100-32", "vendor": "nvidia", "memory_gib": 32, "peak_tflops": 125, "intra_node_gbps": 2400}
#: the same question at 6 ranks: two H100 nodes (gpu-a, gpu-b) on IB, one V100 node (old-a) behind 1 GbE
SMALL = {"name": "small", "clusters": [
    {"name": "main", "fabric": {"type": "ib", "gbps": 3200, "latency_us": 2},
     "nodes": [{"count": 2, "accelerator": "H100", "accelerators_per_node": 2, "hostnames": ["gpu-a", "gpu-b"]}]},
    {"name": "annex", "fabric": {"type": "ethernet", "gbps": 1, "latency_us": 30},
     "nodes": [{"count": 1, "accelerator": V100, "accelerators_per_node": 2, "hostnames": ["old-a"]}]}],
    "links": [{"between": ["main", "annex"], "type": "ethernet", "gbps": 1, "latency_us": 100}]}


@pytest.fixture(autouse=True)
def no_env_ask(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)       # tests/conftest.py sets it for the tests not about this


@pytest.fixture(scope="module")
def gpt():
    return preset_model("gpt-7.5b")


@pytest.fixture(scope="module")
def kept_plan(gpt):
    plan = subsets.plan_nodes(load_cluster(OLD), gpt)
    assert plan.left_out["nodes"] == ["annex-0", "annex-1"] and plan.world_size == 64
    return plan


def request(world: int, every: bool, nodes=None) -> LaunchRequest:
    return LaunchRequest.of(world, rank=0, use_all_nodes=every, nodes=nodes)


def test_a_launch_of_every_node_is_refused_naming_the_left_out_nodes_the_gain_and_both_fixes(gpt):
    with pytest.raises(LeftOutRefused) as exc:
        resolve_launch(str(OLD), request(80, use_all_nodes(None)), model=gpt)
    err = exc.value
    assert "annex-0 annex-1" in err.problem and "x)" in err.problem and err.field == "nodes"
    assert "--hostfile-out" in err.fix and "--heterogeneous-use-all-nodes" in err.fix
    assert "use_all_nodes=True" in err.fix and f"{ENV}=1" in err.fix
    assert err.source == str(OLD)


def test_the_ask_plans_with_every_node(gpt):
    plan = resolve_launch(str(OLD), request(80, True), model=gpt).plan
    assert plan.world_size == 80 and not plan.left_out


def test_the_environment_variable_is_the_ask(gpt, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert use_all_nodes(None) is True
    assert use_all_nodes(False) is False                  # an explicit answer wins over the environment
    plan = resolve_launch(str(OLD), request(80, use_all_nodes(None)), model=gpt).plan
    assert plan.world_size == 80
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(ConfigError) as exc:
        use_all_nodes(None)
    assert exc.value.field == ENV


def test_discovery_refuses_the_same_with_the_nodes_it_found(gpt, kept_plan):
    with pytest.raises(LeftOutRefused, match="annex-0 annex-1"):
        resolve_launch(None, request(80, False), model=gpt, discover=lambda: load_cluster(OLD))
    assert resolve_launch(None, request(80, True), model=gpt, discover=lambda: load_cluster(OLD)).plan.world_size == 80


def test_a_plan_file_that_left_nodes_out_runs_on_its_kept_nodes_only(tmp_path, kept_plan):
    path = tmp_path / "plan.json"
    kept_plan.save(path)
    kept = [n.name for n in kept_plan.nodes]
    for every in (False, True):                       # the plan's own left_out decides, not the ask
        assert resolve_launch(str(path), request(64, every, kept)).plan.hash == kept_plan.hash
        with pytest.raises(ConfigError) as exc:
            resolve_launch(str(path), request(80, every))
        assert "annex-0 annex-1" in exc.value.problem and exc.value.source == str(path)
    with pytest.raises(ConfigError, match="annex-1"):
        resolve_launch(str(path), request(64, False, kept[:-1] + ["annex-1"]))


def test_a_restart_accepts_a_previous_plan_that_left_nodes_out(kept_plan, gpt):
    whole = load_cluster(OLD)
    kept = subsets.sub_cluster(whole, [n.name for n in kept_plan.nodes])
    assert restart_replan._fits(kept_plan, kept)          # the nodes that came back are the kept ones
    assert not restart_replan._fits(kept_plan, whole)     # every node came back: the old plan cannot run there
    # and the re-plan for the nodes that came back refuses the same way (its resolve is resolve_launch)
    with pytest.raises(LeftOutRefused):
        resolve_launch(whole, request(80, False), model=gpt, profile=None)


# ---- the asks, per adapter ---------------------------------------------------------------------------------


def test_megatron_lm_flag_is_carried_into_the_request(monkeypatch):
    import argparse
    from types import SimpleNamespace
    from het_plugin.megatron import args as hargs, lm
    parser = hargs.add_arguments(argparse.ArgumentParser(allow_abbrev=False))
    given = parser.parse_args([hargs.FLAG, "c.yaml", hargs.USE_ALL_NODES_FLAG])
    absent = parser.parse_args([hargs.FLAG, "c.yaml"])
    assert given.heterogeneous_use_all_nodes is True and absent.heterogeneous_use_all_nodes is None
    assert lm.megatron_request(4, 0, {}, given).use_all_nodes is True
    assert lm.megatron_request(4, 0, {}, absent).use_all_nodes is False
    monkeypatch.setenv(ENV, "1")
    assert lm.megatron_request(4, 0, {}, SimpleNamespace()).use_all_nodes is True


def test_megatron_core_keyword_reaches_the_request():
    import inspect
    from het_plugin.megatron import mcore
    assert inspect.signature(mcore.initialize_model_parallel).parameters["use_all_nodes"].default is None
    assert mcore.launch_request(4, use_all_nodes=True).use_all_nodes is True
    assert mcore.launch_request(4).use_all_nodes is True           # the keyword form's default: today's plan


def test_deepspeed_section_option_and_wrap_config(tmp_path, monkeypatch, capsys, kept_plan):
    import json
    from het_plugin.cli import main as cli_main
    from het_plugin.deepspeed import SECTION, HetSection
    from het_plugin.deepspeed.plan_source import RunShape, resolve_section_plan
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1}))
    plan_path = tmp_path / "plan.json"
    kept_plan.save(plan_path)
    out = tmp_path / "wrapped.json"
    assert cli_main(["wrap-config", str(ds), "--cluster", str(plan_path), "--use-all-nodes", "-o", str(out)]) == 0
    section = HetSection.from_dict(json.loads(out.read_text())[SECTION])
    assert section.use_all_nodes is True
    shape = RunShape(world_size=80, pp=kept_plan.pp, tp=kept_plan.tp)
    assert shape.request("s", use_all_nodes=True).use_all_nodes is True
    assert shape.request("s").use_all_nodes is False
    assert shape.request("s", use_all_nodes=False).use_all_nodes is False
    monkeypatch.setenv(ENV, "1")
    assert shape.request("s").use_all_nodes is True
    # the wrapped plan left nodes out: a launch of every node stops naming them, whatever the ask
    with pytest.raises(ConfigError, match="annex-0 annex-1"):
        resolve_section_plan(section, shape, source="ds.json")
    with pytest.raises(ConfigError) as exc:
        HetSection.from_dict(dict(section.to_dict(), use_all_nodes="yes"))
    assert exc.value.field == f"{SECTION}.use_all_nodes"


# ---- Megatron-LM's discovery mode and re-plan on restart -----------------------------------------------------


def megatron_args(spec, **more):
    """Megatron-LM's parsed arguments for ``spec`` (what model_from_args reads), without a file: the bare flag."""
    from types import SimpleNamespace
    return SimpleNamespace(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                           num_attention_heads=spec.num_attention_heads, ffn_hidden_size=spec.ffn_hidden_size,
                           seq_length=spec.seq_length, max_position_embeddings=spec.seq_length,
                           micro_batch_size=1, global_batch_size=spec.global_batch_size, vocab_size=spec.vocab_size,
                           bf16=True, **more)


def test_megatron_lm_discovery_refuses_or_plans_every_node_with_the_nodes_it_discovered(gpt, monkeypatch):
    """The bare --heterogeneous-nic: the discovered cluster (here the example's, by hostname) is planned over
    subsets; its left-out nodes stop the launch, and --heterogeneous-use-all-nodes plans all 80 ranks."""
    from het_plugin.megatron import lm, mcore
    from het_plugin.megatron.args import DISCOVER
    discovered = []
    monkeypatch.setattr(mcore, "discover_cluster", lambda: discovered.append(1) or load_cluster(OLD))
    args = megatron_args(gpt)
    request = lm.megatron_request(80, 0, {}, args)
    with pytest.raises(LeftOutRefused) as exc:
        lm.megatron_planning(args, request, DISCOVER).resolve(None)
    assert "annex-0 annex-1" in exc.value.problem and "--heterogeneous-use-all-nodes" in exc.value.fix
    every = megatron_args(gpt, heterogeneous_use_all_nodes=True)
    plan = lm.megatron_planning(every, lm.megatron_request(80, 0, {}, every), DISCOVER).resolve(None).plan
    assert plan.world_size == 80 and not plan.left_out and discovered == [1, 1]


def _profile_for(plan, tmp_path):
    """A measured profile the plan's run wrote (every stage alike), and the ran plan beside it."""
    from het_plugin.core.cost.measured import RankTimes, measured_profile
    ranks = [RankTimes(r, iterations=4, micro_batches=plan.num_micro_batches, forward_s=0.1, backward_s=0.2,
                       iteration_s=4.0, intervals=4) for r in range(plan.world_size)]
    path = tmp_path / "run.yaml"
    measured_profile(plan, ranks, "test").save(path)
    plan.save(restart_replan.ran_plan_path(str(path)))
    return str(path)


@pytest.fixture(scope="module")
def small():
    """SMALL and its plan: old-a left out, 4 ranks on gpu-a, gpu-b."""
    from het_plugin.core.inputs.cluster import cluster_from_dict
    cluster, model = cluster_from_dict(SMALL, "small.yaml"), preset_model("gpt-3.6b")
    plan = subsets.plan_nodes(cluster, model)
    assert plan.left_out["nodes"] == ["old-a"] and [n.name for n in plan.nodes] == ["gpu-a", "gpu-b"]
    return cluster, model, plan


def test_a_restart_where_the_left_out_nodes_came_back(small, tmp_path):
    """The last attempt ran the plan for the kept nodes; at this start every node came back. Planned for them
    (with the measured times): refused naming the left-out node (it would get no place), or with the ask, planned
    for all 6 ranks (the old plan cannot run there). A start on exactly the kept nodes keeps the old plan."""
    whole, model, kept_plan = small
    path = _profile_for(kept_plan, tmp_path)

    def resolve_with(cluster, every):
        world = cluster.world_size
        return lambda profile: resolve_launch(cluster, request(world, every), model=model, profile=profile)

    with pytest.raises(LeftOutRefused, match="old-a"):
        restart_replan.resolve_on_restart(resolve_with(whole, False), path)
    chosen, decision = restart_replan.resolve_on_restart(resolve_with(whole, True), path)
    assert chosen.plan.world_size == 6 and decision.replanned
    assert "does not fit the nodes of this start" in "\n".join(decision.lines)
    kept = subsets.sub_cluster(whole, ["gpu-a", "gpu-b"])
    chosen, decision = restart_replan.resolve_on_restart(resolve_with(kept, False), path)
    assert chosen.plan.world_size == 4 and [n.name for n in chosen.plan.nodes] == ["gpu-a", "gpu-b"]
    assert decision.old is not None and decision.old.hash == kept_plan.hash     # the old plan fits its nodes


def test_a_restart_that_the_analytic_plan_would_refuse_is_decided_by_the_measured_times(small, tmp_path):
    """The profile, not the analytic model, decides which nodes pay at a re-plan: the analytic plan's refusal
    stands only where the plan with the measured times leaves nodes out too (or there is no profile)."""
    whole, model, kept_plan = small
    path = _profile_for(kept_plan, tmp_path)
    calls = []

    def resolve(profile):
        calls.append(profile is not None)
        if profile is None:
            raise LeftOutRefused("the best plan leaves out old-a", field="nodes")
        return resolve_launch(whole, request(6, True), model=model, profile=profile)

    chosen, decision = restart_replan.resolve_on_restart(resolve, path)
    assert chosen.plan.world_size == 6 and calls == [False, True]      # the profile's plan, planned once
    with pytest.raises(LeftOutRefused):
        restart_replan.resolve_on_restart(resolve, str(tmp_path / "no-profile-yet.yaml"))


def test_a_plan_file_whose_left_out_nodes_came_back_is_refused_on_restart(small, tmp_path):
    """A plan file cannot be re-planned: a start with the left-out nodes back stops naming them."""
    _, _, kept_plan = small
    path = _profile_for(kept_plan, tmp_path)
    plan_path = tmp_path / "plan.json"
    kept_plan.save(plan_path)
    with pytest.raises(ConfigError, match="including the left-out old-a"):
        restart_replan.resolve_on_restart(lambda profile: resolve_launch(str(plan_path), request(6, False)), path)
    chosen, decision = restart_replan.resolve_on_restart(
        lambda profile: resolve_launch(str(plan_path), request(4, False)), path)
    assert chosen.plan.hash == kept_plan.hash and "plan file" in decision.lines[0]
