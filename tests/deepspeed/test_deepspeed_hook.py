"""The DeepSpeed import hook: the .pth imports nothing until deepspeed is imported; what it patches it can undo;
a section that would be ignored is an error. Multi-process runs: integration_tests/test_deepspeed_unmodified.py."""
from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

deepspeed = pytest.importorskip("deepspeed")

import het_plugin.deepspeed as hds  # noqa: E402
from het_plugin.deepspeed import hook  # noqa: E402
from het_plugin.core.errors import ConfigError  # noqa: E402
from tests.deepspeed.test_deepspeed_initialize import DS, plan, pipeline_model_with, recorded  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[2]


def pth_line(name: str = "DS_PTH_TEXT") -> str:
    text = (REPO / "setup.py").read_text()
    start = text.index(f"{name} = (")
    ns: dict = {}
    exec(text[start:text.index("\n", text.index("\\n')", start))], ns)
    return ns[name]


@pytest.fixture
def fresh_hook(monkeypatch):
    """The hook installed in plan mode for one test, and everything undone after."""
    hook.uninstall()
    monkeypatch.delenv(hook.ENV_OFF, raising=False)
    monkeypatch.delenv(hook.ENV_CONFIG, raising=False)
    yield hook
    hook.uninstall()


def test_argv_forms():
    assert hook.config_path_from_argv(["--deepspeed_config", "a.json"]) == "a.json"
    assert hook.config_path_from_argv(["--deepspeed-config=b.json", "-p", "2"]) == "b.json"
    assert hook.config_path_from_argv(["--deepspeed_config"]) is None
    assert hook.config_path_from_argv(["--deepspeed", "--steps", "3"]) is None


def test_process_section_from_argv_then_env(tmp_path, monkeypatch, plan):
    plain, wrapped = tmp_path / "plain.json", tmp_path / "wrapped.json"
    hds.write_config(DS, plain)
    hds.write_config(hds.wrap(DS, plan), wrapped)
    monkeypatch.delenv(hook.ENV_CONFIG, raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", "--deepspeed_config", str(plain)])
    assert hook.process_section() is None
    monkeypatch.setenv(hook.ENV_CONFIG, str(wrapped))         # a script whose own config is plain
    section, source = hook.process_section()
    assert section.plan_hash == plan.hash and source == str(wrapped)
    monkeypatch.setenv(hook.ENV_CONFIG, str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="not found"):
        hook.process_section()


def test_install_records_and_uninstall_restores(fresh_hook):
    from deepspeed.runtime.pipe.module import PipelineModule
    before = (deepspeed.initialize, PipelineModule.__init__, PipelineModule._partition_layers)
    fresh_hook.install()
    assert sorted(fresh_hook.patched()) == [("PipelineModule", "__init__"), ("PipelineModule", "_partition_layers"),
                                            ("ProcessTopology", "__init__"), ("deepspeed", "initialize")]
    assert deepspeed.initialize is not before[0] and fresh_hook.original_initialize() is before[0]
    fresh_hook.install()                                   # idempotent
    assert len(fresh_hook.patched()) == 4
    fresh_hook.uninstall()
    assert (deepspeed.initialize, PipelineModule.__init__, PipelineModule._partition_layers) == before
    assert fresh_hook.patched() == []


def test_hook_off_refuses_a_section_instead_of_ignoring_it(fresh_hook, monkeypatch, plan):
    calls = []

    def fake_initialize(*args, **kwargs):
        calls.append(kwargs)
        return (argparse.Namespace(), None, None, None)

    fake_initialize.__signature__ = inspect.signature(deepspeed.initialize)
    monkeypatch.setattr(deepspeed, "initialize", fake_initialize)
    monkeypatch.setenv(hook.ENV_OFF, "1")
    fresh_hook.install()
    assert fresh_hook.patched() == [("deepspeed", "initialize")]      # PipelineModule untouched
    with pytest.raises(ConfigError, match="HET_PLUGIN_NO_HOOK=1 switched het_plugin's DeepSpeed hook off") as err:
        deepspeed.initialize(model=object(), config=hds.wrap(DS, plan))
    assert "unset HET_PLUGIN_NO_HOOK" in str(err.value)
    deepspeed.initialize(model=object(), config=dict(DS))              # a plain config: DeepSpeed's own call
    assert calls == [{"model": calls[0]["model"], "config": DS}]


def test_section_reaching_initialize_after_an_unplanned_pipeline_module(fresh_hook, recorded, plan):
    """The usual order with a dict config: the PipelineModule was built before initialize saw the section."""
    fresh_hook.install()
    plain = object.__new__(deepspeed.pipe.PipelineModule)
    with pytest.raises(ConfigError, match="reached only deepspeed.initialize") as err:
        hds.initialize(model=plain, config=hds.wrap(DS, plan))
    assert "HET_PLUGIN_DEEPSPEED_CONFIG" in str(err.value) and "--deepspeed_config" in str(err.value)
    assert recorded == []


def test_pipeline_plan_needs_a_pipeline_module(recorded, plan):
    with pytest.raises(ConfigError, match="the plan has 2 pipeline stages, but the model passed to deepspeed"
                                          ".initialize is a Linear") as err:
        hds.initialize(model=__import__("torch").nn.Linear(2, 2), config=hds.wrap(DS, plan))
    assert "num_stages=2" in str(err.value) and "--pp 1" in str(err.value)
    assert recorded == []


def test_planned_module_with_a_plain_config_still_gets_its_plan(recorded, plan):
    """A script whose own config is plain (the section came from HET_PLUGIN_DEEPSPEED_CONFIG at construction)."""
    model = pipeline_model_with(plan)
    object.__setattr__(model, "het_section", hds.HetSection.from_dict(hds.wrap(DS, plan)[hds.SECTION]))
    engine, *_ = hds.initialize(model=model, config=dict(DS))
    assert engine.het_plan is plan and recorded[0][1]["config"] == DS


def _run_pth(tmp_path, code: str, *argv, env=None, site=False):
    pth = tmp_path / "het_plugin_deepspeed.pth"
    pth.write_text(pth_line())
    out = subprocess.run([sys.executable, *([] if site else ["-S"]), "-c", "import sys\nexec(open(sys.argv[1]).read())\n" + code, str(pth),
                          *argv], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split("\n")


def test_the_pth_line_imports_nothing_without_deepspeed(tmp_path):
    """Count imports, not time: a start with the line loads exactly the modules of a start without it."""
    code = "print(sorted(sys.modules))\nprint([type(f).__name__ for f in sys.meta_path][0])\n"
    bare = subprocess.run([sys.executable, "-S", "-c", "import sys\n" + code], capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(REPO)}).stdout.split("\n")
    for argv in ([], ["--deepspeed_config", "x.json"]):
        with_line = _run_pth(tmp_path, code, *argv)
        assert with_line[0] == bare[0]                     # the same modules: none imported by the line
        assert with_line[1] == "HetPluginDeepSpeedTrigger"


def test_the_pth_line_patches_deepspeed_when_imported(tmp_path):
    code = ("import deepspeed\nfrom het_plugin.deepspeed import hook\n"
            "print(sorted(hook.patched()))\n"
            "print(any(type(f).__name__ == 'HetPluginDeepSpeedTrigger' for f in sys.meta_path))\n")
    out = _run_pth(tmp_path, code, site=True)
    assert out[0] == str(sorted([("PipelineModule", "__init__"), ("PipelineModule", "_partition_layers"),
                                 ("ProcessTopology", "__init__"), ("deepspeed", "initialize")]))
    assert out[1] == "False"                                # the trigger removed itself
    out = _run_pth(tmp_path, code, env={"HET_PLUGIN_NO_HOOK": "1"}, site=True)
    assert out[0] == str([("deepspeed", "initialize")])    # the guard only


def test_permuted_plan_refused_after_megatron_deepspeed_built_its_groups(monkeypatch, plan):
    import types

    from het_plugin.deepspeed.foreign_groups import check_no_launch_order_groups
    state = types.ModuleType("megatron.core.parallel_state")
    state.model_parallel_is_initialized = lambda: False
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", state)
    check_no_launch_order_groups(plan)                      # not initialized: nothing to disagree with
    state.model_parallel_is_initialized = lambda: True
    assert not plan.is_identity
    with pytest.raises(ConfigError, match="already built its tensor/pipeline/data-parallel groups in launch order"):
        check_no_launch_order_groups(plan)
    check_no_launch_order_groups(types.SimpleNamespace(is_identity=True))    # launch order: the mpu's groups fit
