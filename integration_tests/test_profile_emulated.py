"""``het-plugin profile`` on the emulated network (root, namespaces; the speed test also the cgroup cpu
controller): the measured links recover the shaped rates within 20%, and with unequal node speeds the profile
makes the planner give the measured-faster device type more layers although the catalog says the opposite.

Outside CI a missing precondition skips with the reason printed; in CI it fails."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.tools.emulate import Emulation, EmulatorUnavailable, check_cpu_controller, check_preconditions
from het_plugin.core.plan import Plan
from het_plugin.core.inputs.profile import load_profile

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ranks" / "profile_cli.py"
NETWORK = HERE / "data" / "emu_two_clusters.yaml"
DEVICES = HERE / "data" / "emu_two_devices.yaml"
SHARED = HERE / "data" / "emu_one_cluster_2x2.yaml"
TINY = HERE / "data" / "profile_tiny_model.yaml"
SPEED_MODEL = HERE / "data" / "profile_speed_model.yaml"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
CLI = [sys.executable, "-c", "import sys; from het_plugin.cli import main; sys.exit(main())"]


def _require(cpu: bool) -> None:
    try:
        check_preconditions()
        if cpu:
            check_cpu_controller()
    except EmulatorUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"emulator unavailable in CI: {exc}")
        print(f"SKIP reason: {exc}", file=sys.stderr)
        pytest.skip(f"emulator unavailable (outside CI): {exc}")


def _profile(emu: Emulation, args: list[str], timeout: float) -> None:
    outs = emu.run_ranks([sys.executable, str(SCRIPT), *args], env=ENV, timeout=timeout)
    assert [o.returncode for o in outs] == [0] * len(outs), "\n".join(o.stderr[-3000:] for o in outs)
    print(outs[0].stderr[-4000:])


def test_links_recover_the_shaped_rates(tmp_path):
    _require(cpu=False)
    out = tmp_path / "profile.yaml"
    with Emulation(load_cluster(NETWORK), scale=1000, log=lambda s: None) as emu:
        ib0 = emu.layout.nodes[0]
        classes = {c.label: c.kbit / 1000 for c in ib0.eth.classes}
        shaped = {("ib", "ib"): ib0.fab.kbit / 1000, ("roce", "roce"): emu.layout.nodes[2].fab.kbit / 1000,
                  ("socket", "ib"): classes["in ib"], ("ib->roce", None): classes["to roce"],
                  ("roce->ib", None): {c.label: c.kbit / 1000 for c in emu.layout.nodes[2].eth.classes}["to ib"]}
        _profile(emu, [str(NETWORK), "--model", str(TINY), "--no-compute",
                       "--message-sizes", "256K,1M", "--window", "0.3", "-o", str(out)], timeout=150)
    prof = load_profile(out)
    measured = {}
    for key, want in shaped.items():
        link = prof.link(*key)
        assert link is not None, (key, [(l.tier, l.cluster) for l in prof.links])
        measured[key] = (dict(link.bandwidth)[1 << 20] * 1000, want)     # Mbit/s at 1 MiB
    print({f"{k[0]}{' in ' + k[1] if k[1] else ''}": f"{got:.1f} of {want:g} Mbit/s"
           for k, (got, want) in measured.items()})
    # the shaped rates come from the cluster file (fabric 200, Ethernet 40 inside, 20 between, at scale 1000)
    assert sorted(w for _, w in measured.values()) == [20, 20, 40, 200, 200]
    for key, (got, want) in measured.items():
        assert 0.8 * want <= got <= 1.2 * want, f"{key}: measured {got:.1f} Mbit/s, shaped {want:g}"


def test_two_senders_of_a_node_share_its_shaped_nic(tmp_path):
    """Two ranks per node: one sender alone and both at once each get the node's shaped fabric rate in total
    (the concurrency curve), and the profile's transfer time for two senders is about twice one sender's.
    Scale 4000 (the fabric at 50 Mbit/s): at 200 Mbit/s two gloo senders on a loaded 2-core machine could not keep
    the shaped NIC full (155.8 of 200 measured beside other work), which is the machine, not the shaping."""
    _require(cpu=False)
    out = tmp_path / "profile.yaml"
    with Emulation(load_cluster(SHARED), scale=4000, log=lambda s: None) as emu:
        nic = emu.layout.nodes[0].fab.kbit / 1000
        _profile(emu, [str(SHARED), "--model", str(TINY), "--no-compute", "--message-sizes", "1M", "--window", "0.3",
                       "-o", str(out)], timeout=150)
    prof = load_profile(out)
    link = prof.link("ib", "ib")
    one = dict(link.bandwidth)[1 << 20] * 1000
    both = dict(dict(link.concurrency)[2])[1 << 20] * 1000
    print(f"ib fabric, node total at 1 MiB: one sender {one:.1f}, two senders {both:.1f} of {nic:g} Mbit/s")
    assert nic == 50
    assert 0.8 * nic <= one <= 1.2 * nic, (one, both, nic)
    # two senders share the NIC: far from the 2x of two NICs; their total sits lower than one sender's on a busy
    # machine (41.9 of 50 twice here, 155.8 of 200 at scale 1000, beside other work: 78-84%), hence 0.7
    assert 0.7 * nic <= both <= 1.2 * nic, (one, both, nic)
    alone, shared = (prof.step_s(["ib"], 1 << 20, k, "ib") for k in (1, 2))
    assert 1.6 <= shared / alone <= 2.4, (alone, shared)


def test_unequal_speeds_make_the_planner_favour_the_faster_device(tmp_path):
    _require(cpu=True)
    out, plan_file = tmp_path / "profile.yaml", tmp_path / "plan.json"
    with Emulation(load_cluster(DEVICES), scale=1000, speeds={"ib": 2, "roce": 1}, log=lambda s: None) as emu:
        _profile(emu, [str(DEVICES), "--model", str(SPEED_MODEL), "--no-links", "--micro-batch-sizes", "1,2",
                       "--window", "0.4", "-o", str(out)], timeout=150)
    prof = load_profile(out)
    a, b = (prof.compute_time(d, "layer", 2, 1) for d in ("dev-a", "dev-b"))
    ratio = (b.forward_s + b.backward_s) / (a.forward_s + a.backward_s)
    print(f"dev-b (half speed) / dev-a layer time at micro-batch 2: {ratio:.2f}")
    assert ratio > 1.3, ratio

    def split(*extra: str) -> dict[str, int]:
        p = subprocess.run([*CLI, "plan", str(DEVICES), "--model", str(SPEED_MODEL), "--tp", "1", "--pp", "2",
                            "--dp", "2", "-o", str(plan_file), *extra], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        plan = Plan.load(plan_file)
        cluster = load_cluster(DEVICES)
        return {cluster.node_of(plan.stage_ranks(s)[0]).accelerator.name: n
                for s, n in enumerate(plan.layers_per_stage)}
    analytic, measured = split(), split("--profile", str(out))
    print(f"layers per device type: catalog {analytic}, profile {measured}")
    assert analytic["dev-b"] > analytic["dev-a"]            # the catalog calls dev-b twice as fast
    assert measured["dev-a"] > measured["dev-b"]            # measured: dev-a runs at twice the speed
