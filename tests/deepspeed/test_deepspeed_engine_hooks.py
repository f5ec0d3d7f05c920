"""DeepSpeed's engine-instance hooks (the replica split's loss scaling, the measured profile's timers) are layers
of the one patch registry: the same composition whichever is installed first, and each can be taken off in any
order, leaving the engine reading DeepSpeed's own methods again."""
from __future__ import annotations

import dataclasses
import types

import pytest

deepspeed = pytest.importorskip("deepspeed")
import torch  # noqa: E402
from deepspeed.runtime.pipe import schedule  # noqa: E402

from het_plugin.core.inputs.cluster import cluster_from_dict  # noqa: E402
from het_plugin.core.planner import assemble_plan  # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims  # noqa: E402
from het_plugin.core.ranks.placement import place  # noqa: E402
from het_plugin.deepspeed import recorder_hooks, replicas  # noqa: E402
from het_plugin.runtime.patches import PATCHES  # noqa: E402
from het_plugin.runtime.recorder import ProfileRecorder, ProfileSettings  # noqa: E402
from het_plugin.runtime.replicas import ReplicaShare  # noqa: E402
from tests.core.test_measured import FakeClock  # noqa: E402
from tests.deepspeed.test_deepspeed_config import TINY, hetero_cluster  # noqa: E402

HOOKED = ("forward", "backward", "step", "allreduce_gradients", "_backward_prologue_per_tensor",
          "_scale_loss_by_gas", "save_checkpoint")


@pytest.fixture
def uneven():
    cluster = cluster_from_dict(hetero_cluster())
    even = assemble_plan(cluster, TINY, place(cluster, ParallelDims(pp=2, dp=2)), [5, 3], 2)
    return dataclasses.replace(even, replica_micro_batches=[3, 1])


class Engine:
    """DeepSpeed's engine as the hooks see it: each call records what reached DeepSpeed's own method; the clock
    advances one second per backward and two per reduction."""

    def __init__(self, clock):
        self.clock, self.calls, self.micro, self.training = clock, [], 0, True
        self._config = types.SimpleNamespace(train_batch_size=12)

    def forward(self, x):
        return x

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        self.calls.append(("backward", loss, scale_wrt_gas))
        self.clock.now += 1.0
        if self.is_gradient_accumulation_boundary():
            self.allreduce_gradients()

    def allreduce_gradients(self):
        self.clock.now += 2.0

    def _backward_prologue_per_tensor(self, grad):
        return grad / 3                                   # DeepSpeed's grad / gas

    def deepspeed_io(self, dataset, batch_size=None, route="train", data_sampler=None):
        return dataset

    def _scale_loss_by_gas(self, prescaled_loss, eval_micro_batches=None):
        return prescaled_loss / (eval_micro_batches or 3)

    def is_gradient_accumulation_boundary(self):
        return (self.micro + 1) % 3 == 0

    def step(self):
        self.micro += 1

    def save_checkpoint(self, path):
        return path


def recorder(plan, tmp_path, clock):
    return ProfileRecorder(plan, 0, ProfileSettings(str(tmp_path / "m.yaml"), warmup=0), "DeepSpeed",
                           clock=clock, exit_handler=False)


def install(engine, order, share, rec):
    steps = {"replicas": lambda: replicas.apply_replica_split(engine, share),
             "recorder": lambda: (recorder_hooks._engine_hooks(engine, rec),
                                  recorder_hooks._left_out(engine, rec, ("save_checkpoint",)))}
    for name in order:
        steps[name]()


def run(engine, iterations=2):
    for _ in range(3 * iterations):
        engine.backward(engine.forward(6.0))
        engine.step()
    return engine._backward_prologue_per_tensor(6.0), engine._scale_loss_by_gas(6.0)


def test_replicas_and_recorder_compose_the_same_in_either_order(uneven, tmp_path):
    share = ReplicaShare.from_plan(uneven, next(r for r in range(4) if uneven.replica_of(r) == 0))
    assert (share.count, share.even_count) == (3, 2)
    seen = []
    for order in (("replicas", "recorder"), ("recorder", "replicas")):
        clock = FakeClock()
        engine = Engine(clock)
        rec = recorder(uneven, tmp_path, clock)
        install(engine, order, share, rec)
        scaled = run(engine)
        t = rec.timer.totals()
        seen.append((engine.calls, scaled, (t.iterations, t.micro_batches, t.backward_s),
                     [PATCHES.labels(engine, name) for name in HOOKED]))
    first = seen[0]
    # DeepSpeed's backward gets loss / n (n = the even count 2), its own division by gas turned off
    assert first[0] == [("backward", 3.0, False)] * 6
    assert first[1] == (3.0, 3.0)                          # grad / n and the pipeline loss / n
    assert first[2] == (2, 6, pytest.approx(6.0))          # backward timed, the reductions taken out
    assert first[3][:3] == [["deepspeed.recorder"], ["deepspeed.replicas", "deepspeed.recorder"],
                            ["deepspeed.recorder"]]
    assert seen[1] == first


@pytest.mark.parametrize("undo", [("replicas", "recorder"), ("recorder", "replicas")])
def test_either_hook_comes_off_in_any_order(uneven, tmp_path, undo):
    share = ReplicaShare.from_plan(uneven, next(r for r in range(4) if uneven.replica_of(r) == 0))
    clock = FakeClock()
    engine = Engine(clock)
    rec = recorder(uneven, tmp_path, clock)
    install(engine, ("recorder", "replicas"), share, rec)
    off = {"replicas": replicas.remove_replica_split, "recorder": recorder_hooks.uninstall}
    assert off[undo[0]](engine) > 0
    run(engine, iterations=1)
    t = rec.timer.totals()
    if undo[0] == "replicas":                              # DeepSpeed's own scaling, still timed
        assert engine.calls == [("backward", 6.0, True)] * 3 and t.micro_batches == 3
    else:                                                  # still scaled, no longer timed
        assert engine.calls == [("backward", 3.0, False)] * 3 and t.micro_batches == 0
    assert off[undo[1]](engine) > 0
    assert not (set(HOOKED) | {"_het_plugin_patches"}) & set(vars(engine))   # DeepSpeed's own methods again
    assert all(PATCHES.labels(engine, name) == [] for name in HOOKED)


def test_pipeline_instruction_map_layers_compose_the_same_in_either_order(uneven, tmp_path):
    """The last stage's backward instruction: loss x count / n (replicas) inside the backward timer (recorder),
    on the engine's own copy of the map; undone, the engine reads DeepSpeed's class map again."""
    share = ReplicaShare.from_plan(uneven, next(r for r in range(4) if uneven.replica_of(r) == 0))

    class Pipe(Engine):
        _INSTRUCTION_MAP = {schedule.ForwardPass: lambda self, buffer_id: None,
                            schedule.BackwardPass: lambda self, buffer_id: self.calls.append(float(self.loss))}

        def is_last_stage(self):
            return True

        def train_batch(self, data_iter=None):
            self._INSTRUCTION_MAP[schedule.ForwardPass](self, 0)
            self._INSTRUCTION_MAP[schedule.BackwardPass](self, 0)

    results = []
    for order in (("replicas", "recorder"), ("recorder", "replicas")):
        clock = FakeClock()
        engine = Pipe(clock)
        rec = recorder(uneven, tmp_path, clock)
        for name in order:
            if name == "replicas":
                replicas.apply_replica_split(engine, share)
            else:
                recorder_hooks._pipeline_hooks(engine, rec)
        engine.loss = torch.tensor(2.0)
        engine.train_batch()
        results.append((engine.calls, rec.timer.totals().micro_batches, PATCHES.labels(engine, "_INSTRUCTION_MAP")))
        assert Pipe._INSTRUCTION_MAP is not engine._INSTRUCTION_MAP
        replicas.remove_replica_split(engine)
        recorder_hooks.uninstall(engine)
        assert engine._INSTRUCTION_MAP is Pipe._INSTRUCTION_MAP and "train_batch" not in vars(engine)
    assert results[0] == results[1] == ([3.0], 1, ["deepspeed.replicas", "deepspeed.recorder"])
