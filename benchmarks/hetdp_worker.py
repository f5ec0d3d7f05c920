"""Rank script of the heterogeneous data-parallel benchmark (run by bench_hetdp.py inside the emulator).

Trains every configuration of the job file for a few rounds, the order rotated each round so that no
configuration always runs first, through the end-to-end benchmark's trainer (e2e_worker.run_config: the
tiny Megatron-Core GPT, gloo groups on the interfaces the configuration names). Rank 0 writes the step
times (per step, the slowest rank's) and losses to the job's results file.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch.distributed as dist  # noqa: E402

from e2e_worker import run_config  # noqa: E402


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    os.environ["HET_PLUGIN_GLOO_IFNAMES_DEFAULT"] = os.environ.get("HET_PLUGIN_GLOO_IFNAMES", "")
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    configs = job["configs"]
    results: dict[str, list] = {c["name"]: [] for c in configs}
    losses: dict[str, list] = {}
    for rnd in range(job["rounds"]):
        order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
        for cfg in order:
            times, loss = run_config(job["shape"], cfg, job["warmup"] + job["steps"])
            results[cfg["name"]].append(times)
            losses[cfg["name"]] = loss
            if dist.get_rank() == 0:
                print(f"round {rnd}: {cfg['name']}: " + " ".join(f"{t * 1e3:.0f}" for t in times) + " ms",
                      flush=True)
    if dist.get_rank() == 0:
        tmp = Path(job["results"] + ".tmp")
        tmp.write_text(json.dumps({"step_times": results, "losses": losses}))
        tmp.rename(job["results"])
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
