"""The mixed-NIC pre-flight inside the DeepSpeed adapter: 4 real ranks through hds.PipelineModule (a config
wrapped with integration_tests/data/preflight-ib-roce-4.yaml, the plan embedded; the section's cluster file
gives the nodes' NICs). Under NCCL (the world backend faked in the rank script) an environment that
contradicts the plan stops every rank before any group; under gloo the same environment is not checked."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from het_plugin.deepspeed import wrap, write_config  # noqa: E402
from het_plugin.core.inputs.model import load_model  # noqa: E402
from integration_tests.support.deepspeed_cpu import cpu_environment  # noqa: E402
from integration_tests.support.launch import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ranks" / "preflight_adapters.py"
CLUSTER = HERE / "data" / "preflight-ib-roce-4.yaml"
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 8,
          "steps_per_print": 10 ** 6}
ENV = dict(cpu_environment(), HET_PLUGIN_GLOO_IFNAMES="ib=lo,roce=lo,socket=lo,local=lo", NCCL_NET="Socket")


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ds_preflight") / "cfg.json"
    write_config(wrap(CONFIG, CLUSTER, load_model(HERE / "data" / "ds_tiny_model.yaml"), pp=2), path)
    return path


def launch(config: Path, env: dict) -> list[dict]:
    outs = run_ranks(SCRIPT, 4, ["--framework", "deepspeed", "--config", str(config)], env=dict(ENV, **env),
                     ranks_per_node=1, timeout=240)
    return sorted((o.result for o in outs), key=lambda r: r["rank"])


def test_nccl_net_forcing_sockets_is_refused_before_any_group(config):
    res = launch(config, {"HET_TEST_FAKE_BACKEND": "nccl", "HET_TEST_WORLD_NET": "Socket"})
    texts = {r["error"] for r in res}
    assert len(texts) == 1 and None not in texts, texts
    text = texts.pop()
    assert text.startswith("pre-flight: NCCL_NET: NCCL_NET=Socket overrides the network of every NCCL communicator")
    assert "fix: unset NCCL_NET" in text
    assert all(r["new_groups"] == 0 for r in res)


def test_gloo_launch_is_not_checked(config):
    res = launch(config, {})
    assert all(r["error"] is None and r["groups"] > 0 for r in res), res
