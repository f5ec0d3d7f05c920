"""Issue 33: DeepSpeed pipeline scripts as users write them, on 4 gloo ranks under plans that permute the ranks.

* tied layers (TiedLayerSpec on the first and last stage) start from the first stage's copy, as DeepSpeed's do;
* a data rank the script reads from the topology object it built is the plan's;
* a loader of the script's own under an uneven replica split reads the replica's range (replica_sampler) or is
  refused, whatever its sampler.

The pipeline runs reuse ranks/deepspeed_pipe.py (and its baseline: DeepSpeed's own PipelineModule with the plan's
split forced), the replica runs ranks/deepspeed_replicas.py and test_deepspeed_replicas' plans and checks.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from het_plugin.core.inputs.cluster import load_cluster  # noqa: E402
from het_plugin.core.planner import assemble_plan  # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims  # noqa: E402
from het_plugin.core.ranks.placement import place  # noqa: E402
from het_plugin.deepspeed import wrap, write_config  # noqa: E402
from integration_tests.test_deepspeed import (DATA, MODEL, PIPE, PIPE_CONFIG, assert_follows_plan,  # noqa: E402
                                              launch, results)
from integration_tests import test_deepspeed_replicas as replicas  # noqa: E402

SAME_SPLIT = ["--parts", "0,6,10", "--pp", 2, "--mp", 1]      # the plan's [5, 3] over InProj, 8 Blocks, Head


def stage0_on_odd_ranks(tmp_path: Path):
    """The 4-rank example cluster (ds_hetero_4.yaml: IB and RoCE nodes launched alternately) with the RoCE
    stage first: stage 0 on launch ranks 1 and 3, so the lowest rank of each pipeline is its last stage."""
    cluster = load_cluster(DATA / "ds_hetero_4.yaml")
    placement = place(cluster, ParallelDims(pp=2, dp=2), domain_order=list(reversed(cluster.domains)))
    plan = assemble_plan(cluster, MODEL, placement, [5, 3], 2)
    assert plan.stage_ranks(0) == [1, 3] and plan.stage_ranks(1) == [0, 2]
    plan.save(tmp_path / "plan.json")
    write_config(wrap(PIPE_CONFIG, tmp_path / "plan.json", layer_pattern="Block", pp=2), tmp_path / "cfg.json")
    return plan, tmp_path / "cfg.json"


def test_tied_layers_start_from_the_first_stage_as_deepspeeds(tmp_path):
    plan, cfg = stage0_on_odd_ranks(tmp_path)
    res = results(launch(PIPE, 4, ["--config", cfg, "--tied", *SAME_SPLIT[2:]]))
    base = results(launch(PIPE, 4, ["--baseline", "--tied", *SAME_SPLIT]))
    assert_follows_plan(res, plan)
    for r in res:
        same_coords = base[plan.logical_of_physical[r["rank"]]]      # DeepSpeed's rank for these coordinates
        assert same_coords["stage"] == r["stage"] and same_coords["data_id"] == r["data_id"]
        assert r["tied"] == same_coords["tied"]                      # before and after training, both stages
        assert r["tied"][0] is not None
    first, last = (next(r for r in base if r["stage"] == s and r["data_id"] == 0) for s in (0, 1))
    assert first["tied"][0] == last["tied"][0]                        # DeepSpeed ties them: one initial value
    assert all(r["losses"] == base[0]["losses"] for r in res)         # bit for bit
    assert len(set(base[0]["losses"])) > 1


def test_a_data_rank_read_from_the_scripts_topology_is_the_plans(tmp_path):
    """The script builds PipeModelDataParallelTopology, hands it to PipelineModule and picks its samples by
    topo.get_coord(rank).data: both stages of a pipeline read the same samples, as with DeepSpeed alone."""
    plan, cfg = stage0_on_odd_ranks(tmp_path)
    res = results(launch(PIPE, 4, ["--config", cfg, "--data-rank", "topology", *SAME_SPLIT[2:]]))
    base = results(launch(PIPE, 4, ["--baseline", "--data-rank", "topology", *SAME_SPLIT]))
    assert_follows_plan(res, plan)            # data_id (read from the script's topology) is the plan's dp coordinate
    assert all(r["losses"] == base[0]["losses"] for r in res)


def test_a_scripts_own_loader_under_uneven_shares_reads_the_replica_range_or_stops(tmp_path):
    even_plan, uneven_plan = replicas.plans(ParallelDims(pp=2, dp=2), [3, 1], 8, [3, 1])
    assert not uneven_plan.is_identity
    outs = replicas.launch(tmp_path, "strided", replicas.PIPE_CONFIG, uneven_plan, "pipe", "--loader", "strided",
                           check=False)
    assert all(o.returncode != 0 and o.result is None for o in outs)
    for o in outs:                                  # pp=2: every rank is a first or last stage and reads data
        assert "ConfigError" in o.stderr and "reads through a list" in o.stderr
        assert "replica_sampler(engine, len(dataset))" in o.stderr
    even = replicas.launch(tmp_path, "even", replicas.PIPE_CONFIG, even_plan, "pipe")
    mine = replicas.launch(tmp_path, "replica", replicas.PIPE_CONFIG, uneven_plan, "pipe", "--loader", "replica")
    replicas.assert_same_training(even, mine)
    replicas.assert_each_sample_once(mine, uneven_plan, 8, list(range(64)))
