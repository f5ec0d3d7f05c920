"""The Plan: deterministic content hash, JSON/YAML round trips, loading errors, helpers, and the
homogeneous no-op through the planner."""
from __future__ import annotations

import json
import os

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from het_plugin.core.inputs.cluster import load_cluster  # noqa: E402
from het_plugin.core.errors import ConfigError  # noqa: E402
from het_plugin.core.inputs.model import ModelSpec, preset_model  # noqa: E402
from het_plugin.core.plan import FORMAT_VERSION, Plan, Prediction, looks_like_plan  # noqa: E402
from het_plugin.core.planner import assemble_plan, make_plan  # noqa: E402
from het_plugin.core.ranks.dims import GROUP_KINDS  # noqa: E402

from tests.core.test_placement import placed  # noqa: E402  (tests/ is on sys.path under pytest)

finite = st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False)


@st.composite
def plans(draw):
    cluster, dims, placement = draw(placed())
    per_stage = draw(st.integers(1, 3))
    layers = [per_stage + draw(st.integers(0, 2)) for _ in range(dims.pp)]
    mb = draw(st.sampled_from([1, 2]))
    model = ModelSpec(num_layers=sum(layers), hidden_size=64, num_attention_heads=4, vocab_size=1000,
                      seq_length=128, global_batch_size=dims.dp * mb * draw(st.integers(1, 4)))
    prediction = None
    if draw(st.booleans()):
        prediction = Prediction(draw(finite), draw(finite), draw(finite),
                                memory_gib_per_stage=[draw(finite) for _ in range(dims.pp)],
                                capacity_gib_per_stage=[80.0] * dims.pp, description="x")
    return cluster, model, placement, layers, mb, prediction


PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(plans())
def test_same_input_same_hash(case):
    cluster, model, placement, layers, mb, prediction = case
    a = assemble_plan(cluster, model, placement, layers, mb, prediction=prediction)
    b = assemble_plan(cluster, model, placement, list(layers), mb, prediction=prediction)
    assert a.hash == b.hash and len(a.hash) == 16
    assert a.canonical_json() == b.canonical_json()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])   # YAML is slow
@given(case=plans())
def test_plan_survives_dict_json_and_yaml(tmp_path_factory, case):
    cluster, model, placement, layers, mb, prediction = case
    plan = assemble_plan(cluster, model, placement, layers, mb, prediction=prediction)
    assert Plan.from_dict(plan.to_dict()).hash == plan.hash
    d = tmp_path_factory.mktemp("plans")
    for name in ("plan.json", "plan.yaml"):
        plan.save(d / name)
        loaded = Plan.load(d / name)
        assert loaded.hash == plan.hash, name
        assert loaded.rank_of_logical == plan.rank_of_logical
        assert loaded.groups == plan.groups
        assert looks_like_plan(d / name)
    assert json.loads((d / "plan.json").read_text())["hash"] == plan.hash
    assert yaml.safe_load((d / "plan.yaml").read_text())["hash"] == plan.hash


@PROPS
@given(plans())
def test_plan_helpers_agree_with_the_placement(case):
    cluster, model, placement, layers, mb, prediction = case
    plan = assemble_plan(cluster, model, placement, layers, mb)
    inverse = plan.logical_of_physical
    for logical, phys in enumerate(plan.rank_of_logical):
        assert inverse[phys] == logical
    dims = plan.dims
    for phys in range(0, plan.world_size, max(1, plan.world_size // 16)):
        assert plan.coord(phys) == dims.coord(inverse[phys])
        assert plan.stage_of(phys) == dims.coord(inverse[phys])["pp"]
        assert plan.vendor_of(phys) == cluster.node_of(phys).vendor
        assert plan.node_of(phys).name == cluster.node_of(phys).name
        for kind in GROUP_KINDS:
            assert phys in plan.group_of(kind, phys).ranks
    assert plan.is_identity == placement.is_identity


def test_hash_changes_with_content(examples_dir):
    cluster = load_cluster(examples_dir / "clusters" / "holmes-ib-roce.yaml")
    model = preset_model("gpt-7.5b")
    from het_plugin.core.ranks.placement import place
    from het_plugin.core.ranks.dims import ParallelDims
    p = place(cluster, ParallelDims(tp=8, pp=2, dp=4))
    base = assemble_plan(cluster, model, p, [18, 18], 1)
    assert assemble_plan(cluster, model, p, [20, 16], 1).hash != base.hash
    assert assemble_plan(cluster, model, p, [18, 18], 2).hash != base.hash
    other = place(cluster, ParallelDims(tp=8, pp=2, dp=4), list(reversed(cluster.domains)))
    assert assemble_plan(cluster, model, other, [18, 18], 1).hash != base.hash


@pytest.fixture
def saved(tmp_path, examples_dir):
    cluster = load_cluster(examples_dir / "clusters" / "two-clusters-25gbe.yaml")
    plan = make_plan(cluster, preset_model("gpt-3.6b"))
    path = tmp_path / "plan.json"
    plan.save(path)
    return plan, path


def test_hand_edited_plan_is_refused(saved):
    plan, path = saved
    data = json.loads(path.read_text())
    data["rank_of_logical"][0], data["rank_of_logical"][1] = data["rank_of_logical"][1], data["rank_of_logical"][0]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        Plan.load(path)
    assert info.value.field == "hash" and "het-plugin plan -o" in info.value.fix
    del data["hash"]                      # without the hash, an edit must still be consistent
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        Plan.load(path)
    assert info.value.field.startswith("groups.") and "het-plugin plan -o" in info.value.fix
    data = json.loads(json.dumps(plan.to_dict()))
    del data["hash"]                      # a consistent edit is accepted (documented escape hatch)
    data["layers_per_stage"] = [n + (1 if s == 0 else -1 if s == 1 else 0)
                                for s, n in enumerate(data["layers_per_stage"])]
    path.write_text(json.dumps(data))
    assert Plan.load(path).layers_per_stage[0] == plan.layers_per_stage[0] + 1


def test_other_format_version_is_refused(saved):
    _, path = saved
    data = json.loads(path.read_text())
    data["format_version"] = FORMAT_VERSION + 1
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        Plan.load(path)
    assert info.value.field == "format_version" and "het-plugin plan" in info.value.fix


def test_unknown_keys_and_non_plans_are_refused(saved, examples_dir):
    _, path = saved
    data = json.loads(path.read_text())
    data["extra"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="unknown plan keys \\['extra'\\]"):
        Plan.load(path)
    cluster_file = examples_dir / "clusters" / "holmes-ib-roce.yaml"
    assert not looks_like_plan(cluster_file)
    with pytest.raises(ConfigError, match="not a plan file"):
        Plan.load(cluster_file)


@pytest.mark.parametrize("name,model", [("holmes-ib-roce", "gpt-7.5b"), ("two-clusters-25gbe", "gpt-3.6b"),
                                        ("homogeneous-ib", "llama2-7b")])
def test_planner_is_deterministic(examples_dir, name, model):
    cluster = load_cluster(examples_dir / "clusters" / f"{name}.yaml")
    first = make_plan(cluster, preset_model(model))
    again = make_plan(load_cluster(examples_dir / "clusters" / f"{name}.yaml"), preset_model(model))
    assert first.hash == again.hash
    assert first.cluster_digest == cluster.digest


HOMOGENEOUS_DEGREES = [(1, 1, 64), (8, 1, 8), (8, 2, 4), (4, 4, 4), (2, 8, 4), (1, 8, 8), (8, 8, 1), (4, 2, 8)]


@pytest.mark.parametrize("tp,pp,dp", HOMOGENEOUS_DEGREES)
def test_homogeneous_plan_is_the_frameworks_default(examples_dir, tp, pp, dp):
    """On a homogeneous cluster the planner must hand the frameworks exactly their own groups."""
    ps = pytest.importorskip("megatron.core.parallel_state")
    ds_topology = pytest.importorskip("deepspeed.runtime.pipe.topology")
    cluster = load_cluster(examples_dir / "clusters" / "homogeneous-ib.yaml")
    model = ModelSpec(name="small", num_layers=16, hidden_size=256, num_attention_heads=8, vocab_size=1000,
                      seq_length=256, global_batch_size=128)
    plan = make_plan(cluster, model, tp=tp, pp=pp, dp=dp)
    assert (plan.tp, plan.pp, plan.dp, plan.cp) == (tp, pp, dp, 1)
    assert plan.is_identity and plan.homogeneous
    gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for kind in GROUP_KINDS:
        assert [g.ranks for g in plan.groups[kind]] == gen.get_ranks(kind), kind
    assert [g.ranks for g in plan.groups["embedding"]] == [ps.default_embedding_ranks(g) for g in gen.get_ranks("pp")]
    topo = ds_topology.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    for kind, axis in (("pp", "pipe"), ("dp", "data"), ("tp", "model")):
        assert [g.ranks for g in plan.groups[kind]] == topo.get_axis_comm_lists(axis), kind
    # one fabric: every communicator that leaves a node uses it, none is forced onto sockets
    assert {g.transport for k in GROUP_KINDS for g in plan.groups[k]} <= {"local", "ib"}


def test_small_floats_survive_json(saved, tmp_path):
    """json.dumps writes 1e-05, which YAML 1.1 reads as a string: plan files must not go through YAML."""
    plan, _ = saved
    plan.prediction = Prediction(1e-05, 2e+20, 3.5e-07, optimizer_s=1e-9)
    for name in ("p.json", "p.yaml"):
        plan.save(tmp_path / name)
        loaded = Plan.load(tmp_path / name)
        assert loaded.prediction.iteration_s == 1e-05 and loaded.prediction.tokens_per_s == 2e+20
        assert loaded.hash == plan.hash


def test_malformed_json_plan_names_the_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{\n "rank_of_logical": [0, 1],\n "tp": 1,,\n}\n')
    with pytest.raises(ConfigError, match="malformed JSON at line 3"):
        Plan.load(path)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_planner_output_on_random_clusters(data):
    """Whatever the planner picks: a permutation, complete disjoint groups, TP inside a node, and the
    same plan again for the same input -- or a ConfigError, never another exception."""
    from tests.core.test_placement import clusters
    cluster = data.draw(clusters(max_clusters=2))
    model = ModelSpec(name="small", num_layers=24, hidden_size=512, num_attention_heads=8, vocab_size=1000,
                      seq_length=256, global_batch_size=96)
    try:
        plan = make_plan(cluster, model)
    except ConfigError as exc:
        assert exc.fix, str(exc)
        return
    assert sorted(plan.rank_of_logical) == list(range(cluster.world_size))
    for kind in GROUP_KINDS:
        flat = sorted(r for g in plan.groups[kind] for r in g.ranks)
        assert flat == list(range(cluster.world_size)), kind
    for g in plan.groups["tp"] + plan.groups["cp"]:
        assert len({cluster.rank_node[r] for r in g.ranks}) == 1
    assert sum(plan.layers_per_stage) == model.num_layers and len(plan.layers_per_stage) == plan.pp
    assert make_plan(cluster, model).hash == plan.hash


def test_replica_split_ranges_weights_and_hash(examples_dir):
    """Per-replica micro-batch counts: sample ranges tile the global batch in dp order, weights are the
    shares, the even split keeps the hash of a plan written before the field, and bad counts are refused."""
    cluster = load_cluster(examples_dir / "clusters" / "holmes-ib-roce.yaml")
    from het_plugin.core.ranks.placement import place
    from het_plugin.core.ranks.dims import ParallelDims
    p = place(cluster, ParallelDims(tp=8, pp=2, dp=4))
    model = preset_model("gpt-7.5b")
    even = assemble_plan(cluster, model, p, [18, 18], 1)
    assert even.replica_counts == [even.num_micro_batches] * 4 and not even.uneven_replicas
    assert [even.replica_weight(d) for d in range(4)] == [0.25] * 4
    legacy = even.to_dict()
    del legacy["replica_micro_batches"], legacy["hash"]
    assert Plan.from_dict(legacy).hash == even.hash            # a plan without the key: same content, same hash

    n = even.num_micro_batches
    counts = [n + 2, n + 2, n - 2, n - 2] if n > 2 else [n] * 4
    data = dict(even.to_dict(), replica_micro_batches=counts)
    del data["hash"]
    uneven = Plan.from_dict(data)
    assert uneven.hash != even.hash and uneven.uneven_replicas == (n > 2)
    ranges = [uneven.replica_samples(d) for d in range(4)]
    assert ranges[0][0] == 0 and ranges[-1][1] == uneven.global_batch_size == even.global_batch_size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert sum(uneven.replica_weight(d) for d in range(4)) == pytest.approx(1.0)
    for phys in range(uneven.world_size):      # every rank of a replica shares its count
        assert uneven.replica_of(phys) == uneven.coord(phys)["dp"]

    for bad, words in (([n] * 3, "3 entries for dp=4"), ([0, 2 * n, n, n], "replica 0 has 0"),
                       ([n + 1, n, n, n], "add up to"), ([True, n, n, n], "replica 0 has True")):
        with pytest.raises(ConfigError) as info:
            Plan.from_dict(dict(data, replica_micro_batches=bad))
        assert info.value.field == "replica_micro_batches" and words in str(info.value), bad


def test_a_plan_file_with_unknown_group_keys_is_one_message_for_every_reader(saved):
    """The adapters load plan files through resolve.load_source: a hand-edited group is a ConfigError there
    too (it was a TypeError outside the CLI)."""
    from het_plugin.core.launch import load_source
    plan, path = saved
    data = json.loads(path.read_text())
    del data["hash"]
    data["groups"]["tp"][0]["color"] = "red"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        load_source(path)
    assert "not a valid plan file" in str(info.value) and "color" in str(info.value)
    assert "het-plugin plan" in info.value.fix


def test_uneven_replicas_refused_where_they_would_hang():
    """Replicas with different counts must not meet in a group that runs a collective every micro-batch (the
    MoE all-to-all of expert-ep, expert-TP), nor run Megatron's interleaved schedule."""
    from het_plugin.core.plan import check_replica_split, replica_split_conflict
    from het_plugin.core.ranks.dims import ParallelDims
    dims = ParallelDims(tp=1, pp=1, dp=4, ep=2)
    pairs = [sorted(dims.coord(r)["dp"] for r in g) for g in dims.groups("expert-ep")]
    assert all(len(p) == 2 for p in pairs)
    a, b = pairs[0]
    counts = [2] * 4
    counts[a], counts[b] = 3, 1                      # the two replicas of one expert group differ
    kind, members, have = replica_split_conflict(dims, counts)
    assert kind == "expert-ep" and sorted(have) == [1, 3]
    with pytest.raises(ConfigError) as info:
        check_replica_split(counts, 4, 2, dims=dims)
    assert info.value.field == "replica_micro_batches" and "expert-ep" in str(info.value)
    paired = [0] * 4                                 # each expert group on one count: fine
    for p, n in zip(pairs, (3, 1)):
        for d in p:
            paired[d] = n
    assert replica_split_conflict(dims, paired) is None
    check_replica_split(paired, 4, 2, dims=dims)
    assert replica_split_conflict(ParallelDims(tp=1, pp=1, dp=4), [3, 1, 2, 2]) is None    # dense: no such group
    with pytest.raises(ConfigError) as info:
        check_replica_split([3, 1], 2, 2, vpp=2)
    assert info.value.field == "replica_micro_batches" and "vpp=2" in str(info.value)


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([1, 2]), ep=st.sampled_from([1, 2, 4]), dp=st.sampled_from([2, 4, 8]),
       pp=st.sampled_from([1, 2]), order=st.sampled_from(["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]),
       seed=st.integers(0, 10 ** 6))
def test_replica_split_conflict_is_the_first_group_joining_two_counts(tp, ep, dp, pp, order, seed):
    """The planner's cached check names the same group as walking every per-micro-batch group member by member."""
    import random

    from het_plugin.core.plan import PER_MICRO_BATCH_KINDS, replica_split_conflict
    from het_plugin.core.ranks.dims import ParallelDims
    try:
        dims = ParallelDims(tp=tp, pp=pp, dp=dp, ep=ep, order=order)
    except ValueError:
        return                                       # not a layout Megatron accepts
    rng = random.Random(seed)
    counts = [rng.choice([1, 2, 3]) for _ in range(dp)]
    expected = None
    for kind in PER_MICRO_BATCH_KINDS:
        for members in dims.groups(kind):
            have = [counts[dims.coord(r)["dp"]] for r in members]
            if len(set(have)) > 1:
                expected = (kind, list(members), have)
                break
        if expected:
            break
    assert replica_split_conflict(dims, counts) == expected
