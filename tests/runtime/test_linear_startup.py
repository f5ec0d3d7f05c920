"""Start-up exchanges are linear in the world size: bounded by counting store requests (CountingStore), not
by time. Ranks are threads, each with its own store client; a few hundred of them against one real TCPStore."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

torch_dist = pytest.importorskip("torch.distributed")

from het_plugin.runtime.agreement import check_plan_agreement  # noqa: E402
from het_plugin.comm.vendors import VendorMapError, agree_on_vendors  # noqa: E402
from het_plugin.core.errors import PlanMismatchError  # noqa: E402
from het_plugin.runtime import exchange  # noqa: E402
from het_plugin.runtime.exchange import Exchange, ExchangeTimeout  # noqa: E402
from het_plugin.runtime.store_counts import CountingStore, StoreCounts  # noqa: E402

from test_agreement import run_rank_threads  # noqa: E402


@pytest.fixture(autouse=True)
def fresh():
    exchange.reset_call_counts()


def counted(stores):
    return [CountingStore(s) for s in stores]


def tcp_clients(n):
    """One real TCPStore server and n clients (the server process's own client is not a rank)."""
    server = torch_dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timedelta(seconds=30))
    def connect(_):
        return torch_dist.TCPStore("127.0.0.1", server.port, None, False, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
    with ThreadPoolExecutor(n) as pool:      # as ranks do, in parallel (a connect here stalls 5 s now and then)
        clients = list(pool.map(connect, range(n)))
    return server, clients


def test_counting_store_counts_requests_and_bytes():
    store = CountingStore(torch_dist.HashStore())
    store.set("k", "abc")
    assert store.get("k") == b"abc"
    store.set("j", b"12")
    assert store.multi_get(["k", "j"]) == [b"abc", b"12"]
    assert store.check(["k", "j"]) and not store.check(["nope"])
    assert store.add("n", 2) == 2
    c = store.counts
    assert dict(c.requests) == {"set": 2, "get": 1, "multi_get": 1, "check": 2, "add": 1}
    assert c.bytes["set"] == len("k") + 3 + len("j") + 2
    assert c.bytes["multi_get"] == 2 + 5
    assert c.total_requests == 7


def _decide_counts(n: int) -> list[StoreCounts]:
    exchange.reset_call_counts()
    stores = counted([torch_dist.HashStore()] * n)

    def body(i, store):
        return Exchange(store, "t", index=i, members=range(n), what="x", timeout=10).decide(
            {"me": i}, judge=lambda entries: sum(e.value["me"] for e in entries)).value

    results = run_rank_threads(n, body, stores)
    assert set(results.values()) == {n * (n - 1) // 2}
    return [s.counts for s in stores]


def test_decide_requests_per_rank_do_not_grow_with_the_world():
    small, large = _decide_counts(8), _decide_counts(64)
    # every member but the root: publish, wait, read, done -- whatever the world size
    assert {c.total_requests for c in small[1:]} == {c.total_requests for c in large[1:]} == {4}
    # the root: its own 4 plus one wait and one multi-key read over the members' keys, publishing the answer,
    # waiting for the done keys: a constant number of requests, bytes linear in the members
    assert small[0].total_requests == large[0].total_requests <= 10
    assert large[0].total_bytes <= 8 * small[0].total_bytes * 1.25
    # an all-gather (what plan agreement was): every member reads every key
    exchange.reset_call_counts()
    stores = counted([torch_dist.HashStore()] * 16)
    run_rank_threads(16, lambda i, s: Exchange(s, "g", index=i, members=range(16), what="x", timeout=10)
                     .all_gather(i), stores)
    assert all(s.counts.bytes["multi_get"] >= 16 * len("het_plugin/0/g/0/v/0") for s in stores)


def test_a_missing_member_is_named_by_the_root_on_every_rank():
    store = torch_dist.HashStore()
    res = run_rank_threads(3, lambda i, s: Exchange(s, "t", index=i, members=[0, 1, 2, 3], what="the x check",
                                                    timeout=0.5).decide(i, judge=len), [store] * 3)
    messages = {str(e) for e in res.values()}
    assert all(isinstance(e, ExchangeTimeout) and e.missing == [3] for e in res.values()), res
    assert len(messages) == 1 and "rank(s) 3 never reached the x check within 0.5s" in messages.pop()


def test_a_missing_root_is_named_by_the_others_themselves():
    """Rank 0 (the root) never runs: the others wait the bound plus the margin, then search for the missing."""
    store = torch_dist.HashStore()
    res = run_rank_threads(3, lambda i, s: Exchange(s, "t", index=i + 1, members=[0, 1, 2, 3], what="the x check",
                                                    timeout=0.3).decide(i, judge=len), [store] * 3, join_s=30)
    for e in res.values():
        assert isinstance(e, ExchangeTimeout) and e.missing == [0], e
        assert "rank(s) 0 never reached the x check within 0.3s" in str(e)


WORLD = 256


def test_hundreds_of_thread_ranks_get_one_verdict_over_a_real_tcpstore():
    """256 ranks, each its own TCPStore client: the same verdict everywhere, a disagreeing rank named on every
    rank, and every rank's requests bounded (the all-gather made 256 reads per rank)."""
    server, clients = tcp_clients(WORLD)
    stores = counted(clients)
    hashes = ["aaaa"] * WORLD
    hashes[137] = "bbbb"
    res = run_rank_threads(WORLD, lambda r, s: check_plan_agreement(hashes[r], rank=r, world_size=WORLD, store=s,
                                                                    timeout_s=60), stores, join_s=120)
    messages = set()
    for r in range(WORLD):
        assert isinstance(res[r], PlanMismatchError), (r, res[r])
        messages.add(str(res[r]))
    assert len(messages) == 1
    text = messages.pop()
    assert "ranks 0-136,138-255 have aaaa" in text and "ranks 137 have bbbb" in text, text
    assert max(s.counts.total_requests for s in stores[1:]) <= 4
    assert stores[0].counts.total_requests <= 10

    for s in stores:
        s.counts.reset()
    ok = run_rank_threads(WORLD, lambda r, s: check_plan_agreement("aaaa", rank=r, world_size=WORLD, store=s,
                                                                   timeout_s=60), stores, join_s=120)
    assert set(ok.values()) == {None}
    assert max(s.counts.total_requests for s in stores) <= 10
    del server


def test_vendor_agreement_is_one_answer_and_a_disagreement_is_named_everywhere():
    n = 32
    stores = counted([torch_dist.HashStore()] * n)
    env_ok = {"HET_PLUGIN_VENDOR_MAP": "nvidia*16,amd*16"}
    res = run_rank_threads(n, lambda r, s: agree_on_vendors(s, group_rank=r, global_ranks=list(range(n)),
                                                            world_size=n, env=env_ok, timeout_s=10), stores)
    assert set(res.values()) == {tuple(["nvidia"] * 16 + ["amd"] * 16)}
    assert max(s.counts.total_requests for s in stores[1:]) <= 4

    exchange.reset_call_counts()
    store = torch_dist.HashStore()

    def body(r, s):
        env = dict(env_ok, HET_PLUGIN_VENDOR="amd") if r == 5 else env_ok
        return agree_on_vendors(s, group_rank=r, global_ranks=list(range(n)), world_size=n, env=env, timeout_s=10)

    bad = run_rank_threads(n, body, [store] * n)
    texts = {str(e) for e in bad.values()}
    assert all(isinstance(e, VendorMapError) for e in bad.values()), bad
    assert len(texts) == 1 and "rank 5 is 'amd' (HET_PLUGIN_VENDOR) but the map says 'nvidia'" in texts.pop()


def test_profile_start_check_is_one_verdict_naming_the_ranks():
    """het-plugin profile's start check (profiling.run._judge_start) over Exchange.decide: views that differ,
    or a rank that refused, stop every rank with the same ConfigError."""
    from het_plugin.core.errors import ConfigError
    from het_plugin.tools.profiler.run import _judge_start
    n = 6
    store = torch_dist.HashStore()

    def body(r, s):
        ex = Exchange(s, "profile-start", index=r, members=range(n), what="the start of profiling", timeout=10)
        verdict = ex.decide({"on_gpu": r in (2, 4), "megatron": False}, judge=_judge_start)
        if verdict.error is not None:
            verdict.raise_error("")
        return verdict.value

    res = run_rank_threads(n, body, [store] * n)
    texts = {str(e) for e in res.values()}
    assert all(isinstance(e, ConfigError) and e.field == "accelerator" for e in res.values()), res
    assert len(texts) == 1 and "ranks disagree on on_gpu: ranks [2, 4] say yes" in texts.pop()

    exchange.reset_call_counts()

    def refusing(r, s):
        ex = Exchange(s, "profile-start", index=r, members=range(n), what="the start of profiling", timeout=10)
        err = ConfigError("too little memory", field="--model", fix="a smaller model") if r == 3 else None
        verdict = ex.decide(None if err else {"on_gpu": False, "megatron": False}, error=err, judge=_judge_start)
        if verdict.error is not None:
            verdict.raise_error("")
        return verdict.value

    res = run_rank_threads(n, refusing, [torch_dist.HashStore()] * n)
    assert {str(e) for e in res.values()} == {str(res[0])} and "rank 3: too little memory" in str(res[0])
    assert all(e.field == "--model" and e.fix == "a smaller model" for e in res.values())
