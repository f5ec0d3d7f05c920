"""The Megatron-LM argument hook against a real argparse parser built the way Megatron-LM builds it."""
from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.megatron import args as hargs
from het_plugin.megatron import hook, launch_state, lm
from het_plugin.megatron.pipeline_layout import layout_string
from het_plugin.core.plan import Plan

DATA = Path(__file__).resolve().parents[2] / "integration_tests" / "data"
CLUSTER_8 = DATA / "megatron-ib-roce-8.yaml"


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron-LM's shape: allow_abbrev=False, its own groups, strict parse_args."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    g = parser.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--vocab-size", type=int)
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-layout", type=str, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    return parser


def fake_arguments_module() -> types.ModuleType:
    """A module with Megatron-LM's parse_args body (core_v0.16): provider chaining, strict parse, env rank."""
    mod = types.ModuleType("megatron.training.arguments")

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = megatron_parser()
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        if ignore_unknown_args:
            args, _ = parser.parse_known_args()
        else:
            args = parser.parse_args()
        args.rank = int(os.getenv("RANK", "0"))
        args.world_size = int(os.getenv("WORLD_SIZE", "1"))
        return args

    mod.parse_args = parse_args
    return mod


def script_provider(parser):
    parser.add_argument_group(title="script").add_argument("--data-path", default=None)
    return parser


MODEL = ["--num-layers", "5", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "8"]


@pytest.fixture
def argv(monkeypatch):
    def set_argv(*items):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *items])
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(lm, "install_initialize_wrapper", lambda: None)   # no megatron import here
    monkeypatch.setattr(launch_state, "_state", launch_state.LaunchState())
    return set_argv


def test_megatron_parser_rejects_the_flag_without_the_hook(argv):
    argv(*MODEL, "--heterogeneous-nic", "c.yaml")
    with pytest.raises(SystemExit):
        fake_arguments_module().parse_args(script_provider)


def test_flag_forms_and_chaining_keep_the_scripts_provider():
    parser = hargs.chain_extra_args_provider(script_provider)(megatron_parser())
    a = parser.parse_args(MODEL + ["--data-path", "d", "--heterogeneous-nic"])
    assert a.heterogeneous_nic == hargs.DISCOVER and a.data_path == "d"
    a = parser.parse_args(MODEL + ["--heterogeneous-nic", "c.yaml", "--heterogeneous-plan-out", "p.json"])
    assert (a.heterogeneous_nic, a.heterogeneous_plan_out) == ("c.yaml", "p.json")
    a = parser.parse_args(MODEL + ["--heterogeneous-nic=c.yaml"])
    assert a.heterogeneous_nic == "c.yaml"
    assert parser.parse_args(MODEL).heterogeneous_nic is None
    with pytest.raises(SystemExit):           # strict parsing, no abbreviations: still strict
        parser.parse_args(MODEL + ["--heterogeneous", "c.yaml"])
    # Chaining twice (hook on a patched tree) adds the flags once.
    twice = hargs.chain_extra_args_provider(hargs.chain_extra_args_provider(None))
    assert twice(megatron_parser()).parse_args(["--heterogeneous-nic", "x"]).heterogeneous_nic == "x"
    p = megatron_parser()
    hargs.add_arguments(p)
    hargs.add_arguments(p)                    # a patched arguments.py already added them: no conflict


def test_hook_wraps_parse_args_and_applies_the_plan(argv):
    argv(*MODEL, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--heterogeneous-nic", str(CLUSTER_8), "--data-path", "d")
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    hook.patch_arguments_module(mod)          # idempotent
    from het_plugin.runtime.patches import PATCHES
    assert PATCHES.labels(mod, "parse_args") == ["megatron.hook"]              # wrapped once
    args = mod.parse_args(script_provider)
    plan = lm.state.plan
    assert isinstance(plan, Plan) and lm.state.error is None
    assert args.data_path == "d"
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (plan.tp, plan.pp) == (2, 2)
    assert args.pipeline_model_parallel_layout == layout_string(plan.layers_per_stage)
    assert plan.overlap_grad_reduce and args.overlap_grad_reduce is False, "the command line's setting stands"
    assert args.heterogeneous_plan_hash == plan.hash, "saved with Megatron's args in its checkpoints"
    assert args.global_batch_size == 8 and args.micro_batch_size == 2
    assert plan.model["num_layers"] == 5 and plan.model["hidden_size"] == 32


def test_no_flag_leaves_parse_args_alone(argv):
    argv(*MODEL)
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    args = mod.parse_args(script_provider)
    assert args.heterogeneous_nic is None and args.pipeline_model_parallel_layout is None
    assert lm.state.args is None


def test_finder_only_acts_on_megatron_arguments_with_the_flag(monkeypatch):
    finder = hook.MegatronArgsFinder()
    monkeypatch.setattr(sys, "argv", ["x.py", "--heterogeneous-nic", "c.yaml"])
    assert finder.find_spec("json", None) is None
    monkeypatch.setattr(sys, "argv", ["x.py"])
    assert finder.find_spec(hook.TARGET, None) is None
    monkeypatch.setenv(hook.ENV_OFF, "1")
    before = list(sys.meta_path)
    hook.install()
    assert sys.meta_path == before


def test_planning_errors_are_kept_for_the_agreement_not_raised(argv, monkeypatch):
    # tp=2 cannot be placed on 1-rank nodes: every rank must stop together at the agreement instead.
    argv(*MODEL, "--tensor-model-parallel-size", "2", "--heterogeneous-nic", str(DATA / "megatron-ib-roce-4.yaml"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    args = mod.parse_args(None)
    assert isinstance(lm.state.error, ConfigError)
    assert "tp=1 pp=" in str(lm.state.error)          # what would work
    assert args.tensor_model_parallel_size == 2       # args untouched


@pytest.mark.parametrize("flag,value", [("--pipeline-model-parallel-layout", "Ett|ttL"),
                                        ("--decoder-first-pipeline-num-layers", "3")])
def test_options_het_plugin_cannot_honour_are_refused(argv, flag, value):
    argv(*MODEL, flag, *([value] if value else []), "--heterogeneous-nic", str(CLUSTER_8))
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    with pytest.raises(ConfigError) as e:
        mod.parse_args(None)
    assert flag in str(e.value) and "fix:" in str(e.value)


def test_degrees_given_reads_the_command_line_not_the_defaults():
    a = megatron_parser().parse_args(MODEL + ["--pipeline-model-parallel-size=2"])
    given = hargs.degrees_given(a, MODEL + ["--pipeline-model-parallel-size=2"])
    assert given == {"tp": None, "pp": 2, "cp": 1, "micro_batch_size": 2, "ep": 1, "etp": None,
                     "order": "tp-cp-ep-dp-pp", "vpp": None, "overlap_p2p_comm": None}


def test_the_other_rank_order_and_expert_sizes_reach_the_plan(argv, monkeypatch):
    """--use-tp-pp-dp-mapping and --expert-model-parallel-size are Megatron's to take: the plan numbers ranks
    in that order and carries the expert sizes (refused before: never refuse what Megatron accepts)."""
    argv(*MODEL, "--pipeline-model-parallel-size", "2", "--use-tp-pp-dp-mapping", "--heterogeneous-nic", str(CLUSTER_8))
    monkeypatch.setenv("WORLD_SIZE", "8")
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    mod.parse_args(None)
    assert lm.state.error is None
    plan = lm.state.plan
    assert plan.order == "tp-cp-ep-pp-dp" and not plan.is_identity
    # in the pp-dp order the pipeline partners are logical neighbours; the placement still puts stages on fabrics
    for g in plan.groups["dp"]:
        assert len({plan.node_of(r).cluster for r in g.ranks}) == 1
    a = megatron_parser().parse_args(MODEL + ["--use-tp-pp-dp-mapping"])
    a.expert_model_parallel_size, a.expert_tensor_parallel_size = 2, 1
    assert {k: v for k, v in hargs.degrees_given(a, MODEL).items() if k in ("ep", "etp", "order")} == \
        {"ep": 2, "etp": 1, "order": "tp-cp-ep-pp-dp"}


# 16 sequences: 2 micro-batches per pipeline at dp 4, a multiple of pp 2 (Megatron's interleaved schedule)
MODEL_16 = [a if a != "8" else "16" for a in MODEL]


def test_an_interleaved_pipeline_with_an_uneven_plan_gets_a_layout_of_pp_times_vpp_segments(argv, monkeypatch):
    """--num-virtual-stages-per-pipeline-rank reaches the planner; the plan's uneven split goes to Megatron as a layout
    of pp*vpp segments, and the VPP flag is cleared (Megatron's validate_args takes at most one of them and the
    layout); the change is in what het_plugin logs as set from the plan."""
    argv(*MODEL_16, "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
         "--heterogeneous-nic", str(CLUSTER_8))
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    args = mod.parse_args(None)
    assert lm.state.error is None
    plan = lm.state.plan
    assert plan.vpp == 2 and plan.overlap_p2p_comm and len(set(plan.layers_per_stage)) > 1
    assert args.pipeline_model_parallel_layout.count("|") == 2 * 2 - 1
    assert args.num_virtual_stages_per_pipeline_rank is None and args.num_layers_per_virtual_pipeline_stage is None
    assert args.overlap_p2p_comm is True
    assert "num_virtual_stages_per_pipeline_rank=None" in lm.state.changes
    assert f"pipeline_model_parallel_layout={args.pipeline_model_parallel_layout}" in lm.state.changes


def test_layers_per_virtual_stage_needs_the_pipeline_size_and_no_overlap_reaches_the_plan(argv, monkeypatch):
    argv(*MODEL_16, "--num-layers-per-virtual-pipeline-stage", "1", "--heterogeneous-nic", str(CLUSTER_8))
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    mod.parse_args(None)
    err = lm.state.error
    assert isinstance(err, ConfigError) and err.field == "--num-layers-per-virtual-pipeline-stage"
    assert "--num-virtual-stages-per-pipeline-rank" in err.fix
    # with the pipeline size: 4 layers / (2 stages x 1 layer) = 2 virtual stages ...
    argv(*[a if a != "5" else "4" for a in MODEL_16], "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "1", "--heterogeneous-nic", str(CLUSTER_8))
    args = mod.parse_args(None)
    assert lm.state.error is None and lm.state.plan.vpp == 2
    assert args.num_layers_per_virtual_pipeline_stage is None
    # ... and Megatron-LM's own rule: no p2p overlap needs pp > 2 with interleaving
    argv(*MODEL_16, "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
         "--no-overlap-p2p-communication", "--heterogeneous-nic", str(CLUSTER_8))
    mod.parse_args(None)
    assert isinstance(lm.state.error, ConfigError) and lm.state.error.field == "vpp"
    assert "pp >= 3" in str(lm.state.error)
    for bad in (["--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage", "1"],):
        a = megatron_parser().parse_args(MODEL_16 + bad)
        with pytest.raises(ConfigError, match="both set"):
            hargs.degrees_given(a, MODEL_16 + bad)


def test_an_interleaved_plan_passes_megatron_lms_own_validate_args(argv, monkeypatch):
    """The real megatron.training (0.19: the wheel ships it) takes the arguments het_plugin wrote: the layout alone
    gives the virtual pipeline size, and the model config gets the layout, vpp and p2p overlap."""
    pytest.importorskip("megatron.training.arguments", reason="megatron-core 0.16.1's wheel has no megatron.training")
    import megatron.training.arguments as margs
    argv("--num-layers", "5", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--vocab-size", "128", "--tokenizer-type", "NullTokenizer",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--pipeline-model-parallel-size", "2",
         "--num-virtual-stages-per-pipeline-rank", "2", "--heterogeneous-nic", str(CLUSTER_8))
    monkeypatch.setattr(margs, "parse_args", margs.parse_args)      # the wrapper goes again after the test
    hook.patch_arguments_module(margs)
    args = margs.parse_args()
    assert lm.state.error is None and lm.state.plan.vpp == 2
    margs.validate_args(args)
    assert args.virtual_pipeline_model_parallel_size == 2 and args.overlap_p2p_comm
    cfg = margs.core_transformer_config_from_args(args)
    from megatron.core.transformer.enums import LayerType
    layout = cfg.pipeline_model_parallel_layout
    assert cfg.virtual_pipeline_model_parallel_size == 2 and cfg.overlap_p2p_comm and not cfg.batch_p2p_comm
    assert [[chunk.count(LayerType.decoder) for chunk in row] for row in layout.layout] == lm.state.plan.virtual_layers


def test_repeated_parses_of_one_command_line_plan_once_and_all_get_the_plan(argv, monkeypatch):
    """megatron.training 0.19 parses the command line again for itself (inprocess_restart before the script's
    parse_and_validate_args, ft_integration.setup at the start of pretrain): each namespace gets the same plan,
    computed once, and a later parse does not take the launch over."""
    argv(*MODEL, "--pipeline-model-parallel-size", "2", "--heterogeneous-nic", str(CLUSTER_8))
    calls = []
    real = lm._plan_file
    monkeypatch.setattr(lm, "_plan_file", lambda *a, **k: calls.append(1) or real(*a, **k))
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    first = mod.parse_args(None, ignore_unknown_args=True)         # inprocess_restart's look at its flags
    script = mod.parse_args(script_provider)                        # the script's parse_and_validate_args
    again = mod.parse_args(None, ignore_unknown_args=True)          # ft_integration.setup
    assert len(calls) == 1
    layout = layout_string(lm.state.plan.layers_per_stage)
    assert first.pipeline_model_parallel_layout == script.pipeline_model_parallel_layout == \
        again.pipeline_model_parallel_layout == layout
    assert lm.state.args is first
    # Another command line is another launch: planned anew.
    argv(*MODEL, "--pipeline-model-parallel-size", "4", "--heterogeneous-nic", str(CLUSTER_8))
    assert mod.parse_args(None).pipeline_model_parallel_size == 4 and len(calls) == 2


def test_the_plan_made_at_initialisation_goes_to_megatrons_global_args(argv, monkeypatch):
    """With the bare flag, initialize_model_parallel writes the plan into the args Megatron trains with
    (megatron.training.global_vars), not into whichever namespace was parsed last."""
    argv(*MODEL, "--heterogeneous-nic")
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    script = mod.parse_args(script_provider)
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_ARGS = None
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    other = mod.parse_args(None, ignore_unknown_args=True)
    assert lm.megatron_args() is script is not other       # before set_global_variables: the launch's first
    global_vars._GLOBAL_ARGS = other                         # Megatron's own choice wins once it is made
    assert lm.megatron_args() is other
    global_vars._GLOBAL_ARGS = argparse.Namespace()          # ... if it is a namespace parsed with the flag
    assert lm.megatron_args() is script


def _plan(counts, *, overlap=True, distributed_optimizer=True):
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.inputs.model import ModelSpec
    from het_plugin.core.ranks.placement import place
    from het_plugin.core.planner import assemble_plan
    from het_plugin.core.ranks.dims import ParallelDims
    cluster = load_cluster(DATA / "megatron-ib-roce-4.yaml")
    model = ModelSpec(name="t", num_layers=sum(counts), hidden_size=32, num_attention_heads=4, vocab_size=128,
                      seq_length=16, global_batch_size=8, micro_batch_size=2)
    dims = ParallelDims(tp=1, pp=len(counts), dp=4 // len(counts))
    return assemble_plan(cluster, model, place(cluster, dims), counts, 2, overlap_grad_reduce=overlap,
                         distributed_optimizer=distributed_optimizer)


def _container(num_layers=4, **transformer):
    """megatron.training 0.19's PretrainConfigContainer, as far as het_plugin looks at it."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig
    config = TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                               pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                               use_cpu_initialization=True, **transformer)
    return types.SimpleNamespace(model=types.SimpleNamespace(transformer=config), ddp=DistributedDataParallelConfig(),
                                 optimizer=OptimizerConfig(), train=object())


def test_pretrains_config_container_gets_the_split_overlap_and_distributed_optimizer():
    """A config container built from args before the plan existed (the bare flag) is brought to the plan; with
    --heterogeneous-take-plan-settings also to the optimizer and overlap it assumed."""
    from megatron.core.transformer.enums import LayerType
    container = _container()
    changes = lm.apply_plan_to_container(container, _plan([3, 1]), take_settings=True)
    layout = container.model.transformer.pipeline_model_parallel_layout
    assert [row[0].count(LayerType.decoder) for row in layout.layout] == [3, 1]
    assert container.ddp.overlap_grad_reduce and container.ddp.use_distributed_optimizer
    assert container.optimizer.use_distributed_optimizer
    assert changes == ["model.transformer.pipeline_model_parallel_layout=Ettt|tL", "ddp.use_distributed_optimizer=True",
                       "ddp.overlap_grad_reduce=True", "optimizer.use_distributed_optimizer=True"]
    assert lm.apply_plan_to_container(container, _plan([3, 1]), take_settings=True) == [], "idempotent"


def test_the_users_optimizer_and_overlap_stand_unless_the_plans_are_asked_for(argv):
    """Issue 21, item 0: a plan that assumed the distributed optimizer and overlapped reduction changes neither in
    args nor in a config container; rank 0 names both flags once; --heterogeneous-take-plan-settings applies them."""
    from het_plugin.megatron import settings
    plan = _plan([3, 1], overlap=True, distributed_optimizer=True)
    args = types.SimpleNamespace(overlap_grad_reduce=False, use_distributed_optimizer=False)
    changes = hargs.apply_plan_to_args(args, plan)
    assert (args.overlap_grad_reduce, args.use_distributed_optimizer) == (False, False)
    assert not any("overlap_grad" in c or "distributed" in c for c in changes)
    container = _container()
    assert lm.apply_plan_to_container(container, plan, take_settings=False) == [
        "model.transformer.pipeline_model_parallel_layout=Ettt|tL"]
    assert not container.ddp.use_distributed_optimizer and not container.optimizer.use_distributed_optimizer
    note = settings.offer(args, plan)
    assert note.startswith(f"het_plugin: plan {plan.hash} assumed --use-distributed-optimizer (")
    assert "--overlap-grad-reduce (" in note and settings.TAKE_FLAG in note
    # the user chose one of them: only the other is offered; both: nothing to say
    args.use_distributed_optimizer = True
    assert "--use-distributed-optimizer" not in settings.offer(args, plan)
    args.overlap_grad_reduce = True
    assert settings.offer(args, plan) is None
    # a plan without them never turns the user's off
    plain = _plan([3, 1], overlap=False, distributed_optimizer=False)
    hargs.apply_plan_to_args(args, plain)
    assert (args.overlap_grad_reduce, args.use_distributed_optimizer) == (True, True)
    # the opt-in, from Megatron-LM's command line
    argv(*MODEL, "--pipeline-model-parallel-size", "2", "--heterogeneous-nic", str(CLUSTER_8))
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    default = mod.parse_args(script_provider)
    assert default.heterogeneous_take_plan_settings is False and default.overlap_grad_reduce is False
    argv(*MODEL, "--pipeline-model-parallel-size", "2", "--heterogeneous-nic", str(CLUSTER_8), settings.TAKE_FLAG)
    taken = mod.parse_args(script_provider)
    assert taken.overlap_grad_reduce is lm.state.plan.overlap_grad_reduce is True
    assert taken.use_distributed_optimizer is lm.state.plan.distributed_optimizer


def test_a_container_that_already_agrees_with_the_plan_is_left_alone():
    even = _container()
    assert lm.apply_plan_to_container(even, _plan([2, 2], overlap=False, distributed_optimizer=False)) == []
    assert even.model.transformer.pipeline_model_parallel_layout is None and not even.ddp.overlap_grad_reduce
    built_from_planned_args = _container(pipeline_model_parallel_layout="Ettt|tL")    # a FILE: args had the split
    before = built_from_planned_args.model.transformer
    lm.apply_plan_to_container(built_from_planned_args, _plan([3, 1]))
    assert built_from_planned_args.model.transformer is before
    with pytest.raises(ConfigError, match="num_layers"):       # a model the plan was not made for: no guessing
        lm.apply_plan_to_container(_container(num_layers=6), _plan([3, 1]))


def test_the_timeout_flag_is_checked_before_planning(argv, monkeypatch):
    argv(*MODEL, "--heterogeneous-timeout", "-5", "--heterogeneous-nic", str(CLUSTER_8))
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    with pytest.raises(ConfigError) as e:
        mod.parse_args(None)
    assert "--heterogeneous-timeout=-5.0 is not a positive number of seconds" in str(e.value)
    parser = hargs.add_arguments(megatron_parser())
    assert parser.parse_args(MODEL + ["--heterogeneous-timeout", "30"]).heterogeneous_timeout == 30.0


def test_the_timeout_flag_bounds_the_plan_check_and_group_creation(argv, monkeypatch):
    import torch.distributed as dist
    from het_plugin.runtime import agreement
    from het_plugin.megatron import mcore as core
    argv(*MODEL, "--pipeline-model-parallel-size", "2", "--heterogeneous-timeout", "12",
         "--heterogeneous-nic", str(CLUSTER_8))
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    mod.parse_args(None)
    seen = {}
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")     # AppliedPlan.begin reads the world's
    monkeypatch.setattr(agreement, "agree_on_plan", lambda make, **kw: seen.update(agree=kw["timeout_s"]) or make())
    monkeypatch.setattr(core, "build_groups", lambda plan, kwargs, **kw: seen.update(build=kw["timeout_s"]))
    monkeypatch.setattr(core, "original_initialize_model_parallel",
                        lambda: (lambda tensor_model_parallel_size=1, pipeline_model_parallel_size=1: None))
    lm.planned_initialize_model_parallel(1, 2)
    assert seen == {"agree": 12.0, "build": 12.0}


def test_a_homogeneous_plan_keeps_the_users_overlap_setting():
    """het_plugin is a no-op on a homogeneous cluster: the plan's overlap assumption does not turn Megatron's
    --overlap-grad-reduce on, neither in args nor in a config container."""
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.inputs.model import ModelSpec
    from het_plugin.core.ranks.placement import place
    from het_plugin.core.planner import assemble_plan
    from het_plugin.core.ranks.dims import ParallelDims
    cluster = load_cluster(DATA / "megatron-homogeneous-4.yaml")
    model = ModelSpec(name="t", num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128,
                      seq_length=16, global_batch_size=8, micro_batch_size=2)
    plan = assemble_plan(cluster, model, place(cluster, ParallelDims(tp=1, pp=2, dp=2)), [2, 2], 2,
                         overlap_grad_reduce=True)
    assert plan.homogeneous and plan.overlap_grad_reduce
    args = types.SimpleNamespace(overlap_grad_reduce=False)
    changes = hargs.apply_plan_to_args(args, plan)
    assert args.overlap_grad_reduce is False and not any("overlap" in c for c in changes)
    container = _container()
    assert lm.apply_plan_to_container(container, plan) == [] and not container.ddp.overlap_grad_reduce


def test_megatron_lms_world_group_gets_its_own_network_when_the_plan_spans_fabrics(monkeypatch):
    """Megatron-LM calls init_process_group itself: with a plan whose world spans fabrics an NCCL world group
    gets netselect.world_group_options() (the pre-flight's fix) without a script edit; gloo, a given pg_options
    and a world inside one fabric are left alone."""
    import torch.distributed as dist

    from het_plugin.runtime import netselect
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.planner import make_plan
    from megatron_common import MODEL
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append(kw))
    sentinel = object()
    monkeypatch.setattr(netselect, "world_group_options", lambda net_name="Socket": sentinel)
    monkeypatch.setattr(launch_state, "_state", launch_state.LaunchState())
    lm.install_world_group_network()
    lm.install_world_group_network()                       # once
    spanning = make_plan(load_cluster(CLUSTER_8), MODEL, tp=1, pp=2)
    inside = make_plan(load_cluster(DATA / "megatron-homogeneous-4.yaml"), MODEL, tp=1, pp=2)
    assert lm.world_needs_own_network(spanning) and not lm.world_needs_own_network(inside)
    launch_state.write(launch_state.LaunchState(plan=spanning))
    dist.init_process_group(backend="nccl", world_size=8, rank=0)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    dist.init_process_group(backend="gloo")
    dist.init_process_group(backend="nccl", pg_options="mine")
    launch_state.write(launch_state.LaunchState(plan=inside))
    dist.init_process_group(backend="nccl")
    assert [c.get("pg_options") for c in calls] == [sentinel, sentinel, None, "mine", None]
