"""A script that builds its own process groups before Megatron-LM initialises anything (``pretrain(...,
skip_model_parallel_init=True, pg_collection=...)``, the MiMo pattern), 4 real ranks on gloo: after parse_args
planned the cluster file (the launch state and the start trigger, as ``--heterogeneous-nic`` leaves them), the
script's first ``HyperCommGrid.create_pg`` runs the one start-up (the ranks agree over the store), the grid's groups
and the embedding groups made from its enumeration are the plan's, communicate among the plan's ranks and pass the
group check; degrees changed in Megatron's args after planning stop every rank alike before any group.

This file is also the rank script (``python test_megatron_pg_collection.py MODE``)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLUSTER = HERE / "data" / "preflight-ib-roce-4.yaml"       # IB + RoCE, launched interleaved: a permutation
GLOO = {"HET_PLUGIN_GLOO_IFNAMES": "ib=lo,roce=lo,socket=lo,local=lo"}


def launch(mode: str) -> list[dict]:
    from integration_tests.support.launch import run_ranks
    outs = run_ranks(Path(__file__), 4, [mode], env=GLOO, ranks_per_node=1, timeout=240)
    return sorted((o.result for o in outs), key=lambda r: r["rank"])


def test_a_scripts_own_grid_starts_the_plan_and_its_groups_are_the_plans():
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.planner import make_plan
    plan = make_plan(load_cluster(CLUSTER), model(), tp=1, pp=2, micro_batch_size=1)
    assert not plan.is_identity
    res = launch("served")
    assert len({r["plan"] for r in res}) == 1 and res[0]["plan"] == plan.hash
    for r in res:
        rank = r["rank"]
        pp = next(g.ranks for g in plan.groups["pp"] if rank in g.ranks)
        dp = next(g.ranks for g in plan.groups["dp"] if rank in g.ranks)
        assert r["pp"] == pp and sorted(r["dp"]) == sorted(dp) and r["embd"] == pp, r
        assert r["pp_sum"] == sum(pp) and r["dp_sum"] == sum(dp), "the groups communicate among the plan's ranks"
        assert r["checked"] >= 5 and r["megatron_globals"] is False
        assert r["socket_groups"] > 0, "the pipeline and embedding groups cross fabrics: the policy named it"


def test_degrees_changed_after_planning_stop_every_rank_before_any_group():
    res = launch("changed")
    texts = {r["error"] for r in res}
    assert len(texts) == 1 and None not in texts, texts
    assert "--tensor-model-parallel-size" in texts.pop()
    assert all(r["new_groups"] == 0 for r in res)


def model():
    from het_plugin.core.inputs.model import ModelSpec
    return ModelSpec(name="t", num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16,
                     global_batch_size=4, micro_batch_size=1)


def rank_main(mode: str) -> None:
    sys.path.insert(0, str(HERE.parent))
    from integration_tests.support.launch import arm_watchdog, report
    arm_watchdog()
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    from het_plugin.core.errors import HetPluginError
    from het_plugin.megatron import applied_state, group_check, late_groups, launch_state, lm
    from het_plugin.megatron.mcore import resolve_megatron_launch

    rank = int(os.environ["RANK"])
    tp = 2 if mode == "changed" else 1       # MiMo copies its own --llm-tp into Megatron's args after parse_args
    # what parse_args leaves with --heterogeneous-nic FILE: the plan in the launch state, the start trigger on
    resolved = resolve_megatron_launch(str(CLUSTER), model=model(), world_size=4, rank=rank, tp=1, pp=2,
                                       micro_batch_size=1)
    args = SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=2, context_parallel_size=1,
                           micro_batch_size=1, global_batch_size=None, rampup_batch_size=None,
                           heterogeneous_timeout=60.0, heterogeneous_nic=str(CLUSTER), use_distributed_optimizer=False)
    launch_state.write(launch_state.LaunchState(args=args, source=str(CLUSTER), plan=resolved.plan,
                                                cluster=resolved.cluster))
    late_groups.install_start(lm.start_explicit_groups)
    dist.init_process_group("gloo")
    made = []
    original = dist.new_group
    dist.new_group = lambda *a, **kw: made.append(1) or original(*a, **kw)
    try:
        grid = HyperCommGrid([tp, 1, 4 // (2 * tp), 2], ["tp", "cp", "dp", "pp"])
        pgc = ProcessGroupCollection()
        pgc.tp, pgc.pp, pgc.dp = grid.create_pg("tp"), grid.create_pg("pp"), grid.create_pg("dp")
        pgc.mp = grid.create_pg(["tp", "pp"])
        for pp in grid.get_rank_enum("pp"):             # MiMo's and the inference shards' embedding groups
            group = dist.new_group(ranks=[pp[0], pp[-1]])
            if rank in pp:
                pgc.embd = group
        checked = group_check.check_groups(pgc)
        sums = {}
        for name in ("pp", "dp"):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=getattr(pgc, name))
            sums[name] = int(t.item())
        applied = applied_state.current_plan()
        report({"rank": rank, "plan": applied.plan.hash, "pp": dist.get_process_group_ranks(pgc.pp),
                "dp": dist.get_process_group_ranks(pgc.dp), "embd": dist.get_process_group_ranks(pgc.embd),
                "pp_sum": sums["pp"], "dp_sum": sums["dp"], "checked": checked,
                "megatron_globals": parallel_state.model_parallel_is_initialized(),
                "socket_groups": sum(r.transport == "socket" for r in applied.records)})
    except HetPluginError as exc:
        report({"rank": rank, "error": str(exc), "new_groups": len(made)})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(sys.argv[1])
