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
