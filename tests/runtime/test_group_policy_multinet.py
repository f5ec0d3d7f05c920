"""The group policy under a plan for NCCL's multi-network communicators: a 'multinet' group gets no forced
network (NCCL_ALLNET_ENABLE picks per peer), its gloo twin the socket interface; groups Megatron adds (the world,
its optimizer instances) follow the same rule."""
from __future__ import annotations

import types

from het_plugin.core.inputs.cluster import cluster_from_dict
from het_plugin.core.nccl_version import parse_build
from het_plugin.core.planner import make_plan
from het_plugin.runtime.group_policy import Policy, spec_for

from megatron_common import MODEL


def opts():
    return types.SimpleNamespace(config=types.SimpleNamespace())


def plan(nccl):
    spec = lambda name, kind: {"name": name, "fabric": {"type": kind, "gbps": 400},      # noqa: E731
                               "nodes": [{"count": 2, "accelerator": "H100", "accelerators_per_node": 2}]}
    c = cluster_from_dict({"name": "ib-roce", "clusters": [spec("ib", "ib"), spec("roce", "roce")],
                           "links": [{"between": ["ib", "roce"], "type": "ethernet", "gbps": 25}]})
    return make_plan(c, MODEL, tp=2, pp=1, nccl=parse_build(nccl))


def test_a_multinet_group_keeps_nccls_choice_and_gloo_crosses_on_sockets(monkeypatch):
    p = plan("2.26.2+cross-dc")
    dp = p.groups["dp"][0].ranks
    spec = spec_for(p, dp, Policy("nccl"), pg_options=opts())
    assert spec.transport == "multinet" and spec.net_name is None and not vars(spec.pg_options.config)
    world = spec_for(p, None, Policy("nccl"), pg_options=opts())
    assert world.transport == "multinet" and world.net_name is None
    monkeypatch.setenv("HET_PLUGIN_GLOO_IFNAMES", "ib=fab0,roce=fab1,socket=eth0")
    assert spec_for(p, dp, Policy("gloo")).gloo_ifname == "eth0"


def test_the_same_group_for_a_release_is_forced_onto_sockets():
    p = plan(None)
    dp = p.groups["dp"][0].ranks
    spec = spec_for(p, dp, Policy("nccl"), pg_options=opts())
    assert spec.transport == "socket" and spec.net_name == "Socket"


def test_the_runtime_preflight_refuses_a_multinet_plan_under_a_release_and_without_allnet():
    """Rank 0's verdict (runtime.preflight.judge) over every rank's NCCL settings and loaded version."""
    from het_plugin.runtime.preflight import VERSION_KEY, judge
    p = plan("cross-dc")
    c = cluster_from_dict({"name": "ib-roce", "clusters": [
        {"name": n, "fabric": {"type": n, "gbps": 400},
         "nodes": [{"count": 2, "accelerator": "H100", "accelerators_per_node": 2}]} for n in ("ib", "roce")],
        "links": [{"between": ["ib", "roce"], "type": "ethernet", "gbps": 25}]})

    def verdict(version, allnet):
        env = {"NCCL_ALLNET_ENABLE": "1"} if allnet else {}
        settings = {r: {**env, VERSION_KEY: list(version)} for r in range(p.world_size)}
        return judge(p, c, settings, "nccl", "Socket")
    fields = lambda v: [r["field"] for r in v["refusals"]]      # noqa: E731
    assert "NCCL version" in fields(verdict((2, 30, 7), True))
    assert "NCCL_ALLNET_ENABLE" in fields(verdict((2, 26, 2), False))
    ok = verdict((2, 26, 2), True)
    assert not ok["refusals"] and any("NCCL version" in w for w in ok["warnings"])
