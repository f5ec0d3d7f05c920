"""The core installs and plans without torch: ``pip install het_plugin`` (no extras) into a fresh virtual
environment, then ``het-plugin plan``, ``wrap-config`` and ``discover --help`` there, and the import hook
loads at start-up without pulling torch in.

Needs pip to reach a package index (pyyaml, pydantic and the build backend); about 20-60 s.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv (no system site-packages) with het_plugin installed from a copy of the sources, no extras."""
    root = tmp_path_factory.mktemp("no-torch")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "het_plugin", src / "het_plugin", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "patches", src / "patches")
    env_dir = root / "venv"
    made = _run([sys.executable, "-m", "venv", env_dir], timeout=120)
    assert made.returncode == 0, made.stderr
    py = env_dir / "bin" / "python"
    installed = _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", src], timeout=240)
    assert installed.returncode == 0, ("pip install het_plugin (no extras) failed; this test needs a package "
                                       f"index:\n{installed.stdout[-2000:]}\n{installed.stderr[-3000:]}")
    return env_dir


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["HET_PLUGIN_NO_HOOK"] = ""
    return env


def test_torch_is_not_installed(venv):
    out = _run([venv / "bin" / "python", "-c", "import torch"], env=_env(), cwd=venv)
    assert out.returncode != 0 and "No module named 'torch'" in out.stderr, out.stdout + out.stderr


def test_plan_runs_and_names_the_plan(venv):
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.inputs.model import preset_model
    from het_plugin.core.planner import make_plan
    from het_plugin.cli.plan import DEFAULT_CLUSTER, DEFAULT_MODEL

    out = _run([venv / "bin" / "het-plugin", "plan"], env=_env(), cwd=venv, timeout=120)
    assert out.returncode == 0, out.stderr
    found = re.search(r"het_plugin plan ([0-9a-f]{8,})", out.stdout)
    assert found, out.stdout[:2000]
    # The same plan as this checkout's planner makes (the installed copy is this code, without torch).
    assert found.group(1) == make_plan(load_cluster(DEFAULT_CLUSTER), preset_model(DEFAULT_MODEL)).hash


def test_wrap_config_and_discover_help_run(venv, tmp_path):
    example = REPO / "examples" / "deepspeed"
    wrapped = tmp_path / "wrapped.json"
    out = _run([venv / "bin" / "het-plugin", "wrap-config", example / "ds_config.json", "--cluster",
                example / "cluster-cpu.yaml", "--model", example / "tiny-model.yaml", "--pp", "2",
                "--layer-pattern", "Block", "-o", wrapped], env=_env(), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"heterogeneous"' in wrapped.read_text()
    out = _run([venv / "bin" / "het-plugin", "discover", "--help"], env=_env(), cwd=tmp_path, timeout=60)
    assert out.returncode == 0 and "--gather" in out.stdout, out.stderr


def test_import_hook_loads_at_start_up_without_torch(venv):
    code = ("import sys\n"
            "print(any(type(f).__name__ == 'MegatronArgsFinder' for f in sys.meta_path))\n"
            "import het_plugin.core.planner, het_plugin.views.report, het_plugin.views.svg, het_plugin.deepspeed.config\n"
            "print('torch' in sys.modules)\n")
    # The .pth installs the hook when the flag is on the command line (and imports nothing otherwise).
    out = _run([venv / "bin" / "python", "-c", code, "--heterogeneous-nic"], env=_env(), cwd=venv, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"], "the .pth hook is installed and nothing imported torch"
