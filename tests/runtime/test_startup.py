"""The one start-up sequence (het_plugin.runtime.startup): every adapter's entry point runs it, it is the only caller
of the plan agreement and of re-plan on restart, and a failure on one rank stops every rank before any group.
Ranks are threads over one HashStore (no process group)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

torch_dist = pytest.importorskip("torch.distributed")

import het_plugin  # noqa: E402
from het_plugin.core.cost.measured import RankTimes, measured_profile  # noqa: E402
from het_plugin.core.errors import ConfigError, PlanMismatchError  # noqa: E402
from het_plugin.core.launch import Resolved, resolve_launch  # noqa: E402
from het_plugin.core.request import LaunchRequest, Timeout  # noqa: E402
from het_plugin.runtime import exchange  # noqa: E402
from het_plugin.runtime.restart_replan import ran_plan_path  # noqa: E402
from het_plugin.runtime.startup import Planning, Replan, Started, resolve_start, startup  # noqa: E402
from tests.core.test_measured import IB_ROCE_4, tiny_model  # noqa: E402
from tests.runtime.test_agreement import hash_store, run_rank_threads  # noqa: E402

PACKAGE = Path(het_plugin.__file__).resolve().parent


@pytest.fixture(autouse=True)
def fresh_call_sequence():
    exchange.reset_call_counts()


def request_of(rank: int, seconds: float = 10.0) -> LaunchRequest:
    return LaunchRequest.of(4, rank=rank, tp=1, pp=2, micro_batch_size=2, timeout=Timeout(seconds))


def planning_for(request: LaunchRequest, calls: list, **more) -> Planning:
    def resolve(profile):
        calls.append(profile)
        return resolve_launch(str(IB_ROCE_4), request, model=tiny_model(), profile=profile)
    return Planning(resolve, **more)


def callers_of(name: str) -> set[str]:
    """Modules of het_plugin that call ``name`` (as a name or an attribute), over the source."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if called == name:
                    found.add(str(path.relative_to(PACKAGE)))
    return found


def test_startup_is_the_only_caller_of_the_agreement_and_of_replan_on_restart():
    assert callers_of("agree_on_plan") == {"runtime/startup.py"}
    assert callers_of("resolve_on_restart") == {"runtime/startup.py"}
    # and every entry point of both adapters runs it
    assert {"megatron/mcore.py", "megatron/lm.py", "deepspeed/pipe.py", "deepspeed/engine.py"} <= callers_of("startup")


def test_every_rank_gets_the_same_plan_its_cluster_and_what_it_applied():
    calls: dict[int, list] = {r: [] for r in range(4)}

    def body(rank, store):
        request = request_of(rank)
        return startup(request, planning_for(request, calls[rank]), store=store, default_backend="gloo")

    results = run_rank_threads(4, body, hash_store(4))
    assert all(isinstance(results[r], Started) for r in range(4)), results
    assert len({results[r].plan.hash for r in range(4)}) == 1
    for r in range(4):
        started = results[r]
        assert started.applied.rank == r and started.applied.plan is started.plan
        assert started.cluster is not None and started.cluster.world_size == 4 and started.applied.cluster is started.cluster
        assert calls[r] == [None]               # planned once, without a profile


def test_a_check_failing_on_one_rank_stops_every_rank_before_any_group():
    def body(rank, store):
        request = request_of(rank)

        def check(resolved):
            if rank == 1:
                raise ConfigError("the topology has data degree 3", source="ds.json", field="topology",
                                  fix="build the topology with num_dp=2")
        return startup(request, planning_for(request, [], check=check), store=store, default_backend="gloo")

    results = run_rank_threads(4, body, hash_store(4))
    assert isinstance(results[1], ConfigError) and results[1].field == "topology"
    for r in (0, 2, 3):
        assert isinstance(results[r], PlanMismatchError), (r, results[r])
        assert "rank(s) 1 could not compute the plan" in str(results[r])
        assert "ds.json: topology: the topology has data degree 3" in str(results[r])


def test_a_plan_resolved_earlier_is_agreed_without_planning_again_and_its_error_stops_all():
    """Megatron-LM's file path: planned at parse_args, agreed at initialisation."""
    plan = resolve_launch(str(IB_ROCE_4), request_of(0), model=tiny_model()).plan
    failed = ConfigError("--heterogeneous-nic: cluster file not found", field="cluster")

    def body(rank, store):
        earlier = failed if rank == 3 else Resolved(plan)
        return startup(request_of(rank), Planning(earlier=earlier), store=store, default_backend="gloo")

    results = run_rank_threads(4, body, hash_store(4))
    assert results[3] is failed
    assert all(isinstance(results[r], PlanMismatchError) and "cluster file not found" in str(results[r])
               for r in range(3))
    results = run_rank_threads(4, lambda r, s: startup(request_of(r), Planning(earlier=Resolved(plan)), store=s,
                                                       default_backend="gloo"), hash_store(4))
    assert all(results[r].plan is plan and results[r].cluster is None for r in range(4))


def test_the_requests_timeout_bounds_every_wait_inside():
    seen = []

    def resolve(profile):
        seen.append(exchange.timeout_s())
        return resolve_launch(str(IB_ROCE_4), request_of(0), model=tiny_model())

    results = run_rank_threads(1, lambda r, s: startup(LaunchRequest.of(1, rank=0, timeout=Timeout(7.5)),
                                                       Planning(resolve), store=s, default_backend="gloo"),
                               hash_store(1))
    assert isinstance(results[0], Started), results[0]
    assert seen == [7.5] and exchange.timeout_s() != 7.5      # inside startup only
    with pytest.raises(ConfigError, match="timeout_s=-1"):
        startup(LaunchRequest.of(1, rank=0, timeout=Timeout(-1)), Planning(resolve))


def test_replan_on_restart_is_decided_once_and_plans_with_the_profile_once(tmp_path, capsys):
    request = request_of(0)
    first = resolve_launch(str(IB_ROCE_4), request, model=tiny_model()).plan
    ranks = [RankTimes(r, iterations=4, micro_batches=8, forward_s=0.08 * (10.0 if first.node_of(r).accelerator ==
                                                                            "H100" else 1.0),
                       backward_s=0.16 * (10.0 if first.node_of(r).accelerator == "H100" else 1.0), iteration_s=4.0,
                       intervals=4) for r in range(4)]
    path = tmp_path / "run.yaml"
    measured_profile(first, ranks, "test").save(path)
    first.save(ran_plan_path(str(path)))
    calls: list = []
    chosen = resolve_start(planning_for(request, calls, replan=Replan(str(path))), rank=0)
    assert calls[0] is None and len(calls) == 2 and calls[1] is not None     # as usual, then once with the profile
    out = capsys.readouterr().out
    assert f"old plan {first.hash}" in out and out.count("het_plugin: re-plan on restart") == 1
    assert chosen.plan.hash != first.hash and chosen.cluster is not None
    calls.clear()
    resolve_start(planning_for(request, calls, replan=Replan(str(path))), rank=1)
    assert "re-plan" not in capsys.readouterr().out     # rank 0 alone says why


# The start-up path, and the public keyword forms that stay on it (a drop-in signature, documented wrappers).
STARTUP_PATH = ("runtime/startup.py", "runtime/agreement.py", "runtime/restart_replan.py", "core/launch.py",
                "core/request.py", "megatron/lm.py", "megatron/launch_state.py", "megatron/mcore.py",
                "deepspeed/pipe.py", "deepspeed/engine.py", "deepspeed/plan_source.py")
PUBLIC_KEYWORD_FORMS = {"initialize_model_parallel", "resolve_megatron_plan", "resolve_megatron_launch"}


def parameter_counts(path: Path) -> dict[str, int]:
    counts = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            counts[node.name] = len(named) + (a.vararg is not None) + (a.kwarg is not None)
    return counts


def test_no_function_on_the_startup_path_takes_ten_parameters():
    long = {(name, f, n) for name in STARTUP_PATH for f, n in parameter_counts(PACKAGE / name).items()
            if n >= 10 and f not in PUBLIC_KEYWORD_FORMS}
    assert not long
    assert parameter_counts(PACKAGE / "core/planner.py")["make_plan"] < 10        # the planner's entry point too
    assert parameter_counts(PACKAGE / "megatron/mcore.py")["resolve_megatron_launch"] >= 10     # the count counts


def test_a_launch_of_nodes_the_best_plan_leaves_out_stops_every_rank_before_any_group(monkeypatch):
    """Issue 32: the refusal is raised by the resolution the start-up runs (resolve_launch), so every rank stops
    with it at the agreement. The four threads stand for a launch of the 80-rank example cluster's every node."""
    from het_plugin.core.inputs.model import preset_model
    from het_plugin.core.launch import LeftOutRefused
    from het_plugin.runtime.all_nodes import ENV, use_all_nodes
    monkeypatch.delenv(ENV, raising=False)
    cluster = PACKAGE.parent / "examples" / "clusters" / "h100-old-ethernet.yaml"
    model = preset_model("gpt-7.5b")
    from het_plugin.core import subsets
    from het_plugin.core.inputs.cluster import load_cluster
    best = subsets.plan_nodes(load_cluster(cluster), model)      # searched once: the ranks share it (share_plan)
    seen = []

    def body(rank, store):
        request = request_of(rank)
        whole = LaunchRequest.of(80, rank=rank, use_all_nodes=use_all_nodes(None))

        def resolve(profile):
            seen.append(rank)
            return resolve_launch(str(cluster), whole, model=model, profile=profile,
                                  share_plan=lambda digest, search: best)
        return startup(request, Planning(resolve), store=store, default_backend="gloo")

    results = run_rank_threads(4, body, hash_store(4), join_s=60.0)
    assert sorted(seen) == [0, 1, 2, 3]
    for r in range(4):
        assert isinstance(results[r], (LeftOutRefused, PlanMismatchError)), (r, results[r])
        assert "annex-0 annex-1" in str(results[r]) and not isinstance(results[r], Started)
