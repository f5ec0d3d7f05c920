"""``het-plugin patch megatron PATH [--check]``: apply (or check) het_plugin's patches to a Megatron-LM tree.

The patches (``patches/megatron-lm/*.patch``, one per Megatron-LM line: core_v0.16.x,
core_v0.17-0.18, core_v0.19-main) add ``--heterogeneous-nic`` to ``megatron/training/arguments.py`` and
call het_plugin in ``megatron/training/initialize.py``. Each is tried on the tree: the one that applies
cleanly is used (an already-applied one is reported as such); when none fits, nothing is changed and
the message names the tree's version (``megatron/core/package_info.py``) and the supported lines. A tree
whose version the adapter would refuse at launch (het_plugin.megatron.version) is refused here too.
Without a patch the pip-installed import hook does the same; the patch makes it explicit in the tree.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ConfigError

PACKAGE = Path(__file__).resolve().parent.parent
# Installed wheels carry the patches inside the package (setup.py copies them); a checkout has patches/.
PATCH_DIRS = [PACKAGE / "_patches", PACKAGE.parent / "patches"]
TARGETS = {"megatron": "megatron-lm"}
REQUIRED = ("megatron/training/arguments.py", "megatron/training/initialize.py")
PACKAGE_INFO = "megatron/core/package_info.py"


@dataclass
class PatchStatus:
    patch: Path
    state: str            # 'applies', 'applied', 'conflict'
    detail: str = ""


def patch_dir(target: str = "megatron") -> Path:
    env = os.environ.get("HET_PLUGIN_PATCHES")
    dirs = ([Path(env)] if env else []) + PATCH_DIRS
    for d in dirs:
        if (d / TARGETS[target]).is_dir():
            return d / TARGETS[target]
    raise ConfigError(f"no het_plugin patches found (looked in {[str(d) for d in dirs]})",
                      fix="reinstall het_plugin, or set HET_PLUGIN_PATCHES to the repository's patches/ folder")


def patches(target: str = "megatron") -> list[Path]:
    return sorted(patch_dir(target).glob("*.patch"))


def _tool() -> list[str]:
    if shutil.which("git"):
        return ["git", "apply"]
    if shutil.which("patch"):
        # --fuzz=0: a hunk fits exactly or not at all, as with git apply (fuzz could pick the wrong line's patch)
        return ["patch", "-p1", "--forward", "--batch", "--fuzz=0", "--no-backup-if-mismatch"]
    raise ConfigError("neither git nor patch is installed", fix="install git (or GNU patch)")


def _run(args: list[str], tree: Path, patch: Path, *, check: bool, reverse: bool = False) -> subprocess.CompletedProcess:
    tool = _tool()
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.resolve().parent))
    if tool[0] == "git":
        cmd = tool + (["--check"] if check else []) + (["--reverse"] if reverse else []) + args + [str(patch)]
    else:
        cmd = tool + (["--dry-run"] if check else []) + (["--reverse"] if reverse else []) + ["-i", str(patch)]
    try:
        return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    except OSError as exc:
        raise ConfigError(f"could not run {cmd[0]}: {exc}", source=str(tree)) from None


def status(tree: Path, patch: Path) -> PatchStatus:
    """Does ``patch`` apply to ``tree`` (or is it already applied)?"""
    forward = _run([], tree, patch, check=True)
    if forward.returncode == 0:
        return PatchStatus(patch, "applies")
    backward = _run([], tree, patch, check=True, reverse=True)
    if backward.returncode == 0:
        return PatchStatus(patch, "applied")
    return PatchStatus(patch, "conflict", (forward.stderr or forward.stdout).strip())


def check_tree(tree: Path) -> Path:
    tree = Path(tree)
    missing = [f for f in REQUIRED if not (tree / f).is_file()]
    if missing:
        raise ConfigError(f"{tree} is not a Megatron-LM tree (missing {', '.join(missing)})", source=str(tree),
                          fix="pass the root of a Megatron-LM checkout (the folder holding megatron/training/)")
    return tree


def tree_version(tree: Path) -> str | None:
    """``MAJOR.MINOR.PATCH`` (plus ``PRE_RELEASE``) from the tree's megatron/core/package_info.py; None if unknown.

    Read with ast, not imported: the file runs git at import time and must not run code from the tree.
    """
    try:
        module = ast.parse((Path(tree) / PACKAGE_INFO).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    found: dict[str, object] = {}
    for node in module.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    parts = [found.get(k) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in parts):
        return None
    pre = found.get("PRE_RELEASE")
    return ".".join(map(str, parts)) + (pre if isinstance(pre, str) else "")


def check_tree_supported(tree: Path, version: str | None) -> None:
    """A patch may apply to a release the adapter refuses at launch (the 0.16 patch fits core_v0.15.x):
    patching it would only move the refusal to the first training launch."""
    from ..megatron.version import check_megatron_version
    if version is None:
        return                    # unknown (no package_info): the patch that fits decides
    try:
        check_megatron_version(version)
    except ConfigError as exc:
        raise ConfigError(f"this tree is Megatron-LM {version}; {exc.problem}; nothing was changed",
                          source=str(tree), field="megatron/core/package_info.py",
                          fix="check out a supported Megatron-LM release (core_v0.16.0 or later)") from None


def _supported_versions(patch: Path) -> str:
    try:
        lines = patch.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    for line in lines:
        if line.lower().startswith("applies-to:"):
            return line.split(":", 1)[1].strip()
    return patch.stem


def _first_line(text: str) -> str:
    """The first line that says what failed (git: 'error: patch failed: FILE:LINE'; GNU patch: 'Hunk #N FAILED')."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    failed = [line for line in lines if "fail" in line.lower() or "error" in line.lower()]
    return (failed or lines or ["does not apply"])[0]


def run(args) -> int:
    tree = check_tree(Path(args.path))
    found = patches(args.target)
    if not found:
        raise ConfigError(f"no patches for {args.target} in {patch_dir(args.target)}")
    results = [status(tree, p) for p in found]
    version = tree_version(tree)
    about = (f"Megatron-LM {version}, read from {PACKAGE_INFO}" if version
             else f"Megatron-LM version unknown: no readable {PACKAGE_INFO}")
    applied = [r for r in results if r.state == "applied"]
    if applied:
        for r in applied:
            print(f"{r.patch.name}: already applied to {tree} ({about})")
        return 0
    fitting = [r for r in results if r.state == "applies"]
    if not fitting:
        supported = "\n".join(f"    {r.patch.name}: {_supported_versions(r.patch)}" for r in results)
        detail = "\n".join(f"    {r.patch.name}: {_first_line(r.detail)}" for r in results)
        raise ConfigError(f"no het_plugin patch fits this tree ({about}); nothing was changed.\n"
                          f"  supported Megatron-LM lines:\n{supported}\n  what did not fit:\n{detail}",
                          source=str(tree),
                          fix="check out a supported Megatron-LM version, or use no patch at all: with het_plugin "
                              "pip-installed, its import hook handles --heterogeneous-nic on an unmodified tree")
    check_tree_supported(tree, version)
    chosen = fitting[0]           # the lines' patches are disjoint (measured); the first in name order wins
    if args.check:
        print(f"{chosen.patch.name}: applies cleanly to {tree} ({about})")
        return 0
    done = _run([], tree, chosen.patch, check=False)
    if done.returncode != 0:
        raise ConfigError(f"{chosen.patch.name} failed to apply: {(done.stderr or done.stdout).strip()}",
                          source=str(tree))
    print(f"{chosen.patch.name}: applied to {tree} ({about})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("patch", help="apply or check het_plugin's patches to a Megatron-LM tree")
    p.add_argument("target", choices=sorted(TARGETS), help="what to patch (megatron: a Megatron-LM checkout)")
    p.add_argument("path", help="root of the Megatron-LM tree")
    p.add_argument("--check", action="store_true", help="only say which patch applies (or is already applied); change nothing")
    p.set_defaults(func=run)


if __name__ == "__main__":  # pragma: no cover
    from . import main
    sys.exit(main(["patch", *sys.argv[1:]]))
