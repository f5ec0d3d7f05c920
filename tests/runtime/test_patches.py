"""The one patch registry (runtime.patches): idempotent per label, the framework's original under any stack of
patches, and undo in any order that keeps the other labels' patches."""
import threading
import types

from het_plugin.runtime.patches import PatchRegistry


def wrapper(tag):
    def make(fn):
        def wrapped(*a):
            return (tag, fn(*a))
        return wrapped
    return make


def module():
    return types.SimpleNamespace(f=lambda: "own")


def test_apply_is_idempotent_per_label_and_keeps_the_original():
    reg, m = PatchRegistry(), module()
    own = m.f
    first = reg.apply(m, "f", wrapper("a"), label="a")
    assert reg.apply(m, "f", wrapper("a"), label="a") is first and m.f() == ("a", "own")
    reg.apply(m, "f", wrapper("b"), label="b")
    assert m.f() == ("b", ("a", "own")) and reg.original(m, "f") is own and reg.labels(m, "f") == ["a", "b"]


def test_undoing_the_inner_label_keeps_the_outer_one():
    reg, m = PatchRegistry(), module()
    reg.apply(m, "f", wrapper("inner"), label="inner")
    reg.apply(m, "f", wrapper("outer"), label="outer")
    assert reg.undo("inner") == 1
    assert m.f() == ("outer", "own") and reg.labels(m, "f") == ["outer"]
    assert reg.undo("outer") == 1 and m.f() == "own" and reg.labels(m, "f") == []
    assert reg.undo("outer") == 0


def test_undo_in_either_order_restores_the_framework():
    for order in (("a", "b"), ("b", "a")):
        reg, m = PatchRegistry(), module()
        own = m.f
        reg.apply(m, "f", wrapper("a"), label="a")
        reg.apply(m, "f", wrapper("b"), label="b")
        for label in order:
            reg.undo(label)
        assert m.f is own


def test_a_foreign_replacement_is_left_in_place():
    reg, m = PatchRegistry(), module()
    reg.apply(m, "f", wrapper("a"), label="a")
    foreign = lambda: "someone else"          # noqa: E731
    m.f = foreign
    assert reg.undo("a") == 1 and m.f is foreign and reg.labels(m, "f") == []


def test_concurrent_applies_wrap_once():
    reg, m = PatchRegistry(), module()
    made = []

    def make(fn):
        made.append(fn)
        return wrapper("a")(fn)

    threads = [threading.Thread(target=reg.apply, args=(m, "f", make), kwargs={"label": "a"}) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and m.f() == ("a", "own")


def test_after_a_foreign_replacement_apply_patches_what_is_there_now():
    reg, m = PatchRegistry(), module()
    reg.apply(m, "f", wrapper("a"), label="a")
    m.f = lambda: "someone else"              # e.g. a test's monkeypatch
    reg.apply(m, "f", wrapper("a"), label="a")
    assert m.f() == ("a", "someone else") and reg.labels(m, "f") == ["a"]


def test_the_composition_does_not_depend_on_the_install_order():
    """Layers compose by their order (lower: nearer the framework's own), whichever was applied first."""
    composed = []
    for first, second in (("inner", "outer"), ("outer", "inner")):
        reg, m = PatchRegistry(), module()
        own = m.f
        orders = {"inner": 10, "outer": 20}
        for label in (first, second):
            reg.apply(m, "f", wrapper(label), label=label, order=orders[label])
        composed.append((m.f(), reg.labels(m, "f")))
        assert reg.original(m, "f") is own
    assert composed[0] == composed[1] == (("outer", ("inner", "own")), ["inner", "outer"])


class Engine:
    """An instance whose method comes from its class (a framework's engine)."""

    def __init__(self):
        self.scale = 2

    def backward(self, x):
        return x * self.scale


def test_an_instance_method_is_patched_on_the_instance_and_read_from_the_class_again_after_undo():
    reg, engine, other = PatchRegistry(), Engine(), Engine()
    reg.apply(engine, "backward", wrapper("a"), label="a")
    assert engine.backward(3) == ("a", 6) and other.backward(3) == 6        # the class is untouched
    assert reg.original(engine, "backward") == Engine.backward.__get__(engine)
    assert reg.labels(engine, "backward") == ["a"] and reg.labels(other, "backward") == []
    assert reg.undo("a") == 1
    assert "backward" not in vars(engine) and engine.backward(3) == 6


def test_undo_of_one_owner_keeps_the_label_on_the_others():
    reg, a, b = PatchRegistry(), Engine(), Engine()
    for engine in (a, b):
        reg.apply(engine, "backward", wrapper("x"), label="x")
    assert reg.undo("x", owner=a) == 1
    assert (a.backward(1), b.backward(1)) == (2, ("x", 2))
    assert reg.undo("x") == 1 and b.backward(1) == 2


def test_undo_in_any_order_re_makes_the_rest_over_the_framework():
    labels = {"a": 10, "b": 20, "c": 30}
    for undo_order in (("a", "b", "c"), ("c", "a", "b"), ("b", "c", "a")):
        reg, engine = PatchRegistry(), Engine()
        for label in ("c", "a", "b"):
            reg.apply(engine, "backward", wrapper(label), label=label, order=labels[label])
        left = ["a", "b", "c"]
        for label in undo_order:
            reg.undo(label)
            left.remove(label)
            expected = 6
            for kept in left:
                expected = (kept, expected)
            assert engine.backward(3) == expected and reg.labels(engine, "backward") == left
        assert "backward" not in vars(engine)


def test_an_instances_patches_go_with_the_instance():
    import gc
    import weakref
    reg, engine = PatchRegistry(), Engine()
    reg.apply(engine, "backward", wrapper("a"), label="a")
    gone = weakref.ref(engine)
    del engine
    gc.collect()
    assert gone() is None and reg.undo("a") == 0
