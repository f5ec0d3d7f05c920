"""The plan file format: its version, what a plan file must hold, the hash (with the keys added to format 3
after plans were written with it, hashed only when set, so an older plan keeps its hash), and reading and
writing plan files as JSON or YAML. :class:`het_plugin.core.plan.Plan` delegates here; this module works on
the plan's plain data (``dataclasses.asdict``) and knows nothing of the classes."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from .errors import ConfigError
from .files import dump_data
from .inputs.yamlio import read_data, read_text

# 2: the plan carries the link kinds between clusters ('links'); 'order' dropped (nothing read it).
# 3: 'embedding_stages' (untied embeddings and MTP change which stages share the word embedding); 'order'
#    (Megatron's rank order: rank_of_logical is in its numbering) and 'etp' with expert groups 'expert-*';
#    'vpp', 'layers_per_virtual_stage' and 'overlap_p2p_comm' (interleaved pipelines), which the hash leaves out
#    at their defaults (a plan written before them keeps its hash); 'replica_micro_batches' (heterogeneous data
#    parallelism), hashed likewise only when set; 'nccl_nets' (the NCCL network an RDMA fabric declares),
#    hashed only when set; 'left_out' and 'price_per_hour' (a plan over a subset of the nodes, prices), written
#    and hashed only when set.
FORMAT_VERSION = 3

# Keys a plan file holds only when set (a plan that uses every node, without prices, is written as before).
WRITTEN_ONLY_WHEN_SET = {"left_out": {}, "price_per_hour": None}

# Keys added to format 3 after plans were written with it: hashed only when they differ from the default.
_HASHED_UNLESS_DEFAULT = {"vpp": 1, "layers_per_virtual_stage": [], "overlap_p2p_comm": False,
                          "replica_micro_batches": [], "nccl_nets": {},
                          **WRITTEN_ONLY_WHEN_SET}

# What the predictor's numbers and the planner's notes are about, not part of what they were computed from.
# (nccl_nets: which NCCL network an RDMA group names does not enter the cost model; left_out and price_per_hour
# describe the choice of nodes and its price, the prediction is of the kept nodes)
_NOT_PREDICTED_FROM = ("prediction", "baseline", "alternatives", "warnings", "predicted_for", "format_version",
                       "nccl_nets", "left_out", "price_per_hour")


def plan_fields(data: Any, known: set[str], source: str) -> tuple[dict[str, Any], Optional[str]]:
    """A plan file's mapping, checked (a plan, this format, no unknown keys): its fields and the hash it states."""
    if not isinstance(data, dict) or "rank_of_logical" not in data:
        raise ConfigError("not a plan file (no 'rank_of_logical')", source=source,
                          fix="write one with `het-plugin plan -o plan.json`")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise ConfigError(f"the plan has format_version {version}, this het_plugin reads format_version "
                          f"{FORMAT_VERSION}", source=source, field="format_version",
                          fix="re-plan with this het_plugin: `het-plugin plan CLUSTER --model MODEL -o PLAN` "
                              "(or re-wrap the DeepSpeed config)")
    data = dict(data)
    stored_hash = data.pop("hash", None)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown plan keys {unknown}", source=source, fix="re-create the plan")
    return data, stored_hash


def check_hash(stored_hash: Optional[str], plan_hash: str, source: str) -> None:
    if stored_hash is not None and stored_hash != plan_hash:
        raise ConfigError("the plan's content does not match its hash (edited by hand?)", source=source,
                          field="hash", fix="re-create the plan with `het-plugin plan -o`, or delete the hash key")


def canonical_json(data: dict[str, Any]) -> str:
    """The text the plan hash is taken of (``data``: the plan's ``asdict``, changed here)."""
    for key, default in _HASHED_UNLESS_DEFAULT.items():
        if data[key] == default:
            del data[key]
    del data["predicted_for"]         # a digest of the content hashed here: adds nothing, keeps hashes as before
    _drop_zero_alltoall(data)
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=_json_default)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def content_digest(data: dict[str, Any]) -> str:
    """A hash of everything the prediction is computed from (the plan less its predictions and notes)."""
    for key in _NOT_PREDICTED_FROM:
        data.pop(key, None)
    return digest(json.dumps(data, sort_keys=True, separators=(",", ":"), default=_json_default))


def to_json(data: dict[str, Any]) -> str:
    """A plan's ``to_dict`` as the JSON a plan file holds."""
    return json.dumps(data, default=_json_default)


def save(data: dict[str, Any], path: str | Path) -> None:
    """Write a plan's ``to_dict`` to ``path``: JSON for .json, YAML otherwise."""
    dump_data(json.loads(to_json(data)), path)


def load(path: str | Path) -> Any:
    """A plan file's data (checked by ``Plan.from_dict``)."""
    return read_data(path)


def looks_like_plan(path: str | Path) -> bool:
    """Plan files and cluster files share suffixes; a plan has 'rank_of_logical'."""
    if "rank_of_logical" not in read_text(path):
        return False            # a cluster file: not parsed twice (a large one takes seconds to parse)
    data = read_data(path)
    return isinstance(data, dict) and "rank_of_logical" in data


def _drop_zero_alltoall(data: dict) -> None:
    """Predictions gained 'alltoall_s' (MoE), 'replica_pipeline_s' and 'shape' (heterogeneous data parallelism)
    after plans were written with format 3: hashed only when not 0 / not empty, so a plan without them keeps its
    hash."""
    for key in ("prediction", "baseline"):
        if data.get(key) is not None and data[key].get("alltoall_s") == 0.0:
            del data[key]["alltoall_s"]
        for name, empty in (("replica_pipeline_s", []), ("shape", ""), ("extrapolated", [])):
            if data.get(key) is not None and data[key].get(name) == empty:
                del data[key][name]


def _json_default(o):
    if isinstance(o, float):
        return repr(o)
    raise TypeError(type(o))
