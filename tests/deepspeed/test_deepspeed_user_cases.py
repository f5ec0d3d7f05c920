"""Issue 33 without a process group: the tied-weight broadcast source, the script's own topology objects, and the
samplers of loaders handed to an engine under an uneven replica split (4 ranks, a plan that permutes them)."""
from __future__ import annotations

import dataclasses
import types

import pytest

deepspeed = pytest.importorskip("deepspeed")
import torch  # noqa: E402
from deepspeed.runtime.dataloader import DeepSpeedDataLoader  # noqa: E402
from deepspeed.runtime.pipe.module import PipelineModule  # noqa: E402
from deepspeed.runtime.pipe.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,  # noqa: E402
                                             ProcessTopology)

from het_plugin.core.errors import ConfigError  # noqa: E402
from het_plugin.core.inputs.cluster import cluster_from_dict  # noqa: E402
from het_plugin.core.planner import assemble_plan  # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims  # noqa: E402
from het_plugin.core.ranks.placement import place  # noqa: E402
from het_plugin.deepspeed import hook, samplers, script_topology  # noqa: E402
from het_plugin.deepspeed.process_topology import PlanTopology  # noqa: E402
from het_plugin.deepspeed.replicas import ReplicaSampleOrder, ReplicaShare, shuffled_order  # noqa: E402
from het_plugin.deepspeed.tied import first_stage_source, start_tied_weights_on_first_stage  # noqa: E402
from het_plugin.runtime.patches import PATCHES  # noqa: E402
from tests.deepspeed.test_deepspeed_config import TINY, hetero_cluster  # noqa: E402


@pytest.fixture
def plan():
    """pp=2 x dp=2, stage 0 on launch ranks 1 and 3 (the lowest rank of each pipeline is on the last stage)."""
    cluster = cluster_from_dict(hetero_cluster())
    placement = place(cluster, ParallelDims(pp=2, dp=2), domain_order=list(reversed(cluster.domains)))
    made = assemble_plan(cluster, TINY, placement, [5, 3], 2)
    assert made.stage_ranks(0) == [1, 3] and not made.is_identity
    return made


# ---- tied weights ------------------------------------------------------------------------------------------

def test_tied_groups_broadcast_from_their_first_stage(plan, monkeypatch):
    """DeepSpeed's own loop runs; only the source changes: min(ranks) would be rank 0, a last-stage rank."""
    import deepspeed.comm as ds_comm
    pipelines = [plan.group_of("pp", r).ranks for r in (1, 3)]          # stage order: [1, 0] and [3, 2]
    assert [first_stage_source(plan, p) for p in pipelines] == [1, 3]
    assert [min(p) for p in pipelines] == [0, 2]                        # what DeepSpeed picks on this placement
    sent = []
    monkeypatch.setattr(ds_comm, "broadcast", lambda tensor, src, group=None, **kw: sent.append((src, group)))
    weight = torch.nn.Linear(2, 2)
    group = object()
    module = types.SimpleNamespace(tied_comms={"embed": {"ranks": pipelines[0], "group": group,
                                                         "weight_attr": ["weight"], "module": weight}},
                                   _recursive_getattr=PipelineModule._recursive_getattr)

    class Module(types.SimpleNamespace):
        _synchronize_tied_weights = PipelineModule._synchronize_tied_weights
    module = Module(**vars(module))
    start_tied_weights_on_first_stage(module, plan)
    module._synchronize_tied_weights()
    assert sent == [(1, group)]
    assert PATCHES.labels(ds_comm, "broadcast") == []                  # the broadcast patch lasted the call only
    PipelineModule._synchronize_tied_weights(module)                   # DeepSpeed's own choice, for contrast
    assert sent[-1] == (0, group)


# ---- the script's own topology ---------------------------------------------------------------------------

@pytest.fixture
def tracked():
    script_topology.forget()
    script_topology.track(hook.LABEL)
    yield
    script_topology.forget()


def test_a_topology_the_script_built_reads_the_plans_coordinates(plan, tracked):
    mine = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)
    two_axes = PipeDataParallelTopology(num_pp=2, num_dp=2)
    other = ProcessTopology(axes=["x", "y"], dims=[2, 3])             # not about this run: left alone
    untouched = dict(other.mapping)
    script_topology.check(plan)
    script_topology.adopt(plan)
    later = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)    # built after the plan: placed at once
    reference = PlanTopology(plan)
    for topo in (mine, two_axes, later):
        for rank in range(4):
            coord = topo.get_coord(rank)
            assert (coord.pipe, coord.data) == (plan.coord(rank)["pp"], plan.coord(rank)["dp"])
        assert topo.get_axis_comm_lists("data") == reference.get_axis_comm_lists("data")
        assert topo.get_axis_comm_lists("pipe") == [g.ranks for g in plan.groups["pp"]]
    assert other.mapping == untouched
    assert mine.get_coord(1).data == 0 and mine.get_coord(1).pipe == 0          # launch order would say 1, 0
    script_topology.adopt(plan)                                                  # once per object
    assert mine.get_coord(1).pipe == 0


def test_after_forget_plan_a_new_topology_keeps_the_launch_order(plan, tracked):
    """A process that trains another configuration after a het_plugin one (the benchmarks do): once
    ``het_plugin.deepspeed.forget_plan()`` ran, a topology built next is DeepSpeed's launch order again; before
    it, the plan still places it (seen as a silent leak into the benchmark's stock DeepSpeed runs)."""
    import het_plugin.deepspeed as hds
    script_topology.adopt(plan)
    still = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)
    moved = [r for r in range(4) if (still.get_coord(r).pipe, still.get_coord(r).data) != (r // 2, r % 2)]
    assert moved, "the plan should move ranks (else this test shows nothing)"
    hds.forget_plan()
    fresh = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)
    assert [(fresh.get_coord(r).pipe, fresh.get_coord(r).data) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_topology_that_cannot_take_the_plan_stops_the_run_naming_it(plan, tracked):
    four = PipeDataParallelTopology(num_pp=1, num_dp=4)       # "data rank = rank": 4 replicas, the plan has 2
    with pytest.raises(ConfigError) as info:
        script_topology.check(plan)
    text = str(info.value)
    assert "PipeDataParallelTopology(pipe=1, data=4) built at " + __file__ in text
    assert "pp=1, dp=4, tp=1, but the plan has pp=2, dp=2, tp=1" in text
    assert "engine.grid.get_data_parallel_rank()" in text and "num_pp=2, num_mp=1, num_dp=2" in text
    del four
    script_topology.adopt(plan)
    with pytest.raises(ConfigError, match="PipeModelDataParallelTopology"):     # built after: refused on creation
        PipeModelDataParallelTopology(num_pp=4, num_mp=1, num_dp=1)


def test_identity_plans_leave_topologies_alone(tracked):
    cluster = cluster_from_dict(hetero_cluster())
    identity = assemble_plan(cluster, TINY, place(cluster, ParallelDims(pp=2, dp=2)), [5, 3], 2)
    identity = dataclasses.replace(identity, rank_of_logical=tuple(range(4)))
    assert identity.is_identity
    odd = PipeDataParallelTopology(num_pp=1, num_dp=4)
    script_topology.check(identity)
    script_topology.adopt(identity)
    assert odd.get_coord(3).data == 3


# ---- samplers under an uneven replica split -------------------------------------------------------------

class Strided(torch.utils.data.Sampler):
    """A script's own even split: every dp-th sample from its data rank."""

    def __init__(self, n, rank, dp):
        self.indices = list(range(rank, n, dp))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


@pytest.fixture
def share(plan):
    uneven = dataclasses.replace(plan, replica_micro_batches=[3, 1])
    return ReplicaShare.from_plan(uneven, uneven.stage_ranks(0)[0])


def test_any_sampler_but_the_replicas_range_is_refused(share):
    data = list(range(32))
    refused = [torch.utils.data.DataLoader(data, batch_size=2, sampler=Strided(32, 0, 2)),
               torch.utils.data.DataLoader(data, batch_size=2),                        # SequentialSampler
               torch.utils.data.DataLoader(data, batch_size=2, shuffle=True),          # RandomSampler
               DeepSpeedDataLoader(data, batch_size=2, pin_memory=False, local_rank=0, tput_timer=None,
                                   data_sampler=Strided(32, 0, 2))]
    for loader in refused:
        for given in (loader, deepspeed.utils.RepeatingLoader(loader)):
            with pytest.raises(ConfigError) as info:
                samplers.refuse_unranged(given, share)
            assert "replica 0 runs 3 micro-batches" in str(info.value)
            assert "replica_sampler(engine, len(dataset))" in info.value.fix
    with pytest.raises(ConfigError, match="through a Strided"):
        samplers.refuse_unranged(iter(refused[0]), share)
    mine = ReplicaSampleOrder(32, share)
    other = ReplicaSampleOrder(32, dataclasses.replace(share, replica=1))
    for ok in (torch.utils.data.DataLoader(data, batch_size=2, sampler=mine), iter([1, 2]), (i for i in data)):
        samplers.refuse_unranged(deepspeed.utils.RepeatingLoader(ok) if hasattr(ok, "dataset") else ok, share)
    with pytest.raises(ConfigError):
        samplers.refuse_unranged(torch.utils.data.DataLoader(data, batch_size=2, sampler=other), share)


def test_deepspeed_io_samplers_get_the_replicas_range(share):
    data = list(range(32))
    default = samplers._replica_order(data, None, share)           # DeepSpeedDataLoader's DistributedSampler
    in_order = samplers._replica_order(data, torch.utils.data.DistributedSampler(data, 2, 0, shuffle=False), share)
    start, stop = share.samples
    assert list(in_order)[:stop - start] == list(range(start, stop))
    assert list(default)[:stop - start] == shuffled_order(0, 32)[start:stop]
    assert samplers._replica_order(data, in_order, share) is in_order
    with pytest.raises(ConfigError, match="data_sampler=Strided.*cannot give"):
        samplers._replica_order(data, Strided(32, 0, 2), share)


def test_replica_sampler_is_one_call(plan):
    uneven = dataclasses.replace(plan, replica_micro_batches=[3, 1])
    rank = uneven.stage_ranks(0)[1]
    engine = types.SimpleNamespace(het_plan=uneven, het_applied=types.SimpleNamespace(rank=rank))
    sampler = samplers.replica_sampler(engine, 16)
    start, stop = uneven.replica_samples(uneven.replica_of(rank))
    assert list(sampler) == list(range(start, stop)) + list(range(8 + start, 8 + stop))
    with pytest.raises(ConfigError, match="not built under a heterogeneous section"):
        samplers.replica_sampler(types.SimpleNamespace(), 16)


# ---- bf16 under uneven shares ----------------------------------------------------------------------------

def backward_seed(loss_fn) -> torch.Tensor:
    """The gradient that reaches a bf16 loss through ``loss_fn`` (what scales every gradient of the micro-batch)."""
    loss = torch.tensor(0.71875, dtype=torch.bfloat16, requires_grad=True)
    loss_fn(loss).backward()
    return loss.grad


def test_the_pipeline_loss_weight_gives_the_even_splits_bf16_seed():
    """DeepSpeed divides by gas: the even split's seed is bf16(1/n); replica d's is (loss * c/n) / c."""
    from het_plugin.deepspeed.loss_weight import weighted_loss
    off_in_bf16 = []
    for n in range(1, 17):
        even = backward_seed(lambda loss: loss / n)
        for c in range(1, 17):
            assert backward_seed(lambda loss: weighted_loss(loss, c / n) / c) == even, (c, n)
            if backward_seed(lambda loss: (loss * (c / n)) / c) != even:
                off_in_bf16.append((c, n))
    assert (7, 3) in off_in_bf16            # weighting in bf16 itself is one bf16 step off for such counts
