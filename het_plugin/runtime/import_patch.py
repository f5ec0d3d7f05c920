"""Patch one module right after it loads: the finder both import-time hooks (Megatron-LM, DeepSpeed) put on
``sys.meta_path``.

It finds nothing itself. Asked for its target, it asks the finders after it for the real spec and wraps that
spec's loader so the module runs as usual and ``patch(module)`` is called before anyone else sees it. Standard
library only: the hooks are imported at interpreter start-up and must not pull in torch or a framework.
"""
from __future__ import annotations

import sys
from importlib.abc import Loader, MetaPathFinder
from typing import Callable


class _PatchingLoader(Loader):
    def __init__(self, inner, patch: Callable):
        self.inner = inner
        self.patch = patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)

    def __getattr__(self, name):           # get_source, get_code, ... for tracebacks and tools
        return getattr(self.inner, name)


class PatchOnLoad(MetaPathFinder):
    """A finder for ``target`` alone: the spec the other finders give, with ``patch`` run after the module.

    Subclasses set ``target`` and define :meth:`patch` (and :meth:`active` where the hook depends on the command
    line). ``skips(finder)`` names finders not to ask (other hooks' triggers for the same module)."""

    target: str = ""

    def active(self) -> bool:
        return True

    def patch(self, module) -> None:
        raise NotImplementedError

    def skips(self, finder) -> bool:
        return False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.target or not self.active():
            return None
        return self.real_spec(fullname, path, target)

    def real_spec(self, fullname, path=None, target=None, also_skip=()):
        """The spec the other finders on ``sys.meta_path`` give, its loader wrapped (None: nobody has it)."""
        for finder in list(sys.meta_path):
            if finder is self or finder in also_skip or isinstance(finder, type(self)) or self.skips(finder) \
                    or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, self.patch)
                return spec
        return None
