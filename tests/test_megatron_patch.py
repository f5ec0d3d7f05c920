"""``het-plugin patch megatron``: the patches apply to Megatron-LM core_v0.16.x and refuse other trees.

The real-tree checks need a Megatron-LM checkout named by the environment: MEGATRON_LM_PATH (a work tree),
or MEGATRON_LM_GIT (a git repository, bare or not, from which the two files are exported at each tested tag).
Without either they are skipped.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from het_plugin.cli import main
from het_plugin.cli.patch import REQUIRED, patches, status



def export_tree(ref: str, dest: Path) -> Path:
    """The two files the patch touches, from a Megatron-LM git mirror at ``ref``."""
    if os.environ.get("MEGATRON_LM_PATH"):
        src = Path(os.environ["MEGATRON_LM_PATH"])
        for f in REQUIRED:
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / f, dest / f)
        return dest
    if not os.environ.get("MEGATRON_LM_GIT"):
        pytest.skip("no Megatron-LM tree: set MEGATRON_LM_PATH to a work tree, or MEGATRON_LM_GIT to a git "
                    "repository of Megatron-LM with the core_v0.16.x tags")
    repo = Path(os.environ["MEGATRON_LM_GIT"])
    if not shutil.which("git"):
        pytest.skip("MEGATRON_LM_GIT is set but git is not installed")
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref, *REQUIRED], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"{ref} not in MEGATRON_LM_GIT={repo}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def test_patches_exist_and_say_which_versions():
    found = patches()
    assert found
    for p in found:
        text = p.read_text()
        assert "Applies-to:" in text and "core_v0.16" in text
        assert "megatron/training/arguments.py" in text and "megatron/training/initialize.py" in text


@pytest.mark.parametrize("ref", ["core_v0.16.0", "core_v0.16.1"])
def test_patch_checks_applies_and_is_then_recognised(ref, tmp_path, capsys):
    tree = export_tree(ref, tmp_path / "Megatron-LM")
    assert main(["patch", "megatron", str(tree), "--check"]) == 0
    assert "applies cleanly" in capsys.readouterr().out
    before = (tree / REQUIRED[0]).read_text()
    assert main(["patch", "megatron", str(tree)]) == 0
    args_py = (tree / "megatron/training/arguments.py").read_text()
    init_py = (tree / "megatron/training/initialize.py").read_text()
    assert args_py != before and "_add_heterogeneous_cluster_args" in args_py and "prepare_args" in args_py
    assert "planned_initialize_model_parallel" in init_py
    compile(args_py, "arguments.py", "exec")
    compile(init_py, "initialize.py", "exec")
    capsys.readouterr()
    assert main(["patch", "megatron", str(tree), "--check"]) == 0
    assert "already applied" in capsys.readouterr().out


def test_a_tree_the_patch_does_not_fit_is_refused_untouched(tmp_path, capsys):
    tree = tmp_path / "other"
    for f in REQUIRED:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        (tree / f).write_text("def parse_args():\n    pass\n")
    assert main(["patch", "megatron", str(tree)]) == 2
    err = capsys.readouterr().err
    assert "do not fit" in err and "core_v0.16" in err and "import hook" in err
    assert all((tree / f).read_text() == "def parse_args():\n    pass\n" for f in REQUIRED)
    assert status(tree, patches()[0]).state == "conflict"


def test_not_a_megatron_tree(tmp_path, capsys):
    assert main(["patch", "megatron", str(tmp_path)]) == 2
    assert "not a Megatron-LM tree" in capsys.readouterr().err
