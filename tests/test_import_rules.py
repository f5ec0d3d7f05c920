"""Imports run one way (docs/architecture.md, "The rule of imports"), read from the source (nothing is imported, so
every package is covered, torch-only modules too, in a fraction of a second):

(a) layers: core <- runtime (discovery with it) <- comm <- adapters (megatron, deepspeed) <- cli / tools; views
    beside the core; a module imports its own layer and those below; core never imports views, the adapters never
    each other; ``het_plugin`` itself imports only ``_moved``, which imports nothing of het_plugin;
(b) no import cycle anywhere in het_plugin, imports inside functions counted;
(c) an import inside a function only where it defers an optional dependency (torch, a framework, matplotlib) that
    the importing module does not load already, or where :data:`ALLOWED` says why.
"""
from __future__ import annotations

import ast
import fnmatch
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

import het_plugin

PACKAGE = Path(het_plugin.__file__).resolve().parent

# Layer of each top-level package; a module may import its own layer and lower ones (see FORBIDDEN for the two
# exceptions inside a layer). discovery runs on ranks and gathers over the store with runtime.exchange: runtime-level.
LAYERS = {"core": 0, "views": 0, "runtime": 1, "discovery": 1, "comm": 2, "megatron": 3, "deepspeed": 3,
          "cli": 4, "tools": 4}
FORBIDDEN = {("core", "views"), ("megatron", "deepspeed"), ("deepspeed", "megatron")}
# Required by pyproject.toml (with the standard library): never a reason to import inside a function.
REQUIRED = {"yaml", "pydantic"}

# Function-level imports of het_plugin modules that load no optional dependency, each with its reason.
# (importer pattern, imported pattern) -> why; patterns are fnmatch patterns over module names.
ALLOWED = {
    ("het_plugin.cli.*", "het_plugin.*"):
        "every `het-plugin` command imports all subcommand modules to build its parser (cli/__init__.py); a "
        "subcommand loads what it runs when it runs, so `--help` or `check` do not load the planner (~0.3 s)",
    ("het_plugin.megatron.hook", "het_plugin.megatron.*"):
        "a .pth imports the hook at interpreter start-up (setup.py); the adapter loads only once Megatron-LM "
        "parses its arguments",
    ("het_plugin.deepspeed", "het_plugin.deepspeed.*"):
        "the package's names load on first use (PEP 562 __getattr__): `het-plugin wrap-config` imports the "
        "package for its config module only",
}

@dataclass(frozen=True)
class Import:
    importer: str
    target: str                 # a het_plugin module, or an outside top-level name ("torch")
    line: int
    function: Optional[str]     # the enclosing function, None at module level
    type_checking: bool         # under ``if TYPE_CHECKING:`` (never runs)

    @property
    def ours(self) -> bool:
        return self.target == "het_plugin" or self.target.startswith("het_plugin.")

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.target}"


def modules(root: Path, top: str = "het_plugin") -> dict[str, Path]:
    out = {}
    for path in sorted((root / top).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _owner(name: str, mods: dict[str, Path]) -> Optional[str]:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


# Reading the imports without parsing whole files (parsing all of het_plugin with ast costs about half a second
# of CPU): strings and comments are blanked, then only the lines that open a def, a class, an ``if TYPE_CHECKING``
# or an import statement are looked at, and each import statement alone is parsed. test_the_fast_reader_agrees_
# with_ast compares the two readings.
_OPENS = re.compile(r"[ \t]*(?:(?:async[ \t]+)?(def|class)[ \t]+(\w+)|if[ \t]+(?:typing\.)?TYPE_CHECKING\b|"
                    r"(import[ \t]|from[ \t]+[\w.]+[ \t]+import\b))")
_IMPORT = re.compile(r"\bimport\b")
_STRINGS = re.compile(r"[rRbBuUfF]{0,2}(?:'''(?:\\.|(?!''').)*?'''"
                      r'|"""(?:\\.|(?!""").)*?"""'
                      r"|'(?:\\.|[^'\\\n])*'"
                      r'|"(?:\\.|[^"\\\n])*")'
                      r"|#[^\n]*", re.S)


def _blank(text: str) -> str:
    """``text`` with every string literal and comment replaced by its newlines (line numbers stay)."""
    out, pos = [], 0
    for m in _STRINGS.finditer(text):
        out += [text[pos:m.start()], "\n" * text.count("\n", m.start(), m.end())]
        pos = m.end()
    return "".join(out) + text[pos:]


def import_statements(text: str):
    """(line, enclosing function or None, under TYPE_CHECKING, the parsed statement) for every import."""
    lines = _blank(text).split("\n")
    stack: list[tuple[int, Optional[str], bool]] = []       # (indent, function name or None, type-checking)
    depth, continued, i = 0, False, 0
    while i < len(lines):
        line = lines[i]
        i += 1
        inside, continued = depth > 0 or continued, line.rstrip().endswith("\\")
        m = _OPENS.match(line)
        if _IMPORT.search(line) and (inside or not (m and m.group(3))):
            raise ValueError(f"line {i}: an import this reader cannot place (after a ':' or a ';'?); give it a line")
        if inside or not line.strip():                       # a statement's continuation line, or nothing
            depth += sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")
            continue
        indent = len(line) - len(line.lstrip())
        while stack and indent <= stack[-1][0]:
            stack.pop()
        function = next((f for _, f, _ in stack if f), None)
        checking = any(tc for _, _, tc in stack)
        if m and m.group(3):                                   # an import statement, maybe over several lines
            start, statement = i, line
            while statement.count("(") > statement.count(")") or statement.rstrip().endswith("\\"):
                statement += "\n" + lines[i]
                i += 1
            continued = False
            for node in ast.parse(statement.strip().replace("\\\n", " ")).body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield start, function, checking, node
            continue
        if m:
            stack.append((indent, m.group(2) if m.group(1) == "def" else None, m.group(1) is None))
        depth += sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")


def _resolve(name: str, is_pkg: bool, node, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        if node.level:
            base = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names]
    return [(_owner(t, mods) or t) if t.split(".")[0] == "het_plugin" else t.split(".")[0]
            for t in dict.fromkeys(targets)]


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> list[Import]:
    is_pkg = path.name == "__init__.py"
    return [Import(name, target, line, function, checking)
            for line, function, checking, node in import_statements(path.read_text())
            for target in dict.fromkeys(_resolve(name, is_pkg, node, mods))]


def imports_by_ast(name: str, path: Path, mods: dict[str, Path]) -> list[Import]:
    """The same, from the whole file's syntax tree (the reference for the fast reader)."""
    is_pkg = path.name == "__init__.py"
    found = []

    def visit(node, function, checking):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(Import(name, t, child.lineno, function, checking)
                             for t in dict.fromkeys(_resolve(name, is_pkg, child, mods)))
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for part in child.body:
                    visit(ast.Module([part], []), function, True)
                for part in child.orelse:
                    visit(ast.Module([part], []), function, checking)
            else:
                inner = function or (child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                                     else None)
                visit(child, inner, checking)
    visit(ast.parse(path.read_text(), str(path)), None, False)
    return found


def scan(root: Path, top: str = "het_plugin") -> tuple[dict[str, Path], list[Import]]:
    mods = modules(root, top)
    return mods, [i for name, path in mods.items() for i in imports_of(name, path, mods)]


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def loaded_by(mods, found) -> dict[str, set[str]]:
    """Module -> everything importing it loads (module-level imports and parent packages, transitively)."""
    direct: dict[str, set[str]] = {m: set(_parents(m)) for m in mods}
    for i in found:
        if i.function is None and not i.type_checking:
            direct[i.importer] |= {i.target} | (set(_parents(i.target)) if i.ours else set())
    closure: dict[str, set[str]] = {}
    for start in mods:
        seen, todo = set(), [start]
        while todo:
            for t in direct.get(todo.pop(), ()):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        closure[start] = seen
    return closure


def _optional(name: str) -> bool:
    return name not in REQUIRED and name not in sys.stdlib_module_names and not name.startswith("het_plugin")


def _layer(module: str) -> Optional[str]:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def layer_problems(mods, found) -> list[str]:
    problems = []
    for i in found:
        if not i.ours:
            continue
        if i.importer == "het_plugin" and i.target != "het_plugin._moved" or i.importer == "het_plugin._moved":
            problems.append(f"{i}: het_plugin/__init__.py imports only _moved, and _moved nothing of het_plugin")
            continue
        a, b = _layer(i.importer), _layer(i.target)
        if a is None or b is None or a == b:
            continue
        if LAYERS[b] > LAYERS[a] or (a, b) in FORBIDDEN:
            problems.append(f"{i}: {a} may not import {b}")
    return problems


def cycles(mods, found) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan), imports in functions included."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for i in found:
        if i.ours and not i.type_checking and i.target != i.importer:
            graph[i.importer].add(i.target)
    index, low, stack, on, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def lazy_problems(mods, found, allowed=None) -> list[tuple[Import, str]]:
    """Function-level imports that defer nothing optional and no entry of ``allowed`` explains, with the fix."""
    allowed = ALLOWED if allowed is None else allowed
    loads = loaded_by(mods, found)
    problems = []
    for i in found:
        if i.function is None or i.type_checking:
            continue
        if not i.ours:
            if not _optional(i.target):
                problems.append((i, "the standard library or a required package: import it at the top"))
            continue
        already = loads[i.importer]
        if i.target in already:
            problems.append((i, "loaded already with the importing module: import it at the top"))
        elif not any(_optional(t) for t in (loads[i.target] | {i.target}) - already) and not any(
                fnmatch.fnmatchcase(i.importer, a) and fnmatch.fnmatchcase(i.target, b) for a, b in allowed):
            problems.append((i, "defers no optional dependency: import it at the top"))
    return problems


@pytest.fixture(scope="module")
def package():
    return scan(PACKAGE.parent)


def test_the_scan_sees_every_package_and_the_imports_inside_functions(package):
    mods, found = package
    assert {_layer(m) for m in mods} == set(LAYERS) | {None}
    assert any(i.function and i.target == "torch" for i in found)          # runtime's lazy torch imports
    assert any(i.target == "het_plugin.core.errors" for i in found if i.importer.startswith("het_plugin.cli"))


def test_layers_run_one_way(package):
    assert layer_problems(*package) == []


def test_the_root_package_and_the_old_paths(package):
    mods, found = package
    from het_plugin import _moved
    assert [i.target for i in found if i.importer == "het_plugin" and i.ours] == ["het_plugin._moved"]
    assert [i for i in found if i.importer == "het_plugin._moved" and i.ours] == []
    assert [new for new in _moved.MOVED.values() if new not in mods] == []     # the aliases point at modules


def test_no_import_cycle(package):
    assert sorted(map(sorted, cycles(*package))) == [], "import cycles"


def test_imports_inside_functions_only_defer_optional_dependencies(package):
    assert [f"{i}: {why}" for i, why in lazy_problems(*package)] == []


def test_the_checks_find_what_they_forbid(tmp_path):
    # A made-up package with one of each fault: the rules are not vacuous.
    files = {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/a.py": "from ..views import v\n",                                  # core -> views
        "views/__init__.py": "",
        "views/v.py": "def f():\n    from ..core import b\n",                    # cycle through a function
        "core/b.py": "from ..views import v\nimport json\ndef g():\n    import re\n    import torch\n",
        "runtime/__init__.py": "",
        "runtime/r.py": "import os\ndef h():\n    import os\n    from ..comm import c\n",   # runtime -> comm
        "comm/__init__.py": "",
        "comm/c.py": "import torch\n",
    }
    for name, text in files.items():
        (tmp_path / "het_plugin" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "het_plugin" / name).write_text(text)
    mods, found = scan(tmp_path)
    assert layer_problems(mods, found) == [
        "het_plugin.core.a:1 imports het_plugin.views.v: core may not import views",
        "het_plugin.core.b:1 imports het_plugin.views.v: core may not import views",
        "het_plugin.runtime.r:4 imports het_plugin.comm.c: runtime may not import comm",
    ]
    assert cycles(mods, found) == [frozenset({"het_plugin.core.b", "het_plugin.views.v"})]
    assert [str(i) for i, _ in lazy_problems(mods, found, allowed={})] == [
        "het_plugin.core.b:4 imports re",                    # the standard library
        "het_plugin.runtime.r:3 imports os",                 # the standard library (loaded already, too)
        "het_plugin.views.v:2 imports het_plugin.core.b",    # defers nothing optional
    ]                                                        # (r's comm import defers torch: allowed)
    explained = {("het_plugin.views.*", "het_plugin.core.*"): "why"}
    assert [str(i) for i, _ in lazy_problems(mods, found, allowed=explained)] == [
        "het_plugin.core.b:4 imports re", "het_plugin.runtime.r:3 imports os"]


TRICKY = '''"""A docstring.

import torch   (a docstring line, not an import)
"""
from typing import TYPE_CHECKING
import os, \\
    sys
if TYPE_CHECKING:
    from .b import B
else:
    import json
x = ("import re; "
     'from re import compile')
def f(a=(1,
2)):
    # import pickle
    from . import b
    class C:
        def g(self):
            import torch.distributed as dist
    return """
import socket
"""
async def h():
    from .b import (
        B,  # import this
    )
class K:
    import math
'''


def test_the_fast_reader_agrees_with_ast(tmp_path):
    (tmp_path / "het_plugin").mkdir()
    for name, text in {"__init__.py": "", "a.py": TRICKY, "b.py": "B = 1\n"}.items():
        (tmp_path / "het_plugin" / name).write_text(text)
    mods = modules(tmp_path)
    fast = imports_of("het_plugin.a", mods["het_plugin.a"], mods)
    assert fast == imports_by_ast("het_plugin.a", mods["het_plugin.a"], mods)
    assert [(i.target, i.line, i.function, i.type_checking) for i in fast] == [
        ("typing", 5, None, False), ("os", 6, None, False), ("sys", 6, None, False),
        ("het_plugin.b", 9, None, True), ("json", 11, None, False), ("het_plugin.b", 17, "f", False),
        ("torch", 20, "f", False), ("het_plugin.b", 25, "h", False), ("math", 29, None, False)]
    real = modules(PACKAGE.parent)        # files with TYPE_CHECKING, nested and multi-line imports
    for name in ("het_plugin.megatron.mcore", "het_plugin.core.planner", "het_plugin.deepspeed.hook",
                 "het_plugin.comm"):
        assert imports_of(name, real[name], real) == imports_by_ast(name, real[name], real), name
    (tmp_path / "het_plugin" / "c.py").write_text("x = 1; import os\n")
    with pytest.raises(ValueError, match="line 1"):
        imports_of("het_plugin.c", tmp_path / "het_plugin" / "c.py", mods)
