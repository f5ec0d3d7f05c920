"""Vendor map parsing, per-rank beliefs and their reconciliation (pure; no process group)."""
import json
import re

import pytest

from het_plugin.comm import vendors as V
from het_plugin.core.errors import ConfigError


@pytest.fixture(autouse=True)
def no_declared_map():
    V.set_vendor_map(None)
    yield
    V.set_vendor_map(None)


def test_parse_vendor_map_plain_and_counted():
    assert V.parse_vendor_map("NVIDIA, nvidia,amd") == {0: "nvidia", 1: "nvidia", 2: "amd"}
    assert V.parse_vendor_map("nvidia*3,amd*2") == {0: "nvidia", 1: "nvidia", 2: "nvidia", 3: "amd", 4: "amd"}


@pytest.mark.parametrize("text,fragment", [("nvidia*0", "positive integer"), ("nvidia*x", "positive integer"),
                                           (",,", "empty"), ("nvidia,a=b", "not a vendor name")])
def test_parse_vendor_map_rejects(text, fragment):
    with pytest.raises(V.VendorMapError, match=fragment) as e:
        V.parse_vendor_map(text)
    assert isinstance(e.value, ConfigError) and "fix:" in str(e.value)


def test_set_vendor_map_accepts_list_and_mapping_and_rejects_bad_keys():
    V.set_vendor_map(["A", "b"])
    assert V.declared_vendor_map() == {0: "a", 1: "b"}
    V.set_vendor_map({1: "amd", 0: "nvidia"})
    assert V.declared_vendor_map() == {0: "nvidia", 1: "amd"}
    with pytest.raises(V.VendorMapError, match="not a global rank"):
        V.set_vendor_map({-1: "amd"})
    with pytest.raises(V.VendorMapError, match="not a vendor name"):
        V.set_vendor_map(["nvidia", ""])


def test_shim_options_from_a_plan_carry_vendors_and_the_plan_transport_rule(examples_dir):
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.inputs.model import preset_model
    from het_plugin.core.ranks.placement import cluster_transport
    from het_plugin.core.planner import make_plan
    cluster = load_cluster(examples_dir / "clusters" / "hethub-mix.yaml")
    plan = make_plan(cluster, preset_model("gpt-7.5b"))
    options = V.ShimOptions.from_plan(plan)
    assert options.vendors == {r: cluster.node_of(r).vendor for r in range(cluster.world_size)}
    for ranks in ([0, 1], [0, 8], [0, cluster.world_size - 1], list(range(0, cluster.world_size, 7))):
        assert options.transport_of(ranks) == cluster_transport(cluster, ranks)


def test_belief_sources_in_priority_order():
    env = {V.ENV_VENDOR_MAP: "nvidia*2,amd*2"}
    V.set_vendor_map(["x", "x", "x", "x"])
    b = V.local_belief([1, 3], 3, 4, env)                      # the environment map wins over set_vendor_map
    assert (b.own, b.group_map, b.map_source) == ("amd", ("nvidia", "amd"), V.ENV_VENDOR_MAP)
    options = V.ShimOptions({1: "nvidia", 3: "amd"})
    b = V.local_belief([1, 3], 3, 4, env, options)               # ... and over the group's own options
    assert b.map_source == V.ENV_VENDOR_MAP
    b = V.local_belief([1, 3], 3, 4, {}, options)               # the group's options win over set_vendor_map
    assert (b.own, b.group_map, b.map_source) == ("amd", ("nvidia", "amd"), "the plan")
    b = V.local_belief([1, 3], 3, 4, {})
    assert (b.own, b.group_map, b.map_source) == ("x", ("x", "x"), "set_vendor_map")
    V.set_vendor_map(None)
    b = V.local_belief([0, 1], 1, 2, {V.ENV_VENDOR: "Gaudi"})
    assert (b.own, b.own_source, b.group_map) == ("gaudi", V.ENV_VENDOR, None)
    assert V.local_belief([0, 1], 1, 2, {}).own == V.detect_vendor()


@pytest.mark.parametrize("text,world,fragment", [("a,a,b,b,c", 4, "rank(s) [4], outside"),
                                                 ("a,b", 4, "no vendor for rank(s) [2, 3]")])
def test_belief_rejects_maps_that_do_not_fit_the_job(text, world, fragment):
    with pytest.raises(V.VendorMapError, match=re.escape(fragment)):
        V.local_belief([0, 1], 0, world, {V.ENV_VENDOR_MAP: text})


def test_belief_round_trips_through_json():
    b = V.Belief("amd", "torch", ("nvidia", "amd"), "set_vendor_map")
    assert V.Belief.from_dict(json.loads(json.dumps(b.to_dict()))) == b
    assert V.Belief("amd", "torch", None, None).to_dict()["map"] is None


def test_reconcile_self_claims_and_agreeing_maps():
    claims = [V.Belief(v, "torch", None, None) for v in ("nvidia", "amd", "nvidia")]
    assert V.reconcile(claims, [4, 5, 6]) == ("nvidia", "amd", "nvidia")
    m = ("nvidia", "amd")
    assert V.reconcile([V.Belief("nvidia", "set_vendor_map", m, "set_vendor_map"),
                        V.Belief("amd", "set_vendor_map", m, "set_vendor_map")], [0, 1]) == m


def test_reconcile_names_disagreeing_ranks_by_global_rank():
    a, b = ("nvidia", "amd", "amd"), ("nvidia", "nvidia", "amd")
    beliefs = [V.Belief(a[0], "s", a, "s"), V.Belief(b[1], "s", b, "s"), V.Belief(a[2], "s", a, "s")]
    with pytest.raises(V.VendorMapError) as e:
        V.reconcile(beliefs, [2, 5, 7])
    msg = str(e.value)
    assert "rank(s) [2, 7] say {2: nvidia, 5: amd, 7: amd}" in msg
    assert "rank(s) [5] say {2: nvidia, 5: nvidia, 7: amd}" in msg


def test_reconcile_rejects_partial_maps_and_contradicting_claims():
    m = ("nvidia", "amd")
    with pytest.raises(V.VendorMapError, match=r"rank\(s\) \[1\] did not"):
        V.reconcile([V.Belief("nvidia", "s", m, "s"), V.Belief("amd", "torch", None, None)], [0, 1])
    with pytest.raises(V.VendorMapError, match="rank 1 is 'intel'"):
        V.reconcile([V.Belief("nvidia", "s", m, "s"), V.Belief("intel", V.ENV_VENDOR, m, "s")], [0, 1])


class FakeStore:
    """Enough of a c10d Store for agree_on_vendors: set/get/check/wait over a dict."""

    def __init__(self, preset=None):
        self.data = {k: v.encode() for k, v in (preset or {}).items()}

    def set(self, k, v):
        self.data[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.data[k]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def wait(self, keys, timeout):
        if not self.check(keys):
            raise RuntimeError("timeout")


def _slot(i):
    """Where member i of a het_shim group publishes (het_plugin.runtime.exchange keys)."""
    return f"het_plugin/0/vendors/0/v/{i}"


def test_agree_on_vendors_reports_failed_and_absent_members():
    other = json.dumps({"value": V.Belief("amd", "torch", None, None).to_dict()})
    store = FakeStore({_slot(1): other})
    assert V.agree_on_vendors(store, group_rank=0, global_ranks=[0, 1], world_size=2,
                              env={V.ENV_VENDOR: "nvidia"}) == ("nvidia", "amd")
    store = FakeStore({_slot(1): json.dumps({"error": {"config": False, "problem": "something broke"}})})
    with pytest.raises(V.VendorMapError, match=r"rank\(s\) \[9\] of group \[3, 9\] could not build"):
        V.agree_on_vendors(store, group_rank=0, global_ranks=[3, 9], world_size=10, env={V.ENV_VENDOR: "a"})
    with pytest.raises(V.VendorMapError, match=r"rank\(s\) 9 never reached the creation of this het_shim group "
                                               r"within 0.1s.*group \[3, 9\]"):
        V.agree_on_vendors(FakeStore(), group_rank=0, global_ranks=[3, 9], world_size=10, timeout_s=0.1,
                           env={V.ENV_VENDOR: "a"})
