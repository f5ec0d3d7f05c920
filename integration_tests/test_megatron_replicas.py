"""Heterogeneous data parallelism on stock Megatron-Core (CPU, gloo, 4 ranks): an uneven split of the global batch
over data-parallel replicas trains exactly what the even split trains.

Each pair of runs uses the same plan (placement, layer split) with and without ``replica_micro_batches``; the
rank script (integration_tests/ranks/megatron_train.py, the tiny GPT of support/megatron_tiny.py, plain SGD
on the reduced gradients) passes the even ``num_microbatches`` to Megatron's schedule as any script does, and
reads its replica's samples (``het_plugin.megatron.replica_share``). Same global batch, so the logged loss of
every step and the parameters after the last step must agree within float tolerance.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.plan import Plan
from het_plugin.core.planner import make_plan
from integration_tests.support.launch import run_ranks
from integration_tests.support.megatron_tiny import TinyGPT

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ranks" / "megatron_train.py"
IB_ROCE_4 = HERE / "data" / "megatron-ib-roce-4.yaml"      # ib, roce, ib, roce: one rank per node
STEPS = 3
LAYERS = 4


def plans(tmp_path: Path, *, pp: int, gbs: int, counts: list[int]) -> tuple[Path, Path, Plan]:
    """The planner's plan for the launch (even split), and the same plan with ``counts``: two plan files."""
    model = TinyGPT(num_layers=LAYERS, global_batch_size=gbs).model_spec()
    even = make_plan(load_cluster(IB_ROCE_4), model, tp=1, pp=pp, micro_batch_size=2)
    uneven = dataclasses.replace(even, replica_micro_batches=counts)
    assert uneven.uneven_replicas and uneven.global_batch_size == even.global_batch_size == gbs
    files = tmp_path / "even.json", tmp_path / "uneven.json"
    even.save(files[0])
    uneven.save(files[1])
    return files[0], files[1], uneven


def run(plan_file: Path, *, gbs: int, extra=(), check: bool = True):
    plan = Plan.load(plan_file)
    return run_ranks(SCRIPT, 4, ["--plan", str(plan_file), "--tp", "1", "--pp", str(plan.pp), "--layers", str(LAYERS), "--steps", str(STEPS),
                                 "--global-batch-size", str(gbs), *extra], ranks_per_node=1, timeout=240,
                     check=check)


def merged_digest(outs) -> dict[str, list[float]]:
    """Every parameter's digest from the ranks holding it (data-parallel replicas hold equal copies)."""
    merged: dict[str, list[float]] = {}
    for o in outs:
        for key, value in o.result["param_digest"].items():
            if key in merged:
                assert merged[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (key, o.rank)
            merged[key] = value
    return merged


@pytest.mark.parametrize("pp, gbs, counts", [(2, 8, [3, 1]), (1, 16, [3, 1, 1, 3])], ids=["pp2-dp2", "dp4"])
def test_uneven_replicas_train_what_the_even_split_trains(tmp_path, pp, gbs, counts):
    even_file, uneven_file, plan = plans(tmp_path, pp=pp, gbs=gbs, counts=counts)
    even, uneven = run(even_file, gbs=gbs), run(uneven_file, gbs=gbs)
    for o in uneven:            # each rank ran its replica's share: the plan's dp coordinate and sample range
        d = plan.replica_of(o.rank)
        assert o.result["replica"] == d and o.result["dp"] == plan.dp
        assert o.result["samples"] == list(range(*plan.replica_samples(d)))
    read = sorted(s for o in uneven if plan.stage_of(o.rank) == 0 for s in o.result["samples"])
    assert read == list(range(gbs)), "every sample of the global batch read once per step"
    assert [o.result["samples"] for o in even] != [o.result["samples"] for o in uneven]
    losses_even, losses_uneven = even[0].result["losses"], uneven[0].result["losses"]
    assert len(losses_even) == STEPS and all(math.isfinite(x) for x in losses_even)
    assert losses_even[-1] < losses_even[0], "it learns"
    # The first step's loss is the same global mean whatever the split; the later ones see the updated weights.
    assert losses_uneven == pytest.approx(losses_even, rel=1e-5, abs=1e-6)
    digest_even, digest_uneven = merged_digest(even), merged_digest(uneven)
    assert digest_even.keys() == digest_uneven.keys() and digest_even
    for key, value in digest_even.items():
        assert digest_uneven[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_a_script_whose_global_batch_is_not_the_plans_stops_every_rank_at_the_first_step(tmp_path):
    _, uneven_file, plan = plans(tmp_path, pp=2, gbs=8, counts=[3, 1])
    outs = run(uneven_file, gbs=16, check=False)        # 4 micro-batches per replica: not the plan's 2 (or 3, 1)
    for o in outs:
        assert o.returncode not in (0, None), (o.rank, o.stderr[-2000:])
        d = plan.replica_of(o.rank)
        assert "num_microbatches=4" in o.stderr and f"replica {d} runs {plan.replica_counts[d]} micro-batches" \
            in o.stderr and "global batch of 8" in o.stderr, o.stderr[-2000:]


def test_a_replica_whose_data_runs_dry_is_named(tmp_path):
    """The script reads the even split's 2 micro-batches; replica 0 must run 3: its ranks stop naming it."""
    _, uneven_file, plan = plans(tmp_path, pp=2, gbs=8, counts=[3, 1])
    outs = run(uneven_file, gbs=8, extra=["--even-data"], check=False)
    for o in outs:
        assert o.returncode != 0, (o.rank, o.stdout[-1000:])
        if plan.replica_of(o.rank) == 0 and plan.stage_of(o.rank) == 0:     # the first stage reads first
            assert "replica 0's data iterator ran dry at micro-batch 3 of 3" in o.stderr, o.stderr[-2000:]
