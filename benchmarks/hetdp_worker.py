"""Rank script of the heterogeneous data-parallel benchmark (run by bench_hetdp.py inside the emulator).

Trains every configuration of the job file for a few rounds, the order rotated each round so that no
configuration always runs first, through the end-to-end benchmark's trainer (e2e_worker.run_config: the
tiny GPT on Megatron-Core or DeepSpeed, gloo groups on the interfaces the configuration names). Rank 0 writes
the step times (per step, the slowest rank's) and losses to the job's results file.

A job with ``links`` instead measures them (e2e_worker.measure_pair: latency and bandwidth by message size, gloo
send/recv between two ranks on one interface, the others waiting) and rank 0 writes them to the results file.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch.distributed as dist  # noqa: E402

from e2e_worker import measure_pair, new_pair_group, run_config  # noqa: E402


def measure_links(pairs: list, sizes: list[int], reps: int) -> dict:
    groups = [(key, new_pair_group(ranks, ifname), ranks) for key, ranks, ifname in pairs]
    return {key: measure_pair(group, a, b, sizes, reps) for key, group, (a, b) in groups}


def train_all(job: dict) -> dict:
    configs = job["configs"]
    results: dict[str, list] = {c["name"]: [] for c in configs}
    losses: dict[str, list] = {}
    layouts: dict[str, list] = {}
    for rnd in range(job["rounds"]):
        order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
        for cfg in order:
            times, loss = run_config(job["shape"], cfg, job["warmup"] + job["steps"])
            if isinstance(loss, dict):        # DeepSpeed: the losses and where every rank ran
                layouts[cfg["name"]] = loss["ranks"]
                loss = loss["losses"]
            results[cfg["name"]].append(times)
            losses[cfg["name"]] = loss
            if dist.get_rank() == 0:
                print(f"round {rnd}: {cfg['name']}: " + " ".join(f"{t * 1e3:.0f}" for t in times) + " ms "
                      f"(ended {time.strftime('%H:%M:%S')})", flush=True)
    return {"step_times": results, "losses": losses, "layouts": layouts}


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    os.environ["HET_PLUGIN_GLOO_IFNAMES_DEFAULT"] = os.environ.get("HET_PLUGIN_GLOO_IFNAMES", "")
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    if "links" in job:
        out = {"links": measure_links(job["links"], job["link_sizes"], job["link_reps"])}
    else:
        out = train_all(job)
    if dist.get_rank() == 0:
        tmp = Path(job["results"] + ".tmp")
        tmp.write_text(json.dumps(out))
        tmp.rename(job["results"])
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
