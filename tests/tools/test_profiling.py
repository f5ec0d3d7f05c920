"""``het-plugin profile``'s pure parts: what is measured (links, TP degrees, rounds), the memory refusal, and the
measuring math (rates from timings, curves from records) -- no processes."""
from pathlib import Path

import pytest

from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.model import ModelSpec, preset_model
from het_plugin.core.planner import make_plan
from het_plugin.core.inputs.profile import load_profile
from het_plugin.tools.profiler import records as rec
from het_plugin.tools.profiler.records import bus_gbps, build_profile, link_gbps
from het_plugin.tools.profiler.settings import (
    check_memory,
    compute_jobs,
    device_types,
    link_jobs,
    make_settings,
    memory_need_bytes,
    sender_counts,
    tp_degrees,
)

DATA = Path(__file__).resolve().parents[2] / "integration_tests" / "data"
TINY = ModelSpec(name="tiny", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32,
                 global_batch_size=8, dtype="fp32")


def _cluster(apn: int = 2, count: int = 2, clusters=("ib",)) -> object:
    return cluster_from_dict({"name": "t", "clusters": [
        {"name": c, "fabric": {"type": c if c in ("ib", "roce") else "ethernet", "gbps": 100},
         "nodes": [{"count": count, "accelerator": "A100-80", "accelerators_per_node": apn,
                    "nics": [{"type": "ethernet", "gbps": 25}]}]} for c in clusters]})


# ---- what is measured -----------------------------------------------------------------------------


def test_link_jobs_cover_every_tier_and_pair_of_clusters():
    jobs = link_jobs(load_cluster(DATA / "emu_two_clusters.yaml"))
    got = [(j.key, j.back_key, j.cluster, j.transport, j.senders, j.receivers) for j in jobs]
    assert got == [("ib", "ib", "ib", "ib", (0,), (1,)), ("socket", "socket", "ib", "socket", (0,), (1,)),
                   ("roce", "roce", "roce", "roce", (2,), (3,)), ("socket", "socket", "roce", "socket", (2,), (3,)),
                   ("ib->roce", "roce->ib", None, "socket", (0,), (2,))]


def test_link_jobs_inside_a_node_and_with_several_senders():
    jobs = link_jobs(_cluster(apn=4, count=2, clusters=("ib", "eth")))
    by = {(j.key, j.cluster): j for j in jobs}
    assert by[("local", "ib")].senders == (0,) and by[("local", "ib")].receivers == (2,)
    assert by[("ib", "ib")].senders == (0, 1, 2, 3) and by[("ib", "ib")].receivers == (4, 5, 6, 7)
    assert ("socket", "eth") in by and ("socket", "ib") in by          # an Ethernet fabric is a socket group
    assert by[("ib->eth", None)].back_key == "eth->ib"
    assert sender_counts(4, quick=False) == [1, 2, 4] and sender_counts(6, quick=False) == [1, 2, 4, 6]
    assert sender_counts(4, quick=True) == [1, 4] and sender_counts(1, quick=True) == [1]


def test_tp_degrees_fit_the_node_and_split_the_model():
    dev = device_types(_cluster(apn=8))[0]
    assert tp_degrees(TINY, dev, None) == [1, 2, 4]                    # 4 heads: not 8
    assert tp_degrees(TINY, dev, [2, 8]) == [2]
    with pytest.raises(ConfigError, match="tp=8 fits no device type") as err:
        compute_jobs(_cluster(apn=8), TINY, make_settings(tp=[8]))
    assert err.value.field == "--tp"


def test_compute_rounds_run_every_device_type_at_once():
    cluster = load_cluster(DATA / "emu_two_devices.yaml")
    rounds = compute_jobs(cluster, TINY, make_settings(micro_batch_sizes=[1, 4]))
    assert [(r[0].kind, r[0].micro_batch_size) for r in rounds] == [
        ("layer", 1), ("layer", 4), ("embedding", 1), ("embedding", 4), ("output", 1), ("output", 4)]
    assert all([(j.device, j.ranks) for j in r] == [("dev-a", (0,)), ("dev-b", (2,))] for r in rounds)
    moe = TINY.model_copy(update={"num_moe_experts": 4, "moe_layer_freq": 2})
    kinds = [r[0].kind for r in compute_jobs(cluster, moe, make_settings(micro_batch_sizes=[1]))]
    assert kinds == ["layer", "moe_layer", "embedding", "output"]


def test_a_size_that_does_not_fit_is_refused_naming_it():
    big = preset_model("gpt-7.5b")
    cluster = _cluster(apn=1, count=1)
    rounds = compute_jobs(cluster, big, make_settings(micro_batch_sizes=[1, 128]))
    with pytest.raises(ConfigError, match="micro-batch 128 with tp=1") as err:
        check_memory(big, rounds, {"A100-80": 80.0}, 2)
    assert err.value.field == "--micro-batch-sizes" and "[1] fit" in err.value.fix
    check_memory(big, compute_jobs(cluster, big, make_settings(micro_batch_sizes=[1])), {"A100-80": 80.0}, 2)
    # the estimate grows with the micro-batch and shrinks with TP
    assert memory_need_bytes(big, "layer", 8, 1, 2) > memory_need_bytes(big, "layer", 4, 1, 2) > \
        memory_need_bytes(big, "layer", 4, 2, 2)


def test_bad_options_are_refused_naming_the_flag():
    for kwargs, field in (({"micro_batch_sizes": [0]}, "--micro-batch-sizes"),
                          ({"message_sizes": [2]}, "--message-sizes"),
                          ({"window_s": 0.0}, "--window"), ({"compute": False, "links": False}, "--no-compute")):
        with pytest.raises(ConfigError) as err:
            make_settings(**kwargs)
        assert err.value.field == field
    s = make_settings(quick=True)
    assert s.micro_batch_sizes == (1, 2) and s.message_sizes == (65536, 16 << 20) and s.window_s == 0.1


# ---- the measuring math ---------------------------------------------------------------------------


def test_rates_from_timings():
    # 1 MB and its reply in 1.02 ms with 10 us latency each way: 8 Gbit/s beyond the two latencies
    assert link_gbps(1e6, 1, 1.02e-3, 10e-6) == pytest.approx(8.0)
    # two senders of a node, each 1 MB in 2 ms: the node moved 2 MB -> 8 Gbit/s
    assert link_gbps(1e6, 2, 2e-3, 0.0) == pytest.approx(8.0)
    # a point the noise put under its latencies still gets a finite (floored) rate
    assert link_gbps(8, 1, 15e-6, 10e-6) == pytest.approx(8 * 8 / (0.05 * 15e-6) / 1e9)
    # ring all-reduce of 1 MB over 4 members in 1.5 ms: each moved 1.5 MB -> 8 Gbit/s
    assert bus_gbps(1e6, 4, 1.5e-3) == pytest.approx(8.0)


def _records():
    R = rec
    return [
        R.ComputeRecord("dev-a", "layer", 1, 1, 0.010, 0.020), R.ComputeRecord("dev-a", "layer", 1, 1, 0.012, 0.024),
        R.ComputeRecord("dev-a", "layer", 1, 1, 0.011, 0.022), R.ComputeRecord("dev-a", "layer", 1, 4, 0.030, 0.060),
        R.ComputeRecord("dev-b", "layer", 1, 1, 0.020, 0.040),
        R.OptimizerRecord("dev-a", 1, 2e-9), R.OverheadRecord("dev-a", 0.003),
        R.SlotRecord("dev-a", 4e-5), R.SlotRecord("dev-a", 6e-5), R.SlotRecord("dev-a", 5e-5),
        R.LatencyRecord("ib", "ib", 20e-6),
        R.TransferRecord("ib", "ib", 1, 1 << 20, 1e-3), R.TransferRecord("ib", "ib", 1, 1 << 20, 2e-3),   # two ways
        R.TransferRecord("ib", "ib", 1, 1 << 16, 1e-4), R.TransferRecord("ib", "ib", 2, 1 << 20, 3e-3),
        R.AllReduceRecord("ib", "ib", 4, 1 << 20, 4e-3),
        R.LatencyRecord("a->b", None, 50e-6), R.LatencyRecord("b->a", None, 50e-6),
        R.TransferRecord("a->b", None, 1, 1 << 20, 4e-3), R.TransferRecord("b->a", None, 1, 1 << 20, 8e-3),
    ]


def test_records_become_curves_that_reproduce_the_measured_times(tmp_path):
    records = [rec.from_json(rec.to_json(r)) for r in _records()]        # as they travel over the store
    prof = build_profile(records, "test")
    path = tmp_path / "p.yaml"
    prof.save(path)
    back = load_profile(path)
    t = back.compute_time("dev-a", "layer", 1, 1)
    assert (t.forward_s, t.backward_s) == (0.011, 0.022)                 # the median of three ranks
    assert back.compute_time("dev-a", "layer", 4, 1).forward_s == 0.030
    assert back.compute_time("dev-b", "layer", 1, 1).forward_s == 0.020
    assert back.optimizer_s_per_param("dev-a", 1) == 2e-9 and back.iteration_overhead_s("dev-a") == 0.003
    assert back.pipeline_slot_s("dev-a") == 5e-5 and back.pipeline_slot_s("dev-b") is None    # measured, median
    # a tier kind keeps the slower direction; the profile's transfer time is the measured one without the reply
    lat = 20e-6
    assert back.step_s(["ib"], 1 << 20, 1, "ib") == pytest.approx(2e-3 - lat)
    assert back.step_s(["ib"], 1 << 16, 1, "ib") == pytest.approx(1e-4 - lat)
    assert back.step_s(["ib"], 1 << 20, 2, "ib") == pytest.approx(3e-3 - lat)      # two senders at once
    link = back.link("ib", "ib")
    assert link.latency_us == pytest.approx(20)
    assert link.allreduce == [(1 << 20, pytest.approx(bus_gbps(1 << 20, 4, 4e-3)))]
    # a named link is written per direction
    assert back.step_s(["a->b"], 1 << 20) == pytest.approx(4e-3 - 50e-6)
    assert back.step_s(["b->a"], 1 << 20) == pytest.approx(8e-3 - 50e-6)
    assert back.directional


def test_the_measured_faster_device_gets_more_layers():
    """The catalog calls dev-b twice as fast as dev-a; a profile measuring the opposite turns the split round."""
    cluster = load_cluster(DATA / "emu_two_devices.yaml")
    model = TINY.model_copy(update={"num_layers": 8, "micro_batch_size": 2})
    R = rec
    records = []
    for dev, scale in (("dev-a", 1.0), ("dev-b", 2.0)):
        for mb in (1, 2):
            records += [R.ComputeRecord(dev, "layer", 1, mb, scale * 0.01 * mb, scale * 0.02 * mb),
                        R.ComputeRecord(dev, "embedding", 1, mb, scale * 1e-4, scale * 2e-4),
                        R.ComputeRecord(dev, "output", 1, mb, scale * 0.005 * mb, scale * 0.01 * mb)]

    def split(profile):
        plan = make_plan(cluster, model, tp=1, pp=2, dp=2, profile=profile)
        return {cluster.node_of(plan.stage_ranks(s)[0]).accelerator.name: n
                for s, n in enumerate(plan.layers_per_stage)}
    analytic, measured = split(None), split(build_profile(records))
    assert analytic["dev-b"] > analytic["dev-a"]
    assert measured["dev-a"] > measured["dev-b"]


def test_megatron_layers_need_its_tp_groups_to_be_the_measuring_ones():
    from het_plugin.tools.profiler.megatron_layers import aligned
    assert aligned(8, [(0,), (0, 1), (4, 5), (0, 1, 2, 3)])
    assert not aligned(6, [(0, 1, 2, 3)])               # Megatron needs tp to divide the world
    assert not aligned(6, [(3, 4)])                     # a node of 3 ranks: its TP-2 group starts at rank 3


def test_a_point_the_device_cannot_hold_now_is_refused_not_crashed(monkeypatch):
    torch = pytest.importorskip("torch")
    from het_plugin.tools.profiler import compute
    from het_plugin.tools.profiler.settings import ComputeJob
    job = ComputeJob("A100-80", "layer", 2, 8, (0, 1))
    dev = compute.Device(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(compute, "free_bytes", lambda d: 1.0 * 2**30)
    with pytest.raises(ConfigError, match=r"layer of tiny at micro-batch 8 with tp=2 on A100-80: needs about 3\.0 GiB "
                                          r"but this cpu has 1\.0 GiB free") as err:
        compute.measure_fitting(job, TINY, dev, 5.0 * 2**30, 0, None, 0.1, 1)     # 2 GiB of it is a GPU's slack
    assert err.value.field == "--micro-batch-sizes"

    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(compute, "measure_job", oom)
    with pytest.raises(ConfigError, match="ran out of memory"):
        compute.measure_fitting(job, TINY, dev, 0.0, 0, None, 0.1, 1)


# ---- the command's refusals: one message naming the option, a fix line, exit 2, nothing written ----------

ONE_NODE = ("clusters: [{name: c, fabric: {type: ib, gbps: 100}, nodes: [{count: $count, accelerator: A100-80, "
            "accelerators_per_node: 1}]}]\n")


@pytest.mark.parametrize("args,where,problem", [
    (["--micro-batch-sizes", "0,2"], "--micro-batch-sizes", "[0] is not a list of whole numbers"),
    (["--micro-batch-sizes", "two"], "--micro-batch-sizes", "is not comma-separated whole numbers"),
    (["--message-sizes", "64X"], "--message-sizes", "'64X' is not a size"),
    (["--window", "0"], "--window", "is not between 0.001 and 600 seconds"),
    (["--tp", "3"], "--tp", "tp=3 fits no device type"),
    (["-o", "{tmp}/profile.txt"], "-o/--output", "cannot tell the format"),
    (["-o", "{tmp}/no-such-folder/p.yaml"], "-o/--output", ""),
    (["--count", "2"], "cluster", "the cluster has 2 ranks but the launch started 1"),
    (["--micro-batch-sizes", "1,512"], "--micro-batch-sizes", "at micro-batch 512 with tp=1"),
])
def test_profile_refuses_bad_options_before_measuring(args, where, problem, tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    from string import Template

    from het_plugin.cli import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    count = "1"
    if args[:1] == ["--count"]:
        count, args = args[1], args[2:]
    (tmp_path / "c.yaml").write_text(Template(ONE_NODE).substitute(count=count))
    out = ["-o", str(tmp_path / "p.yaml")] if "-o" not in args else []
    rc = main(["profile", str(tmp_path / "c.yaml"), "--model", "gpt-7.5b", *args, *out])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    assert len(lines) == 2 and lines[0].startswith("het-plugin profile: error: ") and lines[1].startswith("  fix: ")
    assert where in lines[0] and problem in lines[0], err
    assert not (tmp_path / "p.yaml").exists() and not (tmp_path / "profile.txt").exists()


def test_the_models_own_micro_batch_is_measured_by_default():
    assert make_settings(quick=True, model_micro_batch=4).micro_batch_sizes == (1, 2, 4)
    assert make_settings(model_micro_batch=2).micro_batch_sizes == (1, 2, 4, 8)
    assert make_settings(micro_batch_sizes=[3], model_micro_batch=4).micro_batch_sizes == (3,)   # given: as given


def test_the_allreduce_field_is_format_2_and_checked(tmp_path):
    link = "links: [{tier: ib, bandwidth: [{bytes: 1024, gbps: 1}], allreduce: [{bytes: 2048, gbps: 2}, " \
           "{bytes: 1024, gbps: 1}]}]\n"
    p = tmp_path / "p.yaml"
    p.write_text(link)
    with pytest.raises(ConfigError, match=r"format-2 fields \(links\[0\]\.allreduce\)"):
        load_profile(p)
    p.write_text("format: het_plugin-profile/2\n" + link)
    with pytest.raises(ConfigError, match="allreduce sizes"):
        load_profile(p)
    p.write_text("format: het_plugin-profile/2\n" + link.replace("2048, gbps: 2}, {bytes: 1024, gbps: 1}",
                                                                 "1024, gbps: 1}, {bytes: 2048, gbps: 2}"))
    assert load_profile(p).link("ib").allreduce == [(1024, 1.0), (2048, 2.0)]
