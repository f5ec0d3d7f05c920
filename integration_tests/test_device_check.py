"""benchmarks/device_check.py, the one-command GPU check, tested where there is no GPU.

Without CUDA every part must SKIP quickly; ``--cpu-dry-run`` runs the parts' own workers (the group policy's
NCCL options, the het_shim collectives, the Megatron-LM launch through torchrun) on CPU/gloo, so the check is
known to work before it meets a GPU. The log parsers and the NCCL verdicts are tested on canned output.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "device_check.py"

spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
dc = importlib.util.module_from_spec(spec)
sys.modules["device_check"] = dc
spec.loader.exec_module(dc)


def run_check(tmp_path, *args, timeout=300, env=None):
    out = tmp_path / "report.txt"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO), env=env)
    return proc, out.read_text() if out.exists() else ""


def part_line(text: str, part: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith(f"[{part}] ")]
    assert len(lines) == 1, f"one line for part {part}:\n{text}"
    return lines[0]


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA: the check would really run")
def test_without_cuda_every_part_skips_and_the_report_is_written(tmp_path):
    proc, report = run_check(tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report == proc.stdout, "--out holds exactly what was printed"
    for part in ("1", "2a", "2b", "2c", "3", "4a", "4b", "4c", "5"):
        assert " SKIP " in part_line(report, part) and "no CUDA" in part_line(report, part)
    assert "0 PASS, 0 FAIL, 9 SKIP" in report
    assert "torch " in report and "NCCL" in report, "the summary names the versions"


@pytest.mark.slow
def test_cpu_dry_run_of_the_gpu_path_parts(tmp_path):
    """Part 4 (issue 19): the split-share refusal, NCCL's interface choice predicted, the shim beside a main-thread
    all-reduce loop."""
    proc, report = run_check(tmp_path, "--cpu-dry-run", "--parts", "4", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for part in ("4a", "4b", "4c"):
        assert " PASS " in part_line(report, part), report
    assert "het_plugin refuses: NCCL_COMM_SPLIT_SHARE_RESOURCES: NCCL_COMM_SPLIT_SHARE_RESOURCES=1" in report
    assert "het_plugin predicts NCCL takes" in report
    assert "20 rounds of an async het_shim all-reduce and a main-thread gloo all-reduce" in report


@pytest.mark.slow
def test_cpu_dry_run_of_the_nccl_and_shim_parts(tmp_path):
    proc, report = run_check(tmp_path, "--cpu-dry-run", "--parts", "2,3", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for part in ("2a", "2b", "2c", "3"):
        assert " PASS " in part_line(report, part), report
    # the policy's own NCCL options for a 'socket' and an 'ib' group (stand-in Options on a CPU torch)
    assert "policy transport=socket net_name='Socket' (options.config.net_name read back: 'Socket')" in report
    assert "policy transport=ib net_name='IB' (options.config.net_name read back: 'IB')" in report
    # the cross-vendor group came from the policy as het_shim with the plan's vendors, every collective checked
    for rank in (0, 1):
        assert f"rank {rank}: group [0, 1], vendors agreed ['nvidia', 'amd'], backend het_shim" in report
        for check in ("all_reduce SUM fp32", "all_reduce SUM bf16", "broadcast from rank 1", "all_gather_into_tensor",
                      "all_gather (list)", "single-vendor het_shim group (native backend)"):
            assert f"rank {rank}: {check}: ok" in report
    assert "timing: all_reduce of 4 MiB fp32 on cpu: het_shim median" in report
    assert "4 PASS, 0 FAIL, 0 SKIP" in report


def _megatron_training_path() -> str | None:
    """PYTHONPATH entries giving megatron.training (megatron-core >= 0.19): the environment's own, or the
    copy `make test` installs beside the venv (.mcore-<version>, with the Python-3.11 shim)."""
    probe = subprocess.run([sys.executable, "-c", "import megatron.training"], capture_output=True)
    if probe.returncode == 0:
        return ""
    for d in sorted(REPO.glob(".mcore-*"), reverse=True):
        if (d / "megatron" / "training").is_dir():
            extra = [str(d)]
            if sys.version_info < (3, 12):
                extra.append(str(REPO / "integration_tests" / "support" / "py311"))
            return ":".join(extra)
    return None


@pytest.mark.slow
def test_cpu_dry_run_of_megatron_lm_training(tmp_path):
    path = _megatron_training_path()
    if path is None:
        pytest.skip("no megatron-core >= 0.19 (megatron.training) here; `make test` installs one")
    if not (dc.PRETRAIN_SCRIPT.exists() and dc.CPU_TRAINING_RUNNER.exists()):
        pytest.skip("the Megatron-LM test script or its CPU runner is not in this checkout")
    proc, report = run_check(tmp_path, "--cpu-dry-run", "--parts", "1", "--pythonpath", path, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = part_line(report, "1")
    assert " PASS " in line and "3 finite losses" in line, report
    assert "lm loss per iteration: 1: " in report and "plan file written" in report
    assert "device_check: " in report, "the launcher says how the hook and the dataset helpers were handled"


# ---- canned output: parsers and verdicts -------------------------------------------------------------

SOCKET_OK = """DEVICE_CHECK_RESULT {"rank": 0, "ok": true, "transport": "socket", "policy_net_name": "Socket"}
gpu:11:11 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so.
gpu:11:11 [0] NCCL INFO NET/IB : No device found.
gpu:11:11 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>
gpu:11:11 [0] NCCL INFO Using network Socket
NCCL version 2.27.7+cuda13.0
"""

IB_REFUSED = ("DEVICE_CHECK_RESULT " + json.dumps({
    "rank": 0, "ok": False,
    "error": "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage, NCCL version 2.27.7\n"
             "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
             "Failed to initialize any NET plugin"}) + """
gpu:12:12 [0] NCCL INFO NET/IB : No device found.

gpu:12:12 [0] net.cc:300 NCCL WARN Failed to initialize any NET plugin
""")

IB_IGNORED = """DEVICE_CHECK_RESULT {"rank": 0, "ok": true}
gpu:13:13 [0] NCCL INFO Using network Socket
"""

SPLIT_REFUSED = """DEVICE_CHECK_RESULT {"rank": 0, "ok": false, "error": "DistBackendError: NCCL error: invalid usage"}
gpu:14:14 [0] NCCL INFO Using network Socket

gpu:14:14 [0] net.cc:330 NCCL WARN Comm config netName (IB) does not match the parent (Socket)
"""


def proc(text, rc=0):
    return dc.Proc(rc, text, dc.last_result(text), 1.0)


def test_nccl_log_parsing():
    log = dc.parse_nccl_log(SOCKET_OK + "gpu:11:11 [0] NCCL INFO Using network IB\n")
    assert log["networks"] == ["Socket", "IB"] and log["ib_absent"] and log["version"] == "2.27.7+cuda13.0"
    log = dc.parse_nccl_log(IB_REFUSED)
    assert log["warnings"] == ["Failed to initialize any NET plugin"] and not log["networks"]
    assert dc.parse_nccl_log("x NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000")[
        "duplicate_gpu"]
    assert dc.parse_nccl_log(SPLIT_REFUSED)["parent_mismatch"]
    assert dc.parse_nccl_log("x NCCL WARN Split shares resources, but parent comm netName Socket is different from "
                             "child comm netName IB")["parent_mismatch"]


def test_nccl_verdicts():
    assert dc.evaluate_net(proc(SOCKET_OK), "Socket", allow_refusal=False)[0] == "PASS"
    status, reason = dc.evaluate_net(proc(IB_REFUSED, 1), "IB", allow_refusal=True)
    assert status == "PASS" and "Failed to initialize any NET plugin" in reason
    assert dc.evaluate_net(proc(IB_REFUSED, 1), "Socket", allow_refusal=False)[0] == "FAIL"
    status, reason = dc.evaluate_net(proc(IB_IGNORED), "IB", allow_refusal=True)
    assert status == "FAIL" and "did not reach NCCL" in reason
    status, reason = dc.evaluate_net(proc(SPLIT_REFUSED, 1), "IB", allow_refusal=True, comms=2)
    assert status == "FAIL" and "must equal the parent" in reason
    # a group whose communicator printed nothing: no verdict from the world's line
    assert dc.evaluate_net(proc(IB_IGNORED), "Socket", allow_refusal=False, comms=2)[0] == "FAIL"
    assert dc.evaluate_net(dc.Proc(None, "", None, 60.0), "Socket", allow_refusal=True)[1] == "timed out"


def test_megatron_log_parsing():
    text = (" [2026-12-01 02:47:23.598296] iteration        1/       3 | consumed samples:            4 | elapsed time "
            "per iteration (ms): 51.2 | learning rate: 6.666667E-04 | global batch size:     4 | lm loss: 4.844732E+00 "
            "| loss scale: 1.0 | number of skipped iterations:   0 | number of nan iterations:   0 |\n"
            " [2026-12-01 02:47:23.627712] iteration        2/       3 | consumed samples:            8 | elapsed time "
            "per iteration (ms): 40.3 | global batch size:     4 | loss scale: 1.0 | number of skipped iterations:   0"
            " | number of nan iterations:   1 |\n"
            "het_plugin: plan bbc7ac60669b1752 for device-check-one-gpu (Megatron): 1 ranks\n")
    log = dc.parse_megatron_log(text)
    assert log["losses"] == {1: pytest.approx(4.844732), 2: None}, "Megatron leaves a NaN loss out of the line"
    assert log["train_iters"] == 3 and log["nan_iterations"] == 1 and log["iteration_ms"] == [51.2, 40.3]
    assert log["plan_hashes"] == ["bbc7ac60669b1752"]


def test_cpu_dry_run_of_the_multinet_part(tmp_path):
    """Part 5's policy side: the group across the IB and RoCE clusters, planned for the cross-dc build, is
    'multinet' with no network forced, and its collective runs."""
    proc, report = run_check(tmp_path, "--cpu-dry-run", "--parts", "5", timeout=240)
    assert proc.returncode == 0, report + proc.stderr
    assert " PASS " in part_line(report, "5") and "transport 'multinet'" in part_line(report, "5"), report


def test_part_selection():
    assert dc.select_parts("1,2,3") == ["1", "2a", "2b", "2c", "3"]
    assert dc.select_parts("3,2a") == ["3", "2a"]
    with pytest.raises(SystemExit):
        dc.select_parts("9")
    assert dc.select_parts("4") == ["4a", "4b", "4c"]
