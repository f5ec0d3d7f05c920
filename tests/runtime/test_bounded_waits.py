"""Bounded waits: the one timeout setting (runtime.exchange) and the group-creation guard (runtime.guard),
with ranks simulated as threads on one TCPStore (each with its own client, as processes have).

A "creation" here is a fake rendezvous: each member sets its key and waits for the others' with the
creation timeout the guard gives -- what torch's gloo new_group does (measured: integration_tests/
test_bounded_failures.py runs the real thing).
"""
from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import pytest

torch_dist = pytest.importorskip("torch.distributed")

from het_plugin.core.errors import ConfigError  # noqa: E402
from het_plugin.runtime import exchange  # noqa: E402
from het_plugin.runtime.exchange import configured_timeout, timeout_s  # noqa: E402
from het_plugin.runtime.guard import (GroupCreationTimeout, GroupGuard, bounds_creation,  # noqa: E402
                                      torch_default_timeout)

from tests.runtime.test_agreement import run_rank_threads, tcp_stores  # noqa: E402

BOUND = 2.0
INTERVAL = 0.2


@pytest.fixture(autouse=True)
def fresh():
    exchange.reset_call_counts()


# ---- the setting ------------------------------------------------------------------------------------------

def test_explicit_then_adapter_then_environment_then_default(monkeypatch):
    monkeypatch.delenv(exchange.ENV_TIMEOUT, raising=False)
    assert timeout_s() == exchange.DEFAULT_TIMEOUT_S == 300
    monkeypatch.setenv(exchange.ENV_TIMEOUT, "40")
    assert timeout_s() == 40
    with configured_timeout(12):
        assert timeout_s() == 12 and timeout_s(3) == 3
        with configured_timeout(None):
            assert timeout_s() == 12
    assert timeout_s() == 40


@pytest.mark.parametrize("bad", [0, -5, "soon", float("nan"), float("inf"), True])
def test_a_bad_timeout_parameter_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError) as err:
        with configured_timeout(bad, "heterogeneous.timeout_s", "ds.json"):
            pass
    assert err.value.field == "heterogeneous.timeout_s" and err.value.source == "ds.json"
    assert "positive number of seconds" in str(err.value)


def test_deepspeed_section_carries_the_timeout():
    from het_plugin.deepspeed.config import HetSection, wrap
    from het_plugin.core.plan import Plan  # noqa: F401 - the section parses without torch.distributed
    cfg = wrap({"train_batch_size": 8}, "auto", timeout_s=45)
    assert cfg["heterogeneous"]["timeout_s"] == 45
    assert HetSection.from_dict(cfg["heterogeneous"]).timeout_s == 45
    with pytest.raises(ConfigError, match="timeout_s"):
        HetSection.from_dict(dict(cfg["heterogeneous"], timeout_s=-1), "ds.json")
    with pytest.raises(ConfigError, match="timeout_s"):
        wrap({"train_batch_size": 8}, "auto", timeout_s="never")


# ---- which creations are bounded -----------------------------------------------------------------------

def test_gloo_creations_are_bounded_nccl_and_custom_backends_are_not():
    assert bounds_creation(None, "gloo") and bounds_creation("gloo", "nccl")
    assert bounds_creation(None, "cpu:gloo,cuda:nccl")
    assert not bounds_creation(None, "nccl") and not bounds_creation("het_shim", "gloo")
    assert torch_default_timeout(None, "gloo") == timedelta(minutes=30)


def test_the_creation_timeout_is_the_frameworks_shortened_to_the_bound():
    store = torch_dist.HashStore()
    guard = GroupGuard(store, rank=0, world_size=1, what="x", timeout=BOUND)
    assert guard.creation_timeout(None) == timedelta(seconds=BOUND)
    assert guard.creation_timeout(timedelta(minutes=30)) == timedelta(seconds=BOUND)
    assert guard.creation_timeout(timedelta(seconds=1)) == timedelta(seconds=1)


# ---- the guard --------------------------------------------------------------------------------------------

class Rank:
    """One simulated rank: its guard, a fake rendezvous, and a hard exit that is recorded (the process would
    end: its blocked 'torch' wait is released so the thread can finish)."""

    def __init__(self, store, rank, world):
        self.store, self.rank = store, rank
        self.ended = threading.Event()
        self.exit_message = None
        self.guard = GroupGuard(store, rank=rank, world_size=world, what="the test's groups", timeout=BOUND,
                                interval=INTERVAL, hard_exit=self._hard_exit)

    def _hard_exit(self, message):
        self.exit_message = message
        self.ended.set()

    def create(self, members, desc=None):
        """Members rendezvous (bounded by the guard's creation timeout); non-members return at once."""
        with self.guard.creating(members, desc) as n:
            if self.rank not in members:
                return
            self.store.set(f"rv/{n}/{self.rank}", "1")
            wait = self.guard.creation_timeout(timedelta(minutes=30)).total_seconds()
            self.store.wait([f"rv/{n}/{m}" for m in members], timedelta(seconds=wait))

    def stuck_in_torch(self, members, desc=None):
        """A creation that never returns by itself (a rendezvous whose peer gave up) until the process ends."""
        with self.guard.creating(members, desc):
            self.ended.wait(30)


def test_a_dead_member_is_named_and_a_rank_waiting_behind_a_waiting_rank_blames_the_root(monkeypatch):
    """Rank 3 dies inside creation #1 ([2, 3]); rank 2 waits there (inside 'torch', not interruptible);
    rank 0 waits for rank 2 in creation #2 ([0, 2]), rank 1 for rank 0 in #3 ([0, 1]). Rank 0 names rank 3
    through rank 2's wait, rank 1 through rank 0's and rank 2's; rank 2's watchdog then ends its process
    with the message of whichever gave up first."""
    stores = tcp_stores(4)
    ranks = [Rank(stores[r], r, 4) for r in range(4)]
    started = time.monotonic()

    stopped = {}

    def body(r, _store):
        try:
            return ranks_body(r)
        finally:
            stopped[r] = time.monotonic() - started

    def ranks_body(r):
        me = ranks[r]
        with me.guard:
            if r == 3:
                me.guard.creating([2, 3], "TP").__enter__()
                me.guard._stop.set()              # killed: no more heartbeats, never returns
                me.ended.wait(30)
                return "dead"
            if r == 2:
                me.stuck_in_torch([2, 3], "TP")
                return "ended"
            me.create([2, 3], "TP")               # non-member: returns (every rank calls every creation)
            me.create([0, 2], "DP")
            me.create([0, 1], "PP")
        return "finished"

    threading.Timer(12, lambda: ranks[3].ended.set()).start()     # let the 'dead' thread go at the end
    res = run_rank_threads(4, body, stores, join_s=20)
    err0 = res[0]
    assert isinstance(err0, GroupCreationTimeout), err0
    assert err0.missing == [3] and err0.phase == "group creation"
    text = str(err0)
    assert "group #2 (DP) of the test's groups, ranks 0,2" in text
    assert "rank 2 is alive but waits at group #1 (TP) of the test's groups, ranks 2-3 for rank(s) 3" in text
    assert "rank 3 stopped responding, last at group #1 (TP)" in text
    # rank 2 could not be interrupted: its watchdog ended it, saying why and where
    assert ranks[2].exit_message and re.search(r"rank [01] gave up", ranks[2].exit_message)
    assert "missing rank(s) 3" in ranks[2].exit_message
    assert "inside torch at group #1 (TP)" in ranks[2].exit_message
    # rank 1 waited for rank 0 in #3 and stops with the same root cause
    assert isinstance(res[1], GroupCreationTimeout) and res[1].missing == [3], res[1]
    # the bound, the look at the others (3 intervals), the abort seen (an interval): then everyone is out
    for r in (0, 1, 2):
        assert stopped[r] < BOUND + 6 * INTERVAL + 2, f"rank {r} stopped after {stopped[r]:.1f}s"


def test_a_rank_that_finished_stops_when_another_never_finishes():
    """Rank 1 is alive but never finishes its groups: rank 0, done, waits at the end for at most the bound."""
    stores = tcp_stores(2)
    ranks = [Rank(stores[r], r, 2) for r in range(2)]
    release = threading.Event()

    def body(r, _store):
        with ranks[r].guard:
            if r == 1:
                with ranks[1].guard.creating([1], "LOCAL"):
                    release.wait(BOUND + 6)            # alive, heart beating, busy
            return "finished"

    started = time.monotonic()
    threading.Timer(BOUND + 5, release.set).start()
    res = run_rank_threads(2, body, stores, join_s=30)
    took = time.monotonic() - started
    assert isinstance(res[0], GroupCreationTimeout), res[0]
    assert res[0].missing == [1]
    assert "rank 1 is alive but still at group #1 (LOCAL)" in str(res[0])
    assert "did not finish on every rank" in str(res[0])
    assert BOUND <= took


def test_a_rank_that_gave_up_stops_the_ones_waiting_at_the_end_at_once():
    stores = tcp_stores(3)
    ranks = [Rank(stores[r], r, 3) for r in range(3)]

    def body(r, _store):
        with ranks[r].guard:
            if r == 2:
                raise RuntimeError("the framework broke on rank 2")
        return "finished"

    res = run_rank_threads(3, body, stores, join_s=30)
    assert isinstance(res[2], RuntimeError) and "framework broke" in str(res[2])
    for r in (0, 1):
        assert isinstance(res[r], GroupCreationTimeout), res[r]
        assert res[r].missing == [2]
        assert "rank 2 gave up" in str(res[r]) and "the framework broke on rank 2" in str(res[r])
        # stopped by reading rank 2's abort (the "stopped: ... gave up" message), not by waiting out the bound
        # (which says "did not finish on every rank"): told apart by what was read, not by the clock
        assert "(the test's groups) stopped: missing rank(s) 2: rank 2 gave up" in str(res[r]), res[r]
        assert "did not finish on every rank" not in str(res[r])


def test_a_creation_error_with_every_member_alive_is_the_ranks_own_error():
    stores = tcp_stores(2)
    ranks = [Rank(stores[r], r, 2) for r in range(2)]

    def body(r, _store):
        with ranks[r].guard:
            with ranks[r].guard.creating([0, 1], "TP"):
                if r == 0:
                    raise ValueError("bad pg_options")
                ranks[r].store.wait(["never"], timedelta(seconds=BOUND))

    res = run_rank_threads(2, body, stores, join_s=30)
    assert isinstance(res[0], ValueError)
    assert isinstance(res[1], GroupCreationTimeout) and res[1].missing == [0]
    assert "rank 0 gave up (rank 0 failed at group #1 (TP)" in str(res[1]) and "bad pg_options" in str(res[1])


def test_a_rank_that_never_reached_group_creation_is_named_so():
    stores = tcp_stores(2)
    rank0 = Rank(stores[0], 0, 2)

    def body(r, _store):
        if r == 1:
            return "dead after the plan check"
        with rank0.guard:
            rank0.create([0, 1], "TP")

    res = run_rank_threads(2, body, stores, join_s=30)
    assert isinstance(res[0], GroupCreationTimeout) and res[0].missing == [1]
    assert "rank 1 never started group creation" in str(res[0])


def test_a_creation_that_outlives_the_bound_ends_the_process():
    """A backend that ignores the creation timeout: the watchdog ends the process after bound + margin."""
    stores = tcp_stores(1)
    me = Rank(stores[0], 0, 2)
    started = time.monotonic()

    def body(r, _store):
        with me.guard:
            me.stuck_in_torch([0, 1], "NCCL_EAGER")

    run_rank_threads(1, body, stores, join_s=30)
    took = time.monotonic() - started
    assert me.exit_message and "did not return from torch within 2s" in me.exit_message
    assert "group #1 (NCCL_EAGER)" in me.exit_message and "missing rank(s) 1" in me.exit_message
    assert me.guard.overrun <= took            # it waited the bound and its margin, not less (the end is the join)


def test_naming_the_late_ranks_costs_a_few_store_round_trips_not_one_per_rank():
    """Every finished rank that times out looks for the late ones: on a large world that must not be one
    store request per rank (16k ranks x 16k requests on rank 0's store)."""
    from het_plugin.runtime.guard_protocol import DESCRIBE_LIMIT, GuardKeys

    class CountingStore:
        def __init__(self, done):
            self.done, self.calls = done, 0

        def check(self, keys):
            self.calls += 1
            return all(k in self.done for k in keys)

    world, late = 16384, {5, 9000, 16383}
    keys = GuardKeys("p", world)
    store = CountingStore({keys.key("done", r) for r in range(world) if r not in late})
    assert keys.not_done(store) == sorted(late)
    assert store.calls <= 2 * len(late) * 15, store.calls
    assert keys.not_done(CountingStore(set())) == list(range(DESCRIBE_LIMIT))   # nobody done: at most the limit


def test_a_store_gone_before_the_guard_starts_is_named_not_torchs_socket_error(monkeypatch):
    """The store's host (rank 0) died before this rank reached group creation (CI saw it: rank 0 ahead at its
    3rd new_group, rank 1 still planning): the first store call of the guard fails with torch's socket error,
    which must become the guard's GroupCreationTimeout naming the host."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)

    class GoneStore:
        def __getattr__(self, name):
            def call(*args, **kwargs):
                raise torch_dist.DistNetworkError("Connection reset by peer")
            return call

    guard = GroupGuard(GoneStore(), rank=1, world_size=4, what="Megatron-Core's initialize_model_parallel",
                       timeout=BOUND, interval=INTERVAL)
    with pytest.raises(GroupCreationTimeout) as err:
        with guard:
            pytest.fail("the body ran on a dead store")
    text = str(err.value)
    assert "the store stopped answering (DistNetworkError: Connection reset by peer)" in text
    assert "rank 0, which hosts it" in text and "is gone" in text and err.value.missing == [0]
    assert "at the start of Megatron-Core's initialize_model_parallel" in text


def test_the_final_wait_costs_the_same_requests_however_late_the_last_rank_is():
    """The end of the phase is one counter and one ``end`` key that every rank waits on: a rank's requests
    there do not grow with how long the slowest rank takes (the polling wait it replaces made 88,438 requests
    at 2,048 simulated ranks, docs/benchmark-startup.md). Counted on the main thread's connection (the
    heartbeat thread beats once an interval by design)."""
    from het_plugin.runtime.store_counts import CountingStore

    class MainThreadOnly(CountingStore):
        def clone(self):
            return self.inner.clone()

    def run(late_s: float) -> list[int]:
        exchange.reset_call_counts()
        stores = [MainThreadOnly(s) for s in tcp_stores(4)]
        release = threading.Event()

        def body(r, _store):
            guard = GroupGuard(stores[r], rank=r, world_size=4, what="x", timeout=BOUND * 4, interval=INTERVAL)
            with guard:
                if r == 3:
                    release.wait(late_s)        # the slowest rank, still busy with its groups
            return "finished"

        res = run_rank_threads(4, body, stores, join_s=30)
        assert res == {r: "finished" for r in range(4)}, res
        return [stores[r].counts.total_requests for r in range(4)]

    early, late = run(0.05), run(2.0)
    assert early[:3] == late[:3], (early, late)       # the waiting ranks: the same requests, 10x later
    assert max(early + late) <= 8, (early, late)
