"""Bad inputs, table-driven (issue 14): every file and command-line argument below stops the CLI with one
message -- the file or option, the field, the problem, and a ``fix:`` line -- exit code 2, no traceback, and
quickly (the point: no minutes-long search, no gigabytes, no error only after planning finished).

Each case runs through ``het_plugin.cli.main`` in-process (its return value is the process's exit status);
a few also run as a real subprocess, and the unreadable file runs as an unprivileged user when the tests
run as root (root reads any file).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Callable

import pytest

from het_plugin.cli import main

REPO = Path(__file__).resolve().parents[2]
# The work a refusal may do, counted (not timed: a CPU-seconds bound failed on a loaded machine): the bugs were a
# minutes-long search, a file parsed three times before its limit was checked, planning before a refusal.
WORK_BOUNDS = {"parse": 3,        # YAML/JSON documents parsed: a saved plan (told from a cluster file, then
                                  # loaded) and a model file or preset at most
               "compose": 1,      # YAML node trees built again to find a line
               "analyze": 0,      # placements the cost model analysed: a refusal comes before any planning
               "evaluate": 0}     # candidate plans (degrees x micro-batch x split) evaluated

CLUSTER = Template("""\
name: t
clusters:
  - name: a
    fabric: {type: ib, gbps: $gbps, latency_us: $lat}
    nodes:
      - count: $count
        accelerator: $acc
        accelerators_per_node: $apn
        nics: [{type: ethernet, gbps: 25}]
$extra""")

TWO_CLUSTERS = Template("""\
name: t
clusters:
  - name: a
    fabric: {type: ib, gbps: 800}
    nodes: [{count: 2, accelerator: A100-80, accelerators_per_node: 8}]
  - name: b
    fabric: {type: roce, gbps: 400}
    nodes: [{count: 2, accelerator: A100-80, accelerators_per_node: 8}]
links:
  - {between: [a, b], gbps: $gbps, latency_us: $lat}
""")

MODEL = Template("""\
name: m
num_layers: $layers
hidden_size: $hidden
num_attention_heads: 8
vocab_size: 1000
seq_length: $seq
global_batch_size: $gbs
$extra""")


def cluster(**kw) -> str:
    values = dict(gbps=800, lat=2, count=2, acc="A100-80", apn=8, extra="")
    values.update(kw)
    return CLUSTER.substitute(values)


def model(**kw) -> str:
    values = dict(layers=4, hidden=512, seq=128, gbs=64, extra="")
    values.update(kw)
    return MODEL.substitute(values)


def big_json_cluster(nodes: int, *, hostnames=None, node_order=None) -> str:
    data = {"name": "big", "clusters": [{"name": "a", "fabric": {"type": "ib", "gbps": 800},
                                         "nodes": [{"count": nodes, "accelerator": "A100-80",
                                                    "accelerators_per_node": 8}]}]}
    if hostnames is not None:
        data["clusters"][0]["nodes"][0]["hostnames"] = hostnames
    if node_order is not None:
        data["launch"] = {"node_order": node_order}
    return json.dumps(data)


def alias_bomb() -> str:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\nclusters: *l9\n"


def edited_plan(path: Path) -> None:
    """The saved plan with a group edited by hand (and its hash dropped, as the hash error suggests)."""
    data = json.loads(path.read_text())
    data.pop("hash")
    data["groups"]["tp"] = [{"x": 1}]
    path.write_text(json.dumps(data))


@dataclass
class Case:
    id: str
    argv: list                         # "{name}" is replaced by the path of files[name]
    where: list[str]                   # in the message line: the file / option, the field (with its line)
    problem: str                       # in the message line
    fix: str                           # in the fix line
    files: dict = field(default_factory=dict)    # name -> text (str), bytes, or a callable(path) making it


def plan_cmd(cluster_file="{c}", *more):
    return ["plan", cluster_file, "--model", "gpt-3.6b", *more]


def sparse(size: int) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        with open(path, "wb") as fh:
            fh.truncate(size)
    return make


def fifo(path: Path) -> None:
    os.mkfifo(path)


def directory(path: Path) -> None:
    path.mkdir()


NODE = "clusters[0].nodes[0]"
CASES = [
    # ---- planner denial of service: sizes ----------------------------------------------------------
    Case("apn-int64", plan_cmd(), ["c.yaml", f"{NODE}.accelerators_per_node (line 8)"],
         "9223372036854775807 accelerators per node is over the limit of 1,024", "e.g. 8",
         {"c.yaml": cluster(apn=9223372036854775807)}),
    Case("apn-1025", plan_cmd(), ["c.yaml", f"{NODE}.accelerators_per_node (line 8)"],
         "over the limit of 1,024", "one rank each", {"c.yaml": cluster(apn=1025)}),
    Case("apn-zero", plan_cmd(), ["c.yaml", f"{NODE}.accelerators_per_node (line 8)"],
         "greater than 0", "use a positive value", {"c.yaml": cluster(apn=0)}),
    Case("count-1e9", plan_cmd(), ["c.yaml", f"{NODE}.count (line 6)"],
         "1000000000 nodes is over the limit of 16,384", "plan a part of the cluster",
         {"c.yaml": cluster(count=1_000_000_000)}),
    Case("count-100000", plan_cmd(), ["c.yaml", f"{NODE}.count (line 6)"],
         "100000 nodes is over the limit of 16,384", "plan a part of the cluster",
         {"c.yaml": cluster(count=100_000)}),
    Case("nodes-added-up", plan_cmd(), ["c.yaml", "clusters"], "20,000 nodes in all", "check the counts",
         {"c.yaml": cluster(count=10_000,
                            extra="      - {count: 10000, accelerator: H100, accelerators_per_node: 8}\n")}),
    Case("accelerators-added-up", plan_cmd(), ["c.yaml", "clusters"], "262,144 accelerators in all",
         "count and accelerators_per_node", {"c.yaml": cluster(count=16_384, apn=16)}),
    Case("clusters-257", plan_cmd(), ["c.yaml", "clusters"], "257 clusters are over the limit of 256",
         "describe fewer clusters",
         {"c.yaml": "clusters:\n" + "".join(
             f"  - {{name: c{i}, fabric: {{type: ethernet, gbps: 25}}, nodes: [{{count: 1, accelerator: H100, "
             f"accelerators_per_node: 8}}]}}\n" for i in range(257))}),
    Case("duplicate-hostnames-16384-nodes", plan_cmd("{c}"), ["c.json", "hostnames"],
         "node names repeat: ['n7']", "unique hostname",
         {"c.json": big_json_cluster(16_384, hostnames=[f"n{i}" for i in range(16_383)] + ["n7"])}),
    Case("node-order-16384-nodes", plan_cmd("{c}"), ["c.json", "launch.node_order"],
         "repeated ['a-5']", "list each of the 16384 node names once",
         {"c.json": big_json_cluster(16_384, node_order=[f"a-{i}" for i in range(16_383)] + ["a-5"])}),
    # ---- silently accepted values ---------------------------------------------------------------------
    Case("count-true", plan_cmd(), ["c.yaml", f"{NODE}.count (line 6)"], "got True, a boolean", "write a number",
         {"c.yaml": cluster(count="true")}),
    Case("apn-yes", plan_cmd(), ["c.yaml", f"{NODE}.accelerators_per_node (line 8)"], "a boolean",
         "write a number", {"c.yaml": cluster(apn="yes")}),
    Case("count-fraction", plan_cmd(), ["c.yaml", f"{NODE}.count (line 6)"], "valid integer",
         "use a whole number", {"c.yaml": cluster(count=2.5)}),
    Case("gbps-inf", plan_cmd(), ["c.yaml", "clusters[0].fabric.gbps (line 4)"], "got inf, not a finite number",
         "not .inf or .nan", {"c.yaml": cluster(gbps=".inf")}),
    Case("gbps-nan", plan_cmd(), ["c.yaml", "clusters[0].fabric.gbps (line 4)"], "got nan, not a finite number",
         "not .inf or .nan", {"c.yaml": cluster(gbps=".nan")}),
    Case("gbps-1e-300", plan_cmd(), ["c.yaml", "clusters[0].fabric.gbps (line 4)"],
         "1e-300 Gbit/s is outside the range het_plugin takes, 0.001 .. 1e+06 Gbit/s", "speed in Gbit/s",
         {"c.yaml": cluster(gbps="1e-300")}),
    Case("gbps-1e300", plan_cmd(), ["c.yaml", "clusters[0].fabric.gbps (line 4)"], "1e+300 Gbit/s is outside",
         "speed in Gbit/s", {"c.yaml": cluster(gbps="1.0e+300")}),
    Case("gbps-negative", plan_cmd(), ["c.yaml", "clusters[0].fabric.gbps (line 4)"], "greater than 0 (got -25)",
         "use a positive value", {"c.yaml": cluster(gbps=-25)}),
    Case("link-gbps-1e-300", plan_cmd(), ["c.yaml", "links[0].gbps (line 10)"], "1e-300 Gbit/s is outside",
         "speed in Gbit/s", {"c.yaml": TWO_CLUSTERS.substitute(gbps="1e-300", lat=50)}),
    Case("latency-1e12", plan_cmd(), ["c.yaml", "links[0].latency_us (line 10)"], "1e+12 us is outside",
         "latency in microseconds", {"c.yaml": TWO_CLUSTERS.substitute(gbps=25, lat="1.0e+12")}),
    Case("peak-tflops-1e-300", plan_cmd(), ["c.yaml", f"{NODE}.accelerator.peak_tflops (line 7)"],
         "1e-300 TFLOPS is outside", "dense BF16 TFLOPS",
         {"c.yaml": cluster(acc="{name: X1, vendor: acme, memory_gib: 32, peak_tflops: 1e-300}")}),
    Case("memory-inf", plan_cmd(), ["c.yaml", f"{NODE}.accelerator.memory_gib (line 7)"], "got inf, not a finite number",
         "not .inf", {"c.yaml": cluster(acc="{name: X1, vendor: acme, memory_gib: .inf, peak_tflops: 100}")}),
    Case("efficiency-1e-9", plan_cmd(), ["c.yaml", f"{NODE}.efficiency (line 10)"], "1e-09 is outside",
         "fraction of peak", {"c.yaml": cluster(extra="        efficiency: 1.0e-9\n")}),
    Case("duplicate-key", plan_cmd(), ["c.yaml", f"{NODE}.count (line 7)"],
         "duplicate key 'count' (first at line 6)", "keep one 'count'",
         {"c.yaml": cluster().replace("      - count: 2\n", "      - count: 2\n        count: 4\n")}),
    Case("duplicate-top-key", plan_cmd(), ["c.yaml", "name (line 2)"], "duplicate key 'name' (first at line 1)",
         "keep one 'name'", {"c.yaml": "name: x\n" + cluster()}),
    # ---- files that were tracebacks ---------------------------------------------------------------------
    Case("non-utf8", plan_cmd(), ["c.yaml", "CLUSTER"], "not UTF-8 text: byte 0xe9 at line 1, column 10",
         "save the file as UTF-8", {"c.yaml": b"name: caf\xe9\n"}),
    Case("nested-brackets-50000", plan_cmd(), ["c.yaml", "CLUSTER"], "YAML at line 1, column 74: nested more than 64 levels deep",
         "fewer than 10 levels", {"c.yaml": "clusters: " + "[" * 50_000 + "]" * 50_000 + "\n"}),
    Case("nested-block-lists", plan_cmd(), ["c.yaml", "CLUSTER"], "nested more than 64 levels",
         "fewer than 10 levels", {"c.yaml": "clusters:\n" + "- " * 5_000 + "x\n"}),
    Case("nested-json-50000", plan_cmd(), ["c.json", "CLUSTER"], "brackets nested too deeply",
         "nest at most 64 levels", {"c.json": "[" * 50_000 + "]" * 50_000}),
    Case("alias-bomb", plan_cmd(), ["c.yaml", "CLUSTER"], "expand to more than 1,000,000 values",
         "fewer nested aliases", {"c.yaml": alias_bomb()}),
    Case("alias-cycle", plan_cmd(), ["c.yaml", "CLUSTER"], "refers to a value that contains it (a cycle)",
         "remove the alias", {"c.yaml": "clusters: &c [*c]\n"}),
    Case("integer-5000-digits", plan_cmd(), ["c.yaml", "CLUSTER"],
         "line 6, column 16: cannot read the value '11111111111111111111'... (5000 characters): Exceeds the limit",
         "correct the syntax", {"c.yaml": cluster(count="1" * 5000)}),
    Case("impossible-date", plan_cmd(), ["c.yaml", "CLUSTER"], "cannot read the value '2024-13-45'",
         "correct the syntax", {"c.yaml": "name: 2024-13-45\n"}),
    Case("nul-byte", plan_cmd(), ["c.yaml", "CLUSTER"], "line 1, column 7: character #x0000 is not allowed",
         "remove that character", {"c.yaml": "name: \x00\n"}),
    Case("yaml-over-4-mib", plan_cmd(), ["c.yaml", "CLUSTER"], "over the 4.0 MiB limit for YAML files",
         "as JSON", {"c.yaml": sparse(5 * 2 ** 20)}),
    Case("json-over-64-mib", plan_cmd(), ["c.json", "CLUSTER"], "over the 64.0 MiB limit for JSON files",
         "pass the right file", {"c.json": sparse(65 * 2 ** 20)}),
    Case("empty-file", plan_cmd(), ["c.yaml"], "the file is empty", "write the fields", {"c.yaml": ""}),
    Case("cluster-is-a-directory", plan_cmd("{d}"), ["d", "cluster"], "is a directory, not a file",
         "pass an existing cluster file inside it",
         {"d": directory}),
    Case("model-is-a-directory", ["plan", "--model", "{d}"], ["d", "--model"], "this is a directory, not a file",
         "not the folder", {"d": directory}),
    Case("model-is-a-fifo", ["plan", "--model", "{f}"], ["f.yaml", "--model"], "not a regular file",
         "save it to a file first", {"f.yaml": fifo}),
    Case("cluster-missing", plan_cmd("{missing}/c.yaml"), ["no-such-folder/c.yaml", "cluster"],
         "cluster file not found", "pass an existing", {}),
    # ---- model files ------------------------------------------------------------------------------------
    Case("gbs-1e15-string", ["plan", "--model", "{m}"], ["m.yaml", "global_batch_size (line 7)"],
         "valid integer, unable to parse string as an integer (got '1e15')", "use a whole number",
         {"m.yaml": model(gbs="1e15")}),
    Case("gbs-10-15", ["plan", "--model", "{m}"], ["m.yaml", "global_batch_size (line 7)"],
         "global_batch_size 1000000000000000 is over the limit of 65,536", "use at most 65,536",
         {"m.yaml": model(gbs=10 ** 15)}),
    Case("gbs-json-float", ["plan", "--model", "{m}"], ["m.json", "global_batch_size"],
         "global_batch_size 1000000000000000.0 is over the limit", "use at most 65,536",
         {"m.json": json.dumps({"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "vocab_size": 100,
                                "seq_length": 128, "global_batch_size": 1e15})}),
    Case("layers-huge", ["plan", "--model", "{m}"], ["m.yaml", "num_layers (line 2)"],
         "over the limit of 4,096", "use at most 4,096", {"m.yaml": model(layers=10 ** 9)}),
    Case("hidden-10-30", ["plan", "--model", "{m}"], ["m.yaml", "hidden_size (line 3)"],
         "hidden_size 1000... (31 digits) is over the limit of 1,048,576", "use at most",
         {"m.yaml": model(hidden=10 ** 30)}),
    Case("seq-true", ["plan", "--model", "{m}"], ["m.yaml", "seq_length (line 6)"], "a boolean",
         "write a whole number", {"m.yaml": model(seq="true")}),
    Case("model-micro-batch-0", ["plan", "--model", "{m}"], ["m.yaml", "micro_batch_size (line 8)"],
         "greater than 0", "use a positive value", {"m.yaml": model(extra="micro_batch_size: 0\n")}),
    Case("model-duplicate-key", ["plan", "--model", "{m}"], ["m.yaml", "global_batch_size (line 8)"],
         "duplicate key 'global_batch_size' (first at line 7)", "keep one",
         {"m.yaml": model(extra="global_batch_size: 128\n")}),
    # ---- command-line arguments ----------------------------------------------------------------------
    Case("micro-batch-size-0", ["plan", "--micro-batch-size", "0"], ["--micro-batch-size"],
         "0 is not between 1 and 65,536", "leave --micro-batch-size out", {}),
    Case("tp-0", ["plan", "--tp", "0"], ["--tp"], "0 is not between 1 and 131,072", "whole number from 1", {}),
    Case("pp-negative", ["plan", "--pp", "-1"], ["--pp"], "-1 is not between 1", "whole number from 1", {}),
    Case("tp-int64", ["plan", "--tp", "9223372036854775807"], ["--tp"], "9223372036854775807 is not between 1",
         "whole number from 1", {}),
    Case("cp-0", ["plan", "--cp", "0"], ["--cp"], "0 is not between 1", "whole number from 1", {}),
    Case("vpp-0", ["plan", "--vpp", "0"], ["--vpp"], "0 is not between 1 and 4,096", "whole number from 1", {}),
    Case("plan-edited-by-hand", ["plan", "{plan}"], ["plan.json", "CLUSTER"],
         "not a valid plan file: TypeError: GroupPlan.__init__() got an unexpected keyword argument 'x'",
         "instead of editing it", {"plan.json": edited_plan}),
    Case("order-unknown", ["plan", "--order", "tp-dp-xx"], ["--order"], "must name each of",
         "tp-cp-ep-pp-dp (--use-tp-pp-dp-mapping)", {}),
    Case("saved-plan-order", ["plan", "{plan}", "--order", "tp-cp-ep-pp-dp"], ["plan.json", "--order"],
         "--order tp-cp-ep-pp-dp was passed, but the saved plan has order=tp-cp-ep-dp-pp", "drop --order", {}),
    Case("saved-plan-vpp", ["plan", "{plan}", "--vpp", "2"], ["plan.json", "--vpp"],
         "--vpp 2 was passed, but the saved plan has vpp=1", "drop --vpp", {}),
    Case("saved-plan-tp", ["plan", "{plan}", "--tp", "8"], ["plan.json", "--tp"],
         "--tp 8 was passed, but the saved plan has tp=", "re-plan from the cluster file", {}),
    Case("saved-plan-micro-batch", ["plan", "{plan}", "--micro-batch-size", "64"], ["plan.json", "--micro-batch-size"],
         "but the saved plan has micro_batch_size=", "drop --micro-batch-size", {}),
    Case("saved-plan-model", ["plan", "{plan}", "--model", "gpt-39b"], ["plan.json", "--model"],
         "--model gpt-39b has hidden_size=8192, the saved plan was made for hidden_size=", "drop --model", {}),
    Case("saved-plan-profile", ["plan", "{plan}", "--profile", "p.yaml"], ["plan.json", "--profile"],
         "a saved plan is shown as it is", "drop --profile", {}),
    Case("output-is-the-input", plan_cmd("{c}", "-o", "{c}"), ["c.yaml", "-o/--output"],
         "is also the input (CLUSTER)", "write -o to another file", {"c.yaml": cluster()}),
    Case("output-is-the-model", ["plan", "--model", "{m}", "-o", "{m}"], ["m.yaml", "-o/--output"],
         "is also the input (--model)", "another file", {"m.yaml": model()}),
    Case("output-is-the-saved-plan", ["plan", "{plan}", "-o", "{plan}"], ["plan.json", "-o/--output"],
         "is also the input (CLUSTER)", "another file", {}),
    Case("output-folder-missing", ["plan", "-o", "{missing}/plan.json"], ["-o/--output", "does not exist"],
         "the folder", "create the folder first", {}),
    Case("output-is-a-directory", ["plan", "-o", "{out.json}"], ["-o/--output"], "is a directory",
         "give a file name", {"out.json": directory}),
    Case("output-unwritable", ["plan", "-o", "/proc/het_plugin_plan.json"], ["/proc/het_plugin_plan.json",
                                                                           "-o/--output"],
         "cannot write the plan", "choose a folder you can write to", {}),
    Case("svg-folder-missing", ["plan", "--svg", "{missing}/p.svg"], ["--svg"], "does not exist",
         "create the folder first", {}),
    Case("svg-unwritable", ["plan", "--svg", "/proc/het_plugin.views.svg"], ["/proc/het_plugin.views.svg", "--svg"],
         "cannot write the picture", "choose a folder", {}),
    Case("wrap-config-output-is-the-config", ["wrap-config", "{ds.json}", "--cluster", "{c}", "-o", "{ds.json}"],
         ["ds.json", "-o/--output"], "is also the input (CONFIG)", "another file",
         {"ds.json": '{"train_batch_size": 8}', "c.yaml": cluster()}),
    Case("wrap-config-pp-0", ["wrap-config", "{ds.json}", "--pp", "0"], ["--pp"], "0 is not between 1",
         "leave --pp out", {"ds.json": '{"train_batch_size": 8}'}),
    Case("wrap-config-non-utf8", ["wrap-config", "{ds.json}"], ["ds.json", "CONFIG"], "not UTF-8 text",
         "save the file as UTF-8", {"ds.json": b'{"a": "\xff"}'}),
    Case("wrap-config-nested", ["wrap-config", "{ds.json}"], ["ds.json", "CONFIG"], "nested too deeply",
         "nest at most", {"ds.json": "[" * 50_000 + "]" * 50_000}),
    Case("discover-output-folder-missing", ["discover", "--gather", "-o", "{missing}/c.yaml"],
         ["-o/--output"], "does not exist", "create the folder first", {}),
    Case("discover-output-without-gather", ["discover", "-o", "out.yaml"], ["-o/--output"],
         "without --gather it is not used", "add --gather", {}),
    Case("discover-timeout-0", ["discover", "--gather", "--timeout", "0"], ["--timeout"],
         "--timeout=0.0 is not a positive number of seconds", "e.g. 300", {}),
    Case("check-timeout-nan", ["check", "--gather", "--timeout", "nan"], ["--timeout"],
         "--timeout=nan is not a positive number of seconds", "HET_PLUGIN_TIMEOUT", {}),
    Case("emulate-scale-inf", ["emulate", "{c}", "--show", "--scale", "inf"], ["--scale"],
         "inf is not a scale the emulator takes", "--scale 1000", {"c.yaml": cluster()}),
    Case("emulate-port-70000", ["emulate", "{c}", "--show", "--port", "70000"], ["--port"],
         "70000 is not a TCP port", "from 1 to 65535", {"c.yaml": cluster()}),
    Case("emulate-count-1e9", ["emulate", "{c}", "--show"], ["c.yaml", f"{NODE}.count (line 6)"],
         "over the limit of 16,384", "plan a part", {"c.yaml": cluster(count=1_000_000_000)}),
]


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory) -> Path:
    """A small plan file (one node of 8, GPT-3.6B) for the saved-plan cases."""
    d = tmp_path_factory.mktemp("saved")
    (d / "c.yaml").write_text(cluster(count=1))
    out = d / "plan.json"
    assert main(["plan", str(d / "c.yaml"), "--model", "gpt-3.6b", "-o", str(out), "--format", "json"]) == 0
    return out


@pytest.fixture(scope="module", autouse=True)
def warm():
    """Import what the cases touch before the first case (the counts wrap module functions)."""
    import het_plugin.cli.discover   # noqa: F401
    import het_plugin.deepspeed.config  # noqa: F401
    import het_plugin.core.planner  # noqa: F401
    import het_plugin.views.report  # noqa: F401
    import het_plugin.views.svg  # noqa: F401


def materialise(case: Case, tmp_path: Path, saved_plan: Path) -> list[str]:
    paths = {"missing": str(tmp_path / "no-such-folder")}
    if "{plan}" in " ".join(case.argv):
        paths["plan"] = str(tmp_path / "plan.json")
        Path(paths["plan"]).write_bytes(saved_plan.read_bytes())
    for name, content in case.files.items():
        path = tmp_path / name
        if callable(content):
            content(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        paths[name] = str(path)
        paths[name.split(".")[0]] = str(path)
    out = []
    for arg in case.argv:
        for key, value in paths.items():
            arg = arg.replace("{" + key + "}", value)
        out.append(arg)
    return out


def check_message(err: str, case: Case, command: str) -> None:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 2, f"one message line and one fix line, got:\n{err}"
    message, fix = lines
    assert message.startswith(f"het-plugin {command}: error: "), err
    for part in case.where:
        assert part in message, f"{part!r} not in {message!r}"
    assert case.problem in message, f"{case.problem!r} not in {message!r}"
    assert fix.startswith("  fix: ") and case.fix in fix, f"{case.fix!r} not in {fix!r}"


def test_the_table_is_large_and_names_differ():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


@pytest.fixture
def work(monkeypatch) -> dict:
    """Counts of the work done (see WORK_BOUNDS) while a test runs."""
    from het_plugin.core import cost, planner
    from het_plugin.core.inputs import yamlio
    counts = dict.fromkeys(WORK_BOUNDS, 0)

    def counting(module, name, what):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[what] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counting(yamlio, "parse_yaml", "parse")
    counting(yamlio, "parse_json", "parse")
    counting(yamlio, "compose", "compose")
    counting(cost, "analyze", "analyze")
    counting(planner, "_evaluate_split", "evaluate")
    return counts


def assert_work_within(work: dict, bounds: dict = WORK_BOUNDS) -> None:
    over = {k: v for k, v in work.items() if v > bounds[k]}
    assert not over, f"the refusal did more work than it should: {over} (bounds {bounds})"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_stops_with_one_message(case: Case, tmp_path, capsys, saved_plan, monkeypatch, work):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "1")           # discover --gather alone, never waiting for a store
    argv = materialise(case, tmp_path, saved_plan)
    capsys.readouterr()
    for k in work:
        work[k] = 0                  # materialise() wrote the files; count only the command's own work
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    check_message(err, case, argv[0])
    print(f"[work] {case.id}: {work}")
    assert_work_within(work)


def test_three_hundred_clusters_are_refused_after_one_parse(tmp_path, capsys, work):
    """The issue's file: 300 one-GPU clusters in block style. Its size is refused after one parse: not parsed
    again to tell a plan file from a cluster file, nor composed again to find the line of 'clusters'."""
    lines = ["name: many", "clusters:"]
    for i in range(300):
        lines += [f"  - name: c{i}", "    fabric: {type: ib, gbps: 100, latency_us: 2}", "    nodes:",
                  "      - {count: 1, accelerator: A100-80, accelerators_per_node: 1, nics: [{type: ethernet, gbps: 25}]}"]
    (tmp_path / "many.yaml").write_text("\n".join(lines) + "\n")
    assert main(["plan", str(tmp_path / "many.yaml"), "--model", "gpt-3.6b"]) == 2
    err = capsys.readouterr().err
    assert "clusters (line 2): 300 clusters are over the limit of 256" in err, err
    assert work["parse"] == 1 and work["compose"] == 0, work
    assert_work_within(work)


def test_nothing_was_written_next_to_the_inputs(tmp_path, capsys, saved_plan):
    """A refused -o leaves no plan and no temporary file behind (the writability probe cleans up)."""
    (tmp_path / "c.yaml").write_text(cluster())
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(plan_cmd(str(tmp_path / "c.yaml"), "-o", str(tmp_path / "c.yaml"))) == 2
    assert main(["plan", str(tmp_path / "c.yaml"), "--model", "gpt-3.6b", "--tp", "0", "-o",
                 str(tmp_path / "p.json")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "c.yaml").read_text() == cluster()


# ---- real processes: the exit status, and the unreadable file ---------------------------------------------

def _cli(argv, cwd, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "het_plugin.cli", *argv], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120, **kw)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in ("apn-int64", "micro-batch-size-0",
                                                                 "nested-brackets-50000", "gbs-10-15")],
                         ids=lambda c: c.id)
def test_exit_status_of_the_process_is_2(case: Case, tmp_path, saved_plan):
    argv = materialise(case, tmp_path, saved_plan)
    out = _cli(argv, tmp_path)          # its timeout (120 s) only stops a hang; the work is bounded above
    assert out.returncode == 2, out.stderr
    check_message(out.stderr, case, argv[0])


UNREADABLE = Case("unreadable", plan_cmd(), ["c.yaml", "CLUSTER"], "cannot read the file: permission denied",
                  "make it readable", {"c.yaml": cluster()})


def test_unreadable_file(tmp_path, capsys, saved_plan):
    argv = materialise(UNREADABLE, tmp_path, saved_plan)
    os.chmod(argv[1], 0)
    if os.geteuid() != 0:
        assert main(argv) == 2
        check_message(capsys.readouterr().err, UNREADABLE, "plan")
        return
    # root reads any file through CAP_DAC_OVERRIDE: run the command as root without it (setpriv drops the
    # capabilities from the bounding set, so the exec'd interpreter never has them)
    import shutil
    if shutil.which("setpriv") is None:
        pytest.skip("running as root and setpriv (util-linux) is missing: cannot make a file unreadable to root")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m",
                          "het_plugin.cli", *argv], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    if "setpriv:" in out.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {out.stderr.strip()[-200:]}")
    assert out.returncode == 2, out.stderr
    check_message(out.stderr, UNREADABLE, "plan")
