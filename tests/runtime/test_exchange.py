"""The one store primitive (het_plugin.runtime.exchange) on a HashStore, ranks simulated as threads."""
from __future__ import annotations

import time

import pytest

torch_dist = pytest.importorskip("torch.distributed")

from het_plugin.core.errors import ConfigError  # noqa: E402
from het_plugin.runtime import exchange  # noqa: E402
from het_plugin.runtime.exchange import Exchange, ExchangeTimeout, RemoteError, first_error  # noqa: E402

from tests.runtime.test_agreement import run_rank_threads  # noqa: E402  (tests/ is on sys.path under pytest)


@pytest.fixture(autouse=True)
def fresh():
    exchange.reset_call_counts()


def threads(n, body):
    """body(index) on n threads; returns {index: result or exception}."""
    return run_rank_threads(n, lambda i, _store: body(i), [None] * n)


def test_all_gather_returns_every_value_in_member_order():
    store = torch_dist.HashStore()
    members = [4, 9, 2]
    res = threads(3, lambda i: Exchange(store, "t", index=i, members=members, what="x", timeout=5)
                  .all_gather({"me": members[i]}))
    for i in range(3):
        assert [e.value for e in res[i]] == [{"me": 4}, {"me": 9}, {"me": 2}]
        assert [e.rank for e in res[i]] == members


def test_a_missing_member_is_named_by_global_rank_within_the_timeout():
    store = torch_dist.HashStore()
    started = time.monotonic()
    res = threads(2, lambda i: Exchange(store, "t", index=i, members=[10, 11, 12], what="the vendor check",
                                        timeout=0.5).all_gather(1))
    assert time.monotonic() - started < 5
    for i in range(2):
        assert isinstance(res[i], ExchangeTimeout)
        assert res[i].missing == [12]
        assert "rank(s) 12 never reached the vendor check within 0.5s" in str(res[i])
        assert exchange.ENV_TIMEOUT in str(res[i])


def test_errors_travel_with_their_file_field_and_fix():
    store = torch_dist.HashStore()

    def body(i):
        ex = Exchange(store, "t", index=i, members=[0, 1], what="x", timeout=5)
        if i == 1:
            return ex.all_gather(error=ConfigError("bad", source="c.yaml", field="nodes", fix="fix it"))
        return ex.all_gather("ok")

    res = threads(2, body)
    err = first_error(res[0])
    assert err is not None and err.rank == 1
    with pytest.raises(ConfigError) as info:
        err.raise_error()
    assert (info.value.source, info.value.field, info.value.fix) == ("c.yaml", "nodes", "fix it")
    with pytest.raises(RemoteError, match="rank 3: ValueError: boom"):
        exchange.Entry(0, 3, error=exchange.encode_error(ValueError("boom"))).raise_error()


def test_gather_to_root_then_broadcast():
    store = torch_dist.HashStore()

    def body(i):
        ex = Exchange(store, "t", index=i, members=[0, 1, 2], what="x", timeout=5)
        got = ex.gather(i * 10)
        answer = sum(e.value for e in got) if got is not None else None
        return got is not None, ex.broadcast(answer).value

    res = threads(3, body)
    assert res == {0: (True, 30), 1: (False, 30), 2: (False, 30)}


def test_rounds_and_restarts_use_fresh_keys():
    store = torch_dist.HashStore()
    for round_ in range(2):
        res = threads(2, lambda i: [e.value for e in Exchange(store, "t", index=i, members=[0, 1], what="x",
                                                                timeout=5).all_gather(f"{round_}-{i}")])
        assert res[0] == [f"{round_}-0", f"{round_}-1"]
    exchange.reset_call_counts()
    # an elastic restart reuses the agent's store: the same call number must not see the old keys
    env = {"TORCHELASTIC_RESTART_COUNT": "1"}
    with pytest.raises(ExchangeTimeout):
        Exchange(store, "t", index=0, members=[0, 1], what="x", timeout=0.2, env=env).all_gather("new")


@pytest.mark.parametrize("text, ok", [("12.5", 12.5), ("", exchange.DEFAULT_TIMEOUT_S), ("0", None),
                                      ("-1", None), ("soon", None)])
def test_one_timeout_rule(text, ok):
    env = {exchange.ENV_TIMEOUT: text}
    if ok is None:
        with pytest.raises(ConfigError) as info:
            exchange.timeout_s(None, env)
        assert info.value.field == exchange.ENV_TIMEOUT
    else:
        assert exchange.timeout_s(None, env) == ok
    assert exchange.timeout_s(3, env) == 3.0
