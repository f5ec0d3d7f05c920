"""The pre-flight the adapters run (het_plugin.runtime.preflight): every rank's NCCL settings gathered over the
store, the world group's check, one ConfigError on every rank; skipped under gloo and for a no-op plan.

In-process: ranks are threads sharing one HashStore; the world backend (what torch.distributed would say) is
faked at het_plugin.runtime.preflight.world_backend / world_net_name. The adapters' call sites are covered by
integration_tests/test_megatron_preflight.py and test_deepspeed_preflight.py (real ranks)."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml

from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.model import ModelSpec
from het_plugin.core.planner import make_plan
from het_plugin.core.nccl_env import GroupUse, world_refusal
from het_plugin.runtime import preflight as rp
from het_plugin.runtime.applied import AppliedPlan

DATA = Path(__file__).resolve().parents[2] / "integration_tests" / "data"
CLUSTER = DATA / "preflight-ib-roce-4.yaml"
MODEL = ModelSpec(name="m", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                  global_batch_size=8, micro_batch_size=1)


def plan_of(cluster, **kw):
    return make_plan(cluster, MODEL, tp=1, pp=2, micro_batch_size=1, **kw)


@pytest.fixture
def nccl(monkeypatch):
    """The world group as torch would show it under NCCL; ``net`` is its pg_options' net_name."""
    state = {"backend": "nccl", "net": None}
    monkeypatch.setattr(rp, "world_backend", lambda: state["backend"])
    monkeypatch.setattr(rp, "world_net_name", lambda: state["net"])
    return state


def run_ranks(plan, envs, cluster=None, native=False):
    """Every rank's check_network in a thread over one store; rank -> the exception raised (or None)."""
    import torch.distributed as dist
    from het_plugin.runtime.exchange import reset_call_counts
    reset_call_counts()
    store = dist.HashStore()
    out = {}

    def rank(r):
        try:
            rp.check_network(plan, r, cluster=cluster, native_network=native, store=store, env=envs[r], timeout_s=20)
            out[r] = None
        except Exception as exc:      # noqa: BLE001 - compared below
            out[r] = exc
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(plan.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_rank_raises_the_same_refusal_with_per_node_environments(nccl):
    cluster = load_cluster(CLUSTER)
    plan = plan_of(cluster)
    nccl["net"] = "Socket"
    good = [{"NCCL_IB_HCA": "=mlx5_0,mlx5_1"}, {"NCCL_IB_HCA": "=mlx5_0"}] * 2     # ib-0, roce-0, ib-1, roce-1
    assert run_ranks(plan, good, cluster) == {r: None for r in range(4)}
    # one value exported everywhere: the RoCE nodes have no mlx5_1
    same = [{"NCCL_IB_HCA": "=mlx5_0,mlx5_1"}] * 4
    raised = run_ranks(plan, same, cluster)
    texts = {str(e) for e in raised.values()}
    assert all(isinstance(e, ConfigError) for e in raised.values()) and len(texts) == 1
    assert "NCCL_IB_HCA==mlx5_0,mlx5_1 names mlx5_1, which node roce-0 does not have" in texts.pop()


def test_world_group_spanning_fabrics_needs_its_own_network(nccl):
    cluster = load_cluster(CLUSTER)
    plan = plan_of(cluster)
    raised = run_ranks(plan, [{}] * 4, cluster)
    assert all(isinstance(e, ConfigError) and e.field == "init_process_group(pg_options=)" for e in raised.values())
    assert "world_group_options()" in raised[0].fix
    nccl["net"] = "Socket"
    assert run_ranks(plan, [{}] * 4, cluster) == {r: None for r in range(4)}


def test_an_unreadable_world_net_name_warns_instead_of_refusing(nccl, caplog):
    """Never checked on a GPU build: if torch does not show the world group's NCCL options, a world group made
    right must not be refused; rank 0 logs the warning with the fix."""
    import logging
    from het_plugin.core.nccl_env import NET_NAME_UNREADABLE
    plan = plan_of(load_cluster(CLUSTER))
    nccl["net"] = NET_NAME_UNREADABLE
    with caplog.at_level(logging.WARNING, logger="het_plugin"):
        assert run_ranks(plan, [{}] * 4, load_cluster(CLUSTER)) == {r: None for r in range(4)}
    assert "cannot tell whether it has a network of its own" in caplog.text and "world_group_options()" in caplog.text


def test_ranks_of_one_node_with_different_settings(nccl):
    data = yaml.safe_load(CLUSTER.read_text())
    for c in data["clusters"]:
        c["nodes"][0]["accelerators_per_node"] = 2
    cluster = cluster_from_dict(data)
    plan = plan_of(cluster)
    nccl["net"] = "Socket"
    envs = [{} for _ in range(8)]
    envs[1] = {"NCCL_SOCKET_IFNAME": "eth0"}          # rank 1: ib-0's second rank
    raised = run_ranks(plan, envs, cluster)
    err = raised[3]
    assert isinstance(err, ConfigError) and err.field == "NCCL_SOCKET_IFNAME"
    assert "ranks 0 and 1 on node ib-0 have different NCCL_SOCKET_IFNAME (None and 'eth0')" in err.problem


def test_not_run_under_gloo_for_a_no_op_plan_or_one_rank(nccl):
    cluster = load_cluster(CLUSTER)
    plan = plan_of(cluster)
    bad = [{"NCCL_NET": "IB", "NCCL_IB_HCA": "=nothing"}] * 4
    nccl["backend"] = "gloo"
    assert rp.check_network(plan, 0, cluster=cluster, env=bad[0], store=object()) is None    # no store touched
    nccl["backend"] = "cpu:gloo,cuda:nccl"
    assert all(isinstance(e, ConfigError) for e in run_ranks(plan, bad, cluster).values())
    homo = make_plan(load_cluster(DATA / "megatron-homogeneous-4.yaml"), MODEL, tp=1, pp=2, micro_batch_size=1)
    applied = AppliedPlan.start(homo, 0, "nccl")
    assert applied.policy.native_network
    assert applied.check_network(None, store=object()) is None


def test_a_plan_file_alone_still_checks_the_environment(nccl):
    """No cluster: the nodes' NICs are unknown (a warning), NCCL_NET against the groups is still checked."""
    plan = plan_of(load_cluster(CLUSTER))
    nccl["net"] = "Socket"
    assert run_ranks(plan, [{}] * 4) == {r: None for r in range(4)}
    raised = run_ranks(plan, [{"NCCL_NET": "IB"}] * 4)
    assert {e.field for e in raised.values()} == {"NCCL_NET"}


def test_world_refusal_rules():
    sock = GroupUse("world group", ("a", "b"), "socket")
    assert world_refusal(sock, "gloo", None, {}) is None
    assert world_refusal(sock, "nccl", "Socket", {}) is None
    assert world_refusal(sock, "nccl", None, {"a": "Socket", "b": "socket"}) is None
    assert world_refusal(sock, "nccl", None, {"a": "Socket", "b": None}).field == "init_process_group(pg_options=)"
    assert world_refusal(GroupUse("world group", ("a", "b"), "ib"), "nccl", None, {}) is None
    assert world_refusal(GroupUse("world group", ("a",), "socket"), "nccl", None, {}) is None
    from het_plugin.core.nccl_env import NET_NAME_UNREADABLE
    assert world_refusal(sock, "nccl", NET_NAME_UNREADABLE, {}) is None
    assert world_refusal(GroupUse("world group", ("a", "b"), "host-staged"), "nccl", NET_NAME_UNREADABLE, {})
    vendors = world_refusal(GroupUse("world group", ("a", "b"), "host-staged"), "nccl", "Socket", {})
    assert vendors.field == "init_process_group(backend=)" and "het_shim" in vendors.fix
