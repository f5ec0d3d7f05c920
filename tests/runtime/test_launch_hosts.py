"""Issue 32: a plan that leaves nodes out runs on exactly its kept nodes. A launch of the plan's world size on other
nodes (a left-out node in, a kept node out, the kept nodes in another order) is caught by the hostnames every rank
sends with its plan hash at the agreement, judged once on rank 0: every rank stops before any group with the nodes
and the launch to use, at no store request more (counted). Ranks are threads over one store."""
from __future__ import annotations

import pytest

torch_dist = pytest.importorskip("torch.distributed")

from het_plugin.core import subsets  # noqa: E402
from het_plugin.core.errors import ConfigError, PlanMismatchError  # noqa: E402
from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster  # noqa: E402
from het_plugin.core.inputs.model import preset_model  # noqa: E402
from het_plugin.core.launch import Resolved, resolve_launch  # noqa: E402
from het_plugin.core.request import LaunchRequest, Timeout  # noqa: E402
from het_plugin.runtime import exchange  # noqa: E402
from het_plugin.runtime.agreement import check_plan_agreement  # noqa: E402
from het_plugin.runtime.launch_hosts import HostCheck, this_host  # noqa: E402
from het_plugin.runtime.startup import Planning, Started, startup  # noqa: E402
from het_plugin.runtime.store_counts import CountingStore  # noqa: E402
from tests.runtime.test_agreement import hash_store, run_rank_threads  # noqa: E402
from tests.runtime.test_all_nodes import OLD, SMALL  # noqa: E402

RIGHT = ["gpu-a", "gpu-a", "gpu-b", "gpu-b"]


@pytest.fixture(autouse=True)
def fresh_call_sequence():
    exchange.reset_call_counts()


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    """Two H100 nodes (gpu-a, gpu-b) kept, the V100 node behind 1 GbE (old-a) left out: 4 ranks of 6."""
    plan = subsets.plan_nodes(cluster_from_dict(SMALL, "small.yaml"), preset_model("gpt-3.6b"))
    assert plan.left_out["nodes"] == ["old-a"] and [n.name for n in plan.nodes] == ["gpu-a", "gpu-b"]
    assert plan.world_size == 4
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return plan, path


# ---- the check itself (pure) --------------------------------------------------------------------------------


def test_the_kept_nodes_in_the_plans_order_pass_with_or_without_a_domain(small_plan):
    plan, _ = small_plan
    subsets.check_launch_hosts(plan, RIGHT)
    subsets.check_launch_hosts(plan, [f"{h}.cluster.local" for h in RIGHT])
    subsets.check_launch_hosts(plan, [None] * 4)                        # nothing known: nothing to refuse
    subsets.check_launch_hosts(plan, ["n1", "n1", "n2", "n2"])           # names the file does not know: no evidence


def test_a_left_out_node_in_is_refused_naming_it_its_ranks_and_the_launch_to_use(small_plan):
    plan, _ = small_plan
    with pytest.raises(ConfigError) as exc:
        subsets.check_launch_hosts(plan, ["gpu-a", "gpu-a", "old-a", "old-a"])
    err = exc.value
    assert err.field == "nodes" and "leaves out: old-a (ranks 2-3); the plan is for 4 ranks on 2 nodes" in err.problem
    assert "gpu-a gpu-b" in err.fix and "--include gpu-a@gpu-b" in err.fix and "--use-all-nodes" in err.fix


def test_a_kept_node_out_for_another_node_is_refused(small_plan):
    plan, _ = small_plan
    with pytest.raises(ConfigError) as exc:
        subsets.check_launch_hosts(plan, ["gpu-a", "gpu-a", "spare-9", "spare-9"])
    assert "leaves out 1 of the plan's nodes (gpu-b)" in exc.value.problem
    assert "instead: spare-9 (ranks 2-3)" in exc.value.problem


def test_the_kept_nodes_in_another_order_or_shape_are_refused(small_plan):
    plan, _ = small_plan
    with pytest.raises(ConfigError, match="rank 0 runs on gpu-b, where the plan puts gpu-a"):
        subsets.check_launch_hosts(plan, ["gpu-b", "gpu-b", "gpu-a", "gpu-a"])
    with pytest.raises(ConfigError, match="rank 1 runs on gpu-b, where the plan puts gpu-a"):
        subsets.check_launch_hosts(plan, ["gpu-a", "gpu-b", "gpu-b", "gpu-b"])   # 1 + 3 ranks, not 2 + 2


def test_another_world_size_is_refused_and_a_plan_of_every_node_is_not_checked(small_plan):
    plan, _ = small_plan
    with pytest.raises(ConfigError, match="every node of the cluster file, including the left-out old-a"):
        subsets.check_launch_hosts(plan, RIGHT + ["old-a", "old-a"])
    every = subsets.plan_nodes(cluster_from_dict(SMALL, "small.yaml"), preset_model("gpt-3.6b"), use_all_nodes=True)
    assert not every.left_out
    subsets.check_launch_hosts(every, ["x"] * every.world_size)
    assert HostCheck("old-a").of(Resolved(every)) is None                 # nothing sent: the protocol as before
    assert HostCheck("old-a").of(Resolved(plan)) == "old-a"


def test_this_rank_is_named_by_the_launch_else_as_discovery_names_it(monkeypatch):
    monkeypatch.setenv("HET_PLUGIN_NODE_NAME", "node-7")
    assert this_host(LaunchRequest.of(4, rank=0).launch) == "node-7"
    assert this_host(LaunchRequest.of(4, rank=0, host="gpu-a").launch) == "gpu-a"


# ---- every rank stops at the agreement, before any group ----------------------------------------------------


def start(path, hosts, stores, timeout=10.0):
    world = len(hosts)

    def body(rank, store):
        request = LaunchRequest.of(world, rank=rank, host=hosts[rank], timeout=Timeout(timeout))
        return startup(request, Planning(lambda profile: resolve_launch(str(path), request)), store=store,
                       default_backend="gloo")
    return run_rank_threads(world, body, stores, join_s=60.0)


def test_a_launch_of_the_right_size_on_the_wrong_nodes_stops_every_rank_alike(small_plan):
    plan, path = small_plan
    good = start(path, RIGHT, hash_store(4))
    assert all(isinstance(good[r], Started) and good[r].plan.hash == plan.hash for r in range(4)), good
    for hosts, words in ((["gpu-a", "gpu-a", "old-a", "old-a"], "the plan leaves out: old-a"),
                         (["gpu-b", "gpu-b", "gpu-a", "gpu-a"], "rank 0 runs on gpu-b"),
                         (["gpu-a", "gpu-a", "spare-9", "spare-9"], "(gpu-b)")):
        exchange.reset_call_counts()
        bad = start(path, hosts, hash_store(4))
        assert all(isinstance(bad[r], ConfigError) and not isinstance(bad[r], PlanMismatchError)
                   for r in range(4)), bad
        assert len({(str(e), e.field, e.fix) for e in bad.values()}) == 1      # one verdict, every rank
        assert words in bad[0].problem and "--include gpu-a@gpu-b" in bad[0].fix


def test_a_rank_that_never_arrives_is_named_within_the_bound(small_plan):
    _, path = small_plan
    store = torch_dist.HashStore()

    def body(rank, s):
        request = LaunchRequest.of(4, rank=rank, host=RIGHT[rank], timeout=Timeout(0.5))
        return startup(request, Planning(lambda profile: resolve_launch(str(path), request)), store=s,
                       default_backend="gloo")
    out = run_rank_threads(3, body, [store] * 3, join_s=30.0)           # rank 3 never starts
    assert all(isinstance(e, PlanMismatchError) and "rank(s) 3 never reached" in str(e) for e in out.values()), out


# ---- linear: the hosts ride on the agreement's requests -----------------------------------------------------


def _agreement_counts(n: int, left_out: bool):
    exchange.reset_call_counts()
    stores = [CountingStore(s) for s in hash_store(n)]
    seen: list = []

    def body(rank, store):
        fact = f"host-{rank // 8:05d}.example.org" if left_out else None
        check_plan_agreement("0123456789abcdef", rank=rank, world_size=n, store=store, timeout_s=30, fact=fact,
                             judge_facts=seen.append if left_out else None)
    res = run_rank_threads(n, body, stores, join_s=120.0)
    assert set(res.values()) == {None}, res
    if left_out:
        assert seen == [[f"host-{r // 8:05d}.example.org" for r in range(n)]]    # rank 0 judged every host once
    return [s.counts for s in stores]


def test_sending_the_hosts_costs_no_request_and_bytes_linear_in_the_world():
    small, large = _agreement_counts(16, True), _agreement_counts(128, True)
    plain = _agreement_counts(128, False)
    # every rank but rank 0: publish, wait, read, done, as without hosts, whatever the world size
    assert {c.total_requests for c in small[1:]} == {c.total_requests for c in large[1:]} == \
           {c.total_requests for c in plain[1:]} == {4}
    assert small[0].total_requests == large[0].total_requests == plain[0].total_requests <= 10
    # a rank sends its host once (tens of bytes); rank 0 reads each rank's once: O(N) in all, not O(N^2)
    extra = [a.total_bytes - b.total_bytes for a, b in zip(large[1:], plain[1:])]
    assert max(extra) <= 64
    root_extra = large[0].total_bytes - plain[0].total_bytes
    assert root_extra <= 128 * 2 * 64 and large[0].total_bytes <= 8 * small[0].total_bytes * 1.25
    assert sum(c.total_bytes for c in large) <= 8 * sum(c.total_bytes for c in small) * 1.25


def test_the_example_clusters_kept_plan_at_64_ranks(tmp_path):
    """h100-old-ethernet's plan (64 ranks on main-0..7, annex-0/1 left out), 64 thread ranks through the start-up:
    annex-0 launched in main-7's place stops all 64 with one message; each rank but 0 made 4 store requests."""
    plan = subsets.plan_nodes(load_cluster(OLD), preset_model("gpt-7.5b"))
    path = tmp_path / "plan.json"
    plan.save(path)
    hosts = [f"main-{r // 8}" for r in range(56)] + ["annex-0"] * 8
    stores = [CountingStore(s) for s in hash_store(64)]
    res = start(path, hosts, stores, timeout=30.0)
    assert {type(e) for e in res.values()} == {ConfigError}, res
    assert len({str(e) for e in res.values()}) == 1
    assert "leaves out: annex-0 (ranks 56-63)" in res[0].problem and "main-7" in res[0].fix
    assert max(s.counts.total_requests for s in stores[1:]) == 4


def test_hostnames_match_up_to_the_domain_only_where_one_side_has_none():
    assert subsets.same_host("main-0", "main-0.cluster.local") and subsets.same_host("main-0.cluster.local", "main-0")
    assert subsets.same_host("main-0.a", "main-0.a") and not subsets.same_host("main-0.a", "main-0.b")
    assert not subsets.same_host("10.0.0.1", "10.0.0.2") and not subsets.same_host("10", "10.0.0.1")
    assert not subsets.same_host("main-1", "main-10")


def test_the_check_is_linear_in_the_ranks():
    """Rank 0 checks every rank's host: at 16,384 nodes x 8 ranks the node lookups are dictionary reads (a
    comparison with every node per rank would be 2 * 10^9 string comparisons); counted, not timed."""
    from het_plugin.core.plan import NodePlan
    nodes = [NodePlan(f"n{i}", "c", "ib", "H100", "nvidia", 8 * i, 8) for i in range(16384)]

    class Counting(str):
        compared = 0

        def __eq__(self, other):
            Counting.compared += 1
            return str.__eq__(self, other)
        __hash__ = str.__hash__

    class Fake:                           # the two things check_launch_hosts reads of a plan, at scale
        left_out = {"nodes": ["x0", "x1"]}
        world_size = 8 * 16384

        def __init__(self):
            self.nodes = nodes
            self._by_rank = [n for n in nodes for _ in range(8)]

        def node_of(self, rank):
            return self._by_rank[rank]

    hosts = [Counting(f"n{r // 8}") for r in range(8 * 16384)]
    subsets.check_launch_hosts(Fake(), hosts)
    assert Counting.compared <= 4 * len(hosts)
    hosts[-1] = Counting("x1")
    with pytest.raises(ConfigError, match="x1 \\(ranks 131071\\)"):
        subsets.check_launch_hosts(Fake(), hosts)
