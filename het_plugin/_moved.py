"""Import paths from before the layout of docs/architecture.md, kept for one release.

``import het_plugin.cost`` (and ``from het_plugin.plan import Plan``, ``mock.patch("het_plugin.cost.X")``)
give the very module at its new path: one module object under two names, so no state is duplicated.
Only the paths the docs showed users are kept.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

MOVED = {
    "het_plugin.cost": "het_plugin.core.cost",
    "het_plugin.data": "het_plugin.core.ranks.batches",
    "het_plugin.plan": "het_plugin.core.plan",
    "het_plugin.planner": "het_plugin.core.planner",
    "het_plugin.cluster": "het_plugin.core.inputs.cluster",
    "het_plugin.netselect": "het_plugin.runtime.netselect",
    "het_plugin.errors": "het_plugin.core.errors",
}


class _Alias:
    """A loader whose module is the one at the new path."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass


class MovedFinder:
    """Finds only the old names in :data:`MOVED`; every other import passes by."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        spec = importlib.util.find_spec(new)
        return importlib.util.spec_from_loader(fullname, _Alias(new), is_package=spec.submodule_search_locations is not None)


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
