"""Format-1 profiles (the documented example and the benchmark's bundled files, copied to tests/data/format1)
predict exactly as before.

``tests/data/profile_format1_golden.json`` was written by :func:`write_golden` with the predictor as it was
before profile format 2 (commit 1230344): every prediction field and every plan hash must still match, bit for
bit. Regenerate it only for a deliberate change of format-1 semantics (there should be none)."""
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from het_plugin.core import cost
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.ranks.placement import place
from het_plugin.core.planner import make_plan
from het_plugin.core.inputs.profile import Profile, load_profile
from het_plugin.core.ranks.dims import ParallelDims
from het_plugin.core.inputs.yamlio import read_data

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "profile_format1_golden.json"
# The format-1 example docs/planner.md showed (documented.yaml) and copies of the benchmark's measured profiles
# as benchmarks/results held them (a new benchmark run rewrites those in format 2).
FILES = sorted((ROOT / "tests" / "data" / "format1").glob("*.yaml"))
CASES = [  # (dims, micro-batch, distributed optimizer, vpp)
    (dict(tp=1, pp=4, dp=16), 1, False, 1), (dict(tp=1, pp=4, dp=16), 4, True, 1),
    (dict(tp=4, pp=2, dp=8), 1, False, 1), (dict(tp=4, pp=2, dp=8), 2, True, 1),
    (dict(tp=4, pp=2, dp=8), 8, False, 1), (dict(tp=2, pp=4, dp=8), 2, False, 2),
]


def results(profile: Profile) -> dict:
    holmes = load_cluster(ROOT / "examples" / "clusters" / "holmes-ib-roce.yaml")
    model = preset_model("gpt-7.5b")
    out = {}
    for dims, mb, dist_opt, vpp in CASES:
        d = ParallelDims(**dims)
        layers = [model.num_layers // d.pp] * d.pp
        pred = cost.predict(holmes, model, place(holmes, d), layers, mb, distributed_optimizer=dist_opt,
                            profile=profile, vpp=vpp)
        fields = asdict(pred)
        assert fields.pop("extrapolated") == []        # added with issue 23; format 1 never extrapolates (frozen)
        out[f"{dims} mb={mb} distopt={dist_opt} vpp={vpp}"] = json.loads(json.dumps(fields, default=repr))
    for name in ("holmes-ib-roce", "two-clusters-25gbe"):
        cluster = load_cluster(ROOT / "examples" / "clusters" / f"{name}.yaml")
        out[f"plan {name}"] = make_plan(cluster, model, tp=4, profile=profile).hash
    return out


def _float_repr(data):
    if isinstance(data, float):
        return repr(data)
    if isinstance(data, dict):
        return {k: _float_repr(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_float_repr(v) for v in data]
    return data


def write_golden() -> None:
    GOLDEN.write_text(json.dumps({f.name: _float_repr(results(load_profile(f))) for f in FILES}, indent=1,
                                 sort_keys=True) + "\n")


def test_the_inputs_are_format_1():
    assert len(FILES) >= 9
    for f in FILES:
        assert read_data(f)["format"] == "het_plugin-profile/1", f


@pytest.mark.parametrize("path", FILES, ids=lambda f: f.name)
def test_format1_profiles_predict_exactly_as_before(path):
    golden = json.loads(GOLDEN.read_text())[path.name]
    assert _float_repr(results(load_profile(path))) == golden
