"""The mixed-NIC pre-flight inside the Megatron adapter: 4 real ranks (gloo) through
het_plugin.megatron.initialize_model_parallel, the world backend het_plugin sees faked to NCCL (test-only, in
the rank script), the nodes' NICs from the cluster file (integration_tests/data/preflight-ib-roce-4.yaml).
An environment that contradicts the plan stops every rank with the same ConfigError before any group exists;
a consistent one (the per-node settings `het-plugin check` derives) builds the groups."""
from __future__ import annotations

from pathlib import Path

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.nccl_env import check_launch
from integration_tests.support.launch import run_ranks

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ranks" / "preflight_adapters.py"
CLUSTER = HERE / "data" / "preflight-ib-roce-4.yaml"
GLOO = {"HET_PLUGIN_GLOO_IFNAMES": "ib=lo,roce=lo,socket=lo,local=lo"}
ARGS = ["--framework", "megatron", "--cluster", str(CLUSTER)]
NODES = ["ib-0", "roce-0", "ib-1", "roce-1"]          # the launch order: rank r on NODES[r]


def launch(env: dict, rank_env=None) -> list[dict]:
    outs = run_ranks(SCRIPT, 4, ARGS, env=dict(GLOO, **env), rank_env=rank_env, ranks_per_node=1, timeout=240)
    return sorted((o.result for o in outs), key=lambda r: r["rank"])


def derived_settings() -> list[dict]:
    """Each rank's environment: its node's lines of `het-plugin check --format env` (the NCCL ones)."""
    cluster = load_cluster(CLUSTER)
    result = check_launch(cluster, {})
    assert result.ok
    return [{k: v for k, v in result.nodes[n].settings.items() if k.startswith("NCCL_")} for n in NODES]


def test_contradicting_environment_stops_every_rank_before_any_group():
    """NCCL_IB_HCA names a device the IB nodes lack, and the world group (IB + RoCE) has no network of its own."""
    res = launch({"HET_TEST_FAKE_BACKEND": "nccl"},
                 rank_env=[{"NCCL_IB_HCA": "=mlx5_2"} if n.startswith("ib") else {} for n in NODES])
    texts = {r["error"] for r in res}
    assert len(texts) == 1 and None not in texts, texts           # every rank, the same message
    text = texts.pop()
    assert "pre-flight: NCCL_IB_HCA: NCCL_IB_HCA==mlx5_2 names mlx5_2, which node ib-0 does not have" in text
    assert "fix: on ib-0: export NCCL_IB_HCA==mlx5_0,mlx5_1" in text
    assert "init_process_group(pg_options=): the world group spans fabrics" in text
    assert "world_group_options()" in text
    assert all(r["new_groups"] == 0 for r in res)                   # before any group


def test_consistent_environment_builds_the_groups():
    """The derived per-node settings, and a world group created with net_name 'Socket': no refusal."""
    res = launch({"HET_TEST_FAKE_BACKEND": "nccl", "HET_TEST_WORLD_NET": "Socket"}, rank_env=derived_settings())
    assert all(r["error"] is None and r["groups"] > 0 and r["new_groups"] > 0 for r in res), res
