"""Issue 22: DeepSpeed pipeline scripts written by others run unmodified; only the config is wrapped.

Two scripts (integration_tests/external/, each a reproduction naming the file and commit it follows and what it
changes: the originals are not in the deepspeed wheel and these tests run offline), each launched as 4 CPU ranks
through integration_tests/support/run_unmodified.py, which runs the .pth line an installed het_plugin ships:
(a) a plain config: DeepSpeed's own run (also bit-identical without the hook for the first script);
(b) the config wrapped for a homogeneous cluster: the same losses, split and placement as (a);
(c) the config wrapped for a heterogeneous cluster: each rank's stage and layer range are the plan's.
The wrapped configs carry no model: every rank plans at start-up from the layer list (the RunShape.dp path).

The original DeepSpeedExamples ``training/pipeline_parallelism/train.py``, byte for byte, runs the same three ways
where a DeepSpeedExamples checkout is given (``DEEPSPEED_EXAMPLES_PATH``: a work tree, or a git repository read at
:data:`DSE_COMMIT`) and torchvision is importable (``pip install --no-deps torchvision==0.28.0``): the tests run
offline and the script is not copied into this repository. Its only replacement is the CIFAR-10 download
(support/torchvision_cpu.py: synthetic images of the same shape).
"""
from __future__ import annotations

from pathlib import Path

import os
import subprocess

import pytest

pytest.importorskip("deepspeed")

from het_plugin.deepspeed import wrap, write_config  # noqa: E402
from het_plugin.deepspeed.partition import plan_parts  # noqa: E402
from het_plugin.core.plan import Plan  # noqa: E402
from integration_tests.support.deepspeed_cpu import cpu_environment  # noqa: E402
from integration_tests.support.launch import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
RUN = HERE / "support" / "run_unmodified.py"
DSE = HERE / "external" / "dse_pipeline_train.py"
CIFAR = HERE / "external" / "ds_test_pipe_cifar.py"
ENV = dict(cpu_environment(), HET_PLUGIN_GLOO_IFNAMES="local=lo,ib=lo,roce=lo,socket=lo")
# DeepSpeedExamples' ds_config.json scaled to 4 CPU ranks (batch 256 -> 8), torch's Adam instead of the fused build.
DSE_CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8,
                                                       "torch_adam": True}},
              "steps_per_print": 10, "wall_clock_breakdown": False}
# The dict ds_test_pipe_cifar.py hard-codes, as far as het_plugin reads it (the batch).
CIFAR_CONFIG = {"train_batch_size": 4}
DSE_COMMIT = "83757d9c937daabd1089a08051061706cb73900d"       # microsoft/DeepSpeedExamples, read 2026-12-02
DSE_SCRIPT = "training/pipeline_parallelism/train.py"
TORCHVISION_ENTRIES = 22      # torchvision's AlexNet: 13 features, avgpool, the flatten lambda, 7 classifier entries
ENTRIES = 17          # layers in the scripts' list: 11 features, avgpool, flatten lambda, 4 classifier entries
TIMEOUT = 240


def launch(script: Path, args, env=None, check=True):
    outs = run_ranks(RUN, 4, [str(script), *map(str, args)], env={**ENV, **(env or {})}, timeout=TIMEOUT, check=check)
    return outs


def results(outs) -> list[dict]:
    return sorted((o.result for o in outs), key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("unmodified")


def configs(workdir: Path, base: dict, name: str) -> dict[str, Path]:
    out = {}
    for kind, cfg in (("plain", base), ("homogeneous", wrap(base, DATA / "ds_homogeneous_4.yaml", pp=2)),
                      ("heterogeneous", wrap(base, DATA / "ds_hetero_4.yaml", pp=2))):
        out[kind] = workdir / f"{name}-{kind}.json"
        write_config(cfg, out[kind])
    return out


def check_three_runs(plain, homo, hetero, outs_homo, outs_hetero, entries: int = ENTRIES) -> None:
    # (a) DeepSpeed's own: no plan, its 'parameters' split, its placement.
    assert all(r["plan_hash"] is None for r in plain)
    assert len(plain[0]["losses"]) == 3 and len(set(plain[0]["losses"])) > 1
    # (b) homogeneous: a plan was applied, yet every number is DeepSpeed's own.
    assert all(r["plan_hash"] is not None for r in homo)
    for a, b in zip(plain, homo):
        assert (b["losses"], b["parts"], b["stage"], b["layers"], b["mapping"]) == \
               (a["losses"], a["parts"], a["stage"], a["layers"], a["mapping"])
    said = [o.stdout.count("the plan changes nothing") for o in outs_homo]
    assert said == [1, 0, 0, 0]
    # (c) heterogeneous: placement and split are the plan's (planned at start-up: no model in the config).
    plan = Plan.from_dict(hetero[0]["plan"])
    assert all(r["plan_hash"] == plan.hash for r in hetero) and not plan.is_identity
    parts = plan_parts(entries, list(range(entries)), plan.layers_per_stage)
    assert parts != plain[0]["parts"]                        # DeepSpeed alone splits by parameters
    for r in hetero:
        stage = plan.coord(r["rank"])["pp"]
        assert r["stage"] == stage and r["data_id"] == plan.coord(r["rank"])["dp"]
        assert r["parts"] == parts and r["layers"] == [parts[stage], parts[stage + 1]]
    assert [o.stdout.count("replacing partition_method='parameters'") for o in outs_hetero] == [1, 0, 0, 0]


def test_deepspeed_examples_pipeline_train(workdir):
    """DeepSpeedExamples' train.py shape: --deepspeed_config on the command line, init_distributed by the script,
    partition_method='parameters', training_data."""
    cfg = configs(workdir, DSE_CONFIG, "dse")
    common = ["-p", 2, "--steps", 3, "--backend", "gloo"]
    plain = results(launch(DSE, ["--deepspeed_config", cfg["plain"], *common]))
    no_hook = results(launch(DSE, ["--deepspeed_config", cfg["plain"], *common], env={"HET_TEST_NO_PTH": "1"}))
    assert [r["losses"] for r in no_hook] == [r["losses"] for r in plain]
    outs_homo = launch(DSE, ["--deepspeed_config", cfg["homogeneous"], *common])
    outs_hetero = launch(DSE, [f"--deepspeed_config={cfg['heterogeneous']}", *common])
    check_three_runs(plain, results(outs_homo), results(outs_hetero), outs_homo, outs_hetero)


def test_deepspeed_pipe_cifar10_test(workdir):
    """DeepSpeed's TestPipeCifar10 shape: a config dict inside the script, an explicit topology=; the wrapped
    config reaches the hook through HET_PLUGIN_DEEPSPEED_CONFIG."""
    cfg = configs(workdir, CIFAR_CONFIG, "cifar")
    plain = results(launch(CIFAR, [3]))
    outs_homo = launch(CIFAR, [3], env={"HET_PLUGIN_DEEPSPEED_CONFIG": str(cfg["homogeneous"])})
    outs_hetero = launch(CIFAR, [3], env={"HET_PLUGIN_DEEPSPEED_CONFIG": str(cfg["heterogeneous"])})
    check_three_runs(plain, results(outs_homo), results(outs_hetero), outs_homo, outs_hetero)


def test_a_plan_the_topology_cannot_take_stops_every_rank(workdir):
    """The script's explicit topology has 2 stages; a config wrapped for 4 says so on every rank, naming the fix."""
    path = workdir / "cifar-pp4.json"
    write_config(wrap(CIFAR_CONFIG, DATA / "ds_hetero_4.yaml", pp=4), path)       # planned at start-up
    outs = launch(CIFAR, [3], env={"HET_PLUGIN_DEEPSPEED_CONFIG": str(path)}, check=False)
    for o in outs:
        assert o.returncode != 0 and o.result is None
    assert "ConfigError" in outs[0].stderr and "wrapped for 4 pipeline stages but the model has 2" in outs[0].stderr
    assert "num_stages=4" in outs[0].stderr


def original_train_py(workdir: Path) -> Path:
    """DeepSpeedExamples' own train.py from DEEPSPEED_EXAMPLES_PATH (skip without it)."""
    root = os.environ.get("DEEPSPEED_EXAMPLES_PATH")
    if not root:
        pytest.skip("no DeepSpeedExamples checkout: set DEEPSPEED_EXAMPLES_PATH to a work tree or git repository of "
                    "microsoft/DeepSpeedExamples to run its training/pipeline_parallelism/train.py unmodified")
    root = Path(root)
    if (root / DSE_SCRIPT).is_file():
        return root / DSE_SCRIPT
    out = workdir / "dse-original" / DSE_SCRIPT
    out.parent.mkdir(parents=True, exist_ok=True)
    shown = subprocess.run(["git", f"--git-dir={root if (root / 'objects').is_dir() else root / '.git'}", "show",
                            f"{DSE_COMMIT}:{DSE_SCRIPT}"], capture_output=True)
    if shown.returncode != 0:
        pytest.skip(f"DEEPSPEED_EXAMPLES_PATH={root} has no {DSE_SCRIPT} (nor commit {DSE_COMMIT[:12]})")
    out.write_bytes(shown.stdout)
    return out


def test_the_original_deepspeed_examples_train_py(workdir):
    """The original script (torchvision's AlexNet at 224x224, --deepspeed_config, init_distributed by the script,
    partition_method='parameters'), its config scaled to 4 CPU ranks: plain, homogeneous and heterogeneous."""
    script = original_train_py(workdir)
    from integration_tests.support.torchvision_cpu import import_torchvision
    try:
        import_torchvision()
    except ImportError:
        pytest.skip("torchvision is not installed (pip install --no-deps torchvision==0.28.0: the script imports it)")
    cfg = configs(workdir, DSE_CONFIG, "dse-original")
    common = ["-p", 2, "--steps", 3, "--backend", "gloo"]
    env = {"HET_TEST_SYNTHETIC_CIFAR": "1"}
    plain = results(launch(script, ["--deepspeed_config", cfg["plain"], *common], env=env))
    assert plain[0]["parts"] == [0, 19, 22]             # DeepSpeed's own 'parameters' split of its 22 entries
    outs_homo = launch(script, ["--deepspeed_config", cfg["homogeneous"], *common], env=env)
    outs_hetero = launch(script, ["--deepspeed_config", cfg["heterogeneous"], *common], env=env)
    check_three_runs(plain, results(outs_homo), results(outs_hetero), outs_homo, outs_hetero,
                     entries=TORCHVISION_ENTRIES)
