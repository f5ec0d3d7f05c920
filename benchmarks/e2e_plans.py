"""Per fast:slow ratio: the calibrated profile, the six configurations the benchmark runs, and the
predictor's estimate for each (het_plugin.core.cost.predict with the profile measured through the emulator)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from het_plugin.core.cost.predict import predict
from het_plugin.core.ranks.placement import (Placement, baseline_transport, cluster_transport, default_placement,
                                             stock_multinet_transport)
from het_plugin.core.plan import Plan
from het_plugin.core.planner import assemble_plan, make_plan, uniform_layers
from het_plugin.core.inputs.profile import Profile
from het_plugin.core.ranks.dims import ParallelDims

from e2e_setup import DP, PP, TinyShape, fast_cluster, mixed_cluster, slow_cluster

DEVICE = "A100-80"
# (name in the worker's job, ranks, interface): ranks follow NODE_ORDER ib-0, roce-0, ib-1, roce-1
LINKS = [("ib", [0, 2], "fab0"), ("roce", [1, 3], "fab0"), ("ref", [0, 1], "ref0"),
         ("eth", [0, 2], "eth0"), ("inter", [0, 1], "eth0")]
FAST_LINKS = ["ib", "roce", "ref"]

CONFIGS = {   # name -> what it is
    "1-all-fast": "every node on one fast fabric (homogeneous RDMA reference), Megatron's own groups",
    "2-all-eth": "every group over Ethernet (all-Ethernet reference), Megatron's own groups",
    "3-mixed-today": "mixed cluster as run today: launch-order placement, uniform layers, every group on Ethernet",
    "4p-placement": "het_plugin's placement alone: uniform layers, every group on Ethernet",
    "4t-place+transport": "het_plugin's placement and per-group transport, uniform layers",
    "4-het_plugin": "het_plugin's plan: placement, layer split, per-group transport",
}
DS_CONFIGS = {   # run with --framework deepspeed|both (e2e_deepspeed.py)
    "3-ds": "DeepSpeed as run today: default topology (launch order), uniform partition, every group on Ethernet",
    "4-ds": "DeepSpeed through het_plugin.deepspeed: the plan's placement, layer split, per-group transport",
}
VPP = 2           # virtual stages per rank of the interleaved configurations
VPP_CONFIGS = {   # run with --framework interleaved: Megatron's interleaved schedule, p2p overlapped with compute
    "1v-all-fast+vpp": f"all-fast reference with Megatron's interleaved schedule (vpp={VPP}, overlap_p2p_comm)",
    "5-het_plugin+vpp": f"het_plugin's plan made for vpp={VPP}: placement, layers per virtual stage, transports, "
                        "overlap_p2p_comm",
}
STOCK_CONFIGS = {   # run with --framework stock (issue 30): today's stock stack
    "3s-stock-today": "mixed cluster with today's stock stack: launch-order placement, uniform layers, every group's "
                      "hops inside a cluster on its fabric and across clusters on Ethernet (as NCCL's multi-network "
                      "communicator routes them; the emulator routes by destination)",
    "3s-ds-stock-today": "DeepSpeed's defaults on the same stock network routing",
}
ALL_CONFIGS = {**CONFIGS, **DS_CONFIGS, **VPP_CONFIGS, **STOCK_CONFIGS}


@dataclass
class RatioSetup:
    ratio: float
    profile_path: Path
    configs: list[dict]                      # sent to the ranks
    predictions: dict[str, float]            # config -> predicted step seconds
    compute_share: dict[str, float]          # config -> busiest stage's compute / predicted step
    plan_summary: dict = field(default_factory=dict)
    plan: Optional[Plan] = None              # het_plugin's plans as run (for predictions made again later)
    plan_vpp: Optional[Plan] = None
    links: dict = field(default_factory=dict)
    predictions_start: dict[str, float] = field(default_factory=dict)   # from the start-of-run calibration


def build_profile(compute: dict, links: dict, fabric_key: str) -> Profile:
    prof = Profile(description="measured on this machine through the emulator (bench_e2e)")
    mb = compute["micro_batch_size"]
    for kind in ("layer", "embedding", "output"):
        f, b = compute[kind]
        prof.add_compute(DEVICE, kind, mb, 1, max(f, 0.0), max(b, 0.0))
    def add(tier: str, key: str) -> None:
        prof.add_link(tier, links[key]["bandwidth"], latency_us=links[key]["latency_us"])

    if fabric_key == "ref":
        add("ib", "ref")
    else:
        add("ib", "ib")
        add("roce", "roce")
        add("ib/roce", "inter")
    add("socket", "eth")
    add("ethernet", "eth")
    return prof


def with_pipeline_overhead(compute: dict, x: float) -> dict:
    """The compute entries with ``x`` seconds more per micro-batch on each of the two stages."""
    out = dict(compute)
    out["embedding"] = [compute["embedding"][0] + x / 3, compute["embedding"][1] + 2 * x / 3]
    out["output"] = [compute["output"][0] + x / 3, compute["output"][1] + 2 * x / 3]
    out["pipeline_overhead_per_micro_batch"] = x
    return out


def with_chunk_overhead(compute: dict, vpp: int, layers_per_stage: int) -> dict:
    """The compute entries for an interleaved run: each micro-batch calls every stage's ``vpp`` chunks, and each
    call pays the framework's per-micro-batch overhead (schedule, hooks, p2p calls) that the profile charges once
    per stage (in the embedding and output entries); the ``vpp - 1`` extra calls go on the layers (1:2 forward to
    backward), as the profile format has no per-chunk entry."""
    extra = (vpp - 1) * (compute.get("overhead_per_micro_batch", 0.0)
                         + compute.get("pipeline_overhead_per_micro_batch", 0.0)) / layers_per_stage
    out = dict(compute)
    out["layer"] = [compute["layer"][0] + extra / 3, compute["layer"][1] + 2 * extra / 3]
    return out


def calibrate_pipeline_overhead(shape: TinyShape, compute: dict, ref_link: dict, measured_s: float) -> float:
    """Per-micro-batch cost of the pipelined code path that the single-rank compute profile cannot see
    (p2p calls, schedule, gradient-reduction threads sharing the CPU): the ``x`` for which the predictor
    matches a calibration run on an unshaped reference network (PP x DP, uniform layers). Bisection:
    the prediction grows with x."""
    spec = shape.model_spec()
    dims = ParallelDims(tp=1, cp=1, pp=PP, dp=DP)
    fast = fast_cluster(20)
    uniform = uniform_layers(spec.num_layers, PP)
    links = {"ref": ref_link, "eth": ref_link}

    def predicted(x: float) -> float:
        prof = build_profile(with_pipeline_overhead(compute, x), links, "ref")
        p = predict(fast, spec, default_placement(fast, dims), uniform, spec.micro_batch_size, profile=prof)
        return p.iteration_s + compute.get("overhead_per_step", 0.0)

    lo = -min(sum(compute["embedding"]), sum(compute["output"]))
    hi = measured_s
    if predicted(lo) >= measured_s:
        return lo
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < measured_s else (lo, mid)
    return (lo + hi) / 2


def _plan(cluster, spec, profile: Optional[Profile], vpp: int = 1):
    kwargs = dict(tp=1, pp=PP, dp=DP, micro_batch_size=spec.micro_batch_size)
    if vpp > 1:
        kwargs["vpp"] = vpp
    if "profile" in inspect.signature(make_plan).parameters:
        kwargs["profile"] = profile
    return make_plan(cluster, spec, **kwargs)


def setup_ratio(ratio: float, shape: TinyShape, compute: dict, links: dict, out_dir: Path) -> RatioSetup:
    spec = shape.model_spec()
    mixed = mixed_cluster(ratio)
    prof = build_profile(compute, links, "fabric")
    prof_ref = build_profile(compute, links, "ref")
    tag = f"{ratio:g}to1"
    out_dir.mkdir(parents=True, exist_ok=True)
    profile_path = out_dir / f"profile-{tag}.yaml"
    prof.save(profile_path)
    prof_ref.save(out_dir / f"profile-{tag}-reference.yaml")

    dims = ParallelDims(tp=1, cp=1, pp=PP, dp=DP)
    mb = spec.micro_batch_size
    plan = _plan(mixed, spec, prof)
    plan_path = out_dir / f"plan-{tag}.json"
    plan.save(plan_path)
    placed = Placement.from_rank_of_logical(dims, plan.rank_of_logical, tuple(mixed.domains))
    # the interleaved runs' profile: the extra chunk calls' framework overhead on the layers (with_chunk_overhead)
    chunked = with_chunk_overhead(compute, VPP, spec.num_layers // PP)
    prof_vpp = build_profile(chunked, links, "fabric")
    prof_vpp.save(out_dir / f"profile-{tag}-vpp{VPP}.yaml")
    plan_vpp = _plan(mixed, spec, prof_vpp, VPP)
    plan_vpp_path = out_dir / f"plan-{tag}-vpp{VPP}.json"
    plan_vpp.save(plan_vpp_path)
    uniform = uniform_layers(spec.num_layers, PP)

    # Placement only: the plan as is (a plan file must keep the transports its nodes give); its run maps every
    # transport onto Ethernet (eth_only below) and its prediction uses the framework's transports.
    only_place = assemble_plan(mixed, spec, placed, uniform, mb, overlap_grad_reduce=True)
    only_place_path = out_dir / f"plan-{tag}-placement-only.json"
    only_place.save(only_place_path)
    place_transport = assemble_plan(mixed, spec, placed, uniform, mb, overlap_grad_reduce=True)
    place_transport_path = out_dir / f"plan-{tag}-placement-transport.json"
    place_transport.save(place_transport_path)

    base = dict(pp=PP, overlap=True, micro_batch_size=mb, layers=None, plan=None, ifname="eth0", ifnames=None)
    eth_only = "ib=eth0,roce=eth0,socket=eth0,host-staged=eth0,local=lo"
    configs = [
        dict(base, name="1-all-fast", ifname="ref0"),
        dict(base, name="2-all-eth", ifnames=eth_only),
        dict(base, name="3-mixed-today", ifnames=eth_only),
        dict(base, name="4p-placement", plan=str(only_place_path), ifnames=eth_only),
        dict(base, name="4t-place+transport", plan=str(place_transport_path)),
        dict(base, name="4-het_plugin", plan=str(plan_path), overlap=plan.overlap_grad_reduce,
             micro_batch_size=plan.micro_batch_size),
        dict(base, name="3-ds", framework="deepspeed", overlap=False, ifnames=eth_only),
        dict(base, name="4-ds", framework="deepspeed", overlap=False, plan=str(plan_path),
             micro_batch_size=plan.micro_batch_size),
        # Megatron's own interleaved schedule on the all-fast network, with the p2p overlap het_plugin's plan assumes
        dict(base, name="1v-all-fast+vpp", ifname="ref0", vpp=VPP,
             config_overrides={"overlap_p2p_comm": True, "batch_p2p_comm": False}),
        dict(base, name="5-het_plugin+vpp", plan=str(plan_vpp_path), vpp=VPP, overlap=plan_vpp.overlap_grad_reduce,
             micro_batch_size=plan_vpp.micro_batch_size),
        # today's stock stack: the frameworks' own groups bound to the fabric interface; the emulator sends a hop to
        # another cluster over Ethernet (its route by destination), as a multi-network communicator would
        dict(base, name="3s-stock-today", ifname="fab0"),
        dict(base, name="3s-ds-stock-today", framework="deepspeed", overlap=False, ifname="fab0"),
    ]
    predictions, share = predict_configs(ratio, shape, compute, links, plan, plan_vpp)
    summary = {"layers_per_stage": plan.layers_per_stage, "rank_of_logical": plan.rank_of_logical,
               "micro_batch_size": plan.micro_batch_size, "num_micro_batches": plan.num_micro_batches,
               "overlap_grad_reduce": plan.overlap_grad_reduce,
               "transports": {k: sorted({g.transport for g in v}) for k, v in plan.groups.items() if v},
               "hash": plan.hash,
               "vpp_plan": {"vpp": plan_vpp.vpp, "layers_per_stage": plan_vpp.layers_per_stage,
                            "layers_per_virtual_stage": plan_vpp.layers_per_virtual_stage,
                            "rank_of_logical": plan_vpp.rank_of_logical,
                            "micro_batch_size": plan_vpp.micro_batch_size,
                            "overlap_p2p_comm": plan_vpp.overlap_p2p_comm, "hash": plan_vpp.hash}}
    return RatioSetup(ratio, profile_path, configs, predictions, share, summary, plan, plan_vpp)


def predict_configs(ratio: float, shape: TinyShape, compute: dict, links: dict, plan: Plan,
                    plan_vpp: Plan) -> tuple[dict[str, float], dict[str, float]]:
    """Every configuration's predicted step (s) and compute share at ``ratio`` from ``compute`` and ``links``, for
    het_plugin's plans as they ran (``plan``, ``plan_vpp``: placement and layer split are theirs, not re-planned)."""
    spec = shape.model_spec()
    mixed = mixed_cluster(ratio)
    prof = build_profile(compute, links, "fabric")
    prof_ref = build_profile(compute, links, "ref")
    chunked = with_chunk_overhead(compute, VPP, spec.num_layers // PP)
    prof_vpp, prof_ref_vpp = build_profile(chunked, links, "fabric"), build_profile(chunked, links, "ref")
    dims = ParallelDims(tp=1, cp=1, pp=PP, dp=DP)
    mb = spec.micro_batch_size
    uniform = uniform_layers(spec.num_layers, PP)
    placed = Placement.from_rank_of_logical(dims, plan.rank_of_logical, tuple(mixed.domains))
    placed_vpp = Placement.from_rank_of_logical(dims, plan_vpp.rank_of_logical, tuple(mixed.domains))
    fast = fast_cluster(ratio)
    slow = slow_cluster()
    preds = {
        "1-all-fast": predict(fast, spec, default_placement(fast, dims), uniform, mb, profile=prof_ref),
        "2-all-eth": predict(slow, spec, default_placement(slow, dims), uniform, mb, profile=prof),
        "3-mixed-today": predict(mixed, spec, default_placement(mixed, dims), uniform, mb,
                                 transport_fn=baseline_transport, profile=prof),
        "4p-placement": predict(mixed, spec, placed, uniform, mb, transport_fn=baseline_transport, profile=prof),
        "4t-place+transport": predict(mixed, spec, placed, uniform, mb, transport_fn=cluster_transport, profile=prof),
        "4-het_plugin": predict(mixed, spec, placed, plan.layers_per_stage, plan.micro_batch_size,
                                transport_fn=cluster_transport, overlap_grad_reduce=plan.overlap_grad_reduce,
                                profile=prof),
        # DeepSpeed's pipeline engine reduces gradients after the last micro-batch: no overlap
        "3-ds": predict(mixed, spec, default_placement(mixed, dims), uniform, mb, transport_fn=baseline_transport,
                        overlap_grad_reduce=False, profile=prof),
        "4-ds": predict(mixed, spec, placed, plan.layers_per_stage, plan.micro_batch_size, transport_fn=cluster_transport,
                        overlap_grad_reduce=False, profile=prof),
        "1v-all-fast+vpp": predict(fast, spec, default_placement(fast, dims), uniform, mb, profile=prof_ref_vpp,
                                   vpp=VPP, overlap_p2p_comm=True),
        "5-het_plugin+vpp": predict(mixed, spec, placed_vpp, plan_vpp.layers_per_stage, plan_vpp.micro_batch_size,
                                    transport_fn=cluster_transport, overlap_grad_reduce=plan_vpp.overlap_grad_reduce,
                                    profile=prof_vpp, vpp=VPP, overlap_p2p_comm=plan_vpp.overlap_p2p_comm),
        "3s-stock-today": predict(mixed, spec, default_placement(mixed, dims), uniform, mb,
                                  transport_fn=stock_multinet_transport, profile=prof),
        "3s-ds-stock-today": predict(mixed, spec, default_placement(mixed, dims), uniform, mb,
                                     transport_fn=stock_multinet_transport, overlap_grad_reduce=False, profile=prof),
    }
    # het_plugin.core.cost has no CPU per-step overhead (update, zero-grad, loss sync): add the measured one
    step_overhead = compute.get("overhead_per_step", 0.0)
    mbs = {"4-het_plugin": plan.micro_batch_size, "4-ds": plan.micro_batch_size,
           "5-het_plugin+vpp": plan_vpp.micro_batch_size}
    m = {k: spec.global_batch_size // (DP * mbs.get(k, mb)) for k in preds}
    share = {k: m[k] * max(p.stage_compute_s) / (p.iteration_s + step_overhead) for k, p in preds.items()}
    return {k: p.iteration_s + step_overhead for k, p in preds.items()}, share
