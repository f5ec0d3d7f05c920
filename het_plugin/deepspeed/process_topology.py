"""The plan's placement as a DeepSpeed ``ProcessTopology``.

DeepSpeed numbers coordinates row-major over axes (pipe, data, model) -- the same logical numbering as
het_plugin's (tp fastest, then dp, then pp, with cp = ep = 1). ``ProcessTopology`` keeps one dict,
``mapping`` (coordinate -> global rank), and every query (``get_rank``, ``get_coord``,
``get_axis_comm_lists``, ``filter_match``, ``get_axis_list``) reads it; ``PipelineParallelGrid`` builds
its groups from those queries and the pipeline engine addresses neighbours through
``stage_to_global`` -> ``get_rank``. Rewriting ``mapping`` through ``plan.rank_of_logical`` therefore
moves every group and every point-to-point peer.
"""
from __future__ import annotations

from deepspeed.runtime.pipe.topology import ProcessTopology

from ..core.plan import Plan

AXES = ["pipe", "data", "model"]


class PlanTopology(ProcessTopology):
    """``PipeModelDataParallelTopology(pp, tp, dp)`` with coordinates placed where the plan says."""

    def __init__(self, plan: Plan):
        super().__init__(axes=list(AXES), dims=[plan.pp, plan.dp, plan.tp])
        self.plan_hash = plan.hash
        self.rank_of_logical = list(plan.rank_of_logical)
        # The parent enumerates coordinates in logical-rank order; place each one.
        self.mapping = {coord: self.rank_of_logical[logical] for coord, logical in self.mapping.items()}
        self._coord_of_rank = {rank: coord for coord, rank in self.mapping.items()}

    def get_coord(self, rank):
        """Same answer as the parent's linear search, in O(1) (it is called per layer and per step)."""
        try:
            return self._coord_of_rank[rank]
        except KeyError:
            raise ValueError(f'rank {rank} not found in topology.') from None
