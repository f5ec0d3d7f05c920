"""Subgroups, leaders and chunking of a shim group (pure)."""
import pytest

from het_plugin.comm.shim_layout import ShimLayout, chunk_bounds, describe, stripe_pieces


def test_subgroups_keep_group_rank_order_and_first_appearance():
    lay = ShimLayout(("amd", "nvidia", "amd", "nvidia", "nvidia"))
    assert lay.subgroups == ((0, 2), (1, 3, 4))
    assert lay.leaders == (0, 1)
    assert lay.subgroup_vendors == ("amd", "nvidia")
    assert lay.max_subgroup == 3 and not lay.single_vendor
    assert [lay.subgroup_index(r) for r in range(5)] == [0, 1, 0, 1, 1]
    assert [lay.local_rank(r) for r in range(5)] == [0, 0, 1, 1, 2]
    assert lay.same_vendor(1, 4) and not lay.same_vendor(0, 1)
    assert describe(lay, [10, 11, 12, 13, 14]) == "amd: ranks [10, 12], nvidia: ranks [11, 13, 14]"


def test_single_vendor_and_one_member_subgroups():
    assert ShimLayout(("a",) * 3).single_vendor
    lay = ShimLayout(("a", "b", "c"))
    assert lay.subgroups == ((0,), (1,), (2,)) and lay.max_subgroup == 1


@pytest.mark.parametrize("numel,esize,chunk", [(0, 4, 16), (1, 4, 16), (10, 4, 16), (17, 2, 8), (5, 8, 1)])
def test_chunks_cover_the_tensor_once_within_the_byte_budget(numel, esize, chunk):
    bounds = chunk_bounds(numel, esize, chunk)
    if numel == 0:
        assert bounds == [(0, 0)]
        return
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a < b for a, b in bounds)
    assert all(b1[1] == b2[0] for b1, b2 in zip(bounds, bounds[1:]))
    per = max(1, chunk // esize)
    assert all(b - a <= per for a, b in bounds)


def test_chunk_size_from_environment(monkeypatch):
    monkeypatch.setenv("HET_PLUGIN_SHIM_CHUNK_BYTES", "40")
    assert chunk_bounds(25, 4) == [(0, 10), (10, 20), (20, 25)]


def test_rails_spread_stripes_over_every_member():
    lay = ShimLayout(("a", "a", "b", "b"))
    assert lay.num_stripes == 2 and lay.rails == ((0, 2), (1, 3))
    uneven = ShimLayout(("a", "a", "a", "b"))
    assert uneven.rails == ((0, 3), (1, 3), (2, 3))          # the lone 'b' rank owns every stripe
    assert ShimLayout(("a", "b", "c")).rails == ((0, 1, 2),)
    assert lay.rails[0] == lay.leaders


@pytest.mark.parametrize("numel,stripes,chunk", [(0, 2, 8), (1, 3, 8), (10, 2, 8), (1001, 3, 64), (7, 1, 4)])
def test_stripe_pieces_cover_each_element_once_in_chunk_major_order(numel, stripes, chunk):
    pieces = stripe_pieces(numel, stripes, 4, chunk)
    covered = sorted((a, b) for _, a, b in pieces)
    assert sum(b - a for a, b in covered) == numel
    assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
    assert all(b - a <= max(1, chunk // 4) for _, a, b in pieces)
    for i in range(stripes):          # inside a stripe: consecutive, in order
        mine = [(a, b) for s, a, b in pieces if s == i]
        assert all(x[1] == y[0] for x, y in zip(mine, mine[1:]))
    if len(pieces) > stripes:         # chunk-major: the first pieces are every stripe's first chunk
        assert [s for s, _, _ in pieces[:stripes]] == list(range(stripes))
