"""Rank script of the end-to-end benchmark (run by bench_e2e.py inside the emulated network).

One launch does everything, talking to the parent through files (``Handshake``): per fast:slow ratio the
parent reshapes the fabric, the ranks measure each link with gloo, the parent plans (with the compute profile
from e2e_compute.py and these links), and the ranks train every configuration for a few rounds, interleaved.
Rank 0 posts results; every rank follows rank 0.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from integration_tests.support.launch import report  # noqa: E402


class Handshake:
    """Rank 0 writes ``<n>-<name>.req.json`` and waits for ``.resp.json``; the answer is broadcast."""

    def __init__(self, folder: str):
        self.folder = Path(folder)
        self.n = 0

    def ask(self, name: str, payload) -> object:
        self.n += 1
        box = [None]
        if dist.get_rank() == 0:
            req = self.folder / f"{self.n:03d}-{name}.req.json"
            tmp = req.with_suffix(".tmp")
            tmp.write_text(json.dumps(payload))
            tmp.rename(req)
            resp = self.folder / f"{self.n:03d}-{name}.resp.json"
            while not resp.exists():
                time.sleep(0.05)
            box[0] = json.loads(resp.read_text())
        dist.broadcast_object_list(box, src=0)
        return box[0]


# ---- group bookkeeping: a process runs many configurations, so their gloo groups are destroyed -------

def track_groups() -> set:
    """The groups that exist before a configuration (kept: the link profile's pairs, the world)."""
    from integration_tests.support import megatron_tiny
    return megatron_tiny.groups_now()


def destroy_groups(before: set) -> None:
    """Every group the configuration created destroyed and collected (megatron_tiny.release_groups: leftover gloo
    groups poll, and the rounds of one run got slower and slower: 704 / 1325 / 2337 ms for one configuration)."""
    from integration_tests.support import megatron_tiny
    megatron_tiny.release_groups(keep=before)


# ---- link profile --------------------------------------------------------------------------------

def new_pair_group(ranks: list[int], ifname: str):
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    try:
        return dist.new_group(ranks)
    finally:
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"


def measure_pair(group, a: int, b: int, sizes: list[int], reps: int) -> dict:
    """From ``a`` to ``b``: latency (half the round trip of a 4-byte message) and, per message size, the
    Gbit/s of a send followed by a 4-byte ack (the ack's round trip subtracted)."""
    me = dist.get_rank()
    ack = torch.zeros(1)

    def round_trips(payload, count: int) -> list[float]:
        """``a`` sends ``payload``, ``b`` answers with the 4-byte ack; seconds per round trip."""
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            if me == a:
                dist.send(payload, b, group=group)
                dist.recv(ack, b, group=group)
            else:
                dist.recv(payload, a, group=group)
                dist.send(ack, a, group=group)
            out.append(time.perf_counter() - t0)
        return out

    rtt = round_trips(ack, 8) if me in (a, b) else []
    t_rtt = statistics.median(rtt[2:]) if rtt else 0.0
    points = []
    for nbytes in sizes:
        times = round_trips(torch.zeros(nbytes // 4), reps + 1) if me in (a, b) else []
        if me == a:
            t = max(1e-6, statistics.median(times[1:]) - t_rtt)
            points.append([nbytes, nbytes * 8 / t / 1e9])
        dist.barrier()
    box = [{"latency_us": t_rtt / 2 * 1e6, "bandwidth": points}]
    dist.broadcast_object_list(box, src=a)      # the sender's numbers
    return box[0]


# ---- training configurations ----------------------------------------------------------------------

def forget_plan() -> None:
    """A job applies one plan per process; this one trains many configurations in turn: take back the last
    configuration's plan (its uneven replica wrappers would otherwise run the next configuration's schedule)."""
    from het_plugin.megatron import forget_plan as forget
    forget()


def run_config(shape: dict, cfg: dict, steps: int) -> list[float]:
    """Train ``steps`` steps of one configuration; per-step time = the slowest rank's."""
    if cfg.get("framework") == "deepspeed":
        return run_deepspeed_config(shape, cfg, steps)
    from integration_tests.support import megatron_tiny
    from megatron.core import parallel_state as ps
    os.environ["GLOO_SOCKET_IFNAME"] = cfg["ifname"]
    os.environ["HET_PLUGIN_GLOO_IFNAMES"] = cfg.get("ifnames") or os.environ["HET_PLUGIN_GLOO_IFNAMES_DEFAULT"]
    before = track_groups()
    try:
        tiny = megatron_tiny.TinyGPT(**dict(shape, micro_batch_size=cfg.get("micro_batch_size",
                                                                              shape["micro_batch_size"])))
        # interleaved configurations: vpp chunks per rank (the plugin's plan sets the p2p overlap itself)
        extra = {k: cfg[k] for k in ("vpp", "config_overrides") if cfg.get(k) is not None}
        if cfg["plan"]:
            res = megatron_tiny.train(tiny, tp=1, pp=cfg["pp"], steps=steps, plan=cfg["plan"], use_plugin=True,
                                      overlap_grad_reduce=cfg["overlap"], **extra)
        else:
            res = megatron_tiny.train(tiny, tp=1, pp=cfg["pp"], steps=steps, use_plugin=False,
                                      layers_per_stage=cfg.get("layers"), overlap_grad_reduce=cfg["overlap"], **extra)
    finally:
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        ps.destroy_model_parallel()
        destroy_groups(before)
        forget_plan()
    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, res.step_times)
    return [max(t[i] for t in times) for i in range(steps)], res.losses


def run_deepspeed_config(shape: dict, cfg: dict, steps: int) -> tuple[list[float], dict]:
    """The DeepSpeed configurations (e2e_deepspeed.py); same interfaces and group clean-up as above."""
    import e2e_deepspeed

    os.environ["GLOO_SOCKET_IFNAME"] = cfg["ifname"]
    os.environ["HET_PLUGIN_GLOO_IFNAMES"] = cfg.get("ifnames") or os.environ["HET_PLUGIN_GLOO_IFNAMES_DEFAULT"]
    before = track_groups()
    try:
        step_times, losses, layout = e2e_deepspeed.train(shape, cfg, steps)
    finally:
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        destroy_groups(before)
        if cfg["plan"]:     # the next configuration (perhaps DeepSpeed alone) must not inherit the plan's placement
            import het_plugin.deepspeed as hds
            hds.forget_plan()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (step_times, layout))
    times = [t for t, _ in gathered]
    # for DeepSpeed the losses entry also says where every rank ran (checked in the printed table)
    return [max(t[i] for t in times) for i in range(steps)], {"losses": losses,
                                                               "ranks": [lay for _, lay in gathered]}


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    os.environ["HET_PLUGIN_GLOO_IFNAMES_DEFAULT"] = os.environ.get("HET_PLUGIN_GLOO_IFNAMES", "")
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    hs = Handshake(job["handshake"])
    shape = job["shape"]
    pairs = {name: (new_pair_group(ranks, ifname), ranks) for name, ranks, ifname in job["links"]}
    cal = hs.ask("calibrate", {})          # the parent opened the reference network wide
    if cal.get("config"):
        group, (a, b) = pairs["ref"]
        link = measure_pair(group, a, b, job["link_sizes"], job["link_reps"])
        runs = [run_config(shape, cal["config"], job["warmup"] + job["steps"])[0] for _ in range(cal["rounds"])]
        hs.ask("calibration", {"link": link, "step_times": runs})
    while True:
        step = hs.ask("next", {})
        if step.get("done"):
            break
        if step.get("calibrate"):           # the calibration run again, as one of the round's configurations
            runs = [run_config(shape, step["calibrate"], job["warmup"] + job["steps"])[0]]
            hs.ask("calibration", {"step_times": runs, "round": step["round"]})
            continue
        links = {}
        for name in step["measure"]:
            group, (a, b) = pairs[name]
            links[name] = measure_pair(group, a, b, job["link_sizes"], job["link_reps"])
        configs = hs.ask("links", links)["configs"]
        results = {c["name"]: [] for c in configs}
        losses = {}
        # the parent visits each ratio once per round (its "round"); an older parent: every round at once
        for rnd in ([step["round"]] if "round" in step else range(job["rounds"])):
            order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
            for cfg in order:
                times, loss = run_config(shape, cfg, job["warmup"] + job["steps"])
                results[cfg["name"]].append(times)
                losses[cfg["name"]] = loss
        hs.ask("results", {"step_times": results, "losses": losses})
    dist.barrier()
    dist.destroy_process_group()
    report({"rank": dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"]), "ok": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
