"""The emulator's run registry without root: records are written atomically and exclusively, a record that
cannot be read is never taken for an ownerless run, and cleanup lists namespaces before records (a run
that registers and builds meanwhile is not torn down). ``ip`` is replaced by fakes here; the real thing
runs in integration_tests/test_emulate.py (root)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from het_plugin.tools.emulate import system
from het_plugin.tools.emulate.system import EmulatorUnavailable, RunRecord


@pytest.fixture
def registry(tmp_path, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setattr(system, "STATE_DIR", state)
    removed: list[str] = []
    monkeypatch.setattr(system, "root_links", lambda prefix=system.LINK_PREFIX: [])
    monkeypatch.setattr(system, "cgroups", lambda prefix=system.NS_PREFIX: [])
    monkeypatch.setattr(system, "remove_run", lambda run_id: removed.append(run_id) or [f"run {run_id}"])
    return state, removed


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def me() -> RunRecord:
    return RunRecord("abc123", os.getpid(), system.process_start_time(os.getpid()))


def test_a_record_is_written_whole_private_and_once(registry):
    state, _ = registry
    rec = me()
    rec.write()
    assert system.records() == {"abc123": rec}
    assert sorted(p.name for p in state.iterdir()) == ["abc123.json"], "no temporary file is left"
    assert state.stat().st_mode & 0o777 == 0o700
    with pytest.raises(EmulatorUnavailable, match="already in use"):
        RunRecord("abc123", 1, None).write()
    assert system.records() == {"abc123": rec}, "the run's record was not overwritten"


def test_a_registry_folder_that_is_a_symlink_is_refused(tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "state").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setattr(system, "STATE_DIR", tmp_path / "state")
    with pytest.raises(EmulatorUnavailable, match="not a directory owned by this user"):
        me().write()


def test_an_unreadable_record_keeps_its_run(registry, monkeypatch):
    state, removed = registry
    state.mkdir(mode=0o700)
    (state / "0a0b0c.json").write_text("")                       # half-written by an older version, or damaged
    monkeypatch.setattr(system, "namespaces", lambda prefix=system.NS_PREFIX: ["hpemu-0a0b0c-n0"]
                        if prefix == system.NS_PREFIX else [])
    kept: list[str] = []
    assert system.clean_leftovers(kept) == []
    assert removed == [] and (state / "0a0b0c.json").exists()
    assert len(kept) == 1 and "0a0b0c" in kept[0] and "cannot be read" in kept[0]


def test_dead_owners_go_live_owners_stay(registry, monkeypatch):
    state, removed = registry
    RunRecord("dead00", dead_pid(), None).write()
    me().write()
    monkeypatch.setattr(system, "namespaces", lambda prefix=system.NS_PREFIX: ["hpemu-dead00-n0", "hpemu-abc123-n0"]
                        if prefix == system.NS_PREFIX else [])
    system.clean_leftovers()
    assert removed == ["dead00"]


def test_a_run_that_registers_during_the_listing_is_not_cleaned(registry, monkeypatch):
    """Another start registers (record first) and builds its namespace while this one lists: seen as a
    namespace, its record must be found too -- so the records are read after the namespaces."""
    _, removed = registry

    def namespaces(prefix=system.NS_PREFIX):
        if prefix != system.NS_PREFIX:
            return []
        me().write()                       # the other start: record, then namespace, just as we list
        return ["hpemu-abc123-n0"]
    monkeypatch.setattr(system, "namespaces", namespaces)
    system.clean_leftovers()
    assert removed == []


def test_stale_temporary_records_go_fresh_ones_stay(registry):
    state, _ = registry
    state.mkdir(mode=0o700)
    old, new = state / ".aaaaaa.x1.tmp", state / ".bbbbbb.x2.tmp"
    old.write_text("{")
    new.write_text("{")
    past = time.time() - 2 * system.STALE_TMP_S
    os.utime(old, (past, past))
    assert system.records() == {}
    assert not old.exists() and new.exists()
