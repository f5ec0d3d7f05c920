"""DeepSpeed on CPU/gloo, multi-process: the plan's placement, layer split and transports, and the same
losses as DeepSpeed's defaults. Each launch has a hard timeout (a hang fails with a stack dump)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("deepspeed")

from het_plugin.core.inputs.cluster import load_cluster  # noqa: E402
from het_plugin.deepspeed import wrap, write_config  # noqa: E402
from het_plugin.deepspeed.partition import counted_layers, layers_in_parts  # noqa: E402
from het_plugin.core.inputs.model import load_model  # noqa: E402
from het_plugin.core.ranks.placement import place  # noqa: E402
from het_plugin.core.plan import Plan  # noqa: E402
from het_plugin.core.planner import assemble_plan  # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims  # noqa: E402
from integration_tests.support.deepspeed_cpu import cpu_environment  # noqa: E402
from integration_tests.support.launch import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
PIPE = HERE / "ranks" / "deepspeed_pipe.py"
ZERO = HERE / "ranks" / "deepspeed_zero.py"
MODEL = load_model(DATA / "ds_tiny_model.yaml")
PIPE_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 8,
               "steps_per_print": 10 ** 6}
ZERO_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 8,
               "steps_per_print": 10 ** 6, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
# The layer list of the rank script: InProj, 8 x Block, Head; the plan counts the blocks.
LAYER_NAMES = ["InProj"] + ["Block"] * 8 + ["Head"]
ENV = dict(cpu_environment(), HET_PLUGIN_GLOO_IFNAMES="local=lo,ib=lo,roce=lo,socket=lo")
TIMEOUT = 150


def launch(script: Path, world: int, args, **kw):
    outs = run_ranks(script, world, [str(a) for a in args], env=ENV, timeout=TIMEOUT, **kw)
    return outs


def results(outs) -> list[dict]:
    return sorted((o.result for o in outs), key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deepspeed")


@pytest.fixture(scope="module")
def baseline_pp2_dp2():
    return results(launch(PIPE, 4, ["--baseline", "--pp", 2, "--mp", 1]))


@pytest.fixture(scope="module")
def baseline_pp2_mp2_dp2():
    return results(launch(PIPE, 8, ["--baseline", "--pp", 2, "--mp", 2]))


def assert_follows_plan(res: list[dict], plan: Plan) -> None:
    """Every rank's topology, groups, neighbour, stage and layer split are the plan's."""
    counted = counted_layers(LAYER_NAMES, "Block")
    for r in res:
        rank = r["rank"]
        assert r["plan_hash"] == plan.hash
        coord = plan.coord(rank)
        assert r["stage"] == coord["pp"] and r["data_id"] == coord["dp"]
        assert r["comm_lists"]["data"] == [g.ranks for g in plan.groups["dp"]]
        assert r["comm_lists"]["pipe"] == [g.ranks for g in plan.groups["pp"]]
        assert r["comm_lists"]["model"] == [g.ranks for g in plan.groups["tp"]]
        # The process groups DeepSpeed uses, members in group-rank order.
        assert r["dp_group"] == plan.group_of("dp", rank).ranks
        assert r["pp_group"] == plan.group_of("pp", rank).ranks
        assert r["slice_group"] == plan.group_of("tp", rank).ranks
        pipe = plan.group_of("pp", rank).ranks
        assert r["next_rank"] == (pipe[pipe.index(rank) + 1] if rank != pipe[-1] else None)
        assert layers_in_parts(r["parts"], counted) == plan.layers_per_stage
        # Every group was created with the plan's transport, inside gloo_network (ifname from the env map).
        planned = {frozenset(g.ranks): g.transport for kind in ("dp", "pp", "tp") for g in plan.groups[kind]}
        seen = {frozenset(ranks): transport for ranks, transport, _ in r["records"]}
        for members, transport in planned.items():
            assert seen[members] == transport
        assert all(ifname == "lo" for _, _, ifname in r["records"])
        assert r["gloo_ifname_after"] is None


def assert_same_losses(res: list[dict], baseline: list[dict]) -> None:
    expected = baseline[0]["losses"]
    assert all(r["losses"] == pytest.approx(expected, rel=1e-5, abs=1e-7) for r in res)
    assert len(expected) == 3 and len(set(expected)) > 1    # it trained: the loss moved


def test_pp2_dp2_uneven_split_on_heterogeneous_cluster(workdir, baseline_pp2_dp2):
    """A plan file with an uneven split (5/3) and a permuted placement, through a wrapped config."""
    cluster = load_cluster(DATA / "ds_hetero_4.yaml")
    plan = assemble_plan(cluster, MODEL, place(cluster, ParallelDims(pp=2, dp=2)), [5, 3], 2)
    assert not plan.is_identity
    plan.save(workdir / "plan4.json")
    write_config(wrap(PIPE_CONFIG, workdir / "plan4.json", layer_pattern="Block", pp=2), workdir / "cfg4.json")
    res = results(launch(PIPE, 4, ["--config", workdir / "cfg4.json", "--pp", 2, "--mp", 1]))
    assert_follows_plan(res, plan)
    assert res[0]["parts"] != baseline_pp2_dp2[0]["parts"]          # DeepSpeed alone splits differently
    assert_same_losses(res, baseline_pp2_dp2)


def test_pp2_mp2_dp2_planned_from_the_cluster_file(workdir, baseline_pp2_mp2_dp2):
    """The production path: wrap with a cluster file and a model; every rank loads the embedded plan."""
    cfg = wrap(PIPE_CONFIG, DATA / "ds_hetero_8.yaml", MODEL, pp=2, tp=2, layer_pattern="Block")
    write_config(cfg, workdir / "cfg8.json")
    plan = Plan.from_dict(cfg["heterogeneous"]["plan"])
    assert (plan.pp, plan.tp, plan.dp) == (2, 2, 2)
    # (issue 30) never slower than DeepSpeed's own layout on today's stock stack: for this tiny model the planner's
    # permuted placement may lose to it, and then the plan is DeepSpeed's own (the permuted path: the test above)
    assert plan.prediction.iteration_s <= plan.baseline.iteration_s
    assert plan.is_identity == plan.prediction.description.startswith("stock = ")
    res = results(launch(PIPE, 8, ["--config", workdir / "cfg8.json", "--pp", 2, "--mp", 2]))
    assert_follows_plan(res, plan)
    assert_same_losses(res, baseline_pp2_mp2_dp2)


def test_homogeneous_cluster_is_a_no_op(workdir, baseline_pp2_dp2):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    cfg = wrap(PIPE_CONFIG, DATA / "ds_homogeneous_4.yaml", MODEL, pp=2, layer_pattern="Block")
    write_config(cfg, workdir / "cfg_homo.json")
    plan = Plan.from_dict(cfg["heterogeneous"]["plan"])
    res = results(launch(PIPE, 4, ["--config", workdir / "cfg_homo.json", "--pp", 2, "--mp", 1]))
    deepspeed_default = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)
    expected = sorted([list(c), r] for c, r in deepspeed_default.mapping.items())
    for r in res:
        assert r["mapping"] == expected == baseline_pp2_dp2[r["rank"]]["mapping"]
        assert r["dp_group"] == baseline_pp2_dp2[r["rank"]]["dp_group"]
        assert r["pp_group"] == baseline_pp2_dp2[r["rank"]]["pp_group"]
    assert_follows_plan(res, plan)
    assert_same_losses(res, baseline_pp2_dp2)


def test_zero_data_parallel_group_in_plan_order_with_discovery(workdir):
    """Plain ZeRO-2, no pipeline, cluster "auto": every rank discovers the cluster (four one-rank "nodes",
    H100 and A100 alternating, named through the discovery overrides) and plans with a model derived at
    start-up. The data-parallel group's member order is the plan's (each device type contiguous); losses
    equal DeepSpeed's own run."""
    cfg = wrap(ZERO_CONFIG, "auto")
    assert cfg["heterogeneous"]["plan"] is None
    write_config(cfg, workdir / "zero.json")
    nodes = [{"HET_PLUGIN_NODE_NAME": f"n{r}", "HET_PLUGIN_ACCELERATOR": "H100" if r % 2 == 0 else "A100-80"}
             for r in range(4)]
    base = results(launch(ZERO, 4, ["--config", workdir / "zero.json", "--baseline"]))
    res = results(launch(ZERO, 4, ["--config", workdir / "zero.json"], rank_env=nodes, ranks_per_node=1))
    order = res[0]["plan_order"]
    accelerators = res[0]["accelerators"]
    assert accelerators == ["H100", "A100-80", "H100", "A100-80"]           # what discovery saw
    assert sorted(order) == [0, 1, 2, 3] and order != [0, 1, 2, 3]
    assert accelerators[order[0]] == accelerators[order[1]] != accelerators[order[2]] == accelerators[order[3]]
    for r in res:
        assert r["dp_group"] == order and r["dp_rank"] == order.index(r["rank"]) and r["zero_stage"] == 2
    assert base[0]["dp_group"] == [0, 1, 2, 3]
    assert_same_losses(res, base)


def two_rank_cluster(path: Path, second_fabric: str) -> Path:
    data = {"name": f"two-{second_fabric}", "clusters": [
        {"name": "a", "fabric": {"type": "ib", "gbps": 400},
         "nodes": [{"count": 2, "accelerator": "A100-80", "accelerators_per_node": 1}]}]}
    if second_fabric != "ib":
        data["clusters"][0]["nodes"][0]["count"] = 1
        data["clusters"].append({"name": "b", "fabric": {"type": second_fabric, "gbps": 100},
                                 "nodes": [{"count": 1, "accelerator": "A100-80", "accelerators_per_node": 1}]})
        data["links"] = [{"between": ["a", "b"], "gbps": 25}]
    path.write_text(yaml.safe_dump(data))
    return path


def test_ranks_with_different_plans_all_stop(workdir):
    one = write_and_return(wrap(ZERO_CONFIG | {"train_batch_size": 4},
                                two_rank_cluster(workdir / "c1.yaml", "ib")), workdir / "d1.json")
    two = write_and_return(wrap(ZERO_CONFIG | {"train_batch_size": 4},
                                two_rank_cluster(workdir / "c2.yaml", "roce")), workdir / "d2.json")
    outs = launch(ZERO, 2, [], rank_env=[{"DS_TEST_CONFIG": str(one)}, {"DS_TEST_CONFIG": str(two)}], check=False)
    for o in outs:
        assert o.returncode != 0 and o.result is None
        assert "PlanMismatchError" in o.stderr and "ranks computed different plans" in o.stderr


def test_missing_cluster_file_on_one_rank_stops_every_rank(workdir):
    """Rank 0's config points at a cluster file it cannot read: rank 0 raises its ConfigError, rank 1
    (whose input is fine) stops with PlanMismatchError naming rank 0 -- before any group exists."""
    good = write_and_return(wrap(ZERO_CONFIG | {"train_batch_size": 4},
                                 two_rank_cluster(workdir / "c3.yaml", "ib")), workdir / "d3.json")
    vanished = two_rank_cluster(workdir / "c4.yaml", "ib")
    bad = write_and_return(wrap(ZERO_CONFIG | {"train_batch_size": 4}, vanished), workdir / "d4.json")
    vanished.unlink()
    outs = launch(ZERO, 2, [], rank_env=[{"DS_TEST_CONFIG": str(bad)}, {"DS_TEST_CONFIG": str(good)}], check=False)
    assert all(o.returncode != 0 and o.result is None for o in outs)
    assert "ConfigError" in outs[0].stderr and "c4.yaml: cluster: cluster file not found" in outs[0].stderr
    assert "PlanMismatchError: rank(s) 0 could not compute the plan" in outs[1].stderr
    assert "c4.yaml" in outs[1].stderr


def write_and_return(cfg: dict, path: Path) -> Path:
    write_config(cfg, path)
    return path


def test_gradient_clipping_under_a_permuted_plan_is_deepspeeds(workdir):
    """Issue 22: DeepSpeed's clip norm counts the non-model-parallel gradients of each data slice's
    model-parallel rank 0 (the lowest global rank: stage 0 on DeepSpeed's own topology). Here the plan puts
    stage 0 on ranks 1 and 3, so the lowest rank of each slice is a stage-1 rank; with a clip that binds, the
    losses must still equal plain DeepSpeed with the same layer split [0, 6, 10]."""
    cluster = load_cluster(DATA / "ds_hetero_4.yaml")
    placement = place(cluster, ParallelDims(pp=2, dp=2), domain_order=list(reversed(cluster.domains)))
    plan = assemble_plan(cluster, MODEL, placement, [5, 3], 2)
    assert plan.stage_ranks(0) == [1, 3]                 # the lowest rank of each slice (0, 2) is on stage 1
    plan.save(workdir / "plan_clip.json")
    write_config(wrap(PIPE_CONFIG, workdir / "plan_clip.json", layer_pattern="Block", pp=2), workdir / "cfg_clip.json")
    clip = ["--clip", 0.02, "--pp", 2, "--mp", 1]
    res = results(launch(PIPE, 4, ["--config", workdir / "cfg_clip.json", *clip]))
    same_split = results(launch(PIPE, 4, ["--baseline", "--parts", "0,6,10", *clip]))
    unclipped = results(launch(PIPE, 4, ["--baseline", "--parts", "0,6,10", "--clip", 0.0, "--pp", 2, "--mp", 1]))
    assert [r["parts"] for r in same_split] == [[0, 6, 10]] * 4
    assert_follows_plan(res, plan)
    # The stage-0 rank of each slice counts as DeepSpeed's model-parallel rank 0, as on DeepSpeed's topology.
    assert [r["model_parallel_rank"] for r in res] == [1, 0, 1, 0]
    assert res[0]["losses"][1:] != pytest.approx(unclipped[0]["losses"][1:], rel=1e-4)   # the clip binds
    assert all(r["losses"] == same_split[0]["losses"] for r in res)     # bit for bit
