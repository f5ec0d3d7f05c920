"""One plan per node: the ranks of a node that would compute the same plan let their local rank 0 search, and
read its plan from a node-local file.

The planner's search costs seconds of CPU at 16,384 accelerators (docs/benchmark-startup.md), and every rank of
a node would run the same one at the same moment. Here local rank 0 publishes the digest of its inputs
(``core.launch.planning_digest``) and then its plan (or its ConfigError) in a directory of the node's temp space,
named by the job (MASTER_ADDR:MASTER_PORT, torchrun's run id and restart count). The others:

* read local rank 0's digest; a different one (another cluster file, other arguments) plans by itself, and the
  plan agreement then names it, as without this module;
* wait for the plan (bounded: :data:`WAIT_S` or the adapter's timeout, whichever is less); a local rank 0 that
  never delivers (crashed, or on a node whose temp directory is not shared between its ranks' containers) is not
  an error: the rank plans by itself.

The plan read is checked: its digest is in the file, and the plan hash agreement that follows compares every
rank's plan as before. Nothing goes through the job's store. ``HET_PLUGIN_PLAN_ONCE=0`` switches it off (every
rank plans); a launch without LOCAL_RANK / LOCAL_WORLD_SIZE (one rank a node) needs nothing shared.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

from ..core.errors import ConfigError
from ..core.launch import SharePlan
from ..core.plan import Plan
from .exchange import encode_error, timeout_s as bound

ENV_OFF = "HET_PLUGIN_PLAN_ONCE"
ENV_DIR = "HET_PLUGIN_PLAN_DIR"
WAIT_S = 120.0


def job_key(env: Mapping[str, str]) -> str:
    """Which launch this is: the same on every rank of one job attempt, different for the next attempt."""
    parts = [env.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                                       "TORCHELASTIC_RESTART_COUNT", "GROUP_RANK")]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)                  # readers see the whole file or none


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _wait_for(path: Path, deadline: float) -> Optional[str]:
    pause = 0.005
    while True:
        text = _read(path)
        if text is not None or time.monotonic() >= deadline:
            return text
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def node_sharing(env: Optional[Mapping[str, str]] = None, *, timeout_s: Optional[float] = None,
                 root: Optional[Path] = None) -> Optional[SharePlan]:
    """The ``share_plan`` for ``core.launch.resolve_launch`` on this rank, or None (every rank plans: switched
    off, or one rank per node)."""
    env = os.environ if env is None else env
    if env.get(ENV_OFF, "1") in ("0", "false", "off"):
        return None
    try:
        local_rank, local_world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if local_world <= 1:
        return None
    base = Path(root or env.get(ENV_DIR) or tempfile.gettempdir())
    folder = base / f"het_plugin-plan-{job_key(env)}"
    wait_s = min(WAIT_S, bound(timeout_s, env))
    return lambda digest, search: share_on_node(digest, search, local_rank=local_rank, folder=folder, wait_s=wait_s)


def share_on_node(digest: str, search: Callable[[], Plan], *, local_rank: int, folder: Path,
                  wait_s: float = WAIT_S) -> Plan:
    """Local rank 0 searches and publishes; the others read its plan when their inputs are its inputs."""
    if local_rank == 0:
        return _publish(digest, search, folder)
    deadline = time.monotonic() + wait_s
    theirs = _wait_for(folder / "digest", deadline)
    if theirs != digest:
        return search()                     # other inputs (or no local rank 0): plan here; the agreement judges
    text = _wait_for(folder / f"plan-{digest}.json", deadline)
    if text is None:
        return search()
    record = json.loads(text)
    if "error" in record:
        err = record["error"]
        if err.get("config"):
            raise ConfigError(err["problem"], source=err.get("source"), field=err.get("field"), fix=err.get("fix"))
        return search()                     # not a ConfigError: raise this rank's own
    return Plan.from_dict(record["plan"], f"local rank 0's plan ({folder})")


def _publish(digest: str, search: Callable[[], Plan], folder: Path) -> Plan:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write(folder / "digest", digest)
        atexit.register(shutil.rmtree, folder, True)
    except OSError:
        return search()                     # no writable temp directory: the others time out and plan
    try:
        plan = search()
    except ConfigError as exc:
        _write_quietly(folder / f"plan-{digest}.json", json.dumps({"error": encode_error(exc)}))
        raise
    except Exception as exc:                # noqa: BLE001 - the others plan for themselves and meet the same
        _write_quietly(folder / f"plan-{digest}.json", json.dumps({"error": encode_error(exc)}))
        raise
    _write_quietly(folder / f"plan-{digest}.json", '{"plan": ' + plan.to_json() + "}")
    return plan


def _write_quietly(path: Path, text: str) -> None:
    try:
        _write(path, text)
    except OSError:
        pass
