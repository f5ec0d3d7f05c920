"""Bounded failures: a rank that fails or disappears at start-up stops every live rank within the bound
(HET_PLUGIN_TIMEOUT or the adapter's timeout_s) plus a margin, with a message naming the missing rank(s)
and the phase. Real ranks (integration_tests/ranks/bounded_failures.py), one of them SIGKILLed by a test
hook at a chosen point; every launch has a hard timeout.

What is measured: ``stop`` = when a live rank raised het_plugin's error (or het_plugin ended it), from the
moment the dying rank killed itself or the live rank started waiting (its plan check, after its own
planning), whichever is later -- het_plugin bounds waiting, not work: a rank still importing Megatron or
planning when another one dies starts its bounded wait later; ``gone`` = when the launcher saw the last process end (adds Python's
interpreter teardown with torch loaded: 4-7 s on this loaded 2-core machine, also for a healthy run).
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Optional

import pytest

from integration_tests.support.launch import run_ranks

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ranks" / "bounded_failures.py"
DATA = HERE / "data"
IB_ROCE_4 = DATA / "megatron-ib-roce-4.yaml"
IB_ROCE_4_OTHER = DATA / "megatron-ib-roce-4-other.yaml"
GLOO = {"HET_PLUGIN_GLOO_IFNAMES": "ib=lo,roce=lo,socket=lo,local=lo"}

BOUND = 10.0        # HET_PLUGIN_TIMEOUT / timeout_s in these tests
STOP_MARGIN = 6.0   # bound + this: every live rank has raised (or been ended by het_plugin)
GONE_MARGIN = 25.0  # bound + this: every process has ended (interpreter teardown under load included)
LAUNCH_TIMEOUT = 300
MEGATRON = ["--framework", "megatron", "--tp", "1", "--pp", "2", "--cluster", str(IB_ROCE_4)]


def launch(tmp_path: Path, args, *, die_rank: Optional[int] = None, die_at: Optional[str] = None,
           env: Optional[dict] = None, world: int = 4, **kw):
    """Run the ranks; the launcher never stops the live ones (fail_fast beyond the bound): they must stop
    by themselves. Returns (outputs, death time or None, end time)."""
    death_file = tmp_path / "death"
    e = dict(GLOO, HET_TEST_DEATH_FILE=str(death_file), **(env or {}))
    if die_at is not None:
        e.update(HET_TEST_DIE_RANK=str(die_rank), HET_TEST_DIE_AT=die_at)
    outs = run_ranks(SCRIPT, world, [str(a) for a in args], env=e, ranks_per_node=1, timeout=LAUNCH_TIMEOUT,
                     check=False, fail_fast=BOUND + GONE_MARGIN + 60, **kw)
    end = time.time()
    death = float(death_file.read_text()) if death_file.exists() else None
    return outs, death, end


def end_time(o) -> Optional[float]:
    return stamp(o, "HET_TEST_END")


def stamp(o, name: str) -> Optional[float]:
    m = re.search(rf"{name} ([0-9.]+)", o.stderr)
    return float(m.group(1)) if m else None


def assert_live_ranks_stop(outs, dead: Optional[int], since: float, end: float, label: str) -> dict:
    """Every rank but ``dead`` stopped by itself with a failure, within the bound; returns the measures."""
    stops = {}
    for o in outs:
        if o.rank == dead:
            assert o.returncode == -9, f"rank {o.rank} should have been SIGKILLed: {o.returncode}"
            continue
        assert o.returncode not in (0, None), f"rank {o.rank} did not stop by itself ({o.returncode}):\n" \
                                              f"{o.stderr[-3000:]}"
        assert "[launcher]" not in o.stderr and "Timeout (0:" not in o.stderr, o.stderr[-3000:]
        t, waits = end_time(o), stamp(o, "HET_TEST_WAIT")
        assert t is not None and waits is not None, f"rank {o.rank} has no stamps:\n{o.stderr[-3000:]}"
        stops[o.rank] = round(t - max(since, waits), 1)
    gone = round(end - since, 1)
    print(f"\n[{label}] stop after the failure per rank (s): {stops}; every process gone after {gone}s "
          f"(bound {BOUND:g}s)")
    for rank, stop in stops.items():
        assert stop <= BOUND + STOP_MARGIN, f"rank {rank} stopped {stop}s after the failure (bound {BOUND:g}s)"
    assert gone <= BOUND + GONE_MARGIN, f"the last process ended {gone}s after the failure"
    return stops


def message(o, error: str) -> str:
    """The rank's het_plugin error line (raised, or printed before het_plugin ended the process)."""
    lines = [line for line in o.stderr.splitlines() if f"{error}:" in line]
    assert lines, f"rank {o.rank}: no {error} in\n{o.stderr[-3000:]}"
    return lines[-1]


# ---- Megatron-Core drop-in ------------------------------------------------------------------------------

@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_a_healthy_start_is_not_stopped_and_the_groups_keep_megatrons_timeout(tmp_path):
    """The guard in a run where nothing fails: every rank finishes, and each group, created with the bound
    as its creation timeout, has Megatron's distributed_timeout_minutes (30) back for its collectives."""
    outs, _, _ = launch(tmp_path, MEGATRON + ["--timeout-s", BOUND])
    for o in outs:
        assert o.returncode == 0, o.stderr[-3000:]
        r = o.result
        assert r["groups"] >= 10 and len(r["timeouts"]) >= 10, r
        assert set(r["timeouts"].values()) == {30 * 60.0}, r["timeouts"]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_a_rank_dead_before_planning_is_named_by_every_rank_within_the_bound(tmp_path):
    """HET_PLUGIN_TIMEOUT (the environment) bounds the plan check."""
    outs, death, end = launch(tmp_path, MEGATRON, die_rank=3, die_at="before-planning",
                              env={"HET_PLUGIN_TIMEOUT": str(BOUND)})
    assert_live_ranks_stop(outs, 3, death, end, "dies before planning")
    for o in outs[:3]:
        line = message(o, "PlanMismatchError")
        assert f"rank(s) 3 never reached the plan check within {BOUND:g}s" in line, line


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_a_rank_dead_during_agreement_is_named_when_the_groups_are_built(tmp_path):
    """Rank 3 publishes its plan hash and dies: the others agree, then stop in group creation naming it."""
    outs, death, end = launch(tmp_path, MEGATRON + ["--timeout-s", BOUND], die_rank=3, die_at="agreement")
    assert_live_ranks_stop(outs, 3, death, end, "dies during agreement")
    for o in outs[:3]:
        line = message(o, "GroupCreationTimeout")
        assert "group creation" in line and "missing rank(s) 3" in line, line
        assert "rank 3 never started group creation" in line or "rank 3 gave up" not in line, line


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_a_rank_killed_at_its_third_new_group_stops_every_rank_within_the_bound(tmp_path):
    """The issue's reproduction: 4 ranks through initialize_model_parallel, rank 3 SIGKILLed at its third
    torch.distributed.new_group. Before the guard, the others waited for torch's 30 minutes."""
    outs, death, end = launch(tmp_path, MEGATRON + ["--timeout-s", BOUND], die_rank=3, die_at="new_group:3")
    assert_live_ranks_stop(outs, 3, death, end, "killed at its 3rd new_group")
    for o in outs[:3]:
        line = message(o, "GroupCreationTimeout")
        assert "group creation" in line and "missing rank(s) 3" in line, line
        # where rank 3 was: its third creation, with Megatron's description of the group
        assert re.search(r"rank 3 stopped responding, last at group #3 \([A-Z_]+\)", line), line


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_the_rank_hosting_the_store_killed_in_group_creation_stops_the_others_at_once(tmp_path):
    """Rank 0 hosts the default store (init_process_group's MASTER_ADDR): its death closes every
    connection, so the others do not even wait for the bound."""
    outs, death, end = launch(tmp_path, MEGATRON + ["--timeout-s", BOUND], die_rank=0, die_at="new_group:3")
    stops = assert_live_ranks_stop(outs, 0, death, end, "store host killed at its 3rd new_group")
    assert max(stops.values()) < BOUND / 2
    for o in outs[1:]:
        line = message(o, "GroupCreationTimeout")
        assert "group creation stopped" in line and "the store stopped answering" in line, line
        assert "rank 0, which hosts it" in line and "is gone" in line, line


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_ranks_given_different_cluster_files_stop_at_once_naming_both_sides(tmp_path):
    envs = [{"HET_TEST_CLUSTER": str(IB_ROCE_4)}] * 2 + [{"HET_TEST_CLUSTER": str(IB_ROCE_4_OTHER)}] * 2
    args = ["--framework", "megatron", "--tp", "1", "--pp", "2", "--timeout-s", BOUND]
    start = time.time()
    outs, _, end = launch(tmp_path, args, rank_env=envs)
    ends = [end_time(o) for o in outs]
    assert all(o.returncode not in (0, None) for o in outs), [o.returncode for o in outs]
    for o in outs:
        line = message(o, "PlanMismatchError")
        assert "ranks computed different plans" in line and "ranks 0-1" in line and "ranks 2-3" in line, line
    # nobody waits for anything: they stop as soon as the slowest rank has published its plan
    spread = max(ends) - min(ends)
    print(f"\n[different cluster files] every rank stopped within {spread:.1f}s of each other; "
          f"launch to last exit {end - start:.1f}s")
    assert spread < BOUND


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_fewer_ranks_than_the_world_size_end_with_torchs_own_error_within_its_timeout(tmp_path):
    """3 of 4 ranks started: torch's rendezvous (init_process_group) waits before het_plugin runs. What
    bounds it is init_process_group(timeout=) (torchrun: --rdzv-conf timeout / join_timeout); with 10 s,
    each started rank ends with torch's error, het_plugin is never reached."""
    outs, _, end = launch(tmp_path, MEGATRON, env={"WORLD_SIZE": "4", "HET_TEST_INIT_TIMEOUT": str(BOUND)},
                          world=3)
    for o in outs:
        assert o.returncode not in (0, None), f"rank {o.rank}: {o.returncode}\n{o.stderr[-2000:]}"
        m = re.search(r"HET_TEST_INIT_FAILED after ([0-9.]+)s", o.stderr)
        assert m, o.stderr[-3000:]
        took = float(m.group(1))
        print(f"\n[fewer ranks] rank {o.rank}: torch's init_process_group failed after {took:.1f}s")
        assert took <= BOUND + STOP_MARGIN
        assert re.search(r"DistStoreError|timed? ?out|Timeout", o.stderr, re.I), o.stderr[-2000:]
        assert "het_plugin" not in o.stderr.replace("het_plugin-", "")


# ---- DeepSpeed ------------------------------------------------------------------------------------------

@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_deepspeed_pipeline_rank_killed_at_its_third_new_group_stops_every_rank(tmp_path):
    """PipelineModule through a wrapped config whose heterogeneous section carries timeout_s."""
    pytest.importorskip("deepspeed")
    from het_plugin.deepspeed import wrap, write_config
    from het_plugin.core.inputs.model import load_model
    from integration_tests.support.deepspeed_cpu import cpu_environment

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 8,
              "steps_per_print": 10 ** 6}
    cfg = wrap(config, DATA / "ds_hetero_4.yaml", load_model(DATA / "ds_tiny_model.yaml"), pp=2,
               layer_pattern="Block", timeout_s=BOUND)
    assert cfg["heterogeneous"]["timeout_s"] == BOUND
    write_config(cfg, tmp_path / "ds.json")
    outs, death, end = launch(tmp_path, ["--framework", "deepspeed", "--pp", "2", "--config", tmp_path / "ds.json"],
                              die_rank=3, die_at="new_group:3", env=cpu_environment())
    assert_live_ranks_stop(outs, 3, death, end, "DeepSpeed: killed at its 3rd new_group")
    for o in outs[:3]:
        line = message(o, "GroupCreationTimeout")
        assert "group creation (DeepSpeed's PipelineModule)" in line or "of DeepSpeed's PipelineModule" in line, line
        assert "missing rank(s) 3" in line, line
