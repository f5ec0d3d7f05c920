"""The multi-rank launcher itself (integration_tests/support/launch.py over het_plugin.tools.emulate.procs):
a failing rank stops the run at once, output is drained while ranks run, a hang ends at the timeout.

Each run is a few plain Python processes (integration_tests/ranks/launcher_probe.py), no torch.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from integration_tests.support.launch import run_ranks

PROBE = Path(__file__).resolve().parent / "ranks" / "launcher_probe.py"
LONG = 120          # what the healthy ranks would sleep, and the launcher's timeout: a run that waits it out fails
FAIL_AT = 1.0       # when the failing rank fails, in seconds after it started
WITHIN = 10.0       # the launcher must be back this long after the failure


def probe(steps: list[str], **kw):
    """Run one probe rank per entry of ``steps``; return (outputs or the exception, seconds taken)."""
    start = time.monotonic()
    try:
        outs = run_ranks(PROBE, len(steps), rank_env=[{"HET_TEST_DO": s} for s in steps], **kw)
    except AssertionError as exc:
        return exc, time.monotonic() - start
    return outs, time.monotonic() - start


@pytest.mark.timeout(60)
def test_a_failing_rank_stops_the_run_and_is_named_first():
    steps = [f"sleep:{LONG}"] * 4
    steps[2] = f"sleep:{FAIL_AT};exit:3"
    exc, took = probe(steps, timeout=LONG)
    assert isinstance(exc, AssertionError)
    assert took < FAIL_AT + WITHIN, f"the launcher took {took:.1f}s to notice a rank that failed at {FAIL_AT}s"
    report = str(exc)
    assert report.startswith("rank 2 failed first (rc=3)"), report[:500]
    assert "rank 2 exits with 3" in report                       # the failing rank's own output tail
    assert "killed rank(s) 0, 1, 3" in report


@pytest.mark.timeout(60)
def test_a_rank_killed_by_a_signal_stops_the_run_and_the_others_outputs_are_kept():
    steps = [f"sleep:{LONG}"] * 4
    steps[1] = f"sleep:{FAIL_AT};kill"
    steps[3] = f"flood:1000:10;sleep:{LONG}"                     # output written before the stop is kept
    outs, took = probe(steps, timeout=LONG, check=False, fail_fast=1)
    assert took < FAIL_AT + WITHIN, f"{took:.1f}s"
    assert [o.returncode for o in outs] == [None, -9, None, None]     # None: killed by the launcher
    for o in (outs[0], outs[2], outs[3]):
        assert o.stderr.endswith("[launcher] rank %d killed: rank 1 failed first (killed by SIGKILL), "
                                 "so the others were stopped\n" % o.rank), o.stderr[-300:]
    assert len(outs[3].stdout) == 1000


@pytest.mark.timeout(60)
def test_the_first_failure_in_time_is_named_not_the_lowest_rank():
    steps = ["sleep:3;exit:5", f"sleep:{LONG}", f"sleep:{LONG}", "sleep:0.5;exit:4"]
    exc, took = probe(steps, timeout=LONG, fail_fast=5)        # rank 0 fails too, inside the grace
    assert str(exc).startswith("rank 3 failed first (rc=4)"), str(exc)[:300]
    assert "--- rank 0 rc=5" in str(exc)
    assert took < 0.5 + 5 + WITHIN


@pytest.mark.timeout(60)
def test_ranks_that_stop_by_themselves_within_the_grace_keep_their_exit_status():
    """A failure every rank reports (a plan mismatch): the others are not killed while they print theirs."""
    steps = ["sleep:0.3;exit:3"] + ["sleep:1.5;exit:3"] * 3
    outs, took = probe(steps, timeout=LONG, check=False)       # without check: the default grace is long
    assert [o.returncode for o in outs] == [3, 3, 3, 3]
    assert all("killed" not in o.stderr for o in outs)
    assert took < WITHIN


@pytest.mark.timeout(90)
def test_a_rank_writing_megabytes_does_not_block_while_another_waits_for_it(tmp_path):
    """Rank 0 waits until rank 3 has written 8 MiB to stdout and 2 MiB to stderr (far beyond a pipe's
    64 KiB). A launcher that reads one rank at a time reads rank 0 first, and rank 3 blocks on its full
    pipe forever."""
    done = tmp_path / "written"
    out_bytes, err_bytes = 8 << 20, 2 << 20
    steps = [f"await:{done}:{LONG}", "", "sleep:0.5", f"flood:{out_bytes}:{err_bytes};touch:{done}"]
    outs, took = probe(steps, timeout=45)
    assert took < 30, f"{took:.1f}s"
    assert [o.returncode for o in outs] == [0, 0, 0, 0]
    assert len(outs[3].stdout) == out_bytes and len(outs[3].stderr) == err_bytes
    assert set(outs[3].stdout) == {"x", "\n"}


@pytest.mark.timeout(60)
def test_a_child_left_behind_holding_the_pipes_does_not_hold_the_run():
    """Rank 0 ends, leaving a child in its session that still has its stdout: the run ends anyway and
    the child is killed with the rank's process group."""
    outs, took = probe(["child:300", "sleep:0.5"], timeout=60)
    assert took < WITHIN, f"{took:.1f}s"
    assert [o.returncode for o in outs] == [0, 0]
    pid = int(outs[0].stdout.split()[1])
    for _ in range(100):
        if not _alive(pid):
            break
        time.sleep(0.05)
    assert not _alive(pid), f"child {pid} survived its rank's run"


@pytest.mark.timeout(60)
def test_a_hang_ends_at_the_timeout_with_every_rank_killed():
    outs, took = probe([f"sleep:{LONG}", "flood:10:0;sleep:%d" % LONG], timeout=3, check=False)
    assert 3 <= took < 3 + WITHIN
    assert [o.returncode for o in outs] == [None, None]
    assert all(o.stderr.endswith(f"[launcher] rank {o.rank} killed after 3s (hang)\n") for o in outs)
    assert outs[1].stdout == "x" * 9 + "\n"
    exc, _ = probe([f"sleep:{LONG}"], timeout=2)
    assert str(exc).startswith("ranks hung: still running after 2s; the launcher killed rank(s) 0")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
