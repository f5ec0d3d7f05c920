"""The emulator itself: build the namespaces, bridges, veths and htb shaping of a Layout, run ranks inside
them like torchrun (each node's processes in its cpu cgroup when compute speeds are emulated), and tear
everything down on exit, error, Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Callable, Optional, Sequence

from ...core.inputs.cluster import Cluster
from .netspec import ExtraNetwork, Interface, Layout, make_layout
from .procs import RankOutput, kill_group, wait_all
from .procs import collect as collect_procs
from .speed import SpeedInput
from .system import (
    CommandFailed,
    EmulatorUnavailable,
    RunRecord,
    check_cpu_controller,
    check_preconditions,
    clean_leftovers,
    create_cgroup,
    join_cgroup_argv,
    kill_pids,
    namespace_pids,
    process_start_time,
    remove_run,
    sh,
)

QUANTUM = "65536"          # htb quantum in bytes: >= one GSO frame, quiets the "quantum is big" warning
DEFAULT_PORT = 29500       # free in every fresh namespace: each run has its own
FAIL_FAST_S = 10.0         # after a rank failed, the others get this long to print their side and end


class Emulation:
    """A running emulated network. Use as a context manager::

        with Emulation(load_cluster("c.yaml"), scale=1000) as emu:
            procs = emu.launch([sys.executable, "train.py"])
            codes = emu.wait(procs, timeout=300)
    """

    def __init__(self, cluster: Cluster, *, scale: float = 1000.0, run_id: Optional[str] = None,
                 extra_networks: Sequence[ExtraNetwork] = (), speeds: SpeedInput = None,
                 cpu_per_rank: Optional[float] = None, multinet: bool = False,
                 log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)):
        """``speeds``: emulate each node's compute speed with a cpu cgroup quota -- ``"catalog"`` (the
        accelerators' sustained FLOP/s) or node/cluster names to relative speeds; None: compute unshaped.
        ``cpu_per_rank``: the fastest rank's share of a core (default: see ``speed.default_cpu_per_rank``).
        ``multinet``: other clusters' fabric addresses reachable over Ethernet (``netspec.make_layout``)."""
        self.cluster = cluster
        self.layout: Layout = make_layout(cluster, run_id or secrets.token_hex(3), scale, tuple(extra_networks),
                                          speeds, cpu_per_rank, multinet)
        self.log = log
        self.procs: list[subprocess.Popen] = []
        self._record = RunRecord(self.layout.run_id, os.getpid(), process_start_time(os.getpid()))
        self._cgroup_root: Optional[Path] = None
        self._up = False

    @property
    def shapes_compute(self) -> bool:
        return any(n.cpu is not None for n in self.layout.nodes)

    def cgroup_path(self, node_index: int) -> Optional[Path]:
        """The node's cpu cgroup (None: its compute is not shaped, or the network is not up)."""
        node = self.layout.nodes[node_index]
        if node.cpu is None or self._cgroup_root is None:
            return None
        return self._cgroup_root / node.cgroup

    # ---- life cycle ------------------------------------------------------------------------------
    def __enter__(self) -> "Emulation":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        check_preconditions()
        if self.shapes_compute:         # refuse rather than run unshaped: a benchmark would measure the wrong thing
            self._cgroup_root = check_cpu_controller()
            self._record.cgroups = tuple(str(self._cgroup_root / n.cgroup) for n in self.layout.nodes if n.cpu)
        removed = clean_leftovers()
        if removed:
            self.log(f"emulate: removed leftovers of crashed runs: {', '.join(removed)}")
        self._record.write()        # before creating anything: a SIGKILL from here on leaves a record
        self._up = True
        try:
            self._build()
            self._check_reachable()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill our ranks by pid, then anything left in our namespaces, then delete namespaces and links."""
        if not self._up:
            return
        for p in self.procs:
            if p.poll() is None:
                kill_group(p)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.layout.namespaces:
            kill_pids(namespace_pids(ns), grace_s=0.5)
        remove_run(self.layout.run_id)
        self._up = False

    # ---- building ---------------------------------------------------------------------------------
    def _check_reachable(self) -> None:
        """One TCP connect per bridge between two of its nodes: refused = reachable; a timeout means the
        host drops bridged traffic (iptables FORWARD policy with bridge-nf-call-iptables=1, e.g. Docker)."""
        if shutil.which("bash") is None:
            return
        pairs: dict[str, tuple] = {}
        for node in self.layout.nodes:
            for itf in node.interfaces:
                first = pairs.setdefault(itf.bridge, (node, itf, None))
                if first[2] is None and first[0] is not node:
                    pairs[itf.bridge] = (first[0], first[1], itf)
        for bridge, (src, _, dst) in pairs.items():
            if dst is None:
                continue
            p = sh(["timeout", "3", "bash", "-c", f"echo > /dev/tcp/{dst.address}/9"], ns=src.namespace,
                   check=False)
            if "refused" not in p.stderr.lower():
                raise EmulatorUnavailable(
                    f"emulated nodes cannot reach each other over bridge {bridge} ({src.name} -> {dst.address}: "
                    f"{p.stderr.strip() or 'timed out'}). The host probably filters bridged traffic: "
                    "net.bridge.bridge-nf-call-iptables=1 with a FORWARD policy that drops (Docker sets one). "
                    "Fix: `iptables -I FORWARD -i hp+ -o hp+ -j ACCEPT` or `sysctl -w net.bridge.bridge-nf-call-iptables=0`")

    def _build(self) -> None:
        for node in self.layout.nodes:
            if node.cpu is not None and self._cgroup_root is not None:
                create_cgroup(self._cgroup_root, node.cgroup, node.cpu.quota_us, node.cpu.period_us,
                              node.cpu.shares)
        for br in self.layout.bridges:
            sh(["ip", "link", "add", br, "type", "bridge"])
            sh(["ip", "link", "set", br, "up"])
        for node in self.layout.nodes:
            sh(["ip", "netns", "add", node.namespace])
            sh(["ip", "-n", node.namespace, "link", "set", "lo", "up"])
            for itf in node.interfaces:
                self._add_interface(node.namespace, itf)
            for cidr in node.routes:
                sh(["ip", "-n", node.namespace, "route", "add", cidr, "dev", node.eth.name])

    def _add_interface(self, ns: str, itf: Interface) -> None:
        sh(["ip", "link", "add", itf.peer, "type", "veth", "peer", "name", itf.name, "netns", ns])
        sh(["ip", "link", "set", itf.peer, "master", itf.bridge])
        sh(["ip", "link", "set", itf.peer, "up"])
        sh(["ip", "-n", ns, "addr", "add", f"{itf.address}/{itf.prefix}", "dev", itf.name])
        sh(["ip", "-n", ns, "link", "set", itf.name, "up"])
        # egress from the node, per destination class, under the NIC's rate
        default = 10 + len(itf.classes) - 1
        tc = ["tc", "-n", ns]
        sh(tc + ["qdisc", "add", "dev", itf.name, "root", "handle", "1:", "htb", "default", str(default)])
        sh(tc + ["class", "add", "dev", itf.name, "parent", "1:", "classid", "1:1", "htb",
                 "rate", f"{itf.kbit}kbit", "ceil", f"{itf.kbit}kbit", "quantum", QUANTUM])
        for i, c in enumerate(itf.classes):
            sh(tc + ["class", "add", "dev", itf.name, "parent", "1:1", "classid", f"1:{10 + i}", "htb",
                     "rate", f"{c.kbit}kbit", "ceil", f"{c.kbit}kbit", "quantum", QUANTUM])
            for dst in c.destinations:
                sh(tc + ["filter", "add", "dev", itf.name, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                         "match", "ip", "dst", dst, "flowid", f"1:{10 + i}"])
        # ingress to the node: the bridge port's egress, capped at the NIC's rate
        sh(["tc", "qdisc", "add", "dev", itf.peer, "root", "handle", "1:", "htb", "default", "10"])
        sh(["tc", "class", "add", "dev", itf.peer, "parent", "1:", "classid", "1:10", "htb",
            "rate", f"{itf.kbit}kbit", "ceil", f"{itf.kbit}kbit", "quantum", QUANTUM])

    # ---- running ranks -----------------------------------------------------------------------------
    def set_rate(self, ifname: str, mbit: float, label: Optional[str] = None) -> None:
        """Change a shaped rate while running, in emulated Mbit/s (``label``: one egress class, e.g. "to
        roce"; None: the interface's NIC rate and every class). Lets a benchmark sweep bandwidths without
        restarting its ranks."""
        kbit = f"{max(8, int(round(mbit * 1000)))}kbit"
        for node in self.layout.nodes:
            for itf in node.interfaces:
                if itf.name != ifname:
                    continue
                tc = ["tc", "-n", node.namespace, "class", "change", "dev", itf.name]
                if label is None:
                    sh(tc + ["parent", "1:", "classid", "1:1", "htb", "rate", kbit, "ceil", kbit, "quantum", QUANTUM])
                    sh(["tc", "class", "change", "dev", itf.peer, "parent", "1:", "classid", "1:10", "htb",
                        "rate", kbit, "ceil", kbit, "quantum", QUANTUM])
                for i, c in enumerate(itf.classes):
                    if label is None or c.label == label:
                        sh(tc + ["parent", "1:1", "classid", f"1:{10 + i}", "htb", "rate", kbit, "ceil", kbit,
                                 "quantum", QUANTUM])

    def rank_env(self, rank: int, master_port: int = DEFAULT_PORT) -> dict[str, str]:
        """torchrun's variables plus the interface choices for gloo."""
        node = self.layout.node_of_rank(rank)
        return {
            "RANK": str(rank), "LOCAL_RANK": str(rank - node.first_rank), "WORLD_SIZE": str(self.layout.world_size),
            "LOCAL_WORLD_SIZE": str(node.num_ranks), "GROUP_RANK": str(node.index), "NODE_RANK": str(node.index),
            "MASTER_ADDR": self.layout.master_addr, "MASTER_PORT": str(master_port),
            "GLOO_SOCKET_IFNAME": node.eth.name,          # the default group: Ethernet, like a plain run
            "HET_PLUGIN_GLOO_IFNAMES": node.gloo_ifnames(),
            "HET_PLUGIN_EMULATED": self.layout.run_id, "HET_PLUGIN_EMULATED_NODE": node.name,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }

    def popen_in(self, node_index: int, argv: Sequence[str], env: Optional[dict] = None,
                 **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside node ``node_index``'s namespace (its own session, so it can be killed whole)
        and, when the node's compute is shaped, inside its cpu cgroup from its first instruction on."""
        if not self._up:
            raise RuntimeError("the emulated network is not running")
        ns = self.layout.nodes[node_index].namespace
        full_env = dict(os.environ)
        full_env.update(env or {})
        cmd = ["ip", "netns", "exec", ns, *argv]
        cg = self.cgroup_path(node_index)
        if cg is not None:
            cmd = join_cgroup_argv(cg, cmd)
        p = subprocess.Popen(cmd, env=full_env, start_new_session=True, **kwargs)
        self.procs.append(p)
        return p

    def launch(self, argv: Sequence[str], *, env: Optional[dict] = None, master_port: int = DEFAULT_PORT,
               rank_env: Optional[Sequence[dict]] = None, **kwargs) -> list[subprocess.Popen]:
        """Start ``argv`` once per rank, each in its node's namespace with a torchrun-style environment."""
        procs = []
        for r in range(self.layout.world_size):
            e = dict(env or {})
            e.update(self.rank_env(r, master_port))
            if rank_env:
                e.update(rank_env[r])
            procs.append(self.popen_in(self.layout.node_of_rank(r).index, argv, e, **kwargs))
        return procs

    def run_ranks(self, argv: Sequence[str], *, env: Optional[dict] = None, timeout: float = 600,
                  master_port: int = DEFAULT_PORT, fail_fast: float = FAIL_FAST_S) -> list[RankOutput]:
        """Run ``argv`` as every rank and return each rank's exit code and output (drained while running).
        A failed rank stops the rest ``fail_fast`` s later; returncode None: killed (timeout or a peer failed)."""
        procs = self.launch(argv, env=env, master_port=master_port, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace")
        return collect(procs, self, timeout, fail_fast=fail_fast)

    def compute_rates(self, seconds: float = 0.5) -> list[float]:
        """The same Python busy loop in every node at once for ``seconds``: iterations per second per node
        (in node order). What a benchmark prints to show the compute speed the nodes really got."""
        loop = ("import sys,time\nend=time.perf_counter()+float(sys.argv[1]);n=0;t=time.perf_counter()\n"
                "while time.perf_counter()<end:\n for _ in range(1000): n+=1\nprint(n/(time.perf_counter()-t))")
        procs = [self.popen_in(n.index, [sys.executable, "-c", loop, str(seconds)], stdout=subprocess.PIPE,
                               text=True) for n in self.layout.nodes]
        return [float(p.communicate(timeout=60 + 10 * seconds)[0]) for p in procs]

    def wait(self, procs: Sequence[subprocess.Popen], timeout: float, *,
             fail_fast: float = FAIL_FAST_S) -> list[Optional[int]]:
        """Wait for all; past ``timeout``, or ``fail_fast`` s after one failed, kill the rest (None: killed).
        Output pipes are the caller's (see ``collect`` to drain them here)."""
        return wait_all(procs, timeout, grace=fail_fast).codes


def collect(procs: Sequence[subprocess.Popen], emu: Optional["Emulation"] = None, timeout: float = 600, *,
            fail_fast: float = FAIL_FAST_S) -> list[RankOutput]:
    """Wait for ``procs`` (started with pipes) while draining their output, so no rank blocks on a full
    pipe; returns each rank's exit code and output. The shared collector (``procs.collect``): the test
    launcher uses it too. ``emu`` is not needed (kept for callers that pass it)."""
    return collect_procs(procs, timeout, grace=fail_fast, label="emulate").outputs


def stream_prefixed(stream: IO[str], prefix: str, out: IO[str]) -> threading.Thread:
    """Copy ``stream`` to ``out`` line by line with ``prefix`` (the CLI's "[rank N]" output)."""
    def pump():
        for line in stream:
            out.write(prefix + line)
            out.flush()
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def terminate_on_signals() -> None:
    """Turn SIGTERM and SIGHUP into SystemExit so ``with Emulation(...)`` tears down (Ctrl-C already does)."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handler)


__all__ = ["Emulation", "RankOutput", "CommandFailed", "collect", "stream_prefixed", "terminate_on_signals"]
