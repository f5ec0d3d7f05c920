"""Issue 20, item 2: the ranks of a node plan once (local rank 0 searches, the others read its plan from a
node-local file), and a rank whose inputs differ still plans for itself. Local ranks simulated as threads."""
from __future__ import annotations

import threading

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.core.launch import Launch, planning_digest, resolve_launch
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.ranks.dims import Degrees
from het_plugin.runtime.plan_once import node_sharing, share_on_node
from tests.core.test_measured import DATA, IB_ROCE_4, tiny_model

IB_ROCE_2 = DATA / "megatron-ib-roce-2.yaml"
LOCAL = 4


class CountedSearch:
    """What resolve_launch passes as the search, counted (and optionally failing)."""

    def __init__(self, pp: int = 2, fail: bool = False):
        self.pp, self.fail, self.calls = pp, fail, 0
        self.lock = threading.Lock()

    def __call__(self):
        with self.lock:
            self.calls += 1
        if self.fail:
            raise ConfigError("no placement fits", source="cluster.yaml", field="clusters[0]", fix="add nodes")
        return resolve_launch(str(IB_ROCE_4), launch=Launch(4), model=tiny_model(), degrees=Degrees(4, tp=1, pp=self.pp),
                              micro_batch_size=2).plan


def run_local_ranks(body, n=LOCAL):
    out: dict[int, object] = {}

    def target(r):
        try:
            out[r] = body(r)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            out[r] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a local rank hung"
    return out


def test_one_search_per_node_and_every_rank_holds_the_same_plan(tmp_path):
    search = CountedSearch()
    plans = run_local_ranks(lambda r: share_on_node("d1", search, local_rank=r, folder=tmp_path / "job"))
    assert search.calls == 1
    assert len({p.hash for p in plans.values()}) == 1
    assert plans[1].to_dict() == plans[0].to_dict()          # the whole plan, not only what the hash covers


def test_a_rank_with_other_inputs_plans_for_itself(tmp_path):
    same, other = CountedSearch(), CountedSearch(pp=4)      # e.g. another --pipeline-model-parallel-size

    def body(r):
        if r == 3:
            return share_on_node("other", other, local_rank=r, folder=tmp_path / "job")
        return share_on_node("d1", same, local_rank=r, folder=tmp_path / "job")

    plans = run_local_ranks(body)
    assert (same.calls, other.calls) == (1, 1)
    assert plans[3].hash != plans[0].hash            # what the plan agreement then names


def test_local_rank_0s_config_error_reaches_every_local_rank(tmp_path):
    search = CountedSearch(fail=True)
    errors = run_local_ranks(lambda r: share_on_node("d1", search, local_rank=r, folder=tmp_path / "job"))
    assert search.calls == 1
    for err in errors.values():
        assert isinstance(err, ConfigError) and err.field == "clusters[0]" and "no placement fits" in str(err)


def test_no_local_rank_0_is_not_an_error_the_rank_plans(tmp_path):
    search = CountedSearch()
    plans = run_local_ranks(lambda r: share_on_node("d1", search, local_rank=r + 1, folder=tmp_path / "job",
                                                    wait_s=0.2), n=2)
    assert search.calls == 2 and plans[0].hash == plans[1].hash


def test_sharing_only_with_several_local_ranks_and_not_when_switched_off(tmp_path):
    base = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8", "MASTER_PORT": "29500"}
    assert node_sharing(base, root=tmp_path) is not None
    assert node_sharing({**base, "LOCAL_WORLD_SIZE": "1"}, root=tmp_path) is None
    assert node_sharing({"RANK": "3"}, root=tmp_path) is None
    assert node_sharing({**base, "HET_PLUGIN_PLAN_ONCE": "0"}, root=tmp_path) is None


def test_resolve_launch_plans_once_through_the_hook_and_the_digest_names_every_input(tmp_path):
    calls = []

    def share(digest, search):
        calls.append(digest)
        return search()

    def resolve(cluster=IB_ROCE_4, mbs=2, **fixed):
        return resolve_launch(str(cluster), launch=Launch(4), model=tiny_model(), micro_batch_size=mbs,
                              degrees=Degrees(4, **(fixed or {"tp": 1, "pp": 2})), share_plan=share).plan

    assert resolve().hash == resolve_launch(str(IB_ROCE_4), launch=Launch(4), model=tiny_model(), micro_batch_size=2,
                                            degrees=Degrees(4, tp=1, pp=2)).plan.hash
    resolve()
    resolve(mbs=1)
    resolve(tp=1, pp=4)
    assert calls[0] == calls[1] and len(set(calls)) == 3
    cluster = load_cluster(IB_ROCE_4)
    model = tiny_model()
    assert planning_digest(cluster, model, Degrees(4)) != planning_digest(load_cluster(IB_ROCE_2), model, Degrees(4))
    assert planning_digest(cluster, model, Degrees(4)) == planning_digest(load_cluster(IB_ROCE_4), tiny_model(),
                                                                          Degrees(4))


def test_a_plan_file_is_read_not_shared(tmp_path):
    plan = CountedSearch()()
    path = tmp_path / "plan.json"
    plan.save(path)
    calls = []
    got = resolve_launch(str(path), launch=Launch(4), share_plan=lambda d, s: calls.append(d) or s())
    assert got.plan.hash == plan.hash and calls == []


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
