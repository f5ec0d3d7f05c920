"""Re-plan on restart, end to end (issue 21, item 3): a Megatron-Core run with ``profile_out`` and
``replan_on_restart`` writes its profile and the plan it ran; the next start, a torchrun elastic restart
(``TORCHELASTIC_RESTART_COUNT=1``), re-plans from them on every rank, logs old and new plan and the predicted gain,
and trains on the new plan. 4 CPU ranks on gloo; the test trainer sleeps in every layer on the H100 ranks, so the
run disagrees with the analytic model (which gives the H100 stage 4 of 5 layers)."""
from __future__ import annotations

from pathlib import Path

from het_plugin.core.plan import Plan
from het_plugin.runtime.restart_replan import ran_plan_path
from integration_tests.support.launch import run_ranks
from integration_tests.test_measured_profile import IB_ROCE_4, h100_layers

HERE = Path(__file__).resolve().parent
TIMEOUT = 420          # a hang bound for a loaded 2-core machine, not a timing check


def test_an_elastic_restart_replans_from_the_last_attempts_profile(tmp_path):
    out = tmp_path / "measured.yaml"
    args = ["--tp", "1", "--pp", "2", "--cluster", str(IB_ROCE_4), "--steps", "4", "--profile-out", str(out),
            "--replan-on-restart", "--slow-device", "H100", "--layer-delay-ms", "20"]
    first = run_ranks(HERE / "ranks" / "megatron_train.py", 4, args, ranks_per_node=1, timeout=TIMEOUT)
    old = Plan.load(ran_plan_path(str(out)))
    assert {o.result["plan_hash"] for o in first} == {old.hash}
    assert "no measured profile from a previous attempt" in first[0].stdout
    second = run_ranks(HERE / "ranks" / "megatron_train.py", 4, args, ranks_per_node=1, timeout=TIMEOUT,
                       env={"TORCHELASTIC_RESTART_COUNT": "1"})
    hashes = {o.result["plan_hash"] for o in second}
    assert len(hashes) == 1 and hashes != {old.hash}              # every rank agreed on one new plan
    log = second[0].stdout
    assert f"re-plan on restart (elastic restart 1): old plan {old.hash}" in log
    assert "predicted gain +" in log and "het_plugin:   taken" in log
    new = Plan.load(ran_plan_path(str(out)))                        # the restart records what it ran
    assert new.hash in hashes and f"new plan {new.hash}" in log
    assert h100_layers(new.layers_per_stage, new) < h100_layers(old.layers_per_stage, old)
    assert not any("re-plan on restart" in o.stdout for o in second[1:])      # rank 0 logs it
