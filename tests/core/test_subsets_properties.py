"""Properties of the subset search on generated clusters (random node groups, speeds, memories, links): never
slower than the best plan of any whole-node-group subset, every node used where every node helps, and the cost
objective never under its throughput floor. Small clusters and a small model keep each example fast."""
import itertools
import math
from dataclasses import replace

from hypothesis import HealthCheck, given, settings, strategies as st

from het_plugin.core import subsets
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.cluster import cluster_from_dict
from het_plugin.core.inputs.model import ModelSpec
from het_plugin.core.planner import make_plan

MODEL = ModelSpec(name="small-gpt", num_layers=8, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096,
                  vocab_size=32000, seq_length=1024, global_batch_size=32)
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def clusters(draw):
    """Two or three clusters of one node group each (1-2 nodes of 4 devices), random device speeds and memories,
    fabrics and links; a random price per device-hour per group."""
    n = draw(st.integers(2, 3))
    specs = []
    for i in range(n):
        fabric = draw(st.sampled_from([{"type": "ib", "gbps": 1600, "latency_us": 2},
                                       {"type": "ethernet", "gbps": 25, "latency_us": 30}]))
        acc = {"name": f"dev{i}", "vendor": "nvidia",
               "memory_gib": draw(st.sampled_from([16, 40, 80])),
               "peak_tflops": draw(st.sampled_from([30, 125, 312, 989]))}
        specs.append({"name": f"c{i}", "fabric": fabric,
                      "nodes": [{"count": draw(st.integers(1, 2)), "accelerator": acc, "accelerators_per_node": 4,
                                 "price_per_device_hour": draw(st.sampled_from([0.5, 1.0, 2.0, 4.0]))}]})
    links = [{"between": [a["name"], b["name"]], "type": "ethernet",
              "gbps": draw(st.sampled_from([1, 10, 100, 400])), "latency_us": 50}
             for a, b in itertools.combinations(specs, 2)]
    return cluster_from_dict({"name": "generated", "clusters": specs, "links": links})


def every_subset(cluster, model=MODEL):
    """(plan, price per hour) of every whole-node-group subset with a plan (the whole cluster included)."""
    groups = subsets.node_groups(cluster)
    out = []
    for k in range(1, len(groups) + 1):
        for keep in itertools.combinations(groups, k):
            try:
                plan = make_plan(subsets.sub_cluster(cluster, [n for g in keep for n in g.nodes]), model)
            except ConfigError:
                continue
            out.append((plan, subsets.price_per_hour(list(keep))))
    return out


@SETTINGS
@given(clusters())
def test_never_slower_than_a_subset_and_every_node_where_it_helps(cluster):
    options = every_subset(cluster)
    if not options:
        return
    plan = subsets.plan_nodes(cluster, MODEL)
    best = min(p.prediction.iteration_s for p, _ in options)
    assert plan.prediction.iteration_s <= best * (1 + 1e-12)
    whole = [p for p, _ in options if p.world_size == cluster.world_size]
    if whole and whole[0].prediction.iteration_s <= best:
        # every node helps (no subset is faster): the plan uses every node and is today's plan
        assert plan.left_out == {} and plan.world_size == cluster.world_size
        assert replace(plan, price_per_hour=None).hash == whole[0].hash
    else:
        assert plan.left_out and plan.world_size < cluster.world_size


@SETTINGS
@given(clusters(), st.floats(0.0, 1.0))
def test_the_cost_objective_never_misses_its_throughput_floor(cluster, where):
    options = every_subset(cluster)
    if not options:
        return
    speeds = sorted(p.prediction.tokens_per_s for p, _ in options)
    floor = speeds[0] + where * (speeds[-1] - speeds[0])
    plan = subsets.plan_nodes(cluster, MODEL, objective="cost", min_tokens_per_s=floor)
    assert plan.prediction.tokens_per_s >= floor
    cheapest = min(p.prediction.iteration_s * rate for p, rate in options if p.prediction.tokens_per_s >= floor)
    assert math.isclose(plan.prediction.iteration_s * plan.price_per_hour, cheapest, rel_tol=1e-9)
