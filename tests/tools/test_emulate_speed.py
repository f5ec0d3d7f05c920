"""Emulated compute speed without root: per-node speeds (from the catalog or by name), their validation,
the cgroup quotas and weights they become, the CLI's --speed parsing, and the registry's record of a run's
cgroups (cleanup never follows a record outside the cpu hierarchy). The cgroups themselves are created and
measured in integration_tests/test_emulate_speed.py (root)."""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest

from het_plugin.cli.emulate import check_numbers, parse_speeds
from het_plugin.core.inputs.cluster import cluster_from_dict
from het_plugin.tools.emulate import make_layout, system
from het_plugin.tools.emulate.speed import (
    CPU_BUDGET,
    MIN_QUOTA_US,
    PERIOD_US,
    TASK_WEIGHT,
    cpu_shares,
    default_cpu_per_rank,
    node_speeds,
)
from het_plugin.tools.emulate.system import EmulatorUnavailable, RunRecord
from het_plugin.core.errors import ConfigError


def two_speeds(fast_tflops: float = 400, slow_tflops: float = 200, ranks: int = 2):
    """A fast and a slow cluster of one node each, ``ranks`` accelerators per node."""
    def part(name, tflops):
        return {"name": name, "vendor": "nvidia", "memory_gib": 80, "peak_tflops": tflops}
    return cluster_from_dict({
        "name": "speeds",
        "clusters": [
            {"name": "fast", "fabric": {"type": "ib", "gbps": 200},
             "nodes": [{"count": 1, "accelerator": part("F", fast_tflops), "accelerators_per_node": ranks}]},
            {"name": "slow", "fabric": {"type": "roce", "gbps": 100},
             "nodes": [{"count": 2, "accelerator": part("S", slow_tflops), "accelerators_per_node": ranks}]},
        ],
        "links": [{"between": ["fast", "slow"], "type": "ethernet", "gbps": 25}],
    })


def test_catalog_speeds_follow_sustained_flops():
    c = two_speeds(400, 200)
    assert node_speeds(c, "catalog") == (1.0, 0.5, 0.5)
    assert node_speeds(c, None) is None


def test_named_speeds_by_cluster_and_node_a_node_name_wins():
    c = two_speeds()
    assert node_speeds(c, {"fast": 3, "slow": 1}) == (1.0, pytest.approx(1 / 3), pytest.approx(1 / 3))
    assert node_speeds(c, {"fast": 4, "slow": 1, "slow-1": 2}) == (1.0, 0.25, 0.5)


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "fast", None, 1e12])
def test_a_bad_speed_names_its_node(value):
    with pytest.raises(ConfigError) as e:
        node_speeds(two_speeds(), {"fast": 1, "slow": value})
    assert e.value.field == "speed[slow]" and e.value.fix


@pytest.mark.parametrize("speeds,field,words", [
    ({"fast": 1, "elsewhere": 1, "slow": 1}, "speed", "unknown node or cluster names ['elsewhere']"),
    ({"fast": 1, "slow-0": 1}, "speed", "no speed for nodes ['slow-1']"),
    ({}, "speed", "no speeds given"),
    ("fastest", "speed", "is not a speed source"),
    ({"fast": 21, "slow": 1}, "speed", "21x as fast as slow-0"),
])
def test_bad_speed_sets_are_refused(speeds, field, words):
    with pytest.raises(ConfigError) as e:
        node_speeds(two_speeds(), speeds)
    assert e.value.field == field and words in str(e.value)


def test_quotas_and_weights_are_proportional_to_speed():
    c = two_speeds(400, 200, ranks=2)
    fast, slow, _ = cpu_shares(c, "catalog", cpu_per_rank=0.4)
    assert (fast.quota_us, slow.quota_us) == (round(0.4 * 2 * PERIOD_US), round(0.2 * 2 * PERIOD_US))
    assert fast.period_us == slow.period_us == PERIOD_US
    assert (fast.shares, slow.shares) == (2 * TASK_WEIGHT, TASK_WEIGHT)      # per rank: 1024 and 512
    assert fast.cores_per_rank == 0.4 and slow.cores_per_rank == 0.2


def test_default_share_keeps_all_quotas_within_the_budget():
    c = two_speeds(400, 200, ranks=2)                    # demand 2 x 1 + 2 x 2 x 0.5 = 4 rank-speeds
    for cores in (2, 4, 64):
        shares = cpu_shares(c, "catalog", cores=cores)
        total = sum(s.cores for s in shares)
        assert total <= CPU_BUDGET * cores + 1e-9
        assert shares[0].cores_per_rank == min(1.0, CPU_BUDGET * cores / 4)
    assert default_cpu_per_rank([1.0], [1], cores=64) == 1.0      # one rank is one core at most


@pytest.mark.parametrize("cpu", [0, -0.5, float("nan"), 5, True])
def test_a_bad_cpu_per_rank_is_refused(cpu):
    with pytest.raises(ConfigError) as e:
        cpu_shares(two_speeds(), "catalog", cpu_per_rank=cpu)
    assert e.value.field == "cpu_per_rank"


def test_a_quota_under_the_kernel_minimum_is_refused_naming_the_node():
    c = two_speeds(400, 25, ranks=1)                      # 16x slower
    with pytest.raises(ConfigError, match="node slow-0 would get") as e:
        cpu_shares(c, "catalog", cpu_per_rank=0.5)        # 0.5 / 16 core x 20 ms = 625 us
    assert e.value.field == "cpu_per_rank"
    ok = cpu_shares(c, "catalog", cpu_per_rank=1.0)
    assert min(s.quota_us for s in ok) >= MIN_QUOTA_US
    with pytest.raises(ConfigError, match="cpu_per_rank without speeds"):
        cpu_shares(c, None, cpu_per_rank=0.5)


def test_the_layout_carries_and_describes_the_speeds():
    c = two_speeds(400, 200, ranks=2)
    lay = make_layout(c, "abcdef", 1000, (), "catalog", 0.5)
    assert [n.cpu.speed for n in lay.nodes] == [1.0, 0.5, 0.5]
    assert [n.cgroup for n in lay.nodes] == [n.namespace for n in lay.nodes]
    text = lay.describe()
    assert "compute speed 0.5 (0.25 core per rank: cpu quota 10000/20000 us)" in text
    assert "a ceiling" in text
    plain = make_layout(c, "abcdef", 1000)
    assert all(n.cpu is None for n in plain.nodes) and "compute speed" not in plain.describe()


def test_cli_speed_parsing():
    assert parse_speeds(None) is None
    assert parse_speeds(["catalog"]) == "catalog"
    assert parse_speeds(["ib=2", "roce=0.5"]) == {"ib": 2.0, "roce": 0.5}
    for bad in (["ib"], ["=2"], ["ib=fast"], ["catalog", "ib=2"]):
        with pytest.raises(ConfigError) as e:
            parse_speeds(bad)
        assert e.value.field == "--speed"
    args = SimpleNamespace(scale=1000.0, port=29500, timeout=0.0, speed=None, cpu_per_rank=0.5)
    with pytest.raises(ConfigError, match="without --speed"):
        check_numbers(args)
    args.speed, args.cpu_per_rank = ["catalog"], math.inf
    with pytest.raises(ConfigError) as e:
        check_numbers(args)
    assert e.value.field == "--cpu-per-rank"


# ---- the cgroup side, on a fake hierarchy -------------------------------------------------------------

@pytest.fixture
def fake_cpu(tmp_path, monkeypatch):
    """A folder that looks like a cgroup-v1 cpu mount, named in a fake /proc/self/mounts."""
    root = tmp_path / "cpu,cpuacct"
    root.mkdir()
    (root / "cpu.cfs_quota_us").write_text("-1\n")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
                      f"cgroup {root} cgroup rw,relatime,cpu,cpuacct 0 0\n")
    monkeypatch.setattr(system, "MOUNTS", mounts)
    monkeypatch.setattr(system, "STATE_DIR", tmp_path / "state")
    return root


def test_the_controller_is_found_in_the_mounts(fake_cpu, tmp_path, monkeypatch):
    assert system.cpu_controller() == fake_cpu
    assert system.check_cpu_controller() == fake_cpu
    (tmp_path / "mounts").write_text("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n"
                                     f"cgroup {tmp_path} cgroup rw,cpuacct 0 0\n")
    assert system.cpu_controller() is None
    with pytest.raises(EmulatorUnavailable, match="cgroup-v1 cpu controller.*run without speeds"):
        system.check_cpu_controller()


def test_the_join_wrapper_moves_the_process_before_it_runs(tmp_path):
    """The wrapper writes its own pid (the pid the command keeps after exec) to cgroup.procs, then execs."""
    cg = tmp_path / "cg"
    cg.mkdir()
    import subprocess
    argv = system.join_cgroup_argv(cg, ["sh", "-c", "echo $$"])
    out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True).stdout.split()
    assert (cg / "cgroup.procs").read_text().split() == out
    bad = system.join_cgroup_argv(tmp_path / "missing", ["echo", "ran"])
    p = subprocess.run(bad, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.returncode != 0 and "ran" not in p.stdout          # never runs outside its cgroup


def test_the_record_names_the_runs_cgroups_and_cleanup_stays_inside_the_hierarchy(fake_cpu, tmp_path):
    mine = fake_cpu / "hpemu-abc123-n0"
    mine.mkdir()
    elsewhere = tmp_path / "hpemu-abc123-n1"                  # named like the run, but outside the hierarchy
    elsewhere.mkdir()
    other_run = fake_cpu / "hpemu-fff000-n0"
    other_run.mkdir()
    RunRecord("abc123", os.getpid(), None, (str(mine), str(elsewhere), str(other_run))).write()
    assert system.records()["abc123"].cgroups == (str(mine), str(elsewhere), str(other_run))
    assert system.run_cgroups("abc123") == [mine]
    assert system.cgroups() == [mine, other_run]
    assert [c.split()[1] for c in system.leftovers("abc123") if c.startswith("cgroup")] == [str(mine)]


def test_an_older_record_without_cgroups_still_reads(fake_cpu):
    system.state_dir()
    (system.STATE_DIR / "abc123.json").write_text('{"run_id": "abc123", "pid": 1, "start_time": null}')
    assert system.records()["abc123"].cgroups == ()
