"""examples/deepspeed runs as documented: wrap-config, then 4 CPU ranks print losses."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from het_plugin.cli import main as cli_main  # noqa: E402
from het_plugin.core.plan import Plan  # noqa: E402
from integration_tests.support.deepspeed_cpu import cpu_environment  # noqa: E402
from integration_tests.support.launch import run_ranks  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "deepspeed"


def test_cpu_example_trains_with_the_wrapped_plan(tmp_path):
    wrapped = tmp_path / "wrapped.json"
    assert cli_main(["wrap-config", str(EXAMPLE / "ds_config.json"), "--cluster", str(EXAMPLE / "cluster-cpu.yaml"),
                     "--model", str(EXAMPLE / "tiny-model.yaml"), "--pp", "2", "--layer-pattern", "Block",
                     "-o", str(wrapped)]) == 0
    plan = Plan.from_dict(json.loads(wrapped.read_text())["heterogeneous"]["plan"])
    outs = run_ranks(EXAMPLE / "train.py", 4, ["--deepspeed_config", str(wrapped), "--cpu", "--pp", "2",
                                                "--steps", "3"], env=cpu_environment(), timeout=150)
    out = outs[0].stdout
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", out, re.M)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(256)) < 1.0            # random tokens over a 256-word vocabulary
    assert f"plan {plan.hash}" in out and f"layers per stage {plan.layers_per_stage}" in out
