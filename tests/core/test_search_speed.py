"""The planner's speed-ups are exact (issue 32's planner-time goals): the 1F1B finish times without spans are the
spanned simulation's to the last bit, the partition floor never exceeds the exact partition's bottleneck, the
fixed split's bound is the tables' own entry, and a search with every new prune turned off gives the same plans and
hashes on generated clusters. Work is bounded by counts (predictions, cost tables), never by time."""
import random
from pathlib import Path

import pytest
from hypothesis import given

from het_plugin.core import cost, planner
from het_plugin.core.cost.pipeline import simulate_1f1b
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.layer_split import bottleneck, exact_partition
from het_plugin.core.planner import make_plan
from het_plugin.core.ranks.placement import domain_orders, place

from test_subsets_properties import MODEL, SETTINGS, clusters


def test_finish_times_are_the_spanned_simulations_bit_for_bit():
    rnd = random.Random(32)
    for _ in range(400):
        pp, m = rnd.randint(1, 9), rnd.randint(1, 40)
        fwd = [rnd.random() * rnd.choice([1.0, 10.0, 0.01]) for _ in range(pp)]
        bwd = [rnd.random() * 2 for _ in range(pp)]
        send = [rnd.choice([0.0, rnd.random() * 0.3]) for _ in range(pp)]
        back = None if rnd.random() < 0.5 else [rnd.random() * 0.3 for _ in range(pp)]
        spans: list = []
        assert simulate_1f1b(fwd, bwd, send, m, back) == simulate_1f1b(fwd, bwd, send, m, back, record=spans)
        assert spans


def _splits(cluster, model):
    """SplitCosts of every degree combination, domain order, micro-batch size and optimizer setting."""
    for dims in planner._degree_options(cluster, model, dict(planner._KEYWORDS), None):
        for order in domain_orders(cluster):
            analysis = cost.analyze(cluster, place(cluster, dims, order))
            for mb in planner._micro_batches(model, dims, None):
                for dist_opt in (False, True):
                    yield dims, cost.SplitCosts(model, analysis, mb, distributed_optimizer=dist_opt)


@SETTINGS
@given(clusters())
def test_partition_floor_is_below_every_partition(cluster):
    checked = 0
    for dims, split in _splits(cluster, MODEL):
        caps = split.max_layers()
        tables = split.tables()
        lay = exact_partition(MODEL.num_layers, tables, caps)
        if lay is None:
            continue
        assert split.partition_floor() <= bottleneck(tables, lay)
        # the fixed split's bound is the tables' entry, computed alone
        uniform = planner.uniform_layers(MODEL.num_layers, dims.pp)
        assert split.bottleneck(uniform) == bottleneck(tables, uniform)
        counts = split.balance(lay)
        if counts:              # any uneven split's partition, as the search makes it
            uneven_floor = split.partition_floor(uneven=True)
            split.set_counts(counts)
            lay = exact_partition(MODEL.num_layers, split.tables(), split.max_layers())
            if lay is not None:
                assert uneven_floor <= bottleneck(split.tables(), lay)
        checked += 1
    assert checked


def _unpruned(monkeypatch):
    """Turn off the prunes the speed-ups added: the partition floor and the fixed split's bound."""
    monkeypatch.setattr(planner, "_cannot_win", lambda *args: False)
    monkeypatch.setattr(cost.SplitCosts, "bottleneck", lambda self, layers: 0.0)


@SETTINGS
@given(clusters())
def test_the_plan_is_the_same_without_the_new_prunes(cluster):
    with pytest.MonkeyPatch.context() as mp:
        pruned = make_plan(cluster, MODEL)
        _unpruned(mp)
        full = make_plan(cluster, MODEL)
    assert pruned.hash == full.hash
    assert pruned.alternatives == full.alternatives
    assert pruned.baseline == full.baseline


def test_the_partition_floor_saves_cost_tables(monkeypatch):
    # the HETHUB-like mix and a 140B model: the partition floor skips cost tables that cannot win (counts when
    # written: 647 tables with the prunes, 969 without; the same 65 predictions)
    cluster = load_cluster(Path(__file__).resolve().parents[2] / "examples" / "clusters" / "hethub-mix.yaml")
    model = preset_model("llama-140b")
    counts = {"tables": 0, "predict": 0}
    real_tables, real_predict = cost.SplitCosts.tables, cost.SplitCosts.predict

    def tables(self):
        counts["tables"] += 1
        return real_tables(self)

    def predict(self, *args, **kwargs):
        counts["predict"] += 1
        return real_predict(self, *args, **kwargs)

    monkeypatch.setattr(cost.SplitCosts, "tables", tables)
    monkeypatch.setattr(cost.SplitCosts, "predict", predict)
    pruned = make_plan(cluster, model)
    with_prunes = dict(counts)
    counts.update(tables=0, predict=0)
    _unpruned(monkeypatch)
    full = make_plan(cluster, model)
    assert pruned.hash == full.hash
    assert with_prunes["tables"] * 10 <= counts["tables"] * 7, (with_prunes, counts)
    assert with_prunes["predict"] <= counts["predict"], (with_prunes, counts)


@SETTINGS
@given(clusters())
def test_the_even_tables_are_their_parts_combined(cluster):
    from het_plugin.core.cost.stage import _stage_cost_parts, _stage_costs
    checked = 0
    for dims, split in _splits(cluster, MODEL):
        for overlap in (True, False):
            args = (split.stages, MODEL.num_layers)
            per, exposed = _stage_cost_parts(*args, split.dp, overlap, split.distributed_optimizer, None)
            combined = [[split.num_micro_batches * a + e for a, e in zip(p, x)] for p, x in zip(per, exposed)]
            assert _stage_costs(*args, split.num_micro_batches, split.dp, overlap, split.distributed_optimizer,
                                None) == combined
            checked += 1
    assert checked
