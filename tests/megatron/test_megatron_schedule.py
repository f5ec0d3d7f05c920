"""het_plugin.core.cost.interleaved's interleaved order against the installed Megatron-Core's own schedule functions
(make test runs this on megatron-core 0.16.1 and 0.19.2)."""
from types import SimpleNamespace

import pytest

from het_plugin.core.cost.interleaved import check_micro_batches, interleaved_order, schedule_table, warmup_count

CASES = [(2, 2, 2), (2, 2, 8), (2, 3, 4), (4, 2, 4), (4, 2, 16), (3, 4, 6), (8, 2, 16), (4, 3, 12)]


def megatron_rank(pp, rank, vpp):
    group = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    return SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp)


@pytest.mark.parametrize("pp,vpp,m", CASES)
def test_the_interleaved_order_is_megatrons(pp, vpp, m):
    from megatron.core.pipeline_parallel import schedules
    assert schedule_table(m, vpp, pp) == schedules.get_schedule_table(m, vpp, pp)
    for rank in range(pp):
        total, all_warm, warm, rest = schedules.get_pp_rank_microbatches(
            m, vpp, pp, p2p_communicator=megatron_rank(pp, rank, vpp))
        assert warm == warmup_count(pp, rank, m, vpp) and total == m * vpp
        ops = interleaved_order(pp, rank, m, vpp)
        table = schedules.get_schedule_table(m, vpp, pp)
        # forward k: table entry k; backward k: the same micro-batch on chunk vpp - 1 - c (Megatron's
        # get_model_chunk_id(k, forward=False))
        assert [(i, c) for kind, i, c, _ in ops if kind == "F"] == table
        assert [(i, c) for kind, i, c, _ in ops if kind == "B"] == [(i, vpp - 1 - c) for i, c in table]
        steady = [kind for kind, *_, phase in ops if phase == "steady"]
        assert steady == ["F", "B"] * rest


def test_megatrons_micro_batch_rule_for_interleaving():
    """Megatron's interleaved schedule raises unless pp <= group <= m and m % group is 0 or >= pp (group:
    microbatch_group_size_per_vp_stage, pp by default: m a multiple of pp)."""
    for pp, m, group in [(4, 8, None), (2, 2, None), (4, 14, 5), (2, 8, 3)]:
        check_micro_batches(pp, m, group)
    for pp, m, group in [(4, 6, None), (4, 2, None), (4, 11, 5), (2, 7, 8)]:
        with pytest.raises(ValueError):
            check_micro_batches(pp, m, group)
