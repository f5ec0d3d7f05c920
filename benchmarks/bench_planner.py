"""Planner benchmark: planned vs framework-default predicted throughput (dense and MoE models), the HETHUB-like
mix against its sub-clusters (with and without heterogeneous data parallelism), which node groups the example
clusters are better off without, and planner wall time at 768, 16,384 and 131,072 accelerators, today's search
(every node) beside the search over node subsets (issue 32's goals: 1 s, 5 s and 30 s with the subset search on),
with the subset search's count of candidate predictions. One run, side by side.

    python benchmarks/bench_planner.py            (a few minutes on 2 cores)
    python benchmarks/bench_planner.py --quick    (skips the 16,384- and 131,072-accelerator timings)
    python benchmarks/bench_planner.py --no-131k  (skips the 131,072-accelerator timing)
    python benchmarks/bench_planner.py --hethub   (only the HETHUB-like mix against its sub-clusters)
    python benchmarks/bench_planner.py --subsets  (only "are these nodes worth it" and the wall times)

Every throughput here is the predictor's (het_plugin.core.cost), not a measurement; wall times are real but
rough on a shared machine (CPU s, the process's own CPU time, is less sensitive to other load).
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.cost import SplitCosts
from het_plugin.core.planner import make_plan, plan_candidates
from het_plugin.core.subsets import search_subsets

CLUSTERS = Path(__file__).resolve().parent.parent / "examples" / "clusters"
CASES = [("holmes-ib-roce", "gpt-7.5b"), ("holmes-ib-roce", "gpt-39b"), ("h100-a100", "gpt-7.5b"),
         ("h100-a100", "gpt-39b"),
         ("two-clusters-25gbe", "gpt-7.5b"), ("two-clusters-25gbe", "gpt-39b"),
         ("homogeneous-ib", "gpt-7.5b"), ("homogeneous-ib", "gpt-39b"),
         ("hethub-mix", "llama-140b")]
# Mixture-of-experts models: the planner also chooses ep (and etp in {1, tp}); the baseline is the framework
# default placement with the best ep for it.
MOE_CASES = [("holmes-ib-roce", "mixtral-8x7b"), ("hethub-mix", "mixtral-8x7b"), ("two-clusters-25gbe", "mixtral-8x7b"),
             ("homogeneous-ib", "mixtral-8x7b"), ("holmes-ib-roce", "deepseek-moe-16b"),
             ("hethub-mix", "deepseek-moe-16b")]


HETHUB_GOAL = 0.98         # mix / its sub-clusters as one job on its batch (issue 12; HETHUB reports 0.9749)


def degrees(p) -> str:
    experts = f" ep{p.ep} etp{p.dims.etp}" if p.model.get("num_moe_experts") else ""
    return f"tp{p.tp} pp{p.pp} dp{p.dp}{experts} mb{p.micro_batch_size}"


def shape(p) -> str:
    """The plan's shape and, where uneven, its replica split."""
    if p.prediction is None or not p.prediction.shape:
        return "-"
    from het_plugin.views.report import alt_split
    return p.prediction.shape + ("" if not p.uneven_replicas else f" ({alt_split(p)})")


def _baseline_degrees(plan) -> str:
    base = plan.baseline
    if base is None:
        return "-"
    text = "same as plan" if plan.homogeneous else base.description.split("default: ")[-1].split(", domain")[0]
    return text + (" +distopt" if base.description.endswith("distributed optimizer") and not plan.homogeneous else "")


def moe_planned_vs_baseline() -> None:
    print("## Mixture of experts: planned vs framework-default (baseline), ep chosen by the planner\n")
    print("| cluster | model | plan | expert-ep transport | all-to-all share | planned tok/s | baseline | "
          "baseline all-to-all | baseline tok/s | ratio | planner s |")
    print("|---|---|---|---|---:|---:|---|---:|---:|---:|---:|")
    for cname, mname in MOE_CASES:
        start = time.perf_counter()
        plan = make_plan(load_cluster(CLUSTERS / f"{cname}.yaml"), preset_model(mname), ep=None)
        took = time.perf_counter() - start
        pred, base = plan.prediction, plan.baseline
        where = "/".join(sorted({g.transport for g in plan.groups.get("expert-ep", [])})) if plan.ep > 1 else "(ep=1)"
        ratio = f"{pred.tokens_per_s / base.tokens_per_s:.2f}x" if base else "n/a"
        base_a2a = f"{base.alltoall_s / base.iteration_s:.1%}" if base else "-"
        print(f"| {cname} | {mname} | {degrees(plan)}{' +distopt' if plan.distributed_optimizer else ''} | {where} | "
              f"{pred.alltoall_s / pred.iteration_s:.1%} | {pred.tokens_per_s:,.0f} | {_baseline_degrees(plan)} | "
              f"{base_a2a} | {base.tokens_per_s if base else float('nan'):,.0f} | {ratio} | {took:.1f} |")
    print()


def planned_vs_baseline() -> None:
    print("## Planned vs framework-default (baseline) predicted throughput\n")
    print("| cluster | model | plan | shape | layers per stage | planned tok/s | baseline | baseline tok/s | ratio |")
    print("|---|---|---|---|---|---:|---|---:|---:|")
    for cname, mname in CASES:
        plan = make_plan(load_cluster(CLUSTERS / f"{cname}.yaml"), preset_model(mname))
        base = plan.baseline
        bdeg = _baseline_degrees(plan)
        layers = plan.layers_per_stage if len(plan.layers_per_stage) <= 12 else \
            f"{plan.layers_per_stage[:6]}..."
        ratio = f"{plan.prediction.tokens_per_s / base.tokens_per_s:.2f}x" if base else "n/a"
        print(f"| {cname} | {mname} | {degrees(plan)}{' +distopt' if plan.distributed_optimizer else ''} | "
              f"{shape(plan)} | {layers} | {plan.prediction.tokens_per_s:,.0f} | {bdeg} | "
              f"{base.tokens_per_s if base else float('nan'):,.0f} | {ratio} |")
    print()


def _best_time(sub, model, batch: int, cache: dict):
    """(iteration s, plan) of the sub-cluster's best plan (the full het-aware search) for ``batch`` sequences, or
    (inf, None) where no plan fits."""
    key = (sub.name, batch)
    if key not in cache:
        try:
            best = plan_candidates(sub, model.model_copy(update={"global_batch_size": batch}))
        except ConfigError:
            best = []
        cache[key] = (best[0].prediction.iteration_s, best[0]) if best else (math.inf, None)
    return cache[key]


def _compute_floor_s(sub, model) -> float:
    """Seconds per sequence below which no plan of the predictor's can go on ``sub``: the decoder layers' forward
    and backward FLOPs over every device's sustained rate (no bubble, no communication, no output layer)."""
    return 3 * model.decoder_flops_fwd(1) / sum(n.accelerator.sustained_flops * n.num_accelerators
                                                for n in sub.nodes)


def shared_batch_reference(subs, model):
    """The sub-clusters as one job on the mix's global batch B: sub-cluster 0 takes b sequences, sub-cluster 1
    the other B - b, each runs its own best plan (its own tp, pp, dp: more than one Megatron job can), the
    gradients cross between them for free, and the iteration lasts as long as the slower. The best b of all
    1..B-1: they are taken by their compute floor (:func:`_compute_floor_s`, a lower bound of either part's
    time) until that floor reaches the best iteration found; a part is planned only while it can still beat it.
    Returns (tokens/s, b, (time, plan) of each sub-cluster)."""
    if len(subs) != 2:
        raise ValueError("shared_batch_reference splits a batch between two sub-clusters")
    B = model.global_batch_size
    floors = [_compute_floor_s(sub, model) for sub in subs]
    floor = {b: max(b * floors[0], (B - b) * floors[1]) for b in range(1, B)}
    cache: dict = {}
    best, best_b = math.inf, None
    for b in sorted(floor, key=lambda x: (floor[x], x)):
        if floor[b] >= best:
            break
        first = _best_time(subs[0], model, b, cache)[0]
        if first >= best:
            continue
        t = max(first, _best_time(subs[1], model, B - b, cache)[0])
        if t < best or (t == best and b < best_b):
            best, best_b = t, b
    if best_b is None:
        raise ValueError("no split of the batch has a plan on both sub-clusters")
    parts = (_best_time(subs[0], model, best_b, cache), _best_time(subs[1], model, B - best_b, cache))
    return B * model.seq_length / best, best_b, parts


def hethub_fraction() -> None:
    print("## HETHUB-like mix vs its sub-clusters planned alone\n")
    print("Each sub-cluster is planned alone three ways: with the mix's whole global batch (1536 sequences), with a "
          "batch proportional to its share of the accelerators (same sequences per accelerator as in the mix), and "
          "-- the goal's reference -- with its share of the mix's batch when the two run as one job (the best split "
          "of the 1536 sequences, each sub-cluster with its own best degrees, gradients exchanged for free).\n")
    mix = load_cluster(CLUSTERS / "hethub-mix.yaml")
    model = preset_model("llama-140b")
    plan = make_plan(mix, model)
    even = make_plan(mix, model, replica_split="even")     # the same search without uneven replica shares
    totals = {"same": 0.0, "prop": 0.0, "default": 0.0}
    rows, subs = [], []
    for spec in mix.spec.model_dump()["clusters"]:
        sub = cluster_from_dict({"name": spec["name"], "clusters": [spec]})
        prop_batch = model.global_batch_size * sub.world_size // mix.world_size
        best = plan_candidates(sub, model)[0]           # the full search, distributed optimizer included
        best_prop = plan_candidates(sub, model.model_copy(update={"global_batch_size": prop_batch}))[0]
        dflt = make_plan(sub, model)                    # what het_plugin does on it: the framework default
        totals["same"] += best.prediction.tokens_per_s
        totals["prop"] += best_prop.prediction.tokens_per_s
        totals["default"] += dflt.prediction.tokens_per_s
        subs.append(sub)
        rows.append(f"| {spec['name']} alone ({sub.world_size} x {sub.nodes[0].accelerator.name}) | "
                    f"{_short(best)} | {best.prediction.tokens_per_s:,.0f} | {prop_batch}: {_short(best_prop)} | "
                    f"{best_prop.prediction.tokens_per_s:,.0f} | {degrees(dflt)} | {dflt.prediction.tokens_per_s:,.0f} |")
    print("| cluster | best plan, batch 1536 | tok/s | best plan, proportional batch | tok/s | framework default, "
          "batch 1536 | tok/s |")
    print("|---|---|---:|---|---:|---|---:|")
    print("\n".join(rows))
    for label, p in (("mix", plan), ("mix, even replica split only", even)):
        print(f"| {label} ({mix.world_size}) | {degrees(p)}{' +distopt' if p.distributed_optimizer else ''} "
              f"layers {p.layers_per_stage}, {shape(p)} | {p.prediction.tokens_per_s:,.0f} | | | | |")
    start = time.process_time()
    bound, split, parts = shared_batch_reference(subs, model)
    took = time.process_time() - start
    tok = plan.prediction.tokens_per_s
    frac = tok / bound
    names = [s.name for s in subs]
    print(f"\nOne job, the batch shared: {names[0]} {split} sequences ({_short(parts[0][1])}, {parts[0][0]:.2f} s), "
          f"{names[1]} {model.global_batch_size - split} ({_short(parts[1][1])}, {parts[1][0]:.2f} s): {bound:,.0f} "
          f"tok/s ({took:.0f} CPU s to find)")
    print(f"mix / its sub-clusters sharing its global batch as one job:         {frac:.3f} "
          f"(goal >= {HETHUB_GOAL}: {'met' if frac >= HETHUB_GOAL else 'missed'})")
    print(f"  the same with the even replica split only:                       {even.prediction.tokens_per_s / bound:.3f}")
    print(f"mix / sum of sub-clusters' best plans, proportional global batch:   {tok / totals['prop']:.3f}")
    print(f"mix / sum of sub-clusters' best plans, each the whole batch 1536:   {tok / totals['same']:.3f} "
          "(2 x 1536 sequences per step between them: not a bound, see docs/planner.md)")
    print(f"mix / sum of sub-clusters' framework-default plans (batch 1536):    {tok / totals['default']:.3f}\n")


def _short(cand) -> str:
    s = cand.summary()
    return (f"tp{s['tp']} pp{s['pp']} dp{s['dp']} mb{s['micro_batch_size']}"
            f"{' +distopt' if s['distributed_optimizer'] else ''}")


def big_cluster(nodes_ib: int = 1024, nodes_roce: int = 512, nodes_amd: int = 512):
    """16,384 accelerators in three clusters (IB A100, RoCE H100, RoCE MI300X) joined by 100 GbE (times 8 for
    131,072)."""
    eth = [{"type": "ethernet", "gbps": 100, "interfaces": ["eth0"]}]
    size = 8 * (nodes_ib + nodes_roce + nodes_amd)
    name = f"big-{size // 1024}k"
    return cluster_from_dict({"name": name, "clusters": [
        {"name": "ib", "fabric": {"type": "ib", "gbps": 1600, "latency_us": 2},
         "nodes": [{"count": nodes_ib, "accelerator": "A100-80", "accelerators_per_node": 8, "nics": eth}]},
        {"name": "roce", "fabric": {"type": "roce", "gbps": 3200, "latency_us": 5},
         "nodes": [{"count": nodes_roce, "accelerator": "H100", "accelerators_per_node": 8, "nics": eth}]},
        {"name": "amd", "fabric": {"type": "roce", "gbps": 3200, "latency_us": 5},
         "nodes": [{"count": nodes_amd, "accelerator": "MI300X", "accelerators_per_node": 8, "nics": eth}]}],
        "links": [{"between": ["ib", "roce"], "gbps": 100}, {"between": ["ib", "amd"], "gbps": 100},
                  {"between": ["roce", "amd"], "gbps": 100}]})


SUBSET_CASES = ["h100-old-ethernet", "h100-a100", "two-clusters-25gbe", "holmes-ib-roce", "hethub-mix"]


def nodes_worth_it() -> None:
    print("## Are these nodes worth it? Every node vs the best plan over node-group subsets (gpt-7.5b)\n")
    print("| cluster | every node: plan | s/iteration | subset search: left out | plan | s/iteration | speed-up | "
          "subsets planned / ruled out |")
    print("|---|---|---:|---|---|---:|---:|---:|")
    model = preset_model("gpt-7.5b")
    for cname in SUBSET_CASES:
        found = search_subsets(load_cluster(CLUSTERS / f"{cname}.yaml"), model)
        full, plan = found.full.plan, found.plan
        left = ", ".join(g["group"] for g in plan.left_out.get("groups", [])) or "nothing"
        print(f"| {cname} | {degrees(full)} | {full.prediction.iteration_s:.3f} | {left} | {degrees(plan)} "
              f"({plan.world_size} ranks) | {plan.prediction.iteration_s:.3f} | "
              f"{full.prediction.iteration_s / plan.prediction.iteration_s:.2f}x | {1 + found.searched} / "
              f"{found.pruned} |")
    print()


class _Predictions:
    """Counts the cost model's candidate predictions (``SplitCosts.predict``) while it is entered: the work a
    search does, beside its time (which other load on the machine changes)."""

    def __enter__(self):
        self.count, self._real = 0, SplitCosts.predict
        real = self._real

        def counted(split, *args, **kwargs):
            self.count += 1
            return real(split, *args, **kwargs)

        SplitCosts.predict = counted
        return self

    def __exit__(self, *exc):
        SplitCosts.predict = self._real


# Issue 32's planner-time goals with the subset search on (llama-140b, the goal model): 768 accelerators 1 s,
# 16,384 5 s, 131,072 30 s; Mixtral keeps issue 12's budgets (10 s and 60 s).
def wall_times(quick: bool, big: bool = True) -> None:
    print("## Planner wall time: today's search (every node) and the search over node subsets\n")
    print("| accelerators | cluster | model | wall s | CPU s | with subsets: wall s | CPU s | predictions | planned / "
          "ruled out | budget s | goal (subsets) | plan |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    cases = [(load_cluster(CLUSTERS / "hethub-mix.yaml"), preset_model("llama-140b"), 1),
             (load_cluster(CLUSTERS / "hethub-mix.yaml"), preset_model("mixtral-8x7b"), 10)]
    if not quick:
        cases.append((big_cluster(), preset_model("llama-140b").model_copy(update={"global_batch_size": 8192}), 5))
        cases.append((big_cluster(), preset_model("mixtral-8x7b").model_copy(update={"global_batch_size": 8192}),
                      60))
        if big:
            cases.append((big_cluster(8192, 4096, 4096),
                          preset_model("llama-140b").model_copy(update={"global_batch_size": 65536}), 30))
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    for cl, model, budget in cases:
        start, cpu = time.perf_counter(), time.process_time()
        plan = make_plan(cl, model, ep=None)          # MoE models: ep searched too
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        with _Predictions() as predictions:
            start, sub_cpu = time.perf_counter(), time.process_time()
            found = search_subsets(cl, model, ep=None)
            sub_wall, sub_cpu = time.perf_counter() - start, time.process_time() - sub_cpu
        plan = found.plan
        order = " > ".join(n.split("/")[0] for n in plan.prediction.description.split("domain order ")[1]
                           .split(",")[0].split(";")[0].split(" > "))
        goal = "met" if sub_wall <= budget else ("missed (CPU s within)" if sub_cpu <= budget else "missed")
        left = f", left out {', '.join(g['group'] for g in plan.left_out['groups'])}" if plan.left_out else ""
        print(f"| {cl.world_size:,} | {cl.name} | {model.name} (batch {model.global_batch_size}) | {wall:.1f} | "
              f"{cpu:.1f} | {sub_wall:.1f} | {sub_cpu:.1f} | {predictions.count:,} | {1 + found.searched} / "
              f"{found.pruned} | {budget} | "
              f"{goal} | {degrees(plan)}, {shape(plan)}, stages over {order}, layers {plan.layers_per_stage}{left} |")
    with open("/proc/loadavg") as f:
        print(f"\n(load average {load} before the timings, {f.read().split()[0]} after: other processes share the "
              "2 cores)")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the 16,384- and 131,072-accelerator timings")
    ap.add_argument("--no-131k", dest="big", action="store_false", help="skip the 131,072-accelerator timing")
    ap.add_argument("--hethub", action="store_true", help="only the HETHUB-like mix against its sub-clusters")
    ap.add_argument("--subsets", action="store_true", help="only the node-subset comparison and the wall times")
    args = ap.parse_args()
    if args.hethub:
        hethub_fraction()
        return
    if args.subsets:
        nodes_worth_it()
        wall_times(args.quick, args.big)
        return
    planned_vs_baseline()
    moe_planned_vs_baseline()
    hethub_fraction()
    nodes_worth_it()
    wall_times(args.quick, args.big)


if __name__ == "__main__":
    main()
