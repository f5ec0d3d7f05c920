#!/usr/bin/env python
"""Train a tiny Megatron-Core GPT on CPU (gloo) through het_plugin and print its losses.

    python examples/megatron/train_tiny.py --heterogeneous-nic integration_tests/data/megatron-ib-roce-8.yaml --tp 2 --pp 2

Without RANK in the environment the script launches itself once per rank of the cluster (or plan)
file, with torchrun-style variables shaped like the file's nodes (LOCAL_WORLD_SIZE per node), so one
machine stands in for the cluster. Under torchrun it runs as the given rank.

CPU ONLY: Megatron-Core's GPT needs three CUDA shims to run on CPU; they come from the repository's
TEST SUPPORT code (integration_tests/support/megatron_cpu.py, megatron_tiny.py), not from het_plugin.
On GPUs use Megatron-LM itself (see pretrain_gpt_hetero.sh).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heterogeneous-nic", required=True, metavar="FILE", help="cluster file or plan file")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: the planner chooses)")
    p.add_argument("--pp", type=int, help="pipeline-parallel size (default: the planner chooses)")
    p.add_argument("--num-layers", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeout", type=float, default=600, help="seconds before the local launch gives up")
    return p.parse_args()


def rank_envs(path: str) -> list[dict]:
    """torchrun-style per-rank variables shaped like the file's nodes."""
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.plan import Plan, looks_like_plan
    if looks_like_plan(path):
        nodes = [(n.first_rank, n.num_ranks) for n in Plan.load(path).nodes]
    else:
        c = load_cluster(path)
        nodes = [(c.node_first_rank[n.index], n.num_accelerators) for n in c.nodes]
    envs = []
    for node_rank, (first, count) in enumerate(nodes):
        for local in range(count):
            envs.append({"LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(count), "GROUP_RANK": str(node_rank)})
    return envs


def launch(a: argparse.Namespace) -> int:
    from integration_tests.support.launch import run_ranks   # test support: a hard-timeout local launcher
    envs = rank_envs(a.heterogeneous_nic)
    print(f"launching {len(envs)} local ranks for {a.heterogeneous_nic} ...", flush=True)
    outs = run_ranks(Path(__file__), len(envs), sys.argv[1:], rank_env=envs, timeout=a.timeout, check=False)
    failed = [o for o in outs if o.returncode != 0]
    for o in failed[:1]:
        print(o.stderr[-3000:], file=sys.stderr)
    print(outs[0].stdout, end="")
    return 1 if failed else 0


def train_rank(a: argparse.Namespace) -> int:
    from integration_tests.support.megatron_tiny import TinyGPT, shutdown, train
    source = a.heterogeneous_nic
    from het_plugin.core.plan import looks_like_plan
    is_plan = looks_like_plan(source)
    result = train(TinyGPT(num_layers=a.num_layers), tp=a.tp, pp=a.pp, steps=a.steps,
                   cluster=None if is_plan else source, plan=source if is_plan else None)
    if result.rank == 0:
        print(f"tp={result.tp} pp={result.pp} dp={result.dp}, overlap_grad_reduce={result.overlap_grad_reduce}")
        for step, (loss, t) in enumerate(zip(result.losses, result.step_times)):
            print(f"step {step}: loss {loss:.6f}  ({t * 1000:.0f} ms)")
    shutdown()
    return 0


def main() -> int:
    a = parse()
    if "RANK" not in os.environ:
        return launch(a)
    return train_rank(a)


if __name__ == "__main__":
    sys.exit(main())
