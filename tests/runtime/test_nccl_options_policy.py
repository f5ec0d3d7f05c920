"""Every NCCL communicator het_plugin builds takes its options from the one builder the group policy and the shim
share (het_plugin.runtime.netselect.nccl_options / network_of, also named in runtime.group_policy): a source scan
of the package, and the shim's vendor subgroups recorded under a stand-in ProcessGroupNCCL (CPU torch has none)."""
from __future__ import annotations

import ast
import types
from datetime import timedelta
from pathlib import Path

import pytest

import het_plugin
from het_plugin.runtime.group_policy import Policy, spec_for

PACKAGE = Path(het_plugin.__file__).resolve().parent
POLICY_FILE = PACKAGE / "runtime" / "netselect.py"


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _name(node) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _scan():
    """(file, function, kind, detail) for every NCCL construction, Options() and net_name assignment."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for fn in _functions(tree):
            bound = {}     # name -> the function called to produce it
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    for t in node.targets:
                        if isinstance(t, ast.Name):
                            bound[t.id] = _name(node.value.func)
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    callee = _name(node.func)
                    if callee == "ProcessGroupNCCL":
                        opts = node.args[3] if len(node.args) > 3 else next(
                            (k.value for k in node.keywords if k.arg == "options"), None)
                        source = bound.get(opts.id) if isinstance(opts, ast.Name) else None
                        found.append((path, fn.name, "construct", source))
                    elif callee == "Options" and isinstance(node.func, ast.Attribute):
                        owner = _name(node.func.value)
                        if "nccl" in owner.lower():
                            found.append((path, fn.name, "options", owner))
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        if isinstance(t, ast.Attribute) and t.attr == "net_name":
                            found.append((path, fn.name, "net_name=", None))
    return found


def test_every_nccl_construction_gets_its_options_from_the_policy():
    found = _scan()
    constructs = [f for f in found if f[2] == "construct"]
    assert constructs, "the scan must see the shim's ProcessGroupNCCL construction"
    for path, fn, _, source in constructs:
        assert source == "nccl_options", f"{path.relative_to(PACKAGE)}:{fn} builds ProcessGroupNCCL with options " \
                                         f"from {source!r}, not from runtime.netselect.nccl_options"
    others = [(p.relative_to(PACKAGE), fn, kind) for p, fn, kind, _ in found
              if kind != "construct" and not (p == POLICY_FILE and fn == "nccl_options")]
    assert others == [], f"NCCL Options built or net_name set outside the group policy: {others}"


def test_shim_vendor_subgroups_get_the_policys_network(plan8, monkeypatch, tmp_path):
    import torch.distributed as dist
    from het_plugin.comm import ShimOptions
    from het_plugin.comm import shim
    built = []

    class Options:
        def __init__(self):
            self.config = types.SimpleNamespace()

    class RecordingNCCL:
        def __init__(self, store, rank, size, options):
            built.append(options)
    RecordingNCCL.Options = Options
    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordingNCCL, raising=False)
    options = ShimOptions.from_plan(plan8)
    policy = Policy("nccl")
    seen = set()
    subsets = [g.ranks for gs in plan8.groups.values() for g in gs] + [list(range(plan8.world_size))]
    for ranks in subsets:
        shim._make_native("nccl", None, 0, len(ranks), timedelta(seconds=5), shim._subgroup_net_name(options, ranks))
        want = spec_for(plan8, ranks, policy, pg_options=Options()).net_name
        got = getattr(built[-1].config, "net_name", None)
        assert got == want, (ranks, got, want)
        assert built[-1]._timeout == timedelta(seconds=5)
        seen.add(got)
    assert seen == {None, "Socket"}, "subgroups crossing fabrics are Socket, the rest keep NCCL's choice"
