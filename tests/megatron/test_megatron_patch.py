"""``het-plugin patch megatron``: one patch per Megatron-LM line; the command picks the one that fits the tree,
recognises an applied one, and refuses any other tree (naming its version and the supported lines) untouched.

Three kinds of tree:

* Synthetic trees built from each patch's own pre-image (its context and removed lines at their line
  numbers, filler elsewhere): they run everywhere and check the selection, GNU patch fallback and refusals.
* The megatron/training files of the installed megatron-core wheel (0.19.2 ships them; 0.16.1 does not):
  run by the second pass of ``make test`` (HET_TEST_MCORE=0.19.2), skipped in the plain venv.
* Real Megatron-LM trees, opt-in: MEGATRON_LM_PATH (a work tree) or MEGATRON_LM_GIT (a git repository,
  bare or not, from which the files are exported at each tested tag). Without either they are skipped.
"""
from __future__ import annotations

import importlib.util
import os
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from het_plugin.cli import main
from het_plugin.cli import patch as patch_cli
from het_plugin.cli.patch import PACKAGE_INFO, REQUIRED, patches, status, tree_version

# The patch for each Megatron-LM line, and tags measured to take it (docs/megatron.md, "The patch").
LINES = {
    "core_v0.16.x-heterogeneous-nic.patch": ["core_v0.16.0", "core_v0.16.1"],
    "core_v0.17-0.18-heterogeneous-nic.patch": ["core_v0.17.0", "core_v0.17.1", "core_v0.18.0", "core_v0.18.2"],
    "core_v0.19-main-heterogeneous-nic.patch": ["core_v0.19.0", "main"],
}
HOOKS = {"megatron/training/arguments.py": ("_add_heterogeneous_cluster_args", "prepare_args(args)"),
         "megatron/training/initialize.py": ("planned_initialize_model_parallel",)}


def patch_for_version(version: str) -> str:
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) <= (0, 16):
        return "core_v0.16.x-heterogeneous-nic.patch"
    if (major, minor) <= (0, 18):
        return "core_v0.17-0.18-heterogeneous-nic.patch"
    return "core_v0.19-main-heterogeneous-nic.patch"


def by_name(name: str) -> Path:
    return next(p for p in patches() if p.name == name)


def write_package_info(tree: Path, major, minor, patch, pre: str = "") -> None:
    (tree / PACKAGE_INFO).parent.mkdir(parents=True, exist_ok=True)
    (tree / PACKAGE_INFO).write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = {pre!r}\n"
                                     "VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)\n")


def preimage_tree(patch: Path, dest: Path) -> Path:
    """A tree the patch fits exactly: each hunk's old side at its line numbers, unique filler lines between."""
    files: dict[str, list[tuple[int, list[str]]]] = {}
    current = None
    hunk = None
    for line in patch.read_text().splitlines():
        if line.startswith("--- a/"):
            current = files.setdefault(line[6:], [])
            hunk = None
        elif line.startswith("@@ ") and current is not None:
            start = int(re.match(r"@@ -(\d+)", line).group(1))
            hunk = []
            current.append((start, hunk))
        elif hunk is not None and line[:1] in (" ", "-"):
            hunk.append(line[1:])
        elif hunk is not None and line == "":
            hunk.append("")
    for name, hunks in files.items():
        out: list[str] = []
        for start, old in hunks:
            while len(out) < start - 1:
                out.append(f"# filler {len(out) + 1}")
            out.extend(old)
        out.extend(f"# filler {len(out) + 1 + i}" for i in range(3))
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_text("\n".join(out) + "\n")
    return dest


def export_tree(ref: str, dest: Path, *, git_only: bool = False) -> Path:
    """The two files the patch touches (and package_info.py), from a Megatron-LM tree or git mirror at ``ref``."""
    if os.environ.get("MEGATRON_LM_PATH") and not git_only:
        src = Path(os.environ["MEGATRON_LM_PATH"])
        for f in (*REQUIRED, PACKAGE_INFO):
            if (src / f).is_file():
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src / f, dest / f)
        return dest
    if not os.environ.get("MEGATRON_LM_GIT"):
        pytest.skip("no Megatron-LM tree: set MEGATRON_LM_GIT to a git repository of Megatron-LM with the core_v0.x "
                    "tags" + ("" if git_only else ", or MEGATRON_LM_PATH to a work tree"))
    repo = Path(os.environ["MEGATRON_LM_GIT"])
    if not shutil.which("git"):
        pytest.skip("MEGATRON_LM_GIT is set but git is not installed")
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref, *REQUIRED, PACKAGE_INFO], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"{ref} not in MEGATRON_LM_GIT={repo}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def check_apply_cycle(tree: Path, capsys, expected: str | None = None, *, compiles: bool = True) -> str:
    """--check names one patch; applying it adds the hooks (and the files compile: real trees); --check then
    says already applied."""
    assert main(["patch", "megatron", str(tree), "--check"]) == 0
    out = capsys.readouterr().out
    assert "applies cleanly" in out, out
    chosen = out.split(":", 1)[0]
    if expected:
        assert chosen == expected, out
    before = {f: (tree / f).read_text() for f in REQUIRED}
    assert before == {f: (tree / f).read_text() for f in REQUIRED}          # --check changed nothing
    assert main(["patch", "megatron", str(tree)]) == 0
    assert f"{chosen}: applied to" in capsys.readouterr().out
    for f, hooks in HOOKS.items():
        text = (tree / f).read_text()
        assert text != before[f] and all(h in text for h in hooks), f
        if compiles:
            py_compile.compile(str(tree / f), cfile=str(tree / (f + ".pyc")), doraise=True)
    assert "from het_plugin.megatron.lm import prepare_args" in (tree / REQUIRED[0]).read_text()
    assert main(["patch", "megatron", str(tree), "--check"]) == 0
    assert f"{chosen}: already applied" in capsys.readouterr().out
    assert main(["patch", "megatron", str(tree)]) == 0                     # re-running changes nothing
    assert "already applied" in capsys.readouterr().out
    return chosen


# --- the patch files -----------------------------------------------------------------------------------------

def test_one_patch_per_line_each_saying_which_versions():
    found = {p.name: p for p in patches()}
    assert set(found) == set(LINES)
    for name, p in found.items():
        text = p.read_text()
        applies_to = next(line for line in text.splitlines() if line.startswith("Applies-to:"))
        assert all(tag in applies_to for tag in LINES[name] if tag != "main"), (name, applies_to)
        assert "megatron/training/arguments.py" in text and "megatron/training/initialize.py" in text
        for hooks in HOOKS.values():
            assert all(h in text for h in hooks)
    assert "main" in found["core_v0.19-main-heterogeneous-nic.patch"].read_text().split("diff --git")[0]


def test_setup_ships_every_patch():
    text = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    assert 'rglob("*.patch")' in text and '"_patches"' in text


# --- synthetic trees: selection, fallback, refusal --------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(LINES))
def test_each_lines_tree_gets_its_own_patch(name, tmp_path, capsys):
    tree = preimage_tree(by_name(name), tmp_path / "Megatron-LM")
    assert [status(tree, p).state for p in patches()] == ["applies" if p.name == name else "conflict"
                                                         for p in patches()]
    check_apply_cycle(tree, capsys, expected=name, compiles=False)


@pytest.mark.skipif(not shutil.which("patch"), reason="GNU patch is not installed")
@pytest.mark.parametrize("name", sorted(LINES))
def test_without_git_gnu_patch_gives_the_same_result(name, tmp_path, monkeypatch, capsys):
    via_git = preimage_tree(by_name(name), tmp_path / "git")
    assert main(["patch", "megatron", str(via_git)]) == 0
    which = shutil.which
    monkeypatch.setattr(patch_cli.shutil, "which", lambda tool: None if tool == "git" else which(tool))
    assert patch_cli._tool()[0] == "patch"
    tree = preimage_tree(by_name(name), tmp_path / "patch")
    capsys.readouterr()
    assert check_apply_cycle(tree, capsys, compiles=False) == name
    for f in REQUIRED:
        assert (tree / f).read_text() == (via_git / f).read_text()
    assert not list(tree.rglob("*.orig")) and not list(tree.rglob("*.rej"))


@pytest.mark.parametrize("version, shown", [((0, 14, 0, ""), "Megatron-LM 0.14.0"),
                                            ((0, 21, 0, "rc1"), "Megatron-LM 0.21.0rc1"),
                                            (None, "Megatron-LM version unknown")])
def test_a_tree_no_patch_fits_is_refused_untouched_naming_its_version(version, shown, tmp_path, capsys):
    tree = tmp_path / "other"
    for f in REQUIRED:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        (tree / f).write_text("def parse_args():\n    pass\n")
    if version:
        write_package_info(tree, *version)
    for argv in (["--check"], []):
        assert main(["patch", "megatron", str(tree), *argv]) == 2
        err = capsys.readouterr().err
        assert shown in err and "nothing was changed" in err and "Traceback" not in err
        assert "no het_plugin patch fits" in err and "import hook" in err
        if version:
            assert f"read from {PACKAGE_INFO}" in err
        else:
            assert f"no readable {PACKAGE_INFO}" in err
        for p in patches():                         # the supported lines, with what each applies to
            assert f"{p.name}: {patch_cli._supported_versions(p)}" in err
            assert "core_v0." in patch_cli._supported_versions(p)
    assert all((tree / f).read_text() == "def parse_args():\n    pass\n" for f in REQUIRED)
    assert all(status(tree, p).state == "conflict" for p in patches())


def test_a_tree_the_adapter_would_refuse_is_not_patched_even_where_the_patch_fits(tmp_path, capsys, monkeypatch):
    """The 0.16 patch fits core_v0.15.x, but the adapter refuses megatron-core 0.15 at launch: refuse it here."""
    name = "core_v0.16.x-heterogeneous-nic.patch"
    tree = preimage_tree(by_name(name), tmp_path / "Megatron-LM")
    write_package_info(tree, 0, 15, 3)
    before = {f: (tree / f).read_text() for f in REQUIRED}
    monkeypatch.delenv("HET_PLUGIN_ANY_MEGATRON", raising=False)
    for argv in (["--check"], []):
        assert main(["patch", "megatron", str(tree), *argv]) == 2
        err = capsys.readouterr().err
        assert "Megatron-LM 0.15.3" in err and "outside the range" in err and "nothing was changed" in err
        assert "core_v0.16.0 or later" in err and "Traceback" not in err
    assert {f: (tree / f).read_text() for f in REQUIRED} == before
    monkeypatch.setenv("HET_PLUGIN_ANY_MEGATRON", "1")          # the gate's own switch lets it through
    assert main(["patch", "megatron", str(tree), "--check"]) == 0


def test_a_half_patched_tree_is_refused_untouched(tmp_path, capsys):
    name = "core_v0.19-main-heterogeneous-nic.patch"
    tree = preimage_tree(by_name(name), tmp_path / "half")
    done = preimage_tree(by_name(name), tmp_path / "done")
    assert main(["patch", "megatron", str(done)]) == 0
    shutil.copy(done / REQUIRED[0], tree / REQUIRED[0])      # arguments.py patched, initialize.py not
    before = {f: (tree / f).read_text() for f in REQUIRED}
    capsys.readouterr()
    assert main(["patch", "megatron", str(tree)]) == 2
    assert "no het_plugin patch fits" in capsys.readouterr().err
    assert before == {f: (tree / f).read_text() for f in REQUIRED}


@pytest.mark.parametrize("text, version", [
    ("MAJOR = 0\nMINOR = 19\nPATCH = 2\nPRE_RELEASE = \"\"\n", "0.19.2"),
    ("MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = 'rc0'\nimport os\n", "0.20.0rc0"),
    ("MAJOR = 0\nMINOR = 17\nPATCH = 1\n", "0.17.1"),
    ("MAJOR = '0'\nMINOR = 19\nPATCH = 2\n", None),
    ("MAJOR = 0\nMINOR = 19\n", None),
    ("MAJOR = (\n", None),
    ("raise SystemExit('never run')\nMAJOR = 0\nMINOR = 18\nPATCH = 0\n", "0.18.0"),
])
def test_tree_version_reads_package_info_without_running_it(text, version, tmp_path):
    (tmp_path / PACKAGE_INFO).parent.mkdir(parents=True)
    (tmp_path / PACKAGE_INFO).write_text(text)
    assert tree_version(tmp_path) == version


def test_tree_version_unknown_without_package_info(tmp_path):
    assert tree_version(tmp_path) is None


def test_not_a_megatron_tree(tmp_path, capsys):
    assert main(["patch", "megatron", str(tmp_path)]) == 2
    assert "not a Megatron-LM tree" in capsys.readouterr().err


# --- the installed megatron-core wheel's Megatron-LM files (the make test megatron-core 0.19.2 pass) -----------

def installed_training_dir() -> Path | None:
    """megatron/training of the installed megatron-core (where ``megatron.training.arguments.__file__`` lies).

    Found from the ``megatron`` package's search path rather than by importing megatron.training, whose
    import-time code loads torch and Megatron's model specs (15 s here) and is not what is tested.
    """
    loaded = sys.modules.get("megatron.training.arguments")
    if loaded is not None and getattr(loaded, "__file__", None):
        return Path(loaded.__file__).parent
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        training = Path(location) / "training"
        if (training / "__init__.py").is_file():
            return training if all((training / Path(f).name).is_file() for f in REQUIRED) else None
    return None


def test_installed_megatron_core_wheel_files_take_their_lines_patch(tmp_path, capsys):
    training = installed_training_dir()
    if training is None:
        if os.environ.get("HET_TEST_MCORE"):
            pytest.fail(f"HET_TEST_MCORE={os.environ['HET_TEST_MCORE']} but the installed megatron-core ships no "
                        "megatron/training (the 0.19.2 wheel does): check PYTHONPATH")
        pytest.skip("this megatron-core ships no megatron/training (0.16.1 does not); `make test` runs this test "
                    "in its megatron-core 0.19.2 pass")
    tree = tmp_path / "Megatron-LM"
    for f in REQUIRED:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(training / Path(f).name, tree / f)
    info = training.parent / "core" / "package_info.py"
    if info.is_file():
        (tree / PACKAGE_INFO).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(info, tree / PACKAGE_INFO)
    version = tree_version(tree)
    assert version, f"no version in {info}"
    if os.environ.get("HET_TEST_MCORE"):
        assert version.startswith(os.environ["HET_TEST_MCORE"]), (version, os.environ["HET_TEST_MCORE"])
    assert main(["patch", "megatron", str(tree), "--check"]) == 0
    assert f"Megatron-LM {version}" in capsys.readouterr().out
    check_apply_cycle(tree, capsys, expected=patch_for_version(version))


# --- real Megatron-LM trees (opt-in) -----------------------------------------------------------------------------

@pytest.mark.parametrize("ref", ["core_v0.16.0", "core_v0.16.1"])
def test_patch_checks_applies_and_is_then_recognised(ref, tmp_path, capsys):
    tree = export_tree(ref, tmp_path / "Megatron-LM")
    version = tree_version(tree)
    check_apply_cycle(tree, capsys, expected=patch_for_version(version) if version else None)


@pytest.mark.parametrize("ref, name", [(ref, name) for name, refs in LINES.items() for ref in refs])
def test_each_tag_takes_its_lines_patch_and_no_other(ref, name, tmp_path, capsys):
    tree = export_tree(ref, tmp_path / "Megatron-LM", git_only=True)
    assert [status(tree, p).state for p in patches()] == ["applies" if p.name == name else "conflict"
                                                         for p in patches()]
    check_apply_cycle(tree, capsys, expected=name)
