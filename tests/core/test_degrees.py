"""The degrees object: validated once against the world size; None leaves a degree to the planner,
-1 infers it (torchtitan's ParallelDims convention)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from het_plugin.core.errors import ConfigError
from het_plugin.core.ranks.dims import Degrees, ParallelDims


def test_minus_one_is_inferred_from_the_others():
    assert Degrees(16, tp=2, pp=-1, dp=4).exact() == ParallelDims(tp=2, pp=2, dp=4)
    assert Degrees(24, tp=2, pp=3, dp=-1, cp=2).exact() == ParallelDims(tp=2, cp=2, pp=3, dp=2)


@pytest.mark.parametrize("kwargs, field, words", [
    (dict(tp=3), "tp", "tp = 3 does not divide the world size 16"),
    (dict(tp=2, pp=2, dp=3), "tp, pp, dp", "tp*pp*dp = 2*2*3 = 12, but the world size is 16"),
    (dict(tp=-1, pp=-1), "tp", "tp=-1 asks to infer it, but pp, dp is not given"),
    (dict(tp=True), "tp", "tp=True is not a positive integer"),
    (dict(pp=0), "pp", "pp=0 is not a positive integer"),
    (dict(cp=-1), "cp", "cp=-1 is not a positive integer"),          # only tp, pp, dp are searched
    (dict(tp=2, pp=2, dp=4, ep=16), "ep", "etp*ep = 2*16 does not divide tp*cp*dp = 8"),
    (dict(tp=2, pp=2, dp=4, ep=2, order="tp-cp-dp-pp"), "order", "leaves out ep"),
])
def test_bad_degrees_name_the_field(kwargs, field, words):
    with pytest.raises(ConfigError) as info:
        Degrees(16, source="launch", **kwargs)
    assert info.value.field == field and words in str(info.value) and info.value.source == "launch"


def test_messages_use_the_users_names():
    names = {"dp": "train_batch_size / (micro * accumulation)", "pp": "num_stages"}
    with pytest.raises(ConfigError) as info:
        Degrees(8, tp=1, pp=2, dp=3, names=names)
    assert "train_batch_size / (micro * accumulation) = 4 with the others as given" in info.value.fix
    assert info.value.field == "tp, num_stages, train_batch_size / (micro * accumulation)"


@given(st.integers(1, 64), st.data())
def test_candidates_keep_what_is_fixed_and_multiply_to_the_world(world, data):
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    tp = data.draw(st.sampled_from([None] + divisors))
    pp = data.draw(st.sampled_from([None] + divisors))
    try:
        req = Degrees(world, tp=tp, pp=pp)
    except ConfigError:
        assert world % ((tp or 1) * (pp or 1))
        return
    got = req.candidates(divisors, max_pp=world)
    assert got, (world, tp, pp)
    for d in got:
        assert d.world_size == world
        assert tp is None or d.tp == tp
        assert pp is None or d.pp == pp
    assert len(set(got)) == len(got)


def test_expert_degrees_follow_megatrons_arithmetic():
    # ep is not a factor of the world size: the expert layers re-split one stage's tp*cp*dp ranks.
    assert Degrees(16, tp=2, pp=2, dp=4, ep=8, etp=1).exact() == ParallelDims(tp=2, pp=2, dp=4, ep=8, etp=1)
    got = Degrees(16, ep=4).candidates([1, 2, 4], max_pp=16)
    assert got and all((d.tp * d.cp * d.dp) % (d.etp * d.ep) == 0 for d in got)
    assert {(d.tp, d.pp) for d in got} >= {(1, 1), (2, 2), (4, 1)} and (4, 4) not in {(d.tp, d.pp) for d in got}
    assert Degrees(16, tp=1, pp=2, dp=8, order="tp-cp-ep-pp-dp").exact().order == "tp-cp-ep-pp-dp"
