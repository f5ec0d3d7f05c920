"""Plan agreement across ranks through a key-value store (ranks simulated as threads; no process group)."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest

torch_dist = pytest.importorskip("torch.distributed")

from het_plugin.runtime import agreement  # noqa: E402
from het_plugin.runtime import exchange  # noqa: E402
from het_plugin.runtime.agreement import agree_on_plan, check_plan_agreement  # noqa: E402
from het_plugin.core.errors import ConfigError, PlanMismatchError  # noqa: E402


class FakePlan:
    def __init__(self, hash_: str):
        self.hash = hash_


def hash_store(world_size):
    store = torch_dist.HashStore()
    return [store] * world_size


def tcp_stores(world_size):
    master = torch_dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False,
                                 timeout=timedelta(seconds=10))
    clients = [torch_dist.TCPStore("127.0.0.1", master.port, world_size, False, timeout=timedelta(seconds=10))
               for _ in range(world_size - 1)]
    return [master] + clients


@pytest.fixture(autouse=True)
def fresh_call_sequence(monkeypatch):
    exchange.reset_call_counts()


def run_rank_threads(world_size, body, stores, join_s=20.0):
    """Simulated ranks, no processes: ``body(rank, store)`` on one thread each; {rank: result or exception}."""
    results: dict[int, object] = {}

    def target(rank):
        try:
            results[rank] = body(rank, stores[rank])
        except BaseException as exc:   # noqa: BLE001 - the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"ranks {hung} hung"
    return results


@pytest.mark.parametrize("make_stores", [hash_store, tcp_stores])
def test_same_hash_everywhere_passes(make_stores):
    plans = {r: FakePlan("abc123") for r in range(4)}
    results = run_rank_threads(4, lambda r, s: agree_on_plan(lambda: plans[r], rank=r, world_size=4, store=s,
                                                             timeout_s=10), make_stores(4))
    assert all(results[r] is plans[r] for r in range(4))


@pytest.mark.parametrize("make_stores", [hash_store, tcp_stores])
def test_mismatch_names_the_ranks_on_every_rank(make_stores):
    hashes = ["aaaa", "aaaa", "bbbb", "aaaa"]
    results = run_rank_threads(4, lambda r, s: check_plan_agreement(hashes[r], rank=r, world_size=4, store=s,
                                                                    timeout_s=10), make_stores(4))
    for r in range(4):
        exc = results[r]
        assert isinstance(exc, PlanMismatchError), (r, exc)
        assert "ranks 0-1,3 have aaaa" in str(exc) and "ranks 2 have bbbb" in str(exc)
        assert "same cluster file" in str(exc)


def test_a_failing_rank_stops_everyone_with_its_message():
    def body(rank, store):
        def make():
            if rank == 2:
                raise ConfigError("unknown accelerator 'X'", source="cluster.yaml", field="clusters[0].nodes[0]")
            return FakePlan("abc")
        return agree_on_plan(make, rank=rank, world_size=3, store=store, timeout_s=10)

    results = run_rank_threads(3, body, hash_store(3))
    assert isinstance(results[2], ConfigError) and results[2].field == "clusters[0].nodes[0]"
    for r in range(2):
        exc = results[r]
        assert isinstance(exc, PlanMismatchError), (r, exc)
        assert "rank(s) 2 could not compute the plan" in str(exc)
        assert "cluster.yaml: clusters[0].nodes[0]: unknown accelerator 'X'" in str(exc)


def test_a_rank_that_never_reports_times_out_instead_of_hanging():
    # world of 3, but rank 2 never runs (crashed before planning)
    results = run_rank_threads(2, lambda r, s: check_plan_agreement("abc", rank=r, world_size=3, store=s,
                                                                    timeout_s=1.0), hash_store(2))
    for r in range(2):
        exc = results[r]
        assert isinstance(exc, PlanMismatchError), (r, exc)
        assert "rank(s) 2 never reached the plan check within 1s" in str(exc)
    # no time bound: a rank that hung would be caught by run_rank_threads' join (its "hung" assertion)


def test_repeated_checks_use_fresh_keys():
    stores = hash_store(2)
    first = run_rank_threads(2, lambda r, s: check_plan_agreement("one", rank=r, world_size=2, store=s, timeout_s=5),
                             stores)
    assert first == {0: None, 1: None}
    # the second round must not see the first round's values: a mismatch now is reported
    second = run_rank_threads(2, lambda r, s: check_plan_agreement(["one", "two"][r], rank=r, world_size=2, store=s,
                                                                   timeout_s=5), stores)
    assert all(isinstance(e, PlanMismatchError) for e in second.values())


def test_describe_disagreement_directly():
    def entries(values):
        return [exchange.Entry(i, i, v) for i, v in enumerate(values)]
    agreement.describe_disagreement(entries(["h", "h", "h"]))
    with pytest.raises(PlanMismatchError, match="ranks 0,2 have h1; ranks 1 have h2"):
        agreement.describe_disagreement(entries(["h1", "h2", "h1"]))
