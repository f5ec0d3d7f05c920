"""``het-plugin patch megatron PATH [--check]``: apply (or check) het_plugin's patches to a Megatron-LM tree.

The patches (``patches/megatron-lm/*.patch``) add ``--heterogeneous-nic`` to
``megatron/training/arguments.py`` and call het_plugin in ``megatron/training/initialize.py``. Without
a patch the pip-installed import hook does the same; the patch makes it explicit in the tree.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

PACKAGE = Path(__file__).resolve().parent.parent
# Installed wheels carry the patches inside the package (setup.py copies them); a checkout has patches/.
PATCH_DIRS = [PACKAGE / "_patches", PACKAGE.parent / "patches"]
TARGETS = {"megatron": "megatron-lm"}
REQUIRED = ("megatron/training/arguments.py", "megatron/training/initialize.py")


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
        return ["patch", "-p1", "--forward", "--batch"]
    raise ConfigError("neither git nor patch is installed", fix="install git (or GNU patch)")


def _run(args: list[str], tree: Path, patch: Path, *, check: bool, reverse: bool = False) -> subprocess.CompletedProcess:
    tool = _tool()
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.resolve().parent))
    if tool[0] == "git":
        cmd = tool + (["--check"] if check else []) + (["--reverse"] if reverse else []) + args + [str(patch)]
    else:
        cmd = tool + (["--dry-run"] if check else []) + (["--reverse"] if reverse else []) + ["-i", str(patch)]
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)


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


def _supported_versions(patch: Path) -> str:
    for line in patch.read_text().splitlines():
        if line.lower().startswith("applies-to:"):
            return line.split(":", 1)[1].strip()
    return patch.stem


def run(args) -> int:
    tree = check_tree(Path(args.path))
    found = patches(args.target)
    if not found:
        raise ConfigError(f"no patches for {args.target} in {patch_dir(args.target)}")
    results = [status(tree, p) for p in found]
    conflicts = [r for r in results if r.state == "conflict"]
    if conflicts:
        versions = "; ".join(_supported_versions(r.patch) for r in conflicts)
        detail = "\n".join(f"    {r.patch.name}: {r.detail.splitlines()[0] if r.detail else 'does not apply'}"
                           for r in conflicts)
        raise ConfigError(f"the patches do not fit this Megatron-LM tree (made for {versions}); nothing was "
                          f"changed:\n{detail}", source=str(tree),
                          fix="check out a supported Megatron-LM version, or use no patch at all: with het_plugin "
                              "pip-installed, its import hook handles --heterogeneous-nic on an unmodified tree")
    for r in results:
        if r.state == "applied":
            print(f"{r.patch.name}: already applied to {tree}")
        elif args.check:
            print(f"{r.patch.name}: applies cleanly to {tree}")
        else:
            done = _run([], tree, r.patch, check=False)
            if done.returncode != 0:
                raise ConfigError(f"{r.patch.name} failed to apply: {done.stderr.strip()}", source=str(tree))
            print(f"{r.patch.name}: applied to {tree}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("patch", help="apply or check het_plugin's patches to a Megatron-LM tree")
    p.add_argument("target", choices=sorted(TARGETS), help="what to patch (megatron: a Megatron-LM checkout)")
    p.add_argument("path", help="root of the Megatron-LM tree")
    p.add_argument("--check", action="store_true", help="only check that the patches apply (or are applied)")
    p.set_defaults(func=run)


if __name__ == "__main__":  # pragma: no cover
    from . import main
    sys.exit(main(["patch", *sys.argv[1:]]))
