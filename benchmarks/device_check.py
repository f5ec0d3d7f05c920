#!/usr/bin/env python3
"""het_plugin on a real GPU: one command, three parts, each with its own time limit.

    python3 benchmarks/device_check.py --out device-check-output.txt      # on a CUDA machine
    python3 benchmarks/device_check.py --cpu-dry-run                      # here: the same code paths on CPU/gloo

Parts (docs/device-check.md says what each can and cannot demonstrate):

1   Megatron-LM training through the real ``megatron.training`` (integration_tests/ranks/pretrain_gpt.py) on one
    GPU under torchrun, with ``--heterogeneous-nic <one-node cluster file>`` and ``--heterogeneous-plan-out``:
    exit 0, a finite 'lm loss' on every iteration, the plan file written and the same hash in the log.
2a  NCCL communicators created with the ``pg_options`` het_plugin's group policy (runtime.group_policy.spec_for)
    gives a group whose transport is 'socket' and one whose transport is 'ib': NCCL_DEBUG=INFO must say
    'Using network Socket' for the first, and 'Using network IB' or NCCL's own refusal for the second.
2b  The same through a default group bound to the device (``init_process_group(device_id=...)``), where torch
    creates every new NCCL group by ncclCommSplit of the world communicator.
2c  Two processes, one GPU, one 2-rank NCCL group from the policy: what NCCL says (it refuses two ranks of
    one communicator on one GPU: "Duplicate GPU detected").
3   The ``het_shim`` backend's host-staged path: two processes declaring different vendors (the plan of an
    NVIDIA node and an AMD node), both on the one GPU, all-reduce / broadcast / all-gather of CUDA tensors
    checked against the expected values, single-vendor shim groups forwarding to NCCL, and a timing line.
4a  Split children sharing resources (NCCL_COMM_SPLIT_SHARE_RESOURCES=1): het_plugin's pre-flight must refuse
    it (groups with different networks); then, on the GPU, what NCCL itself does with a device-bound world and
    a 'Socket' group split from it under that setting (recorded, not judged).
4b  NCCL_SOCKET_IFNAME unset: which interface NCCL picks (its 'NET/Socket : Using' and 'Bootstrap' lines) next
    to the one het_plugin's port of NCCL's choice (core.nccl_env.nccl_auto_interfaces) predicts.
4c  The shim under CUDA_DEVICE_MAX_CONNECTIONS=1 beside a main-thread NCCL all-reduce loop: async het_shim
    all-reduces interleaved with all-reduces on a 1-rank NCCL group, every value checked, within the limit.
5   NCCL's multi-network communicators (issue 30): a group spanning an IB and a RoCE cluster planned for the
    cross-dc build ('multinet': no net_name forced) created under NCCL_ALLNET_ENABLE=1; NCCL_DEBUG=INFO says which
    networks the communicator loaded and whether this NCCL knows ALLNET, next to het_plugin's verdict for the
    loaded version (a release: no multi-network communicators, so one network per communicator).

Without CUDA every part prints SKIP (no CUDA). ``--cpu-dry-run`` runs the same workers with gloo and CPU
tensors (part 1 through integration_tests/support/megatron_training_cpu.py, the test-only CPU runner), so the
check's own logic is known to work before it meets a GPU. The script exits 1 if any part FAILs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
PRETRAIN_SCRIPT = REPO / "integration_tests" / "ranks" / "pretrain_gpt.py"
CPU_TRAINING_RUNNER = REPO / "integration_tests" / "support" / "megatron_training_cpu.py"
RESULT_TAG = "DEVICE_CHECK_RESULT "
MEGATRON_FIX = ("pip install --no-deps megatron-core==0.19.2   (offline: carry the cp312 wheel in .whl/, see "
                "docs/device-check.md; bash benchmarks/device_check.sh installs .whl/*.whl)")
HET_PLUGIN_FIX = ("pip install --no-deps --no-build-isolation -e .  plus pyyaml and pydantic>=2.5 (pydantic, "
                  "pydantic-core, annotated-types, typing-inspection; offline: carried wheels)")

# Part time limits (s); every part also stops at the global --budget.
LIMITS = {"1": 240.0, "2a": 60.0, "2b": 50.0, "2c": 45.0, "3": 75.0, "4a": 45.0, "4b": 40.0, "4c": 60.0,
          "5": 50.0}
TITLES = {
    "1": "Megatron-LM training (megatron.training, torchrun, 1 GPU) with --heterogeneous-nic",
    "2a": "NCCL net_name from het_plugin's group policy: 'Socket' and 'IB' communicators",
    "2b": "net_name on a group split from a device-bound default group (ncclCommSplit path)",
    "2c": "two ranks on one GPU in one NCCL group (policy group over two nodes)",
    "3": "het_shim host-staged collectives of CUDA tensors between two declared vendors",
    "4a": "NCCL_COMM_SPLIT_SHARE_RESOURCES=1 with groups on different networks: refused before any group",
    "4b": "NCCL_SOCKET_IFNAME unset: the interface NCCL picks, next to het_plugin's prediction",
    "4c": "het_shim under CUDA_DEVICE_MAX_CONNECTIONS=1 beside a main-thread NCCL all-reduce loop",
    "5": "NCCL multi-network communicator: a 'multinet' group under NCCL_ALLNET_ENABLE=1",
}


# ---------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------

@dataclass
class PartResult:
    part: str
    status: str                      # PASS | FAIL | SKIP
    reason: str
    details: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Report:
    """Every line goes to stdout and, as it is printed, to the --out file (a run killed from outside keeps
    what it printed)."""

    def __init__(self, out: Optional[Path]):
        self.out = None
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            self.out = open(out, "w", encoding="utf-8")

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        if self.out is not None:
            self.out.write(text + "\n")
            self.out.flush()

    def part(self, r: PartResult) -> None:
        self.line(f"[{r.part}] {r.status} {TITLES.get(r.part, '')} ({r.seconds:.1f} s): {r.reason}")
        for d in r.details:
            self.line(f"       {d}")

    def close(self) -> None:
        if self.out is not None:
            self.out.close()


# ---------------------------------------------------------------------------------------------------------
# Processes (only the ones this script starts; each in its own process group, killed by its own id)
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Proc:
    rc: Optional[int]                # None: killed at the time limit
    output: str
    result: Optional[dict]
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_result(text: str) -> Optional[dict]:
    found = None
    for line in text.splitlines():
        if line.startswith(RESULT_TAG):
            try:
                found = json.loads(line[len(RESULT_TAG):])
            except ValueError:
                pass
    return found


def run_processes(cmds: Sequence[Sequence[str]], envs: Sequence[dict], timeout: float, logdir: Path,
                  name: str) -> list[Proc]:
    """Start every command at once (output to a file each), wait up to ``timeout``, kill what is left."""
    started = time.monotonic()
    procs, files = [], []
    for i, (cmd, env) in enumerate(zip(cmds, envs)):
        path = logdir / f"{name}-{i}.log"
        fh = open(path, "w+", encoding="utf-8", errors="replace")
        files.append((path, fh))
        procs.append(subprocess.Popen(list(cmd), env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=str(REPO),
                                      start_new_session=True))
    deadline = started + max(1.0, timeout)
    rcs: list[Optional[int]] = [None] * len(procs)
    ends = [0.0] * len(procs)
    while any(rc is None for rc in rcs) and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if rcs[i] is None and p.poll() is not None:
                rcs[i], ends[i] = p.returncode, time.monotonic() - started
        time.sleep(0.1)
    for i, p in enumerate(procs):
        if rcs[i] is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)      # the group this script started for p, and nothing else
            except ProcessLookupError:
                pass
            p.wait()
            ends[i] = time.monotonic() - started
    out = []
    for i, (path, fh) in enumerate(files):
        fh.close()
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append(Proc(rcs[i], text, last_result(text), ends[i]))
    return out


def child_env(args, extra: Optional[dict] = None, drop: Sequence[str] = ()) -> dict:
    env = dict(os.environ)
    paths = [str(REPO)] + [p for p in (args.pythonpath or "").split(os.pathsep) if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HET_PLUGIN_TIMEOUT"] = "60"
    for k in drop:
        env.pop(k, None)
    env.update(extra or {})
    return env


def tail(text: str, n: int = 12) -> list[str]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return ["| " + ln[:300] for ln in lines[-n:]]


def worker_cmd(args, worker: str, spec: dict) -> list[str]:
    return [args.python, "-u", str(Path(__file__).resolve()), "--worker", worker, "--spec", json.dumps(spec)]


def dist_env(rank: int, world: int, port: int) -> dict:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(world)}


# ---------------------------------------------------------------------------------------------------------
# Log parsing (unit-tested on canned lines: tests/test_device_check.py)
# ---------------------------------------------------------------------------------------------------------

NCCL_NET_RE = re.compile(r"NCCL INFO Using network (\S+)")
NCCL_ASSIGNED_RE = re.compile(r"NCCL INFO Assigned NET plugin (\S+) to comm")
NCCL_VERSION_RE = re.compile(r"NCCL version (\S+)")
NCCL_WARN_RE = re.compile(r"NCCL WARN (.*)")


PARENT_MISMATCH = ("does not match the parent", "is different from child comm netName")


def parse_nccl_log(text: str) -> dict:
    """What NCCL_DEBUG=INFO output says: the network of each communicator in creation order, warnings, version."""
    warns = [m.group(1).strip() for m in NCCL_WARN_RE.finditer(text)]
    version = NCCL_VERSION_RE.search(text)
    return {
        "networks": NCCL_NET_RE.findall(text),
        "assigned": NCCL_ASSIGNED_RE.findall(text),
        "warnings": list(dict.fromkeys(warns)),
        "version": version.group(1) if version else None,
        "duplicate_gpu": "Duplicate GPU detected" in text,
        "ib_absent": "NET/IB : No device found" in text or "NET/IB : No IP interface found" in text,
        "net_env_reset": "netName reset to NCCL_NET" in text,
        # ncclCommSplit sharing the parent's resources (splitShare, NCCL_COMM_SPLIT_SHARE_RESOURCES=1) with a
        # net_name other than the parent's: NCCL's ncclNetInitFromParent / commAlloc refuse it
        "parent_mismatch": any(m in text for m in PARENT_MISMATCH),
    }


MEGATRON_ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|(.*)")
MEGATRON_LOSS_RE = re.compile(r"\blm loss: (\S+) \|")
MEGATRON_NAN_RE = re.compile(r"number of nan iterations:\s*(\d+)")
MEGATRON_MS_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
PLAN_SUMMARY_RE = re.compile(r"het_plugin: plan ([0-9a-f]{16}) for ")


def parse_megatron_log(text: str) -> dict:
    """Megatron's training_log lines: {iteration: loss or None (no 'lm loss': Megatron drops NaN from the line)}."""
    losses: dict[int, Optional[float]] = {}
    nan_iters, ms, total = 0, [], None
    for m in MEGATRON_ITER_RE.finditer(text):
        it, total, rest = int(m.group(1)), int(m.group(2)), m.group(3)
        loss = MEGATRON_LOSS_RE.search(rest)
        value = None
        if loss:
            try:
                value = float(loss.group(1))
            except ValueError:
                value = float("nan")
        losses[it] = value
        nan = MEGATRON_NAN_RE.search(rest)
        nan_iters = max(nan_iters, int(nan.group(1)) if nan else 0)
        t = MEGATRON_MS_RE.search(rest)
        if t:
            ms.append(float(t.group(1)))
    return {"losses": losses, "train_iters": total, "nan_iterations": nan_iters, "iteration_ms": ms,
            "plan_hashes": PLAN_SUMMARY_RE.findall(text)}


# ---------------------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------------------

def environment(args) -> tuple[dict, list[str]]:
    info: dict = {"cuda": False}
    lines = [f"python {platform.python_version()} ({sys.executable}); host {platform.node()}; "
             f"{platform.platform()}"]
    try:
        import torch
        info["torch"] = torch.__version__
        info["cuda_build"] = torch.version.cuda
        info["cuda"] = bool(torch.cuda.is_available())
        lines.append(f"torch {torch.__version__}; CUDA build {torch.version.cuda}; "
                     f"torch.cuda.is_available() = {info['cuda']}")
        if info["cuda"]:
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
            lines.append(f"GPU: {info['gpu']} ({info['gpus']} visible); capability "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(0)))}")
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as exc:                                  # CPU builds have no NCCL
            info["nccl"] = None
            lines.append(f"NCCL: none in this torch ({type(exc).__name__}: {str(exc)[:120]})")
        if info.get("nccl"):
            lines.append(f"NCCL (torch.cuda.nccl.version()): {info['nccl']}")
        import torch.distributed as dist
        pg_nccl = "present" if hasattr(dist, "ProcessGroupNCCL") else "absent"
        lines.append(f"torch.distributed: nccl available {dist.is_nccl_available()}, gloo available "
                     f"{dist.is_gloo_available()}; ProcessGroupNCCL {pg_nccl}")
    except Exception as exc:
        lines.append(f"torch not importable: {exc}")
    if shutil.which("nvidia-smi"):
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_mode",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            lines.append(f"nvidia-smi: {q.stdout.strip() or q.stderr.strip()}")
        except Exception as exc:
            lines.append(f"nvidia-smi failed: {exc}")
    ib = Path("/sys/class/infiniband")
    ib_devs = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    info["ib_devices"] = ib_devs
    lines.append(f"RDMA devices (/sys/class/infiniband): {', '.join(ib_devs) or 'none'}")
    nccl_env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    lines.append(f"NCCL_* in the environment: {nccl_env or 'none'} (the NCCL parts unset NCCL_NET: it overrides "
                 "a communicator's net_name)")
    try:
        probe = child_probe(args)
        text = (probe.stdout.strip() or probe.stderr.strip()[-400:]).replace("\n", " ")
    except Exception as exc:                                    # e.g. a child import that hangs past 120 s
        text = f"could not probe the children's imports: {type(exc).__name__}: {exc}"
    info["packages"] = text
    info["het_plugin_ok"] = "het_plugin ok" in text
    lines.append(f"children see: {text}")
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "het_plugin", "benchmarks"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if commit:
            lines.append(f"het_plugin checkout {commit}{' (with local changes)' if dirty else ''}")
    except Exception:
        pass
    return info, lines


def child_probe(args) -> subprocess.CompletedProcess:
    """What a child process of the check can import (het_plugin, megatron-core, megatron.training, the hook)."""
    return subprocess.run(
        [args.python, "-c",
         "import sys\n"
         "out = []\n"
         "try:\n import het_plugin, het_plugin.core.inputs.cluster; out.append('het_plugin ok')\n"
         "except Exception as e: out.append(f'het_plugin NOT importable: {type(e).__name__}: {e}')\n"
         "try:\n import megatron.core as mc; out.append('megatron-core ' + str(getattr(mc, '__version__', '?')))\n"
         "except Exception as e: out.append(f'megatron-core NOT importable: {type(e).__name__}: {e}')\n"
         "try:\n import megatron.training; out.append('megatron.training ok')\n"
         "except Exception as e: out.append(f'megatron.training NOT importable: {type(e).__name__}: {e}')\n"
         "hook = any(type(f).__name__ == 'MegatronArgsFinder' for f in sys.meta_path)\n"
         "out.append('import hook (het_plugin_megatron.pth) ' + ('active' if hook else 'not installed'))\n"
         "print(' | '.join(out))\n",
         "--heterogeneous-nic"],          # the .pth installs the hook only for a command line with the flag
        capture_output=True, text=True, timeout=120, env=child_env(args), cwd=str(REPO))


# ---------------------------------------------------------------------------------------------------------
# Cluster files the check writes into its temporary directory
# ---------------------------------------------------------------------------------------------------------

CLUSTERS = {
    # Part 1: the one GPU of this machine as a one-node cluster.
    "one-gpu": """# device_check part 1: this machine, one GPU
name: device-check-one-gpu
clusters:
  - name: local
    fabric: {type: ib, gbps: 400, latency_us: 2}
    nodes:
      - {count: 1, accelerator: H200, accelerators_per_node: 1}
""",
    # Part 5: two IB nodes and two RoCE nodes joined by 25 GbE; for the cross-dc build a group of both IB nodes and
    # a RoCE node is 'multinet' (the IB hop stays RDMA).
    "multinet": """# device_check part 5: two InfiniBand and two RoCE nodes joined by 25 GbE (transport 'multinet')
name: device-check-multinet
clusters:
  - name: ib
    fabric: {type: ib, gbps: 400, latency_us: 2}
    nodes:
      - {count: 2, accelerator: H200, accelerators_per_node: 1}
  - name: roce
    fabric: {type: roce, gbps: 200, latency_us: 6}
    nodes:
      - {count: 2, accelerator: H100, accelerators_per_node: 1}
links:
  - {between: [ib, roce], type: ethernet, gbps: 25, latency_us: 50}
""",
    # Part 2 'socket': two clusters joined only by Ethernet -> the group of both nodes is 'socket'.
    "socket": """# device_check part 2: an InfiniBand node and a RoCE node joined by 25 GbE (transport 'socket')
name: device-check-socket
clusters:
  - name: ib
    fabric: {type: ib, gbps: 400, latency_us: 2}
    nodes:
      - {count: 1, accelerator: H200, accelerators_per_node: 1}
  - name: roce
    fabric: {type: roce, gbps: 200, latency_us: 6}
    nodes:
      - {count: 1, accelerator: H100, accelerators_per_node: 1}
links:
  - {between: [ib, roce], type: ethernet, gbps: 25, latency_us: 50}
""",
    # Part 2 'ib': two InfiniBand nodes of one fabric with different GPUs. An RDMA group keeps NCCL's own network
    # unless the cluster file names it (fabric.nccl_net): named here, so that the policy forces 'IB'.
    "ib": """# device_check part 2: two nodes on one InfiniBand fabric, different GPUs (transport 'ib')
name: device-check-ib
clusters:
  - name: ib
    fabric: {type: ib, gbps: 400, latency_us: 2, nccl_net: IB}
    nodes:
      - {count: 1, accelerator: H200, accelerators_per_node: 1}
      - {count: 1, accelerator: H100, accelerators_per_node: 1}
""",
    # Part 4a: two IB nodes and a RoCE node joined by Ethernet: 'ib' groups (NCCL's network) and 'socket' ones.
    "share": """# device_check part 4a: groups on two networks (NCCL's default inside ib, Socket across)
name: device-check-share
clusters:
  - name: ib
    fabric: {type: ib, gbps: 400, latency_us: 2}
    nodes:
      - {count: 2, accelerator: H200, accelerators_per_node: 1}
  - name: roce
    fabric: {type: roce, gbps: 200, latency_us: 6}
    nodes:
      - {count: 1, accelerator: H100, accelerators_per_node: 1}
links:
  - {between: [ib, roce], type: ethernet, gbps: 25, latency_us: 50}
""",
    # Part 3: an NVIDIA node and an AMD node -> the group of both is 'host-staged' (het_shim).
    "vendors": """# device_check part 3: an NVIDIA node and an AMD node joined by Ethernet (transport 'host-staged')
name: device-check-vendors
clusters:
  - name: nv
    fabric: {type: ib, gbps: 400, latency_us: 2}
    nodes:
      - {count: 1, accelerator: H200, accelerators_per_node: 1}
  - name: amd
    fabric: {type: roce, gbps: 200, latency_us: 6}
    nodes:
      - {count: 1, accelerator: MI300X, accelerators_per_node: 1}
links:
  - {between: [nv, amd], type: ethernet, gbps: 25, latency_us: 50}
""",
}


def write_clusters(tmp: Path) -> dict[str, Path]:
    out = {}
    for name, text in CLUSTERS.items():
        out[name] = tmp / f"cluster-{name}.yaml"
        out[name].write_text(text, encoding="utf-8")
    return out


# ---------------------------------------------------------------------------------------------------------
# Part 1: Megatron-LM training
# ---------------------------------------------------------------------------------------------------------

PART1_MODEL_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--mock-data", "--transformer-impl", "local",
    "--lr", "1e-3", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--seed", "1234",
    # no apex / Transformer Engine / fused kernels are assumed on the machine
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm", "--no-masked-softmax-fusion",
]


def part1_command(args, tmp: Path, clusters: dict, plan_out: Path) -> tuple[list[str], dict]:
    train_iters = 3 if args.cpu_dry_run else 5
    margs = PART1_MODEL_ARGS + ["--train-iters", str(train_iters),
                                "--heterogeneous-nic", str(clusters["one-gpu"]),
                                "--heterogeneous-plan-out", str(plan_out)]
    # torchrun -> this file's megatron worker (the launcher: hook and dataset-helper facts, printed) -> the script;
    # the dry run puts the test-only CPU runner (CPU shims for megatron.training) between launcher and script.
    target = [str(Path(__file__).resolve()), "--worker", "megatron", "--"]
    if args.cpu_dry_run:
        # CPU: gloo, and no gradient clipping (Megatron's clip_grads asserts torch.cuda.FloatTensor grads)
        margs += ["--distributed-backend", "gloo", "--clip-grad", "0"]
        target += [str(CPU_TRAINING_RUNNER), str(PRETRAIN_SCRIPT)]
    else:
        margs += ["--distributed-backend", "nccl"]
        target += [str(PRETRAIN_SCRIPT)]
    margs += shlex.split(args.part1_extra or "")
    cmd = [args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] + target + margs
    env = child_env(args, {"CUDA_DEVICE_MAX_CONNECTIONS": "1",
                           "HET_TEST_TIMEOUT": str(int(LIMITS["1"]))})    # the CPU runner's hang watchdog
    return cmd, env


def part1(args, tmp: Path, clusters: dict, limit: float) -> PartResult:
    if not PRETRAIN_SCRIPT.exists():
        return PartResult("1", "SKIP", f"{PRETRAIN_SCRIPT.relative_to(REPO)} is not in this checkout")
    if args.cpu_dry_run and not CPU_TRAINING_RUNNER.exists():
        return PartResult("1", "SKIP", f"dry run needs {CPU_TRAINING_RUNNER.relative_to(REPO)} (not in this checkout)")
    probe = subprocess.run([args.python, "-c", "import megatron.training, megatron.core as m; print(m.__version__)"],
                           capture_output=True, text=True, timeout=120, env=child_env(args), cwd=str(REPO))
    if probe.returncode != 0:
        err = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return PartResult("1", "SKIP", f"megatron.training is not importable ({err[:200]})",
                          [f"fix: {MEGATRON_FIX}",
                           "or point --pythonpath at a directory holding megatron-core >= 0.19 "
                           "(with megatron/training)"])
    mcore = probe.stdout.strip()
    plan_out = tmp / "part1-plan.json"
    cmd, env = part1_command(args, tmp, clusters, plan_out)
    procs = run_processes([cmd], [env], limit, tmp, "part1")
    p = procs[0]
    log = parse_megatron_log(p.output)
    details = [f"megatron-core {mcore}; command: {' '.join(shlex.quote(c) for c in cmd[:8])} ... "
               f"({len(cmd)} args; full log {tmp / 'part1-0.log'})"]
    for line in p.output.splitlines():
        if line.startswith("device_check:"):
            details.append(line)
    problems = []
    if p.rc is None:
        problems.append(f"killed at the part's time limit ({limit:.0f} s)")
    elif p.rc != 0:
        problems.append(f"torchrun exited {p.rc}")
    expected = list(range(1, (log["train_iters"] or 0) + 1))
    finite = {i: v for i, v in log["losses"].items() if v is not None and math.isfinite(v)}
    if not log["losses"]:
        problems.append("no 'iteration N/M' line in Megatron's output")
    else:
        missing = [i for i in expected if i not in finite]
        if missing:
            problems.append(f"iterations without a finite 'lm loss': {missing}")
        if log["nan_iterations"]:
            problems.append(f"Megatron counted {log['nan_iterations']} NaN iteration(s)")
        details.append("lm loss per iteration: " + ", ".join(f"{i}: {v:.4f}" for i, v in sorted(finite.items())))
        if log["iteration_ms"]:
            ms = ", ".join(f"{x:.1f}" for x in log["iteration_ms"])
            details.append(f"elapsed ms per iteration (Megatron's log): {ms}")
    plan_hash = None
    if plan_out.exists():
        try:
            plan_hash = json.loads(plan_out.read_text()).get("hash")
            details.append(f"plan file written ({plan_out.stat().st_size} bytes), hash {plan_hash}")
        except ValueError as exc:
            problems.append(f"plan file is not JSON: {exc}")
    else:
        problems.append("--heterogeneous-plan-out file was not written")
    if plan_hash and plan_hash not in log["plan_hashes"]:
        problems.append(f"het_plugin's start-up summary with plan {plan_hash} is not in the log "
                        f"(found {log['plan_hashes'] or 'none'})")
    if problems:
        return PartResult("1", "FAIL", "; ".join(problems), details + tail(p.output, 25), p.seconds)
    mode = "dry run on CPU/gloo through the test-only CPU runner" if args.cpu_dry_run else "on the GPU"
    return PartResult("1", "PASS", f"{mode}: exit 0, {len(finite)} finite losses, plan {plan_hash} written and "
                      "applied", details, p.seconds)


def worker_megatron(argv: list[str]) -> int:
    """torchrun target on the GPU: run the training script as __main__ after two facts of the environment are
    handled (each printed): the import hook when het_plugin_megatron.pth is not installed, and the dataset
    helpers' `make` step when the megatron-core wheel has no Makefile."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    script = argv[0]
    def hooked() -> bool:
        return any(type(f).__name__ == "MegatronArgsFinder" for f in sys.meta_path)

    if hooked():
        print("device_check: --heterogeneous-nic handled by the import hook from het_plugin_megatron.pth", flush=True)
    else:
        from het_plugin.megatron import hook
        hook.install()
        print("device_check: het_plugin_megatron.pth is not installed in this environment; the check installed "
              "the same hook (het_plugin.megatron.hook.install) before running the script"
              + ("" if hooked() else f" -- but it stayed off ({hook.ENV_OFF} is set)"), flush=True)
    try:
        import megatron.core.datasets.utils as dataset_utils
        datasets_dir = Path(dataset_utils.__file__).parent
        if not (datasets_dir / "Makefile").exists():
            import megatron.core.datasets.helpers_cpp  # noqa: F401  (prebuilt in the wheel)
            dataset_utils.compile_helpers = lambda: None
            print("device_check: the megatron-core wheel ships helpers_cpp prebuilt but no Makefile, and "
                  "megatron.training's _compile_dependencies runs `make` there (it would exit 1); the check "
                  "skips that step", flush=True)
    except Exception as exc:
        print(f"device_check: could not check megatron's dataset helpers: {exc}", flush=True)
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(script).resolve().parent))
    import runpy
    runpy.run_path(script, run_name="__main__")
    return 0


# ---------------------------------------------------------------------------------------------------------
# Part 2: NCCL net_name per communicator
# ---------------------------------------------------------------------------------------------------------

NCCL_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV"}


def part2_scenario(args, tmp: Path, clusters: dict, name: str, spec: dict, world: int, limit: float) -> list[Proc]:
    """Run one scenario (``world`` processes); each Proc's output is its stdout followed by its NCCL log.

    NCCL writes its debug lines with vfprintf and no fflush: on a redirected stdout they would sit in libc's
    buffer, so each process gets its own NCCL_DEBUG_FILE (NCCL makes that file line-buffered)."""
    port = free_port()
    envs, cmds, nccl_logs = [], [], []
    for rank in range(world):
        extra = dist_env(rank, world, port)
        nccl_logs.append(tmp / f"part2-{name}-{rank}.nccl.log")
        if not args.cpu_dry_run:
            extra.update(NCCL_DEBUG_ENV, NCCL_DEBUG_FILE=str(nccl_logs[-1]))
        envs.append(child_env(args, extra, drop=("NCCL_NET", "NCCL_DEBUG_FILE")))
        cmds.append(worker_cmd(args, "nccl", dict(spec, rank=rank, world=world, dry_run=args.cpu_dry_run)))
    procs = run_processes(cmds, envs, limit, tmp, f"part2-{name}")
    for p, log in zip(procs, nccl_logs):
        if log.exists():
            p.output += "\n" + log.read_text(encoding="utf-8", errors="replace")
    return procs


def describe_nccl(p: Proc, label: str) -> list[str]:
    r = p.result or {}
    nccl = parse_nccl_log(p.output)
    out = [f"{label}: policy transport={r.get('transport')} net_name={r.get('policy_net_name')!r} "
           f"(options.config.net_name read back: {r.get('options_net_name')!r}); "
           f"collective {'ok' if r.get('ok') else 'FAILED'}; exit {p.rc}"]
    if nccl["networks"]:
        out.append(f"{label}: NCCL 'Using network' per communicator, in creation order: {nccl['networks']}")
    if r.get("error"):
        out.append(f"{label}: error: {r['error'][:500]}")
    for w in nccl["warnings"][:4]:
        out.append(f"{label}: NCCL WARN {w[:300]}")
    if p.rc is None:
        out.append(f"{label}: killed at the time limit")
    if not p.result:
        out += tail(p.output, 10)
    return out


REFUSAL_RE = re.compile(r"NET plugin|network|NET/IB|\bIB\b|netName", re.IGNORECASE)


def evaluate_net(p: Proc, want: str, allow_refusal: bool, comms: int = 1) -> tuple[str, str]:
    """(status, reason) for a process whose ``comms``-th NCCL communicator (the group's; earlier ones are the
    world's) was created with net_name ``want``."""
    r = p.result or {}
    log = parse_nccl_log(p.output)
    nets = log["networks"] or log["assigned"]
    got = nets[comms - 1] if len(nets) >= comms else None
    if r.get("ok") and got is not None and got.lower() == want.lower():
        return "PASS", f"NCCL: 'Using network {got}' for the group created with net_name {want!r}"
    if r.get("ok") and got is not None:
        return "FAIL", f"net_name {want!r} did not reach NCCL: the group's communicator uses {got!r}"
    if r.get("ok"):
        return "FAIL", (f"the collective ran but NCCL printed {len(nets)} 'Using network' line(s), expected {comms} "
                        "(NCCL_DEBUG=INFO output missing?)")
    err = (r.get("error") or "").strip()
    said = err + " " + " ".join(log["warnings"])
    if log["parent_mismatch"]:
        warn = next((w for w in log["warnings"] if any(m in w for m in PARENT_MISMATCH)), err)
        return "FAIL", (f"NCCL refuses a group split from the world communicator with net_name {want!r} "
                        f"(it must equal the parent's): {warn[:300]}")
    if allow_refusal and err and REFUSAL_RE.search(said) and not log["duplicate_gpu"]:
        return "PASS", (f"NCCL refused net_name {want!r} with its own error (expected where there is no {want} "
                        f"device): {err[:300]}")
    if p.rc is None:
        return "FAIL", "timed out"
    return "FAIL", f"the group's collective failed: {err[:300] or f'exit {p.rc}, no result'}"


def part2a(args, tmp, clusters, limit) -> PartResult:
    started = time.monotonic()
    details, statuses = [], []
    for i, (transport, want) in enumerate((("socket", "Socket"), ("ib", "IB"))):
        left = limit - (time.monotonic() - started)
        p = part2_scenario(args, tmp, clusters, f"a-{transport}",
                           {"cluster": str(clusters[transport]), "bind": False, "group": "one"}, 1,
                           left if i else min(left, limit / 2))[0]
        details += describe_nccl(p, f"{want} group")
        if args.cpu_dry_run:
            statuses.append(dry_status(p, transport, want))
        else:
            statuses.append(evaluate_net(p, want, allow_refusal=(want == "IB")))
        details.append(f"{want} group: {statuses[-1][0]}: {statuses[-1][1]}")
    return combine("2a", statuses, details, time.monotonic() - started, args)


def dry_status(p: Proc, transport: str, want: str) -> tuple[str, str]:
    r = p.result or {}
    if not r.get("ok"):
        return "FAIL", f"dry run: the worker failed: {r.get('error') or f'exit {p.rc}'}"
    got = (r.get("transport"), r.get("policy_net_name"), r.get("options_net_name"))
    if got != (transport, want, want):
        return "FAIL", (f"dry run: the policy gave transport / net_name / options.config.net_name {got}, expected "
                        f"{(transport, want, want)}")
    return "PASS", f"dry run: policy {transport!r} -> options.config.net_name {want!r}; gloo group all-reduced"


def combine(part: str, statuses, details, seconds, args) -> PartResult:
    worst = "FAIL" if any(s == "FAIL" for s, _ in statuses) else (
        "SKIP" if statuses and all(s == "SKIP" for s, _ in statuses) else "PASS")
    picked = [r for s, r in statuses if s == worst]
    reason = picked[0] if len(set(picked)) == 1 else "; ".join(picked)
    return PartResult(part, worst, reason, details, seconds)


def part2b(args, tmp, clusters, limit) -> PartResult:
    started = time.monotonic()
    details, statuses = [], []
    for i, (transport, want) in enumerate((("socket", "Socket"), ("ib", "IB"))):
        left = limit - (time.monotonic() - started)
        p = part2_scenario(args, tmp, clusters, f"b-{transport}",
                           {"cluster": str(clusters[transport]), "bind": True, "group": "one"}, 1,
                           left if i else min(left, limit / 2))[0]
        details += describe_nccl(p, f"{want} group split from the bound world")
        if args.cpu_dry_run:
            statuses.append(dry_status(p, transport, want))
        else:
            status, reason = evaluate_net(p, want, allow_refusal=(want == "IB"), comms=2)
            nets = parse_nccl_log(p.output)["networks"]
            if status == "PASS" and len(nets) >= 2 and nets[0].lower() == want.lower():
                reason += (f" (the world communicator uses {nets[0]} too, so this alone does not show the group's "
                           "own setting was read; the other case decides)")
            statuses.append((status, reason))
        details.append(f"{want}: {statuses[-1][0]}: {statuses[-1][1]}")
    res = combine("2b", statuses, details, time.monotonic() - started, args)
    if res.status == "FAIL" and not args.cpu_dry_run:
        res.reason = ("finding for frameworks that bind the default group to a device (Megatron-LM 0.19's "
                      "initialize does not; torch then splits new NCCL groups from the world communicator): "
                      + res.reason)
    return res


def part2c(args, tmp, clusters, limit) -> PartResult:
    started = time.monotonic()
    procs = part2_scenario(args, tmp, clusters, "c-two-ranks",
                           {"cluster": str(clusters["socket"]), "bind": False, "group": "both"}, 2, limit)
    details = []
    for p in procs:
        details += describe_nccl(p, f"rank {(p.result or {}).get('rank', '?')}")
    seconds = time.monotonic() - started
    if args.cpu_dry_run:
        st = [dry_status(p, "socket", "Socket") for p in procs]
        return combine("2c", st, details, seconds, args)
    text = "\n".join(p.output for p in procs)
    if parse_nccl_log(text)["duplicate_gpu"] or "Duplicate GPU" in " ".join((p.result or {}).get("error") or ""
                                                                            for p in procs):
        return PartResult("2c", "SKIP", "NCCL refuses two ranks of one communicator on one GPU ('Duplicate GPU "
                          "detected'): a 2-rank NCCL group needs two GPUs; parts 2a/2b show the net_name on "
                          "1-rank communicators instead", details, seconds)
    st = [evaluate_net(p, "Socket", allow_refusal=False) for p in procs]
    return combine("2c", st, details, seconds, args)


def worker_nccl(spec: dict) -> dict:
    """One rank: the policy's spec for the two-node group of ``spec['cluster']``, then an NCCL group with its
    pg_options (world of 1: a 1-rank group; world of 2: the 2-rank group itself) and an all-reduce on it."""
    import torch
    import torch.distributed as dist
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.inputs.model import ModelSpec
    from het_plugin.runtime.netselect import nccl_net_name
    from het_plugin.core.planner import make_plan
    from het_plugin.runtime.applied import AppliedPlan

    rank, world, dry = spec["rank"], spec["world"], spec["dry_run"]
    out: dict = {"rank": rank, "ok": False}
    model = ModelSpec(name="device-check", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128,
                      seq_length=64, global_batch_size=4, micro_batch_size=1)
    from het_plugin.core.nccl_version import parse_build
    plan = make_plan(load_cluster(spec["cluster"]), model, tp=1, pp=1, nccl=parse_build(spec.get("nccl")))
    two_nodes = list(spec.get("members", [0, 1]))
    out["transport"] = plan.transport_of(two_nodes)
    out["would_be_net_name"] = nccl_net_name(out["transport"])
    if not dry:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if not dry else torch.device("cpu")
    if dry:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        default = "gloo"
    elif world == 1:
        # as Megatron-LM's initialize: an NCCL default group; bound to the device only where asked (2b)
        kwargs = {"device_id": device} if spec["bind"] else {}
        dist.init_process_group("nccl", rank=rank, world_size=world, **kwargs)
        default = "nccl"
        if spec["bind"]:
            t = torch.ones(8, device=device)
            dist.all_reduce(t)                  # the world communicator exists before the group (as in training)
            torch.cuda.synchronize()
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)     # 2c: the world must not be NCCL
        default = "gloo"
    applied = AppliedPlan.start(plan, rank, default_backend=default)
    wanted_backend = None if default == "nccl" else "nccl"      # Megatron passes None for its NCCL groups
    fake = dry and not hasattr(dist, "ProcessGroupNCCL")
    if fake:
        # Dry run on a CPU-only torch: a stand-in for ProcessGroupNCCL.Options, so that the policy's own code
        # (runtime.group_policy.with_net_name) builds the options it would hand to NCCL; removed before any group.
        import types

        class _Options:
            def __init__(self):
                self.config = types.SimpleNamespace()
        dist.ProcessGroupNCCL = type("ProcessGroupNCCL", (), {"Options": _Options})
    try:
        spec_2 = applied.spec(two_nodes, backend=wanted_backend)
    finally:
        if fake:
            del dist.ProcessGroupNCCL
    out["policy_net_name"] = spec_2.net_name
    opts = spec_2.pg_options
    out["options_net_name"] = getattr(getattr(opts, "config", None), "net_name", None) if opts is not None else None
    members = two_nodes[:world] if spec["group"] == "both" else [rank]
    if dry:
        opts, wanted_backend = None, None          # the groups themselves are gloo in the dry run
    try:
        kwargs = {"pg_options": opts} if opts is not None else {}
        if wanted_backend:
            kwargs["backend"] = wanted_backend
        group = dist.new_group(members, **kwargs)
        t = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(t, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        expect = float(sum(r + 1 for r in members))
        out["ok"] = bool(torch.all(t == expect).item())
        if not out["ok"]:
            out["error"] = f"all_reduce gave {t[:4].tolist()}, expected {expect}"
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


# ---------------------------------------------------------------------------------------------------------
# Part 3: het_shim with CUDA tensors
# ---------------------------------------------------------------------------------------------------------

def part3(args, tmp, clusters, limit) -> PartResult:
    started = time.monotonic()
    port = free_port()
    world = 2
    cmds = [worker_cmd(args, "shim", {"rank": r, "world": world, "dry_run": args.cpu_dry_run,
                                       "cluster": str(clusters["vendors"])}) for r in range(world)]
    envs = [child_env(args, dist_env(r, world, port), drop=("HET_PLUGIN_VENDOR_MAP", "HET_PLUGIN_VENDOR"))
            for r in range(world)]
    procs = run_processes(cmds, envs, limit, tmp, "part3")
    seconds = time.monotonic() - started
    details, problems = [], []
    for p in procs:
        r = p.result or {}
        tag = f"rank {r.get('rank', '?')}"
        if r:
            details.append(f"{tag}: group {r.get('group')}, vendors agreed {r.get('vendors')}, backend "
                           f"{r.get('backend')}, device {r.get('device')}")
            for name, ok in r.get("checks", {}).items():
                details.append(f"{tag}: {name}: {'ok' if ok is True else ok}")
            if r.get("native"):
                details.append(f"{tag}: single-vendor het_shim group -> native backends {r['native']}")
        if p.rc != 0 or not r.get("ok"):
            problems.append(f"{tag}: " + (r.get("error") or (f"exit {p.rc}" if p.rc is not None else "timed out")))
            details += tail(p.output, 15)
    timing = next(((p.result or {}).get("timing") for p in procs if (p.result or {}).get("rank") == 0), None)
    if timing:
        details.append(timing)
    if problems:
        return PartResult("3", "FAIL", "; ".join(problems), details, seconds)
    where = ("dry run: CPU tensors over gloo (host staging is a no-op on CPU)" if args.cpu_dry_run
             else "CUDA tensors staged through host memory between two declared vendors on one GPU")
    return PartResult("3", "PASS", f"{where}; every collective matched the expected values", details, seconds)


def worker_shim(spec: dict) -> dict:
    import torch
    import torch.distributed as dist
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.inputs.model import ModelSpec
    from het_plugin.core.planner import make_plan
    from het_plugin.runtime.applied import AppliedPlan
    import het_plugin.comm as comm

    rank, world, dry = spec["rank"], spec["world"], spec["dry_run"]
    out: dict = {"rank": rank, "ok": False, "checks": {}}
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    if not dry:
        torch.cuda.set_device(0)
    out["device"] = str(device)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = ModelSpec(name="device-check", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128,
                      seq_length=64, global_batch_size=4, micro_batch_size=1)
    plan = make_plan(load_cluster(spec["cluster"]), model)
    applied = AppliedPlan.start(plan, rank, default_backend="gloo")
    members = [0, 1]
    group = applied.create(lambda s: dist.new_group(list(s.ranks), **s.new_group_kwargs()), members,
                           desc="device-check cross-vendor")
    rec = applied.records[-1]
    out["group"] = list(rec.ranks)
    out["backend"] = rec.backend
    layout = getattr(group, "layout", None)
    out["vendors"] = list(getattr(layout, "vendors", ()) or ()) if layout is not None else None
    if rec.backend != comm.SHIM_BACKEND:
        out["error"] = f"the policy created the cross-vendor group with backend {rec.backend!r}, not het_shim"
        return out
    checks = out["checks"]

    def check(name: str, fn: Callable[[], bool]) -> None:
        try:
            checks[name] = bool(fn())
        except Exception as exc:
            checks[name] = f"{type(exc).__name__}: {str(exc)[:300]}"

    n = 100_003 if dry else 1_000_003            # odd: uneven stripes and chunks
    base = torch.arange(n, dtype=torch.float32, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def allreduce_sum():
        x = base * (rank + 1)
        dist.all_reduce(x, group=group)
        sync()
        return torch.equal(x, base * 3)

    def allreduce_avg_max():
        x = base * (rank + 1)
        dist.all_reduce(x, op=dist.ReduceOp.AVG, group=group)
        y = base * (rank + 1)
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)
        sync()
        return torch.allclose(x, base * 1.5) and torch.equal(y, base * 2)

    def allreduce_bf16():
        x = torch.full((4099,), float(rank + 1), dtype=torch.bfloat16, device=device)
        dist.all_reduce(x, group=group)
        sync()
        return bool(torch.all(x == 3).item())

    def broadcast():
        x = base + 10 * rank
        dist.broadcast(x, src=1, group=group)
        sync()
        return torch.equal(x, base + 10)

    def all_gather_into_tensor():
        out_t = torch.empty(2 * n, dtype=torch.float32, device=device)
        dist.all_gather_into_tensor(out_t, base + 10 * rank, group=group)
        sync()
        return torch.equal(out_t[:n], base) and torch.equal(out_t[n:], base + 10)

    def all_gather_list():
        outs = [torch.empty(n, dtype=torch.float32, device=device) for _ in range(2)]
        dist.all_gather(outs, base * (rank + 1), group=group)
        sync()
        return torch.equal(outs[0], base) and torch.equal(outs[1], base * 2)

    def noncontiguous():
        m = (torch.arange(64 * 33, dtype=torch.float32, device=device).view(64, 33) * (rank + 1)).t()
        dist.all_reduce(m, group=group)
        sync()
        return torch.equal(m, (torch.arange(64 * 33, dtype=torch.float32, device=device).view(64, 33) * 3).t())

    for name, fn in (("all_reduce SUM fp32", allreduce_sum), ("all_reduce AVG/MAX fp32", allreduce_avg_max),
                     ("all_reduce SUM bf16", allreduce_bf16), ("broadcast from rank 1", broadcast),
                     ("all_gather_into_tensor", all_gather_into_tensor), ("all_gather (list)", all_gather_list),
                     ("all_reduce of a non-contiguous tensor", noncontiguous)):
        check(name, fn)

    # Single-vendor het_shim groups forward to the native backend (NCCL for CUDA tensors; one rank each:
    # NCCL allows one rank per GPU in a communicator). Every rank takes part in creating both.
    own = None
    for r in members:
        g = dist.new_group([r], backend=comm.SHIM_BACKEND, pg_options=comm.ShimOptions({r: plan.vendor_of(r)}))
        if r == rank:
            own = g
    out["native"] = sorted(getattr(own, "_native", {}).keys())

    def single_vendor():
        x = base * (rank + 1)
        dist.all_reduce(x, group=own)
        sync()
        return torch.equal(x, base * (rank + 1))

    check("single-vendor het_shim group (native backend)", single_vendor)

    # Timing: het_shim all-reduce of device tensors against a host-only gloo all-reduce of the same bytes.
    elems = (4 if dry else 64) * 2 ** 20 // 4
    reps = 3 if dry else 5
    x = torch.ones(elems, dtype=torch.float32, device=device)
    h = torch.ones(elems, dtype=torch.float32)

    def timed(fn) -> list[float]:
        fn()
        sync()
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return sorted(times)

    try:
        shim_t = timed(lambda: dist.all_reduce(x, group=group))
        gloo_t = timed(lambda: dist.all_reduce(h))
        mb = elems * 4 / 2 ** 20
        med = lambda ts: ts[len(ts) // 2]                                              # noqa: E731
        out["timing"] = (f"timing: all_reduce of {mb:.0f} MiB fp32 on {device.type}: het_shim median "
                         f"{med(shim_t) * 1e3:.1f} ms ({mb / 1024 / med(shim_t):.2f} GiB/s algorithmic; min "
                         f"{shim_t[0] * 1e3:.1f} ms, {reps} reps) vs plain gloo on host tensors median "
                         f"{med(gloo_t) * 1e3:.1f} ms ({mb / 1024 / med(gloo_t):.2f} GiB/s); "
                         f"HET_PLUGIN_SHIM_CHUNK_BYTES={os.environ.get('HET_PLUGIN_SHIM_CHUNK_BYTES', 'default')}")
    except Exception as exc:
        checks["timing"] = f"{type(exc).__name__}: {exc}"
    out["ok"] = all(v is True for v in checks.values())
    if not out["ok"]:
        out["error"] = "; ".join(f"{k}: {v if v is not True else ''}" for k, v in checks.items() if v is not True)
    return out



# ---------------------------------------------------------------------------------------------------------
# Part 4: the GPU-path assumptions of issue 19 (docs/gpu-assumptions.md)
# ---------------------------------------------------------------------------------------------------------

def part4_run(args, tmp, name: str, spec: dict, world: int, limit: float, extra_env: Optional[dict] = None,
              drop: Sequence[str] = ()) -> list[Proc]:
    port = free_port()
    envs, cmds, logs = [], [], []
    for rank in range(world):
        extra = dist_env(rank, world, port)
        logs.append(tmp / f"part{name}-{rank}.nccl.log")
        if not args.cpu_dry_run:
            extra.update(NCCL_DEBUG_ENV, NCCL_DEBUG_FILE=str(logs[-1]))
        extra.update(extra_env or {})
        envs.append(child_env(args, extra, drop=("NCCL_NET", "NCCL_DEBUG_FILE") + tuple(drop)))
        cmds.append(worker_cmd(args, "gpu19", dict(spec, rank=rank, world=world, dry_run=args.cpu_dry_run)))
    procs = run_processes(cmds, envs, limit, tmp, f"part{name}")
    for p, log in zip(procs, logs):
        if log.exists():
            p.output += "\n" + log.read_text(encoding="utf-8", errors="replace")
    return procs


def _part4_single(args, tmp, clusters, limit, part: str, spec: dict, world: int = 1, **kw) -> tuple[list[Proc], list[str]]:
    procs = part4_run(args, tmp, part, dict(spec, case=part, clusters={k: str(v) for k, v in clusters.items()}),
                      world, limit, **kw)
    details = []
    for p in procs:
        r = p.result or {}
        details += [f"rank {r.get('rank', '?')}: {line}" for line in r.get("lines", [])]
        if r.get("error"):
            details.append(f"rank {r.get('rank', '?')}: error: {r['error'][:400]}")
        if p.rc is None:
            details.append("killed at the time limit")
        if not p.result:
            details += tail(p.output, 10)
    return procs, details


def part4a(args, tmp, clusters, limit) -> PartResult:
    started = time.monotonic()
    procs, details = _part4_single(args, tmp, clusters, limit, "4a", {},
                                   extra_env={"NCCL_COMM_SPLIT_SHARE_RESOURCES": "1"})
    r = procs[0].result or {}
    nccl = parse_nccl_log(procs[0].output)
    if nccl["parent_mismatch"] or nccl["warnings"]:
        details.append(f"NCCL said: {(nccl['warnings'] or ['(no WARN line)'])[0][:300]}")
    if not r.get("refused"):
        return PartResult("4a", "FAIL", f"het_plugin's pre-flight did not refuse NCCL_COMM_SPLIT_SHARE_RESOURCES=1: "
                          f"{r.get('error') or r.get('refusals')}", details, time.monotonic() - started)
    outcome = r.get("nccl_outcome") or f"the process ended with exit {procs[0].rc} before NCCL answered"
    return PartResult("4a", "PASS", "refused before any group, naming NCCL_COMM_SPLIT_SHARE_RESOURCES and the fix"
                      + ("" if args.cpu_dry_run else f"; NCCL itself: {outcome}"),
                      details, time.monotonic() - started)


NCCL_SOCKET_USING_RE = re.compile(r"NET/Socket : Using \[0\]([^:\s]+):")
NCCL_BOOTSTRAP_RE = re.compile(r"Bootstrap\s*: Using ([^:\s]+):")


def part4b(args, tmp, clusters, limit) -> PartResult:
    started = time.monotonic()
    procs, details = _part4_single(args, tmp, clusters, limit, "4b", {}, drop=("NCCL_SOCKET_IFNAME",))
    r = procs[0].result or {}
    text = procs[0].output
    sock = NCCL_SOCKET_USING_RE.findall(text)
    boot = NCCL_BOOTSTRAP_RE.findall(text)
    predicted = r.get("predicted") or []
    details.append(f"interfaces up here: {r.get('interfaces')}; het_plugin predicts NCCL takes {predicted}")
    details.append(f"NCCL: bootstrap on {boot[:1] or '(no Bootstrap line)'}, Socket network on "
                   f"{sock[:1] or '(no NET/Socket line)'}")
    seconds = time.monotonic() - started
    if not r.get("ok"):
        return PartResult("4b", "FAIL", f"the worker failed: {r.get('error') or f'exit {procs[0].rc}'}", details, seconds)
    if args.cpu_dry_run:
        return PartResult("4b", "PASS", f"dry run: het_plugin predicts {predicted[:1]} (NCCL not run)", details, seconds)
    got = (boot or sock)[:1]
    if not got:
        return PartResult("4b", "FAIL", "NCCL printed no Bootstrap / NET/Socket line (NCCL_DEBUG=INFO output "
                          "missing?)", details, seconds)
    if got[0] in predicted:
        return PartResult("4b", "PASS", f"NCCL picked {got[0]}, as het_plugin predicts", details, seconds)
    return PartResult("4b", "FAIL", f"NCCL picked {got[0]}, het_plugin predicted {predicted}: the port of NCCL's "
                      "interface choice is wrong here", details, seconds)


def part4c(args, tmp, clusters, limit) -> PartResult:
    started = time.monotonic()
    procs, details = _part4_single(args, tmp, clusters, limit, "4c", {}, world=2,
                                   extra_env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
                                   drop=("HET_PLUGIN_VENDOR_MAP", "HET_PLUGIN_VENDOR"))
    seconds = time.monotonic() - started
    bad = [p for p in procs if p.rc != 0 or not (p.result or {}).get("ok")]
    if bad:
        why = [(p.result or {}).get("error") or ("timed out (a hang?)" if p.rc is None else f"exit {p.rc}") for p in bad]
        return PartResult("4c", "FAIL", "; ".join(str(w)[:300] for w in why), details, seconds)
    iters = (procs[0].result or {}).get("iterations")
    return PartResult("4c", "PASS", f"{iters} rounds of an async het_shim all-reduce and a main-thread "
                      f"{'gloo' if args.cpu_dry_run else 'NCCL'} all-reduce, every value right, no hang",
                      details, seconds)


NCCL_ALLNET_RE = re.compile(r"ALLNET", re.IGNORECASE)


def part5(args, tmp, clusters, limit) -> PartResult:
    """The multi-network communicator: het_plugin's policy side (transport 'multinet', no net_name) and what this
    NCCL does with NCCL_ALLNET_ENABLE=1 (its log), against het_plugin's verdict for the loaded version."""
    started = time.monotonic()
    spec = {"cluster": str(clusters["multinet"]), "bind": False, "group": "one", "members": [0, 1, 2],
            "nccl": "2.26.2+cross-dc"}
    port = free_port()
    log = tmp / "part5-0.nccl.log"
    extra = dist_env(0, 1, port)
    extra["NCCL_ALLNET_ENABLE"] = "1"
    if not args.cpu_dry_run:
        extra.update(NCCL_DEBUG_ENV, NCCL_DEBUG_FILE=str(log))
    env = child_env(args, extra, drop=("NCCL_NET", "NCCL_DEBUG_FILE", "NCCL_IB_HCA"))
    cmd = worker_cmd(args, "nccl", dict(spec, rank=0, world=1, dry_run=args.cpu_dry_run))
    p = run_processes([cmd], [env], limit, tmp, "part5")[0]
    if log.exists():
        p.output += "\n" + log.read_text(encoding="utf-8", errors="replace")
    r = p.result or {}
    details = describe_nccl(p, "multinet group")
    seconds = time.monotonic() - started
    if r.get("transport") != "multinet" or r.get("policy_net_name") is not None:
        return PartResult("5", "FAIL", f"the plan for the cross-dc build gave the group transport "
                          f"{r.get('transport')!r}, net_name {r.get('policy_net_name')!r} (want 'multinet', None)",
                          details, seconds)
    if not r.get("ok"):
        return PartResult("5", "FAIL", f"the group's collective failed: {(r.get('error') or f'exit {p.rc}')[:300]}",
                          details, seconds)
    if args.cpu_dry_run:
        return PartResult("5", "PASS", "dry run: transport 'multinet', no net_name forced (NCCL not run)",
                          details, seconds)
    from het_plugin.core.multinet_env import check_build
    from het_plugin.core.nccl_version import parse_version
    nccl = parse_nccl_log(p.output)
    try:
        version = parse_version(nccl["version"].split("+")[0]) if nccl["version"] else None
    except ValueError:
        version = None
    verdict = check_build(None, version, needed=True)
    said = [ln.strip()[:200] for ln in p.output.splitlines() if NCCL_ALLNET_RE.search(ln) and "NCCL INFO" in ln]
    details.append(f"NCCL {nccl['version']}: lines naming ALLNET: {said[:3] or 'none'}; het_plugin's verdict: "
                   f"{[f.level + ': ' + f.problem[:120] for f in verdict] or 'has them'}")
    if verdict and verdict[0].level == "error" and said:
        return PartResult("5", "FAIL", f"het_plugin says NCCL {nccl['version']} has no multi-network communicators, "
                          f"but its log names ALLNET: {said[0]}", details, seconds)
    nets = nccl["networks"] or nccl["assigned"]
    return PartResult("5", "PASS", f"NCCL {nccl['version']}: networks {nets or '(none printed)'}; "
                      + ("ALLNET named in its log (a cross-dc build)" if said else
                         "no ALLNET in its log, as het_plugin expects of a release"), details, seconds)


def _interfaces_up() -> list[str]:
    """This machine's interfaces that are up, in the kernel's order (what getifaddrs gives NCCL, roughly)."""
    import socket as _socket
    names = [n for _, n in _socket.if_nameindex()]
    out = []
    for n in names:
        try:
            state = Path(f"/sys/class/net/{n}/operstate").read_text().strip()
        except OSError:
            state = "unknown"
        if state in ("up", "unknown"):
            out.append(n)
    return out


def worker_gpu19(spec: dict) -> dict:
    import torch
    import torch.distributed as dist
    case, rank, world, dry = spec["case"], spec["rank"], spec["world"], spec["dry_run"]
    out: dict = {"rank": rank, "ok": False, "lines": []}
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    if not dry:
        torch.cuda.set_device(0)
    if case == "4a":
        from het_plugin.core.inputs.cluster import load_cluster
        from het_plugin.core.nccl_env import check_launch
        cluster = load_cluster(spec["clusters"]["share"])
        result = check_launch(cluster, dict(os.environ))
        fields = [r.field for r in result.refusals]
        out["refusals"] = fields
        out["refused"] = "NCCL_COMM_SPLIT_SHARE_RESOURCES" in fields
        for r in result.refusals:
            out["lines"].append(f"het_plugin refuses: {r.text()[:400]}")
        out["ok"] = out["refused"]
        if dry:
            return out
        print(RESULT_TAG + json.dumps(out), flush=True)       # kept if NCCL below takes the process down
        # What NCCL does itself: a device-bound world (no net_name), then a 'Socket' group split from it.
        try:
            from het_plugin.runtime.group_policy import nccl_options
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
            t = torch.ones(8, device=device)
            dist.all_reduce(t)
            g = dist.new_group([0], pg_options=nccl_options("Socket"))
            dist.all_reduce(t, group=g)
            torch.cuda.synchronize()
            out["nccl_outcome"] = "NCCL accepted the split (no refusal seen)"
        except Exception as exc:
            out["nccl_outcome"] = f"NCCL refused: {type(exc).__name__}: {str(exc)[:300]}"
        out["lines"].append(out["nccl_outcome"])
        return out
    if case == "4b":
        from het_plugin.core.nccl_env import nccl_auto_interfaces
        out["interfaces"] = _interfaces_up()
        out["predicted"] = nccl_auto_interfaces(out["interfaces"])
        if dry:
            out["ok"] = True
            return out
        from het_plugin.runtime.group_policy import nccl_options
        dist.init_process_group("nccl", rank=rank, world_size=world)
        g = dist.new_group([0], pg_options=nccl_options("Socket"))
        t = torch.ones(8, device=device)
        dist.all_reduce(t, group=g)
        torch.cuda.synchronize()
        out["ok"] = bool(torch.all(t == 1).item())
        return out
    if case == "4c":
        import het_plugin.comm  # noqa: F401   registers het_shim (runtime never imports comm)
        from het_plugin.core.inputs.cluster import load_cluster
        from het_plugin.core.inputs.model import ModelSpec
        from het_plugin.core.planner import make_plan
        from het_plugin.runtime.applied import AppliedPlan
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = ModelSpec(name="device-check", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128,
                          seq_length=64, global_batch_size=4, micro_batch_size=1)
        plan = make_plan(load_cluster(spec["clusters"]["vendors"]), model)
        applied = AppliedPlan.start(plan, rank, default_backend="gloo")
        shim_group = applied.create(lambda s: dist.new_group(list(s.ranks), **s.new_group_kwargs()), [0, 1])
        if applied.records[-1].backend != "het_shim":
            out["error"] = f"the cross-vendor group got backend {applied.records[-1].backend!r}"
            return out
        own = [dist.new_group([r], backend="gloo" if dry else "nccl") for r in range(world)]
        mine = own[rank]
        iterations = 20
        n = 1 << 16
        for i in range(iterations):
            x = torch.full((n,), float(rank + 1 + i), device=device)
            work = dist.all_reduce(x, group=shim_group, async_op=True)
            y = torch.full((n,), 2.0, device=device)
            for _ in range(3):
                dist.all_reduce(y, group=mine)          # the main thread's own collectives, meanwhile
            work.wait()
            want = float(sum(r + 1 + i for r in range(world)))
            if not (torch.all(x == want).item() and torch.all(y == 2.0).item()):
                out["error"] = f"round {i}: het_shim gave {x[:2].tolist()} (want {want}), own group {y[:2].tolist()}"
                return out
        if device.type == "cuda":
            torch.cuda.synchronize()
        out["iterations"] = iterations
        out["ok"] = True
        return out
    raise ValueError(case)


# ---------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------

PARTS: dict[str, Callable] = {"1": part1, "2a": part2a, "2b": part2b, "2c": part2c, "3": part3, "4a": part4a,
                               "4b": part4b, "4c": part4c, "5": part5}


def select_parts(text: str) -> list[str]:
    chosen = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        matches = [p for p in PARTS if p == item or (item in ("2", "4") and p.startswith(item))]
        if not matches:
            raise SystemExit(f"--parts: unknown part {item!r} (known: {', '.join(PARTS)}, or 2 / 4 for 2a-2c / 4a-4c)")
        chosen += [m for m in matches if m not in chosen]
    return chosen


def run_worker(name: str, spec_text: Optional[str], rest: list[str]) -> int:
    if name == "megatron":
        return worker_megatron(rest)
    spec = json.loads(spec_text or "{}")
    try:
        result = {"nccl": worker_nccl, "shim": worker_shim, "gpu19": worker_gpu19}[name](spec)
    except Exception as exc:
        result = {"rank": spec.get("rank"), "ok": False,
                  "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    print(RESULT_TAG + json.dumps(result), flush=True)
    sys.stdout.flush()
    try:                                          # C stdio buffers too (os._exit skips them)
        import ctypes
        ctypes.CDLL(None).fflush(None)
    except Exception:
        pass
    os._exit(0 if result.get("ok") else 1)      # no teardown: a failed NCCL communicator can hang destroy


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="also write the whole report to this file")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the parts' workers on CPU with gloo (no GPU needed): tests the check itself")
    ap.add_argument("--parts", default="1,2,3,4,5", help="comma-separated: 1, 2 (= 2a,2b,2c), 2a, 2b, 2c, 3, 4 "
                    "(= 4a,4b,4c), 4a, 4b, 4c, 5")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for all parts together (default 560)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the child processes")
    ap.add_argument("--pythonpath", default="", help="extra PYTHONPATH entries for the children (e.g. a "
                    "megatron-core >= 0.19 installed with --target)")
    ap.add_argument("--part1-extra", default="", help="extra Megatron arguments for part 1 (e.g. '--bf16')")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temporary directory (logs, cluster files)")
    ap.add_argument("--logs", type=Path, help="also write every part's full log (and the cluster files) into this "
                    "one file (a device machine returns few files)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.worker:
        return run_worker(args.worker, args.spec, rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    parts = select_parts(args.parts)
    report = Report(args.out)
    t0 = time.monotonic()
    mode = "CPU dry run (gloo, CPU tensors)" if args.cpu_dry_run else "GPU (each part SKIPs where there is no CUDA)"
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report.line(f"== het_plugin device check: {now}"
                f", mode {mode}, parts {', '.join(parts)}, budget {args.budget:.0f} s")
    info, env_lines = environment(args)
    for ln in env_lines:
        report.line(f"   {ln}")
    tmp = Path(tempfile.mkdtemp(prefix="het-device-check-"))
    clusters = write_clusters(tmp)
    kept = " (kept)" if args.keep_tmp else " (removed at the end unless a part failed)"
    report.line(f"   logs and cluster files: {tmp}{kept}")
    results: list[PartResult] = []
    for part in parts:
        if not args.cpu_dry_run and not info.get("cuda"):
            r = PartResult(part, "SKIP", "no CUDA (torch.cuda.is_available() is False; --cpu-dry-run runs the "
                           "check's own logic on CPU)")
        elif not info.get("het_plugin_ok"):
            r = PartResult(part, "SKIP", "het_plugin is not importable in the child processes (see 'children "
                           f"see' above); fix: {HET_PLUGIN_FIX}")
        else:
            left = args.budget - (time.monotonic() - t0)
            if left < 10:
                r = PartResult(part, "SKIP", f"the global budget ({args.budget:.0f} s) is spent")
            else:
                limit = min(LIMITS[part], left)
                started = time.monotonic()
                try:
                    r = PARTS[part](args, tmp, clusters, limit)
                except Exception as exc:
                    r = PartResult(part, "FAIL", f"the check itself failed: {type(exc).__name__}: {exc}",
                                   traceback.format_exc().splitlines()[-8:])
                r.seconds = r.seconds or (time.monotonic() - started)
        results.append(r)
        report.part(r)
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    report.line("== summary")
    report.line(f"   torch {info.get('torch')}, CUDA {info.get('cuda_build')}, NCCL {info.get('nccl')}, "
                f"GPU {info.get('gpu', 'none')}; {info.get('packages', '')}")
    for r in results:
        report.line(f"   {r.part:<3} {r.status:<4}  {r.reason[:160]}")
    report.line(f"   {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in "
                f"{time.monotonic() - t0:.0f} s ({mode})")
    report.close()
    if args.logs is not None:
        bundle_logs(tmp, args.logs)
    if not (args.keep_tmp or counts["FAIL"]):
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if counts["FAIL"] else 0


def bundle_logs(tmp: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", encoding="utf-8") as fh:
        for f in sorted(tmp.iterdir()):
            if f.is_file():
                fh.write(f"===== {f.name} =====\n")
                fh.write(f.read_text(encoding="utf-8", errors="replace"))
                fh.write("\n")


if __name__ == "__main__":
    sys.exit(main())
