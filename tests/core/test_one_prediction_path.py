"""One prediction path (issue 18): the even split is the one-replica-group case of the replica path, so the same
stages predicted as one replica group or as two identical groups give the same iteration -- also with a
profile's per-direction link times and per-layer overrides (the replica path once dropped both: 12.10 s
against 9.25 s on this very case). The timeline draws what the prediction ran."""
from pathlib import Path

import pytest

from het_plugin.core import cost
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.inputs.profile import Profile
from het_plugin.core.ranks.dims import ParallelDims
from het_plugin.core.ranks.placement import place

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"
A100 = "A100-80"
LAYERS = [9, 9, 9, 9]


@pytest.fixture(scope="module")
def setting():
    holmes = load_cluster(EXAMPLES / "holmes-ib-roce.yaml")
    placement = place(holmes, ParallelDims(tp=2, pp=4, dp=8))       # stages 0-1 on IB, 2-3 on RoCE
    return preset_model("gpt-7.5b"), cost.analyze(holmes, placement)


def curves() -> Profile:
    prof = Profile()
    for mb in (1, 2, 4):
        prof.add_compute(A100, "layer", mb, 2, 0.05 + 0.05 * mb, 0.1 + 0.1 * mb)
        prof.add_compute(A100, "embedding", mb, 2, 0.001 * mb, 0.002 * mb)
        prof.add_compute(A100, "output", mb, 2, 0.01 + 0.01 * mb, 0.02 + 0.02 * mb)
    return prof


def slow_backward_sends() -> Profile:
    prof = curves()                       # gradients cross the Ethernet link 3x slower than activations
    prof.add_link("ib->roce", [(1, 3.0)], latency_us=50)
    prof.add_link("roce->ib", [(1, 1.0)], latency_us=50)
    return prof


def slow_layers() -> Profile:
    prof = slow_backward_sends()
    for layer in (0, 20, 21):             # per-layer overrides: three slow layers on stages 0 and 2
        prof.add_compute(A100, "layer", 2, 2, 1.5, 3.0, layer=layer)
    return prof


def split(model, analysis, profile, groups: int) -> cost.SplitCosts:
    sc = cost.SplitCosts(model, analysis, 2, profile=profile)
    (replicas, stages), = sc.replica_groups
    size = len(replicas) // groups
    sc.replica_groups = [(replicas[g * size:(g + 1) * size], stages) for g in range(groups)]
    return sc


@pytest.mark.parametrize("profile", [slow_backward_sends, slow_layers], ids=["per-direction links", "overrides"])
def test_one_replica_group_and_two_identical_groups_predict_the_same_iteration(setting, profile):
    model, analysis = setting
    one = split(model, analysis, profile(), 1)
    two = split(model, analysis, profile(), 2)
    assert not one.per_replica and two.per_replica
    a, b = one.predict(LAYERS), two.predict(LAYERS)
    assert b.iteration_s == pytest.approx(a.iteration_s, rel=1e-12)
    assert b.pipeline_s == pytest.approx(a.pipeline_s, rel=1e-12)
    assert b.stage_compute_s == pytest.approx(a.stage_compute_s, rel=1e-12)
    assert two.balance(LAYERS) == []                       # identical groups: no reason to deal unevenly
    # the case is not degenerate: the slow direction and the slow layers both change the prediction
    plain = split(model, analysis, curves(), 2).predict(LAYERS)
    assert b.iteration_s > plain.iteration_s * 1.01


def test_the_tables_charge_each_link_its_own_direction(setting):
    model, analysis = setting
    one = split(model, analysis, slow_backward_sends(), 1)
    two = split(model, analysis, slow_backward_sends(), 2)
    two.counts = [one.num_micro_batches] * one.dp          # forces the per-group tables
    flat = lambda rows: [x for row in rows for x in row]      # noqa: E731
    assert flat(two.tables()) == pytest.approx(flat(one.tables()), rel=1e-12)


def test_the_timeline_draws_the_pipeline_the_prediction_ran(setting):
    model, analysis = setting
    sc = split(model, analysis, slow_layers(), 2)
    groups = cost.group_pipelines(sc, LAYERS, record=True)
    pred = sc.predict(LAYERS)
    assert max(max(g.finish) for g in groups) == pytest.approx(pred.pipeline_s)
    for g in groups:         # each stage's last recorded span (its last backward or gradient send) ends at its finish
        for stage, finish in enumerate(g.finish):
            assert max(end for s, _, _, end, _ in g.spans if s == stage) == finish
