"""docs/architecture.md names only what exists: every module path (``het_plugin/...py``, ``het_plugin.x.y``, a
backticked ``pkg/module.py``), every file the tree lists, and every ``module.function`` of the walk-through
("One launch, followed"). Read from the source with ast (nothing is imported)."""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "het_plugin"
DOC = ROOT / "docs" / "architecture.md"
WALK_THROUGH = "**One launch, followed.**"
# Names of the frameworks' own modules the walk-through mentions (not het_plugin's).
FRAMEWORK = {"parallel_state"}

DOTTED = re.compile(r"\bhet_plugin(?:\.\w+)+")
FILE = re.compile(r"\bhet_plugin/[\w/]+\.py\b")
TICKED = re.compile(r"`([^`\s]+)`")
NAME = re.compile(r"(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """``pkg.mod`` (relative to het_plugin) -> file, packages by their ``__init__.py``."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _names(body) -> dict[str, ast.AST]:
    """What a module or class body defines: functions, classes, assignments, imported names (conditional ones too)."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(((a.asname or a.name).split(".")[0], node) for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            out.update(_names(node.body + node.orelse))
    return out


def _classes(mods: dict[str, Path]) -> dict[str, list[Path]]:
    """Class name -> the files defining it (found by a regex; only those files are parsed, when asked)."""
    out: dict[str, list[Path]] = {}
    for path in mods.values():
        for name in re.findall(r"^[ \t]*class[ \t]+(\w+)", path.read_text(), re.M):
            out.setdefault(name, []).append(path)
    return out


def resolves(name: str, mods: dict[str, Path], classes: dict[str, list[Path]]) -> bool:
    """``a.b.c`` is a module (a suffix of a het_plugin module's dotted name), an attribute of one, or a class's
    attribute (``Class.method``)."""
    parts = name.split(".")
    if parts[0] == "het_plugin":
        parts = parts[1:]
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        found = [p for m, p in mods.items() if m == prefix or m.endswith("." + prefix)]
        rest = parts[k:]
        if found and len(rest) <= 1 and (not rest or any(rest[0] in _names(_tree(p).body) or
                                                          ".".join((m, rest[0])) in mods
                                                          for m, p in mods.items() if p in found)):
            return True
    if len(parts) == 2 and parts[0] in classes:
        return any(parts[1] in _names(node.body) for path in classes[parts[0]] for node in ast.walk(_tree(path))
                   if isinstance(node, ast.ClassDef) and node.name == parts[0])
    return False


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


@pytest.fixture(scope="module")
def package():
    mods = modules()
    return mods, _classes(mods)


def walk_through(text: str) -> str:
    start = text.index(WALK_THROUGH)
    end = text.find("\n\n", start)
    return text[start:end if end >= 0 else None]


def walk_through_names(text: str) -> list[str]:
    """Every dotted name inside the walk-through's backticks (call arguments dropped)."""
    spans = re.findall(r"`([^`]+)`", walk_through(text).replace("\n", " "))
    return [n for span in spans for n in NAME.findall(span) if not n.endswith((".yaml", ".json"))]


def test_every_module_path_exists(doc, package):
    mods, classes = package
    files = sorted(set(FILE.findall(doc)))
    assert [f for f in files if not (ROOT / f).is_file()] == []
    dotted = sorted(set(DOTTED.findall(doc)))
    assert [d for d in dotted if not resolves(d, mods, classes)] == []
    ticked = sorted({t.rstrip(".,;:") for t in TICKED.findall(doc) if re.fullmatch(r"[\w/]+\.py", t)})
    missing = [t for t in ticked if not ((ROOT / t).is_file() or any(PACKAGE.rglob(t)))]   # a bare name: in its package
    assert missing == []
    assert len(files) > 20 and len(dotted) > 5 and len(ticked) > 10        # the parse found the doc's names


def test_every_file_the_tree_lists_exists(doc):
    tree = doc[doc.index("## The tree"):]
    tree = tree[tree.index("```") + 3:]
    tree = tree[:tree.index("```")]
    missing, checked, top = [], 0, None
    for line in tree.splitlines():
        m = re.match(r"  (\w+)/", line)
        if m:
            top = m.group(1)
        if top is None:
            continue
        for name in re.findall(r"\b(\w+)\.py\b", re.sub(r"tests/\S+", "", line)):
            checked += 1
            if not list((PACKAGE / top).rglob(f"{name}.py")):
                missing.append(f"{top}/{name}.py")
    assert missing == []
    assert checked >= 10


def test_the_walk_through_names_only_what_exists(doc, package):
    mods, classes = package
    names = sorted({n for n in walk_through_names(doc) if n.split(".")[0] not in FRAMEWORK})
    assert [n for n in names if not resolves(n, mods, classes)] == []
    assert len(names) > 30                                   # the paragraph was found and parsed
    for a, b in (("lm.prepare_args", "lm.planned_initialize_model_parallel"), ("mcore.build_groups",
                 "runtime.startup.startup"), ("engine.initialize_with_plan", "pipe.build_with_plan")):
        assert a in names and b in names


def test_the_check_finds_what_does_not_exist(package):
    mods, classes = package
    assert resolves("core.launch.resolve_launch", mods, classes)
    assert resolves("het_plugin.megatron.mcore.current_plan", mods, classes)
    assert resolves("AppliedPlan.begin", mods, classes) and resolves("startup.bounded", mods, classes)
    for gone in ("resolve.resolve_launch", "resolve.check_launch_settings", "runtime.groups.spec_for",
                 "lm.no_such_function", "AppliedPlan.no_such_method", "het_plugin.data"):
        assert not resolves(gone, mods, classes), gone
    text = "x\n\n**One launch, followed.** `--flag c.yaml` `lm.prepare_args` -> `pipe.build_with_plan(..., Wrapped(a, b))`.\n\nnext"
    assert walk_through_names(text) == ["lm.prepare_args", "pipe.build_with_plan"]
