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
