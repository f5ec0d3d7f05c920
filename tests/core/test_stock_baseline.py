"""Today's stock stack is the baseline: the planner never returns a plan predicted slower than it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from het_plugin.core import planner
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.nccl_version import parse_build
from het_plugin.core.planner import STOCK_IS_BEST, make_plan
from het_plugin.core.ranks.placement import baseline_transport

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"
CLUSTERS = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))
# benchmarks/bench_planner.py's dense cases cover the same clusters with these models
MODELS = {"hethub-mix": ["llama-140b"]}


def cases():
    for c in CLUSTERS:
        for m in MODELS.get(c, ["gpt-7.5b", "gpt-39b"]):
            for nccl in (None, "2.26.2+cross-dc"):
                yield pytest.param(c, m, nccl, id=f"{c}-{m}-{nccl or 'release'}",
                                   marks=[pytest.mark.slow] if c == "hethub-mix" else [])


@pytest.mark.parametrize("cname, mname, nccl", list(cases()))
def test_no_plan_is_predicted_slower_than_todays_stock_stack(cname, mname, nccl):
    plan = make_plan(load_cluster(EXAMPLES / f"{cname}.yaml"), preset_model(mname), nccl=parse_build(nccl))
    if plan.baseline is None:       # stock does not fit (h100-old-ethernet with every node): nothing to be slower than
        assert any("no framework-default plan fits in memory" in w for w in plan.warnings)
        return
    assert plan.prediction.iteration_s / plan.baseline.iteration_s <= 1.0
    if plan.baseline_previous is not None:        # the previous baseline, kept as a second line, is slower
        assert plan.baseline_previous.iteration_s > plan.baseline.iteration_s
        assert "previous baseline" in plan.baseline_previous.description


def test_with_multinetwork_communicators_the_stock_baseline_catches_up_on_holmes():
    """The issue's point: with NCCL joining IB and RoCE, stock Megatron on Holmes' shape is as fast as the plan."""
    c, m = load_cluster(EXAMPLES / "holmes-ib-roce.yaml"), preset_model("gpt-7.5b")
    released = make_plan(c, m)
    branch = make_plan(c, m, nccl=parse_build("cross-dc"))
    assert released.baseline_previous is None            # no release joins fabrics: the baseline is unchanged
    assert branch.baseline.iteration_s < released.baseline.iteration_s
    assert branch.baseline_previous.iteration_s == pytest.approx(released.baseline.iteration_s)
    assert "multi-network" in branch.baseline.description or branch.baseline is branch.prediction


def test_where_stock_is_best_the_plan_is_stock_and_says_so(monkeypatch):
    """A search that only finds slower plans (here: forced onto sockets) returns the frameworks' default."""
    real = planner._search_planned

    def sockets_only(inputs, *args, **kw):
        return real(dataclasses.replace(inputs, transport_fn=baseline_transport), *args, **kw)
    monkeypatch.setattr(planner, "_search_planned", sockets_only)
    c, m = load_cluster(EXAMPLES / "two-clusters-25gbe.yaml"), preset_model("gpt-7.5b")
    plan = make_plan(c, m, nccl=parse_build("cross-dc"))
    assert plan.prediction.iteration_s == plan.baseline.iteration_s
    assert plan.prediction.description.startswith(STOCK_IS_BEST.split(":")[0])
    assert plan.is_identity
