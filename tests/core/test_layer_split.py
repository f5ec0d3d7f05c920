"""Exact partition: brute force agreement, monotonicity in device speed, memory caps."""
import itertools

from hypothesis import given, settings, strategies as st

from het_plugin.core.layer_split import bottleneck, exact_partition, linear_costs


def brute_force(num_layers, costs, caps, min_layers=1):
    best = None
    p = len(costs)
    for split in itertools.product(*(range(min_layers, c + 1) for c in caps)):
        if sum(split) != num_layers:
            continue
        value = max(costs[s][n] for s, n in enumerate(split))
        if best is None or value < best:
            best = value
    return best


@st.composite
def problems(draw):
    p = draw(st.integers(1, 4))
    num_layers = draw(st.integers(p, 8))
    fixed = draw(st.lists(st.integers(0, 20), min_size=p, max_size=p))
    per = draw(st.lists(st.integers(0, 15), min_size=p, max_size=p))
    caps = draw(st.lists(st.integers(0, num_layers), min_size=p, max_size=p))
    min_layers = draw(st.integers(0, 1))
    return num_layers, linear_costs(fixed, per, num_layers), caps, min_layers


@settings(max_examples=150, deadline=None)
@given(problems())
def test_matches_brute_force_on_small_linear_cases(problem):
    num_layers, costs, caps, min_layers = problem
    got = exact_partition(num_layers, costs, caps, min_layers)
    want = brute_force(num_layers, costs, caps, min_layers)
    if want is None:
        assert got is None
    else:
        assert got is not None and sum(got) == num_layers
        assert all(min_layers <= n <= c for n, c in zip(got, caps))
        assert bottleneck(costs, got) == want


@st.composite
def monotone_tables(draw):
    p = draw(st.integers(1, 3))
    num_layers = draw(st.integers(p, 8))
    tables = []
    for _ in range(p):
        steps = draw(st.lists(st.integers(0, 9), min_size=num_layers + 1, max_size=num_layers + 1))
        tables.append(list(itertools.accumulate(steps)))
    return num_layers, tables


@settings(max_examples=200, deadline=None)
@given(monotone_tables())
def test_matches_brute_force_on_any_non_decreasing_costs(problem):
    num_layers, tables = problem
    caps = [num_layers] * len(tables)
    got = exact_partition(num_layers, tables)
    assert got is not None
    assert bottleneck(tables, got) == brute_force(num_layers, tables, caps)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 5).flatmap(lambda p: st.tuples(
    st.integers(p, 60), st.integers(0, 5), st.lists(st.integers(1, 100), min_size=p, max_size=p))))
def test_faster_stages_get_at_least_as_many_layers(case):
    num_layers, fixed, per_layer = case
    costs = linear_costs([fixed] * len(per_layer), per_layer, num_layers)
    got = exact_partition(num_layers, costs)
    for a, b in itertools.permutations(range(len(per_layer)), 2):
        if per_layer[a] < per_layer[b]:
            assert got[a] >= got[b], (per_layer, got)


def test_holmes_shape_on_identical_gpus_with_a_costlier_stage():
    # 48 layers; the second stage pays 18% more per layer (its links): 26 * 1.0 = 26 vs 22 * 1.18 = 25.96,
    # while 25/23 gives 23 * 1.18 = 27.14 and 27/21 gives 27.
    costs = linear_costs([0, 0], [1.0, 1.18], 48)
    assert exact_partition(48, costs) == [26, 22]


def test_memory_cap_binds_and_moves_layers_to_the_slower_stage():
    costs = linear_costs([0, 0], [1.0, 2.0], 30)
    free = exact_partition(30, costs)
    assert free == [20, 10]
    capped = exact_partition(30, costs, max_layers=[12, 30])
    assert capped == [12, 18]


def test_infeasible_caps_and_too_many_stages_give_none():
    costs = linear_costs([0, 0, 0], [1, 1, 1], 5)
    assert exact_partition(5, costs, max_layers=[1, 1, 2]) is None
    assert exact_partition(2, linear_costs([0, 0, 0], [1, 1, 1], 2)) is None      # 3 stages, 2 layers, min 1


def test_zero_layer_stage_only_when_allowed():
    costs = linear_costs([0, 0], [1.0, 100.0], 4)
    assert exact_partition(4, costs, min_layers=0) == [4, 0]
    assert exact_partition(4, costs) == [3, 1]


def test_fixed_costs_shift_layers_away_from_first_and_last():
    # embedding costs 2 on stage 0, output layer + loss 3 on stage 2, one layer costs 1 everywhere
    costs = linear_costs([2, 0, 3], [1, 1, 1], 13)
    got = exact_partition(13, costs)
    assert bottleneck(costs, got) == 6
    assert got[1] >= got[0] >= got[2]
