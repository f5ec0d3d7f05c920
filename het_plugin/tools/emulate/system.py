"""Thin wrappers over ``ip``/``tc`` and the cpu cgroups, the preconditions check, and the run registry used
to find leftovers.

Every run writes ``/run/het-plugin-emulate/<run id>.json`` (its owner's pid and process start time, and
the cpu cgroups it will create) *before* creating anything, so a run killed with SIGKILL leaves a record;
the next start removes the namespaces, links, cgroups and record of every run whose owner is gone.
Records are written atomically (a private temporary file in the same folder, then a link to the final
name), so a concurrent start never reads half a record; a record it cannot read is left alone with its
run, never taken for an ownerless run.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ...core.errors import HetPluginError
from .netspec import LINK_PREFIX, NS_PREFIX, RUN_ID_RE

STATE_DIR = Path(os.environ.get("HET_PLUGIN_EMULATE_STATE", "/run/het-plugin-emulate"))
MOUNTS = Path("/proc/self/mounts")


class EmulatorUnavailable(HetPluginError, RuntimeError):
    """The emulator cannot run here (not root, no network namespaces, no ip/tc, no htb)."""


class CommandFailed(HetPluginError, RuntimeError):
    pass


def sh(args: Sequence[str], *, check: bool = True, ns: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run one command (inside namespace ``ns`` when given); a failure names the command and its stderr."""
    cmd = list(args)
    if ns is not None:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and p.returncode != 0:
        raise CommandFailed(f"`{' '.join(cmd)}` failed (rc {p.returncode}): {p.stderr.strip()}")
    return p


def check_preconditions() -> None:
    """One clear message when the emulator cannot work here."""
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise EmulatorUnavailable(f"the emulator needs {' and '.join(missing)} (iproute2): install iproute2")
    if os.geteuid() != 0:
        raise EmulatorUnavailable("the emulator needs root (it creates network namespaces, veths, bridges and tc "
                                  "qdiscs): run as root, or in CI as root (sudo -E)")
    probe = f"{NS_PREFIX}probe{os.getpid()}"
    p = sh(["ip", "netns", "add", probe], check=False)
    if p.returncode != 0:
        raise EmulatorUnavailable(f"cannot create a network namespace (`ip netns add` said: {p.stderr.strip()}); "
                                  "the emulator needs CONFIG_NET_NS and CAP_SYS_ADMIN (a privileged container)")
    try:
        q = sh(["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb"], ns=probe, check=False)
        if q.returncode != 0:
            raise EmulatorUnavailable(f"tc cannot add an htb qdisc ({q.stderr.strip()}): the emulator needs sch_htb")
    finally:
        sh(["ip", "netns", "del", probe], check=False)


# ---- cpu cgroups (compute speed) --------------------------------------------------------------------

def cpu_controller() -> Optional[Path]:
    """Where the cgroup-v1 hierarchy with the ``cpu`` controller (CFS bandwidth: cpu.cfs_quota_us) is
    mounted, e.g. /sys/fs/cgroup/cpu or /sys/fs/cgroup/cpu,cpuacct; None when there is none."""
    try:
        text = MOUNTS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 4 and f[2] == "cgroup" and "cpu" in f[3].split(","):
            path = Path(f[1].replace("\\040", " "))
            if (path / "cpu.cfs_quota_us").exists():
                return path
    return None


def check_cpu_controller() -> Path:
    """The cpu controller's mount, or one clear message why compute speeds cannot be emulated here."""
    root = cpu_controller()
    if root is None:
        raise EmulatorUnavailable(
            "emulated compute speeds need the cgroup-v1 cpu controller with CFS bandwidth control "
            "(cpu.cfs_quota_us), and none is mounted here (cgroup v2's cpu.max is not supported): mount it "
            "(`mkdir -p /sys/fs/cgroup/cpu && mount -t cgroup -o cpu cgroup /sys/fs/cgroup/cpu`), or run "
            "without speeds (every node then computes at whatever the shared CPU gives it)")
    if not os.access(root, os.W_OK):
        raise EmulatorUnavailable(f"cannot create cgroups under {root} (read-only, or not root): emulated compute "
                                  "speeds need a writable cgroup-v1 cpu hierarchy (a privileged container)")
    return root


def create_cgroup(root: Path, name: str, quota_us: int, period_us: int, shares: int) -> Path:
    """A new cpu cgroup ``root/name`` whose processes together get at most ``quota_us`` per ``period_us``,
    and weigh ``shares`` when the CPU is contended."""
    path = root / name
    path.mkdir()
    (path / "cpu.cfs_period_us").write_text(str(period_us))
    (path / "cpu.cfs_quota_us").write_text(str(quota_us))
    (path / "cpu.shares").write_text(str(shares))
    return path


def join_cgroup_argv(path: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` started through a shell that first moves itself into cgroup ``path``, then execs ``argv``
    (same pid): the process is in the cgroup before it runs a single instruction of its own."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(path / "cgroup.procs"), *argv]


def cgroup_pids(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def remove_cgroup(path: Path, timeout_s: float = 5.0) -> bool:
    """Kill what still runs in cgroup ``path`` (by pid) and remove it; False when it could not be removed."""
    deadline = time.monotonic() + timeout_s
    while True:
        kill_pids(cgroup_pids(path), grace_s=0.5)
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)          # exiting tasks leave the cgroup a moment after they are reaped


def cgroups(prefix: str = NS_PREFIX) -> list[Path]:
    """The emulator's cpu cgroups (named like its namespaces) that exist now."""
    root = cpu_controller()
    if root is None:
        return []
    try:
        return sorted(p for p in root.iterdir() if p.name.startswith(prefix) and p.is_dir())
    except OSError:
        return []


# ---- processes -------------------------------------------------------------------------------------

def process_start_time(pid: int) -> Optional[int]:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None when it is gone; guards pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def alive(pid: int, start_time: Optional[int]) -> bool:
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def kill_pids(pids: Sequence[int], grace_s: float = 2.0) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL; by pid only."""
    live = [p for p in pids if process_start_time(p) is not None]
    for p in live:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        live = [p for p in live if _running(p)]
        time.sleep(0.05)
    for p in live:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in live:
        for _ in range(100):
            if not _running(p):
                break
            time.sleep(0.02)


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (reaps our own children)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def namespace_pids(ns: str) -> list[int]:
    p = sh(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


# ---- what exists -----------------------------------------------------------------------------------

def namespaces(prefix: str = NS_PREFIX) -> list[str]:
    out = sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def root_links(prefix: str = LINK_PREFIX) -> list[str]:
    out = sh(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0]
        if name.startswith(prefix) and _is_emulator_link(name):
            names.append(name)
    return names


def _is_emulator_link(name: str) -> bool:
    """hp<6 hex><E|F<k>|X<i>|e<node>|f<node>|x<i>n<node>>: only names the emulator makes."""
    rest = name[len(LINK_PREFIX):]
    return len(rest) >= 7 and all(c in "0123456789abcdef" for c in rest[:6]) and rest[6] in "EFXefx"


def run_of_name(name: str) -> Optional[str]:
    run = None
    if name.startswith(NS_PREFIX):
        run = name[len(NS_PREFIX):len(NS_PREFIX) + 6]
    elif name.startswith(LINK_PREFIX) and _is_emulator_link(name):
        run = name[len(LINK_PREFIX):len(LINK_PREFIX) + 6]
    return run if run and RUN_ID_RE.match(run) else None


# ---- the run registry ------------------------------------------------------------------------------

@dataclass
class RunRecord:
    run_id: str
    pid: int
    start_time: Optional[int]
    cgroups: tuple[str, ...] = ()       # cpu cgroups the run creates (paths), so cleanup finds them too

    @property
    def path(self) -> Path:
        return STATE_DIR / f"{self.run_id}.json"

    def write(self) -> None:
        """Atomically and exclusively: the record appears whole or not at all, and a run id in use is
        never overwritten (``os.link`` of a complete private temporary file to the final name)."""
        folder = state_dir()
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{self.run_id}.", suffix=TMP_SUFFIX)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps({"run_id": self.run_id, "pid": self.pid, "start_time": self.start_time,
                                     "cgroups": list(self.cgroups)}))
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                raise EmulatorUnavailable(f"emulator run id {self.run_id} is already in use ({self.path}); start "
                                          "again (a new id is drawn each time)") from None
            except OSError:                  # a filesystem without hard links: still atomic, not exclusive
                os.replace(tmp, self.path)
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    @property
    def owner_alive(self) -> bool:
        return alive(self.pid, self.start_time)


TMP_SUFFIX = ".tmp"
STALE_TMP_S = 60.0      # a temporary record older than this was left by a writer that died mid-write


def state_dir() -> Path:
    """The registry folder, created private (0700); refused when it is not a directory of ours (a symlink or
    a folder someone else owns could redirect or forge records)."""
    try:
        STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(STATE_DIR)
    except OSError as exc:
        raise EmulatorUnavailable(f"cannot create the emulator's run registry {STATE_DIR}: {exc.strerror or exc}"
                                  " (set HET_PLUGIN_EMULATE_STATE to a folder root can write)") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise EmulatorUnavailable(f"the emulator's run registry {STATE_DIR} is not a directory owned by this user "
                                  "(a symlink, or another owner): remove it, or set HET_PLUGIN_EMULATE_STATE")
    return STATE_DIR


def records(unreadable: Optional[dict[str, str]] = None) -> dict[str, RunRecord]:
    """The readable run records by run id. A record that cannot be read is *not* deleted (its owner may be
    alive): its run id and the reason go to ``unreadable`` when given. Stale temporary files go."""
    out = {}
    if not STATE_DIR.is_dir():
        return out
    for f in STATE_DIR.iterdir():
        if f.name.endswith(TMP_SUFFIX):
            try:
                if time.time() - f.stat().st_mtime > STALE_TMP_S:
                    f.unlink()
            except OSError:
                pass
            continue
        if f.suffix != ".json" or not RUN_ID_RE.match(f.stem):
            continue
        try:
            d = json.loads(f.read_text())
            if d["run_id"] != f.stem:
                raise ValueError(f"names run {d['run_id']!r}")
            out[f.stem] = RunRecord(f.stem, int(d["pid"]), d.get("start_time"),
                                    tuple(str(c) for c in d.get("cgroups", ())))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if unreadable is not None:
                unreadable[f.stem] = f"{type(exc).__name__}: {exc}"
    return out


def run_cgroups(run_id: str) -> list[Path]:
    """The run's cpu cgroups: those that exist under the controller, and those its record names (only paths
    named like the run's namespaces inside a cpu hierarchy: a record never points cleanup elsewhere)."""
    prefix = f"{NS_PREFIX}{run_id}-"
    found = set(cgroups(prefix))
    rec = records().get(run_id)
    for c in (rec.cgroups if rec else ()):
        p = Path(c)
        if p.name.startswith(prefix) and p.is_dir() and (p.parent / "cpu.cfs_quota_us").exists():
            found.add(p)
    return sorted(found)


def remove_run(run_id: str) -> list[str]:
    """Kill what runs in the run's namespaces and cgroups (by pid), delete them and its root links; returns
    what went."""
    removed = []
    for ns in namespaces(f"{NS_PREFIX}{run_id}-"):
        kill_pids(namespace_pids(ns))
        sh(["ip", "netns", "del", ns], check=False)
        removed.append(f"netns {ns}")
    for cg in run_cgroups(run_id):
        if remove_cgroup(cg):
            removed.append(f"cgroup {cg}")
    for link in root_links(f"{LINK_PREFIX}{run_id}"):
        sh(["ip", "link", "del", link], check=False)   # a veth's peer went with its namespace
        removed.append(f"link {link}")
    RunRecord(run_id, 0, None).remove()
    return removed


def clean_leftovers(kept: Optional[list[str]] = None) -> list[str]:
    """Remove every emulator run whose owner is gone (crashed, SIGKILLed); live runs are left alone, and so
    is a run whose record cannot be read (why goes to ``kept`` when given).

    Namespaces and links are listed *before* the records: a run writes its record before it creates
    anything, so every run seen here whose owner is alive has its record in the listing that follows."""
    names = namespaces() + root_links() + [c.name for c in cgroups()]
    unreadable: dict[str, str] = {}
    recs = records(unreadable)
    runs = {run_of_name(n) for n in names} | set(recs)
    removed = []
    for ns in namespaces(f"{NS_PREFIX}probe"):          # a precondition probe whose process died
        pid = ns[len(NS_PREFIX) + 5:]
        if pid.isdigit() and process_start_time(int(pid)) is None:
            sh(["ip", "netns", "del", ns], check=False)
            removed.append(f"netns {ns}")
    for run_id in sorted(r for r in runs if r):
        rec = recs.get(run_id)
        if rec is not None and rec.owner_alive:
            continue
        if run_id in unreadable:
            if kept is not None:
                kept.append(f"run {run_id} (its record {STATE_DIR / (run_id + '.json')} cannot be read: "
                            f"{unreadable[run_id]}; delete the record by hand if its owner is gone)")
            continue
        removed += remove_run(run_id)
    return removed


def leftovers(run_id: Optional[str] = None) -> list[str]:
    """Namespaces, root links and cpu cgroups of ``run_id`` (or of any run) that still exist; for tests and
    checks."""
    ns_prefix = NS_PREFIX + (f"{run_id}-" if run_id else "")
    link_prefix = LINK_PREFIX + (run_id or "")
    return ([f"netns {n}" for n in namespaces(ns_prefix)] + [f"link {n}" for n in root_links(link_prefix)]
            + [f"cgroup {c}" for c in cgroups(ns_prefix)])
