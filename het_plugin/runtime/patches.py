"""The one way het_plugin replaces a framework's attribute (a function, a class, an engine's method) in a
running process.

Both adapters patch framework objects at a few sites: modules and classes (Megatron's schedule functions, its
sampler and argument parser, DeepSpeed's pipeline p2p, ...) and the instances DeepSpeed hands back (an engine's
``backward``, its instruction map, ...). Each goes through :data:`PATCHES`, which keeps one stack of layers per
attribute, so:

* applying is idempotent per label (a second ``apply`` of the same label on the same attribute is a no-op);
* each layer is a wrapper factory ``make(inner) -> replacement``; the stack is composed over the framework's own
  attribute in the order of the layers' ``order`` (then of application): two hooks give the same composition
  whichever is installed first;
* ``original(owner, name)`` is the framework's own attribute under any stack of het_plugin's patches;
* ``undo(label)`` takes one label's layers away and re-composes the other labels' layers over the framework's
  own attribute: the order in which a process takes hooks away does not matter;
* an attribute the owner did not hold itself (an instance's method, found on its class) is deleted again on
  undo, so the instance reads its class's attribute as before;
* every change happens under one lock (a thread applying while another undoes cannot interleave).

An attribute that something else replaced after het_plugin (not a het_plugin patch) is left as it is, and
het_plugin's records of it are dropped (a later ``apply`` patches what is there now).

The stacks of an instance (not a module or class) live in the instance itself and the registry holds it weakly:
an engine's patches go when the engine goes.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

#: Layer orders: hooks that change what a call does sit next to the framework's own (``BEHAVIOUR``), hooks that
#: only observe it (timers) around them (``OBSERVE``), whichever was installed first.
BEHAVIOUR = 10
OBSERVE = 20

#: where an instance keeps its stacks (its own ``__dict__``)
_INSTANCE_KEY = "_het_plugin_patches"
_ABSENT = object()


@dataclass
class Patch:
    """One layer: ``make(inner)`` gave ``replacement`` over ``original`` (the layer below, or the framework's)."""
    owner: Any
    name: str
    original: Any
    replacement: Any
    make: Callable[[Any], Any]
    label: str
    order: int = 0
    seq: int = 0


@dataclass
class _Stack:
    """One attribute's layers, innermost first, over the framework's own value (``own``: what the owner held
    itself, or _ABSENT when the attribute came from its class)."""
    owner: Any
    name: str
    framework: Any
    own: Any
    layers: list[Patch] = field(default_factory=list)

    @property
    def top(self) -> Any:
        return self.layers[-1].replacement if self.layers else self.framework


def _held_by_instance(owner: Any) -> bool:
    """An instance with a ``__dict__`` that can be weakly referenced keeps its own stacks."""
    if isinstance(owner, (type, types.ModuleType)) or not isinstance(getattr(owner, "__dict__", None), dict):
        return False
    try:
        weakref.ref(owner)
    except TypeError:
        return False
    return True


def _own(owner: Any, name: str) -> Any:
    """What the owner itself holds under ``name`` (restored by undo), _ABSENT when it reads it from its class;
    an owner without a ``__dict__`` (slots): what it reads now."""
    held = getattr(owner, "__dict__", None)
    return getattr(owner, name) if held is None else held.get(name, _ABSENT)


class PatchRegistry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._static: dict[int, dict[str, _Stack]] = {}           # modules, classes: held for the process
        self._instances: dict[int, weakref.ref] = {}              # instances: their stacks live in them
        self._seq = itertools.count()

    # ---- the stacks -----------------------------------------------------------------------------------------

    def _stacks(self, owner: Any, create: bool = False) -> Optional[dict[str, _Stack]]:
        if not _held_by_instance(owner):
            return self._static.setdefault(id(owner), {}) if create else self._static.get(id(owner))
        held = vars(owner).get(_INSTANCE_KEY)
        if held is None and create:
            held = vars(owner)[_INSTANCE_KEY] = {}
            key = id(owner)
            self._instances[key] = weakref.ref(owner, lambda _ref, key=key: self._instances.pop(key, None))
        return held

    def _stack(self, owner: Any, name: str) -> Optional[_Stack]:
        """The live stack of ``owner.name``; a stack that something else replaced since is forgotten."""
        stacks = self._stacks(owner)
        stack = None if stacks is None else stacks.get(name)
        if stack is not None and getattr(owner, name) is not stack.top:
            # something else replaced the attribute since (a test's monkeypatch, another tool): ours are gone
            del stacks[name]
            return None
        return stack

    def _owners(self) -> Iterator[tuple[Any, dict[str, _Stack]]]:
        for stacks in list(self._static.values()):
            for stack in list(stacks.values()):
                yield stack.owner, stacks
                break
        for ref in list(self._instances.values()):
            owner = ref()
            if owner is not None and vars(owner).get(_INSTANCE_KEY):
                yield owner, vars(owner)[_INSTANCE_KEY]

    def _compose(self, stack: _Stack, start: int) -> None:
        """(Re)make the layers from ``start`` outwards and put the top in place (the framework's own when empty)."""
        inner = stack.layers[start - 1].replacement if start else stack.framework
        for layer in stack.layers[start:]:
            layer.original, layer.replacement = inner, layer.make(inner)
            inner = layer.replacement
        if stack.layers:
            setattr(stack.owner, stack.name, inner)
        elif stack.own is _ABSENT:
            delattr(stack.owner, stack.name)
        else:
            setattr(stack.owner, stack.name, stack.own)

    # ---- the interface -------------------------------------------------------------------------------------

    def apply(self, owner: Any, name: str, make: Callable[[Any], Any], *, label: str, order: int = 0) -> Any:
        """Put ``make`` in ``owner.name``'s stack (at its ``order``: lower is nearer the framework's own; equal
        orders stack in order of application), unless this label's layer is already there; returns what is in
        place."""
        with self._lock:
            stack = self._stack(owner, name)
            if stack is None:
                stack = _Stack(owner, name, getattr(owner, name), _own(owner, name))
                self._stacks(owner, create=True)[name] = stack
            elif any(p.label == label for p in stack.layers):
                return stack.top
            layer = Patch(owner, name, None, None, make, label, order, next(self._seq))
            at = sum((p.order, p.seq) < (order, layer.seq) for p in stack.layers)
            stack.layers.insert(at, layer)
            self._compose(stack, at)
            return stack.top

    def patch(self, owner: Any, name: str, label: str) -> Optional[Patch]:
        """This label's layer on ``owner.name``, if it is applied."""
        with self._lock:
            stack = self._stack(owner, name)
            return None if stack is None else next((p for p in stack.layers if p.label == label), None)

    def original(self, owner: Any, name: str) -> Any:
        """``owner.name`` as it was before any of het_plugin's patches."""
        with self._lock:
            stack = self._stack(owner, name)
            return getattr(owner, name) if stack is None else stack.framework

    def labels(self, owner: Any, name: str) -> list[str]:
        """The labels patched on ``owner.name``, innermost first."""
        with self._lock:
            stack = self._stack(owner, name)
            return [] if stack is None else [p.label for p in stack.layers]

    def undo(self, label: str, owner: Any = None) -> int:
        """Take away every layer of ``label`` (of ``owner`` only, when given) and re-compose the others over
        the framework's own attribute; returns how many were taken away."""
        with self._lock:
            removed = 0
            owners = list(self._owners()) if owner is None else [(owner, self._stacks(owner) or {})]
            for held_by, stacks in owners:
                for name, stack in list(stacks.items()):
                    at = next((i for i, p in enumerate(stack.layers) if p.label == label), None)
                    if at is None:
                        continue
                    removed += 1
                    if self._stack(held_by, name) is None:
                        continue                     # replaced by something other than het_plugin: leave it
                    del stack.layers[at]
                    self._compose(stack, at)
                    if not stack.layers:
                        del stacks[name]
                if not stacks:
                    self._forget(held_by)
            return removed

    def _forget(self, owner: Any) -> None:
        """``owner`` has no stacks left: drop its (empty) table."""
        if _held_by_instance(owner):
            vars(owner).pop(_INSTANCE_KEY, None)
            self._instances.pop(id(owner), None)
        else:
            self._static.pop(id(owner), None)

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
