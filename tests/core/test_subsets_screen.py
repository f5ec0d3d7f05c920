"""The subset search's screen (planner.could_beat): a subset that cannot beat the best plan so far is searched only
as far as showing that (no plan assembled, candidates that cannot beat it pruned), and the result is the same as
planning every subset. Work is bounded by counts (make_plan calls, cost-model predictions), never by time."""
import itertools
from pathlib import Path

import pytest
from hypothesis import given

from het_plugin.core import cost, subsets
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.planner import could_beat, make_plan

from test_subsets_properties import MODEL, SETTINGS, clusters

CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"


@pytest.fixture
def counted(monkeypatch):
    """Counts make_plan calls of the subset search and every cost-model prediction of a candidate."""
    counts = {"make_plan": 0, "predict": 0}
    real_plan, real_predict = subsets.make_plan, cost.SplitCosts.predict

    def plan(*args, **kwargs):
        counts["make_plan"] += 1
        return real_plan(*args, **kwargs)

    def predict(self, *args, **kwargs):
        counts["predict"] += 1
        return real_predict(self, *args, **kwargs)

    monkeypatch.setattr(subsets, "make_plan", plan)
    monkeypatch.setattr(cost.SplitCosts, "predict", predict)
    return counts


def _unscreened(cluster, model):
    """The same search planning every subset in full (a plan_fn other than make_plan turns the screen off)."""
    return subsets.search_subsets(cluster, model, plan_fn=lambda *a, **k: subsets.make_plan(*a, **k))


def three_clusters(flops, link_gbps):
    """Three clusters of two 4-device nodes (one device type each, ``flops`` peak TFLOP/s) on IB, joined by
    Ethernet: subsets of two groups are heterogeneous, so the screen applies to them."""
    specs = [{"name": f"c{i}", "fabric": {"type": "ib", "gbps": 1600, "latency_us": 2},
              "nodes": [{"count": 2, "accelerator": {"name": f"dev{i}", "vendor": "nvidia", "memory_gib": 80,
                                                      "peak_tflops": f}, "accelerators_per_node": 4}]}
             for i, f in enumerate(flops)]
    links = [{"between": [a["name"], b["name"]], "type": "ethernet", "gbps": link_gbps, "latency_us": 50}
             for a, b in itertools.combinations(specs, 2)]
    return cluster_from_dict({"name": "three", "clusters": specs, "links": links})


def test_subsets_that_lose_are_screened_not_planned(counted):
    # the slowest cluster only slows the job down: {c0, c1} wins; {c0, c2}, {c1, c2} and {c0} alone (homogeneous:
    # the frameworks' default search is screened) cannot beat the best found before them and are screened
    cluster = three_clusters((989, 312, 125), 400)
    found = subsets.search_subsets(cluster, MODEL)
    screened = dict(counted)
    assert [g["group"] for g in found.plan.left_out["groups"]] == ["c2/dev2"]
    assert {t.groups for t in found.tried if t.screened} == {(0,), (0, 2), (1, 2)}
    assert all(t.plan is None for t in found.tried if t.screened)
    # planned in full: the whole cluster and the winner
    assert screened["make_plan"] == 2
    counted.update(make_plan=0, predict=0)
    full = _unscreened(cluster, MODEL)
    assert counted["make_plan"] == 5
    assert found.plan.hash == full.plan.hash and found.searched == full.searched and found.pruned == full.pruned
    # stated bound: the screened search predicts at most 9/10 of the candidates planning every subset does
    # (measured when written: 672 against 775; the screen still searches the frameworks' default in full)
    assert screened["predict"] * 10 <= counted["predict"] * 9, (screened, counted)


@pytest.mark.parametrize("flops", [(989, 312, 125), (989, 989, 312), (312, 312, 312)])
@pytest.mark.parametrize("link_gbps", [10, 400])
def test_the_plan_is_the_same_as_without_the_screen(flops, link_gbps):
    cluster = three_clusters(flops, link_gbps)
    found, full = subsets.search_subsets(cluster, MODEL), _unscreened(cluster, MODEL)
    assert found.plan.hash == full.plan.hash
    assert found.plan.left_out == full.plan.left_out
    assert [(t.groups, t.searched) for t in found.tried] == [(t.groups, t.searched) for t in full.tried]


def test_the_examples_plans_are_the_same_as_without_the_screen():
    cluster, model = load_cluster(CLUSTERS / "h100-old-ethernet.yaml"), preset_model("gpt-7.5b")
    found, full = subsets.search_subsets(cluster, model), _unscreened(cluster, model)
    assert found.plan.left_out and found.plan.left_out == full.plan.left_out
    assert found.plan.hash == full.plan.hash


@SETTINGS
@given(clusters())
def test_could_beat_never_says_no_where_make_plan_is_below_the_cutoff(cluster):
    try:
        best = make_plan(cluster, MODEL).prediction.iteration_s
    except ConfigError:
        assert not could_beat(cluster, MODEL, 1e9)
        return
    assert could_beat(cluster, MODEL, best * (1 + 1e-9))     # its own plan is below
    for cutoff in (best, best * 0.999, best * 0.5):
        assert could_beat(cluster, MODEL, cutoff) or best >= cutoff


@SETTINGS
@given(clusters())
def test_could_beat_on_one_node_group_is_exact(cluster):
    # a homogeneous sub-cluster's plan is the frameworks' default search's: the screen of that search says no only
    # where make_plan's plan is at or above the cut-off, and yes where it is below
    for group in subsets.node_groups(cluster):
        sub = subsets.sub_cluster(cluster, group.nodes)
        assert sub.is_homogeneous
        try:
            best = make_plan(sub, MODEL).prediction.iteration_s
        except ConfigError:
            continue
        assert could_beat(sub, MODEL, best * (1 + 1e-9))
        for cutoff in (best, best * 0.999, best * 0.5):
            assert could_beat(sub, MODEL, cutoff) or best >= cutoff
