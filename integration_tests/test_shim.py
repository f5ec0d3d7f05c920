"""The het_shim process group against flat gloo, multi-process on CPU (vendors emulated by tagging ranks)."""
from pathlib import Path

import pytest

from integration_tests.support.launch import run_ranks

RANKS = Path(__file__).parent / "ranks"


@pytest.mark.timeout(150)
def test_every_supported_op_equals_flat_gloo():
    """3+1, 2+2 interleaved, 1+1+1+1, one vendor, and a 3-rank sub-group: all ops, all dtypes, async, strided;
    then vendors from HET_PLUGIN_VENDOR (per rank) and HET_PLUGIN_VENDOR_MAP."""
    outs = run_ranks(RANKS / "shim_equiv.py", 4, env={"HET_PLUGIN_SHIM_CHUNK_BYTES": "1024"}, timeout=120)
    for o in outs:
        res = o.result
        assert res is not None, o.stderr[-2000:]
        assert res["nfail"] == 0, f"rank {o.rank}: {res['failures']}"
        assert res["layouts"]["3+1"] == [[0, 1, 2], [3]]
        assert res["layouts"]["2+2-interleaved"] == [[0, 3], [1, 2]]
        assert res["layouts"]["1+1+1+1"] == [[0], [1], [2], [3]]
        assert res["layouts"]["single-vendor"] == [[0, 1, 2, 3]]
        assert res["layouts"]["HET_PLUGIN_VENDOR"] == [[0, 2], [1, 3]]       # tagged per rank, via the store
        assert res["layouts"]["HET_PLUGIN_VENDOR_MAP"] == [[0, 1, 2], [3]]
    # rank 0 is outside the 3-rank sub-group, so it runs fewer comparisons
    assert outs[0].result["checks"] > 300
    assert all(o.result["checks"] > outs[0].result["checks"] for o in outs[1:])
    assert outs[1].result["layouts"]["subset 1,2,3"] == [[0, 1], [2]]


@pytest.mark.timeout(90)
def test_shim_as_the_default_group():
    """init_process_group("het_shim"): the world group spans vendors; groups made without a backend inherit it."""
    outs = run_ranks(RANKS / "shim_default.py", 4, env={"HET_PLUGIN_VENDOR_MAP": "nvidia*2,amd*2"}, timeout=60)
    for o in outs:
        res = o.result
        assert res["world_backend"] == "het_shim" and res["world_subgroups"] == [[0, 1], [2, 3]]
        assert res["world_all_reduce"] == [i * (1 + 2 + 3 + 4) for i in range(6)]
        assert res["half_backend"] == "het_shim" and res["half_subgroups"] == [[0, 1]]   # one vendor: native path
        assert res["half_all_reduce"] == ([1.0] * 4 if o.rank < 2 else [5.0] * 4)
        assert res["all_gather_object"] == [0, 1, 2, 3]
        assert res["world_reduce"].startswith("ShimUnsupportedError: het_shim does not support reduce")
    assert outs[0].result["half_reduce_at_root"] == [3.0, 3.0] and outs[2].result["half_reduce_at_root"] == [7.0, 7.0]
