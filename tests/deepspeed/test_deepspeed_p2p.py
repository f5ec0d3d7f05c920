"""DeepSpeed's pipeline hops (deepspeed.runtime.pipe.p2p.send/recv) go through the plan's pipeline group.

In-process: a grid over PlanTopology, deepspeed.comm.send/recv recorded (the narrowest point: what DeepSpeed
would hand torch). The emulated-network test (integration_tests/test_emulate_deepspeed.py) shows the bytes
on the pipeline group's interface."""
from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

from deepspeed.runtime.pipe import p2p  # noqa: E402

from het_plugin.deepspeed import p2p as hop  # noqa: E402
from het_plugin.deepspeed.process_topology import PlanTopology  # noqa: E402
from het_plugin.runtime.applied import AppliedPlan  # noqa: E402

from tests.deepspeed.test_deepspeed_topology import homogeneous, interleaved, plan_for  # noqa: E402


class Grid:
    """What p2p reads of a PipelineParallelGrid (stage of this rank, stage -> global rank, the pp group)."""

    def __init__(self, plan, rank):
        self.plan = plan
        self.topo = PlanTopology(plan)
        self.rank = rank
        self.pipe_parallel_size = plan.pp
        self.pp_group = ("pp group", tuple(plan.group_of("pp", rank).ranks))

    def get_stage_id(self):
        return self.topo.get_coord(self.rank).pipe

    def stage_to_global(self, stage_id):
        me = self.topo.get_coord(self.rank)
        return self.topo.get_rank(**me._replace(pipe=stage_id)._asdict())

    def get_pipe_parallel_group(self):
        return self.pp_group


@pytest.fixture
def calls(monkeypatch):
    import deepspeed.comm as dist
    seen = []
    monkeypatch.setattr(dist, "send", lambda t, dst, group=None, **kw: seen.append(("send", dst, group)))
    monkeypatch.setattr(dist, "recv", lambda t, src=None, group=None, **kw: seen.append(("recv", src, group)))
    monkeypatch.setattr(p2p, "_grid", None)
    return seen


def test_hops_of_a_placed_plan_use_its_pipeline_group(calls):
    plan = plan_for(interleaved(2), pp=2, tp=1, dp=4)
    assert not plan.is_identity
    for rank in range(plan.world_size):
        grid = Grid(plan, rank)
        assert hop.route_pipeline_hops(grid, AppliedPlan.start(plan, rank, "gloo"))
        p2p._grid = grid
        pipe = plan.group_of("pp", rank).ranks
        stage = pipe.index(rank)
        other = 1 - stage
        calls.clear()
        p2p.send(None, other)
        p2p.recv(None, other)
        assert calls == [("send", pipe[other], grid.pp_group), ("recv", pipe[other], grid.pp_group)]
        with pytest.raises(AssertionError):
            p2p.send(None, other, async_op=True)


def test_homogeneous_identity_plan_keeps_deepspeeds_world_hops(calls):
    plan = plan_for(homogeneous(2, 2), pp=2, tp=1, dp=2)
    grid = Grid(plan, 0)
    assert not hop.route_pipeline_hops(grid, AppliedPlan.start(plan, 0, "gloo"))
    p2p._grid = grid
    p2p.send(None, 1)
    p2p.recv(None, 1)
    assert calls == [("send", 2, None), ("recv", 2, None)]        # DeepSpeed's own: the world group


def test_other_grids_keep_deepspeeds_behaviour_after_routing(calls):
    routed = Grid(plan_for(interleaved(2), pp=2, tp=1, dp=4), 0)
    hop.route_pipeline_hops(routed, AppliedPlan.start(routed.plan, 0, "gloo"))
    plain = Grid(plan_for(homogeneous(2, 2), pp=2, tp=1, dp=2), 1)
    p2p._grid = plain
    p2p.send(None, 1)
    assert calls == [("send", 3, None)]
    from het_plugin.runtime.patches import PATCHES
    assert PATCHES.labels(p2p, "send") == [hop.PATCH_LABEL]
    hop._install()                                                  # idempotent: wrapped once
    assert PATCHES.labels(p2p, "send") == [hop.PATCH_LABEL]
