"""The one group-creation policy (het_plugin.runtime.group_policy): backend, pg_options (NCCL net_name or the
shim's options), gloo interface and member order, for any group a framework creates under a plan."""
from __future__ import annotations

import types

import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.planner import make_plan
from het_plugin.runtime.applied import AppliedPlan
from het_plugin.runtime.group_policy import Policy, spec_for

from megatron_common import DATA, MODEL


def nccl_options(**config):
    """Stands in for the ProcessGroupNCCL.Options a framework passes (CPU torch has no NCCL)."""
    return types.SimpleNamespace(config=types.SimpleNamespace(**config))


def test_net_name_per_group_kind(plan8):
    cluster = load_cluster(DATA / "megatron-ib-roce-8.yaml")
    policy = Policy("nccl")
    for rank in range(8):
        def spec(kind):
            return spec_for(plan8, plan8.group_of(kind, rank).ranks, policy, pg_options=nccl_options())
        assert spec("tp").net_name is None, "a TP group inside one node uses NVLink: no NIC to choose"
        assert spec("dp").net_name is None, "DP stays on the RDMA fabric with NCCL's own choice of its network"
        assert not vars(spec("dp").pg_options.config), "nothing forced on an RDMA group"
        assert spec("dp-cp").net_name == spec("dp").net_name
        assert spec("pp").net_name == "Socket" and spec("embedding").net_name == "Socket"
        assert spec("tp-pp").net_name == "Socket"
        assert len({cluster.node_of(r).cluster for r in plan8.group_of("dp", rank).ranks}) == 1
    world = spec_for(plan8, None, policy, pg_options=nccl_options())
    assert world.ranks == tuple(range(8)) and world.net_name == "Socket", "the whole world crosses Ethernet"


def test_the_frameworks_own_nccl_settings_are_kept(plan8):
    mine = nccl_options(max_ctas=8, cga_cluster_size=2)
    spec = spec_for(plan8, plan8.groups["pp"][0].ranks, Policy("nccl"), pg_options=mine)
    assert vars(spec.pg_options.config) == {"max_ctas": 8, "cga_cluster_size": 2, "net_name": "Socket"}
    assert spec.pg_options is not mine and vars(mine.config) == {"max_ctas": 8, "cga_cluster_size": 2}, \
        "the network is written on the group's own copy: the framework may pass this object to other groups"
    assert spec.new_group_kwargs()["pg_options"] is spec.pg_options
    dp = nccl_options(max_ctas=8)
    assert spec_for(plan8, plan8.groups["dp"][0].ranks, Policy("nccl"), pg_options=dp).pg_options is dp
    assert vars(dp.config) == {"max_ctas": 8}, "an RDMA group keeps the framework's options untouched"


def test_homogeneous_identity_plan_keeps_nccls_own_choice():
    plan = make_plan(load_cluster(DATA / "megatron-homogeneous-4.yaml"), MODEL, tp=2, pp=2)
    applied = AppliedPlan.start(plan, 0, "nccl")
    assert applied.policy.native_network
    for kind in ("pp", "dp", "tp"):
        spec = applied.spec(plan.groups[kind][0].ranks, pg_options=nccl_options())
        assert spec.net_name is None and not vars(spec.pg_options.config)
        assert spec.sort_ranks and spec.backend is None


def test_gloo_interface_and_member_order(plan8, monkeypatch):
    monkeypatch.setenv("HET_PLUGIN_GLOO_IFNAMES", "ib=fab0,roce=fab1,socket=eth0,local=lo")
    policy = Policy("gloo")
    pp = plan8.groups["pp"][2].ranks
    spec = spec_for(plan8, pp, policy)
    assert (spec.transport, spec.gloo_ifname, spec.net_name) == ("socket", "eth0", None)
    assert spec.sort_ranks is (pp == sorted(pp))
    assert spec.new_group_kwargs() == ({} if pp == sorted(pp) else {"sort_ranks": False})
    tp = plan8.groups["tp"][0].ranks
    assert spec_for(plan8, tp, policy).gloo_ifname == "lo"
    # a mixed default ('cpu:gloo,cuda:nccl') still sets the gloo interface
    assert spec_for(plan8, pp, Policy("cpu:gloo,cuda:nccl")).gloo_ifname == "eth0"


def test_groups_spanning_vendors_go_through_the_shim_with_their_options(examples_dir):
    pytest.importorskip("torch.distributed")
    from het_plugin.comm import SHIM_BACKEND, ShimOptions
    plan = make_plan(load_cluster(examples_dir / "clusters" / "hethub-mix.yaml"), preset_model("gpt-7.5b"))
    vendors = {plan.vendor_of(r) for r in range(plan.world_size)}
    assert len(vendors) > 1
    world = spec_for(plan, None, Policy("nccl"))
    assert world.transport == "host-staged" and world.backend == SHIM_BACKEND
    assert isinstance(world.pg_options, ShimOptions) and world.net_name is None
    assert world.pg_options.vendors == {r: plan.vendor_of(r) for r in range(plan.world_size)}
    gloo_twin = spec_for(plan, None, Policy("nccl"), backend="gloo")
    assert gloo_twin.backend == "gloo" and gloo_twin.pg_options is None, "gloo twins stay gloo"


def test_applied_plan_records_every_creation(plan8, monkeypatch):
    monkeypatch.setenv("HET_PLUGIN_GLOO_IFNAMES", "socket=eth0")
    import os
    applied = AppliedPlan.start(plan8, 3, "gloo")
    seen = []
    group = applied.create(lambda spec: seen.append((spec, os.environ.get("GLOO_SOCKET_IFNAME"))) or "G",
                           plan8.groups["pp"][0].ranks, desc="pp")
    assert group == "G" and seen[0][1] == "eth0" and "GLOO_SOCKET_IFNAME" not in os.environ
    (rec,) = applied.records
    assert (rec.ranks, rec.transport, rec.gloo_ifname, rec.desc) == (plan8.groups["pp"][0].ranks, "socket", "eth0", "pp")


def test_transport_of_known_and_derived_groups(plan8):
    """(Was tests/megatron/test_megatron_groups.py, against the Megatron adapter's own copy of the rule.)"""
    policy = Policy("gloo")
    assert spec_for(plan8, plan8.groups["pp"][0].ranks, policy).transport == "socket"
    assert spec_for(plan8, plan8.groups["dp"][0].ranks, policy).transport == plan8.groups["dp"][0].transport
    ib = [r for r in range(8) if plan8.node_of(r).cluster == "ib"]
    assert spec_for(plan8, ib, policy).transport == "ib"            # not a plan group: from the node table
    assert spec_for(plan8, [ib[0], ib[1]], policy).transport == "local"
    assert spec_for(plan8, [0, 2], policy).transport == "socket"


def test_a_torch_without_sort_ranks_is_refused_for_a_permuted_group(plan8, monkeypatch):
    from het_plugin.core.errors import ConfigError
    from torch.distributed import distributed_c10d

    def old_new_group(ranks=None, timeout=None, backend=None, pg_options=None):
        raise AssertionError("not called")

    monkeypatch.setattr(distributed_c10d, "new_group", old_new_group)
    pp = plan8.groups["pp"][2].ranks
    assert pp != sorted(pp)
    with pytest.raises(ConfigError, match="sort_ranks") as info:
        spec_for(plan8, pp, Policy("gloo"))
    assert info.value.field == "torch"
    tp = plan8.groups["tp"][0].ranks
    assert tp == sorted(tp) and [plan8.logical_of_physical[r] for r in tp] == sorted(plan8.logical_of_physical[r] for r in tp)
    assert spec_for(plan8, tp, Policy("gloo")).sort_ranks       # ascending in logical and physical ranks: no flag


def test_members_are_ordered_as_torch_would_order_them_without_het_plugin(plan8):
    """Torch sorts a group's members by rank; under a plan that is the *logical* rank. An identity plan keeps
    torch's own sorting whatever order the framework lists the members in (Megatron concatenates some lists)."""
    from het_plugin.megatron.mcore import resolve_megatron_plan
    from megatron_common import DATA, MODEL
    homogeneous = resolve_megatron_plan(DATA / "megatron-homogeneous-4.yaml", model=MODEL, world_size=4, tp=1, pp=2)
    assert homogeneous.is_identity
    spec = spec_for(homogeneous, [2, 0, 3, 1], Policy("gloo"))
    assert spec.sort_ranks and spec.ranks == (2, 0, 3, 1)
    logical = plan8.logical_of_physical
    mp = next(g.ranks for g in plan8.groups["tp-pp"] if g.ranks != sorted(g.ranks))   # logical order, permuted
    shuffled = mp[1:] + mp[:1]                                  # a framework's concatenation, say
    assert shuffled != sorted(shuffled)
    spec = spec_for(plan8, shuffled, Policy("gloo"))
    assert not spec.sort_ranks and list(spec.torch_ranks) == mp and spec.ranks == tuple(shuffled)
    assert [logical[r] for r in spec.torch_ranks] == sorted(logical[r] for r in mp)
    # Megatron's lists all come from its rank generator: even an ascending one is ordered by logical rank
    spec = spec_for(plan8, sorted(mp), Policy("gloo"))
    assert list(spec.torch_ranks) == mp and not spec.sort_ranks
    # DeepSpeed lists launch ranks itself (its range(world) group): an ascending list keeps torch's sorting
    for ranks in (None, list(range(plan8.world_size)), sorted(mp)):
        spec = spec_for(plan8, ranks, Policy("gloo"), ascending_is_launch_order=True)
        assert spec.sort_ranks and list(spec.torch_ranks) == sorted(spec.ranks)
    assert not spec_for(plan8, shuffled, Policy("gloo"), ascending_is_launch_order=True).sort_ranks


# ---- the network choice: only 'Socket' is forced, or the network a cluster file declares ------------------

def _declared_cluster(tmp_path, ib_net="IB-CAST", roce_net=None):
    import yaml
    data = yaml.safe_load((DATA / "megatron-ib-roce-8.yaml").read_text())
    if ib_net:
        data["clusters"][0]["fabric"]["nccl_net"] = ib_net
    if roce_net:
        data["clusters"][1]["fabric"]["nccl_net"] = roce_net
    path = tmp_path / "declared.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_cluster(path)


def test_net_name_is_forced_only_to_socket_or_the_declared_network(plan8, tmp_path):
    plan = make_plan(_declared_cluster(tmp_path), MODEL, tp=2, pp=2)
    assert plan.nccl_nets == {"ib": "IB-CAST"} and plan.hash != plan8.hash
    policy = Policy("nccl")
    forced = set()
    for p in (plan8, plan):
        for kind, groups in p.groups.items():
            for g in groups:
                spec = spec_for(p, g.ranks, policy, pg_options=nccl_options())
                forced.add(spec.net_name)
                if g.transport in ("ib", "roce"):
                    cluster = p.node_of(g.ranks[0]).cluster
                    assert spec.net_name == p.nccl_nets.get(cluster), (kind, g.ranks)
                elif g.transport in ("socket", "host-staged"):
                    assert spec.net_name == "Socket"
                else:
                    assert spec.net_name is None
    assert forced == {None, "Socket", "IB-CAST"}
    ib_dp = next(g for g in plan.groups["dp"] if plan.node_of(g.ranks[0]).cluster == "ib")
    assert spec_for(plan, ib_dp.ranks, policy, pg_options=nccl_options()).pg_options.config.net_name == "IB-CAST"


def test_the_declared_network_reaches_the_plan_file_and_its_hash(tmp_path):
    from het_plugin.core.plan import Plan
    plan = make_plan(_declared_cluster(tmp_path), MODEL, tp=2, pp=2)
    again = Plan.from_dict(plan.to_dict())
    assert again.nccl_nets == {"ib": "IB-CAST"} and again.hash == plan.hash
    bad = plan.to_dict()
    bad.pop("hash")
    bad["nccl_nets"] = {"nowhere": "IB"}
    from het_plugin.core.errors import ConfigError
    with pytest.raises(ConfigError) as exc:
        Plan.from_dict(bad)
    assert exc.value.field == "nccl_nets"


def test_a_cross_vendor_group_without_the_shim_is_refused_under_nccl(examples_dir, monkeypatch):
    from het_plugin.core.errors import ConfigError
    plan = make_plan(load_cluster(examples_dir / "clusters" / "hethub-mix.yaml"), preset_model("gpt-7.5b"))
    policy = Policy("nccl", shim_checked=True, shim_backend=None)      # a torch that did not take het_shim
    with pytest.raises(ConfigError) as exc:
        spec_for(plan, None, policy)
    assert exc.value.field == "backend" and "NCCL and RCCL cannot form one communicator" in str(exc.value)
    assert spec_for(plan, None, Policy("gloo", shim_checked=True, shim_backend=None)).backend is None   # gloo works


def test_options_without_config_are_refused_with_the_versions_needed():
    from het_plugin.core.errors import ConfigError
    from het_plugin.runtime.group_policy import nccl_options as make
    with pytest.raises(ConfigError) as exc:
        make("Socket", types.SimpleNamespace())          # an old torch's Options: no .config
    assert exc.value.field == "torch" and "torch >= 2.1" in exc.value.fix and "NCCL >= 2.17" in exc.value.fix
    assert "no 'config'" in str(exc.value)


def test_a_cross_vendor_group_before_the_shim_was_imported_is_refused_naming_the_import(examples_dir, monkeypatch):
    """Runtime never imports comm: a caller that builds groups of a vendor-spanning plan without importing
    het_plugin.comm (which registers het_shim) is told so, instead of getting the default backend silently."""
    import sys

    import torch.distributed as tdist
    from het_plugin.core.errors import ConfigError
    plan = make_plan(load_cluster(examples_dir / "clusters" / "hethub-mix.yaml"), preset_model("gpt-7.5b"))
    monkeypatch.delitem(sys.modules, "het_plugin.comm", raising=False)
    monkeypatch.setattr(tdist.Backend, "backend_list", [b for b in tdist.Backend.backend_list if b != "het_shim"])
    with pytest.raises(ConfigError) as exc:
        spec_for(plan, None, Policy("gloo"))
    assert exc.value.field == "het_shim" and "import het_plugin.comm" in exc.value.fix
