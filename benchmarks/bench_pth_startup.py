"""What het_plugin_megatron.pth and het_plugin_deepspeed.pth cost every Python start: `python -c pass` with and
without them.

    .venv/bin/python benchmarks/bench_pth_startup.py [RUNS] [--old-pth FILE]

Builds a throw-away venv (no pip) from this interpreter's base, with this checkout on its path (a plain
path .pth), then times `python -c pass` with no hook .pth, with setup.py's PTH_TEXT, and with it under
HET_PLUGIN_NO_HOOK=1, and with setup.py's DS_PTH_TEXT (the DeepSpeed hook's one-lambda finder) (and, with --old-pth, another .pth line for comparison), interleaved, RUNS times each
(default 200). Prints medians of wall time and of the child's user+sys CPU time (steadier on a shared
machine).
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def pth_text(name: str = "PTH_TEXT") -> str:
    text = (REPO / "setup.py").read_text()
    start = text.index(f"\n{name} = (") + 1
    ns: dict = {}
    exec(text[start:text.index("\n", text.index("\\n')", start))], ns)
    return ns[name]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="?", type=int, default=200)
    ap.add_argument("--old-pth", type=Path, help="another .pth line to compare (e.g. an older release's)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="het_plugin_pth_bench_"))
    try:
        venv = tmp / "venv"
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                       check=True)
        py = venv / "bin" / "python"
        site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
        (site / "het_plugin_checkout.pth").write_text(str(REPO) + "\n")
        hook = site / "het_plugin_megatron.pth"
        configs = {"no .pth": (None, {}), "hook .pth": (pth_text(), {}),
                   "hook .pth, NO_HOOK=1": (pth_text(), {"HET_PLUGIN_NO_HOOK": "1"}),
                   "deepspeed hook .pth": (pth_text("DS_PTH_TEXT"), {})}
        if args.old_pth:
            old = args.old_pth.read_text()
            configs.update({"old .pth": (old, {}), "old .pth, NO_HOOK=1": (old, {"HET_PLUGIN_NO_HOOK": "1"})})
        wall: dict[str, list[float]] = {k: [] for k in configs}
        cpu: dict[str, list[float]] = {k: [] for k in configs}
        for _ in range(args.runs):
            for name, (text, env) in configs.items():
                if text is None:
                    hook.unlink(missing_ok=True)
                else:
                    hook.write_text(text)
                r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                t0 = time.perf_counter()
                subprocess.run([py, "-c", "pass"], env={**os.environ, **env}, check=True)
                wall[name].append((time.perf_counter() - t0) * 1e3)
                r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu[name].append((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1e3)
        for name in configs:
            print(f"{name:22s} wall median {statistics.median(wall[name]):7.2f} ms   "
                  f"CPU (user+sys) median {statistics.median(cpu[name]):6.2f} ms   n={args.runs}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
