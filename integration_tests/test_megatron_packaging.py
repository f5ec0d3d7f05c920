"""The import hook ships with the package: wheels and editable wheels carry het_plugin_megatron.pth."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD = ("import sys; from setuptools import build_meta as b; "
         "print(getattr(b, sys.argv[1])(sys.argv[2]))")


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Path:
    """A copy of what a build reads, so building leaves no build/ folder in the working tree."""
    dest = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, dest / name)
    shutil.copytree(REPO / "het_plugin", dest / "het_plugin", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "patches", dest / "patches")
    return dest


def _build(kind: str, src: Path, out: Path) -> zipfile.ZipFile:
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-c", BUILD, kind, str(out)], cwd=src, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return zipfile.ZipFile(out / done.stdout.strip().splitlines()[-1])


def test_wheel_carries_the_hook_and_the_patches(source_copy, tmp_path):
    wheel = _build("build_wheel", source_copy, tmp_path / "wheel")
    names = wheel.namelist()
    assert "het_plugin_megatron.pth" in names, "the .pth sits at the top of site-packages"
    line = wheel.read("het_plugin_megatron.pth").decode()
    assert line.startswith("import ") and "het_plugin.megatron.hook" in line and line.count("\n") == 1
    assert "het_plugin/megatron/hook.py" in names
    assert any(n.startswith("het_plugin/_patches/megatron-lm/") and n.endswith(".patch") for n in names)


def test_editable_wheel_carries_the_hook(source_copy, tmp_path):
    wheel = _build("build_editable", source_copy, tmp_path / "editable")
    assert "het_plugin_megatron.pth" in wheel.namelist()


def test_the_pth_line_installs_the_finder_and_nothing_heavy(tmp_path):
    """Run the .pth line as site.py would, in a fresh interpreter, and look at what got imported."""
    code = ("import sys\n"
            "exec(open(sys.argv[1]).read())\n"
            "print(any(type(f).__name__ == 'MegatronArgsFinder' for f in sys.meta_path))\n"
            "print('torch' in sys.modules, 'megatron' in sys.modules, 'het_plugin.core.plan' in sys.modules)\n")
    setup_text = (REPO / "setup.py").read_text()
    start = setup_text.index("PTH_TEXT = (")
    ns: dict = {}
    exec(setup_text[start:setup_text.index("\n\n", start)], ns)
    pth = tmp_path / "het_plugin_megatron.pth"
    pth.write_text(ns["PTH_TEXT"])
    out = subprocess.run([sys.executable, "-S", "-c", code, str(pth), "--heterogeneous-nic", "c.yaml"],
                         capture_output=True, text=True, env={"PYTHONPATH": str(REPO)}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False", "False"]
    # Without the flag (or with HET_PLUGIN_NO_HOOK=1) the line imports nothing of het_plugin at all.
    code += "print(sorted(m for m in sys.modules if m.startswith('het_plugin')))\n"
    for argv, env in (([], {}), (["--heterogeneous-nic=c.yaml"], {"HET_PLUGIN_NO_HOOK": "1"})):
        out = subprocess.run([sys.executable, "-S", "-c", code, str(pth), *argv], capture_output=True, text=True,
                             env={"PYTHONPATH": str(REPO), **env}, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["False", "False", "False", "False", "[]"], (argv, env, out.stdout)
