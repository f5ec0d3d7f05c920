"""The core is pure (docs/architecture.md, "The rule of imports"): importing every module of het_plugin.core and
het_plugin.views loads no torch, no runtime, comm, discovery or adapter module and no framework, and writes no
environment variable. Checked two ways: in a fresh interpreter (what import actually loads), and over the
source (an import inside a function would only load when called)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import het_plugin

PACKAGE = Path(het_plugin.__file__).resolve().parent
PURE = ("core", "views")
FORBIDDEN = ("torch", "megatron", "deepspeed", "het_plugin.runtime", "het_plugin.comm", "het_plugin.discovery",
             "het_plugin.megatron", "het_plugin.deepspeed", "het_plugin.tools", "het_plugin.cli")

PROBE = r"""
import importlib, json, os, pkgutil, sys
before = dict(os.environ)
import het_plugin
names = []
for top in %(pure)r:
    pkg = importlib.import_module("het_plugin." + top)
    names.append(pkg.__name__)
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(info.name)
        names.append(info.name)
print(json.dumps({"imported": names, "loaded": sorted(sys.modules), "env_changed":
                  sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))}))
"""


def _pure_files():
    for top in PURE:
        yield from sorted((PACKAGE / top).rglob("*.py"))


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_importing_every_core_module_loads_nothing_impure_and_writes_no_environment():
    out = subprocess.run([sys.executable, "-c", PROBE % {"pure": PURE}], capture_output=True, text=True,
                         check=True, cwd=PACKAGE.parent)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["imported"]) >= 25          # every module was reached (the walk did not stop early)
    assert [m for m in result["loaded"] if _forbidden(m)] == []
    assert result["env_changed"] == []


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")[: -node.level]
    return ".".join(base + ([node.module] if node.module else []))


def test_no_core_source_imports_an_impure_module_even_inside_a_function():
    found = []
    for path in _pure_files():
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts if rel.name != "__init__" else rel.parts[:-1] + ("__init__",))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(module, node)
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{rel}.py:{node.lineno} imports {n}" for n in names if _forbidden(n)]
    assert found == []


def test_no_core_source_writes_the_environment():
    writes = []
    for path in _pure_files():
        for node in ast.walk(ast.parse(path.read_text())):
            target = None
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                target = next((t for t in targets if isinstance(t, ast.Subscript)
                               and ast.unparse(t.value) == "os.environ"), None)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and ast.unparse(node.func.value) == "os.environ" \
                    and node.func.attr in ("setdefault", "pop", "update", "clear", "__setitem__"):
                target = node
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.putenv", "os.unsetenv"):
                target = node
            if target is not None:
                writes.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert writes == []


def test_the_checks_see_an_impure_import(tmp_path):
    # The source check is not vacuous: the same walk finds a lazy torch import and an environment write.
    tree = ast.parse("import os\ndef f():\n    import torch\n    os.environ['X'] = '1'\n")
    imports = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert [i for i in imports if _forbidden(i)] == ["torch"]
    assert any(isinstance(n, ast.Assign) and ast.unparse(n.targets[0].value) == "os.environ" for n in ast.walk(tree))


WRITER = Path("core") / "files.py"          # the core's one writer (its docstring says why it is allowed)
_WRITE_CALLS = {"os.replace", "os.rename", "os.fdopen", "os.unlink", "os.remove", "os.chmod", "os.mkdir",
                "os.makedirs", "tempfile.mkstemp", "tempfile.NamedTemporaryFile", "shutil.copy", "shutil.move"}
_WRITE_METHODS = {"write_text", "write_bytes", "touch", "mkdir", "unlink", "savefig"}


def _file_writes(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        mode = node.args[1] if name == "open" and len(node.args) > 1 else \
            next((k.value for k in node.keywords if k.arg == "mode"), None) if name == "open" else None
        if name in _WRITE_CALLS or (isinstance(node.func, ast.Attribute) and node.func.attr in _WRITE_METHODS) \
                or (isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+")):
            lines.append(node.lineno)
    return lines


def test_the_core_writes_files_only_through_its_one_writer():
    """Plans and profiles are written where a caller asks (Plan.save, MeasuredProfile.save, the CLI's -o), all
    through core/files.py; no other module of the core opens a file for writing. (The views write one thing:
    the picture a caller names, views/svg.py and views/timeline.py.)"""
    writes = {str(p.relative_to(PACKAGE)): _file_writes(ast.parse(p.read_text()))
              for p in sorted((PACKAGE / "core").rglob("*.py"))}
    assert {p: lines for p, lines in writes.items() if lines and p != str(WRITER)} == {}
    assert writes[str(WRITER)], "the check finds the writer's own writes (it is not vacuous)"
