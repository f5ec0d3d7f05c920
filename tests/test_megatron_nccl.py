"""The per-communicator NCCL config (nccl_communicator_config_path) written from the plan's transports."""
from __future__ import annotations


import yaml

from het_plugin.cluster import load_cluster
from het_plugin.megatron.ncclcfg import PG_NAME_KIND, nccl_config_for_rank, write_nccl_config
from het_plugin.planner import make_plan

from megatron_common import DATA, MODEL


def test_net_name_per_group_kind(plan8):
    cluster = load_cluster(DATA / "megatron-ib-roce-8.yaml")
    for rank in range(8):
        cfg = nccl_config_for_rank(plan8, rank)
        assert "tp" not in cfg, "a TP group inside one node uses NVLink: no NIC to choose"
        assert cfg["dp"] == {"net_name": "IB"}, "DP stays on the node's RDMA fabric (RoCE is IB verbs too)"
        assert cfg["dp_cp"] == cfg["dp"]
        assert cfg["pp"] == {"net_name": "Socket"} and cfg["embd"] == {"net_name": "Socket"}
        assert cfg["mp"] == {"net_name": "Socket"}
        # the DP group really sits on one cluster
        assert len({cluster.node_of(r).cluster for r in plan8.group_of("dp", rank).ranks}) == 1
        # Megatron-Core accepts only these (get_nccl_options)
        assert all(v["net_name"].lower() in ("ib", "socket") for v in cfg.values())
        assert set(cfg) <= set(PG_NAME_KIND) | {"intra_dist_opt_instance"}
        assert cfg["intra_dist_opt_instance"] == {"net_name": "Socket"}, "the whole world crosses Ethernet"


def test_user_entries_are_kept_and_file_is_megatron_yaml(plan8, tmp_path):
    base = tmp_path / "mine.yaml"
    base.write_text(yaml.safe_dump({"dp": {"max_ctas": 8}, "tp": {"cga_cluster_size": 2}}))
    path = write_nccl_config(plan8, 3, tmp_path / "out", base)
    cfg = yaml.safe_load(path.read_text())
    assert cfg["dp"] == {"max_ctas": 8, "net_name": "IB"}
    assert cfg["tp"] == {"cga_cluster_size": 2}
    assert cfg["pp"]["net_name"] == "Socket"
    assert path.name.endswith("rank3.yaml") and plan8.hash in path.name


def test_single_rdma_fabric_everywhere_is_ib_only():
    plan = make_plan(load_cluster(DATA / "megatron-homogeneous-4.yaml"), MODEL, tp=2, pp=2)
    cfg = nccl_config_for_rank(plan, 0)
    assert cfg["pp"] == {"net_name": "IB"} and "tp" not in cfg
