"""The one way het_plugin replaces a framework's attribute (a function, a class) in a running process.

Both adapters patch framework objects at a few sites (Megatron's schedule functions, its sampler and argument
parser, DeepSpeed's pipeline p2p, ...). Each goes through :data:`PATCHES`, which records what it replaced, so:

* applying is idempotent per label (a second ``apply`` of the same label on the same attribute is a no-op);
* ``original(owner, name)`` is the framework's own attribute under any stack of het_plugin's patches;
* ``undo(label)`` takes one label's patches away, in reverse order of application, and keeps the patches of
  other labels that were applied on top of them (re-made over the restored attribute): the order in which a
  process takes hooks away no longer matters;
* every change happens under one lock (a thread applying while another undoes cannot interleave).

An attribute that something else replaced after het_plugin (not a het_plugin patch) is left as it is, and
het_plugin's records of it are dropped (a later ``apply`` patches what is there now).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence


@dataclass
class Patch:
    """One replacement: ``owner.name`` was ``original`` and is ``replacement``, made by ``make(original)``."""
    owner: Any
    name: str
    original: Any
    replacement: Any
    make: Callable[[Any], Any]
    label: str


class PatchRegistry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._patches: list[Patch] = []

    def apply(self, owner: Any, name: str, make: Callable[[Any], Any], *, label: str) -> Any:
        """Replace ``owner.name`` by ``make(current)``, unless this label's patch is already in place there;
        returns what is in place."""
        with self._lock:
            current = getattr(owner, name)
            stack = [p for p in self._patches if p.owner is owner and p.name == name]
            if stack and current is not stack[-1].replacement:
                # something else replaced the attribute since (a test's monkeypatch, another tool): ours are gone
                gone = {id(p) for p in stack}
                self._patches = [p for p in self._patches if id(p) not in gone]
            elif self.patch(owner, name, label) is not None:
                return current
            replacement = make(current)
            setattr(owner, name, replacement)
            self._patches.append(Patch(owner, name, current, replacement, make, label))
            return replacement

    def patch(self, owner: Any, name: str, label: str) -> Optional[Patch]:
        """This label's patch of ``owner.name``, if it is applied."""
        with self._lock:
            return next((p for p in self._patches if p.owner is owner and p.name == name and p.label == label),
                        None)

    def original(self, owner: Any, name: str) -> Any:
        """``owner.name`` as it was before any of het_plugin's patches."""
        with self._lock:
            first = next((p for p in self._patches if p.owner is owner and p.name == name), None)
            return getattr(owner, name) if first is None else first.original

    def labels(self, owner: Any, name: str) -> list[str]:
        """The labels patched on ``owner.name``, innermost first."""
        with self._lock:
            return [p.label for p in self._patches if p.owner is owner and p.name == name]

    def undo(self, label: str) -> int:
        """Take away every patch of ``label`` (reverse order); returns how many were taken away."""
        with self._lock:
            targets = {(id(p.owner), p.name) for p in self._patches if p.label == label}
            removed = 0
            for key in targets:
                stack = [p for p in self._patches if (id(p.owner), p.name) == key]
                owner, name = stack[0].owner, stack[0].name
                ids = {id(p) for p in stack}
                if getattr(owner, name) is not stack[-1].replacement:
                    # replaced by something other than het_plugin since: leave it, forget ours
                    self._patches = [p for p in self._patches if id(p) not in ids or p.label != label]
                    removed += sum(p.label == label for p in stack)
                    continue
                for p in reversed(stack):            # peel to the framework's own, newest first
                    setattr(owner, name, p.original)
                self._patches = [p for p in self._patches if id(p) not in ids]
                for p in stack:                      # re-make the other labels' patches, oldest first
                    if p.label == label:
                        removed += 1
                        continue
                    self.apply(owner, name, p.make, label=p.label)
            return removed

    @contextlib.contextmanager
    def temporarily(self, label: str, patches: Sequence[tuple[Any, str, Callable[[Any], Any]]]) -> Iterator[None]:
        """``(owner, name, make)`` patches for the duration of a block (e.g. while a framework builds its groups),
        under the registry's lock throughout: no other thread patches or undoes meanwhile."""
        with self._lock:
            try:
                for owner, name, make in patches:
                    self.apply(owner, name, make, label=label)
                yield
            finally:
                self.undo(label)


#: The process's one registry (module state, listed in docs/architecture.md).
PATCHES = PatchRegistry()
