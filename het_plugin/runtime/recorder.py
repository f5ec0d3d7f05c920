"""Stage timer and measured-profile writer, shared by both adapters (docs/planner.md, "Plans that learn from
the run").

The adapters hold only the framework hooks: they wrap one micro-batch's forward and backward in
:meth:`StageTimer.timing` and mark each training iteration (:meth:`StageTimer.iteration`, or
:meth:`StageTimer.end_iteration` where the framework has no single iteration call), then call
:meth:`ProfileRecorder.after_iteration`.

* **Cheap.** On a GPU each span is a pair of CUDA events on the current stream; they are read one iteration
  later (by then finished: no stall of the stream), and when writing. On a CPU the wall clock. The first
  ``warmup`` iterations (allocation, autotuning) are not counted.
* **No collective.** Every ``every`` iterations and at exit each reporting rank
  (:func:`het_plugin.core.cost.measured.reporting_ranks`: up to 8 per stage and device type) puts its sums (a few numbers)
  into the job's key-value store (torch.distributed's default store, which rank 0 hosts); rank 0 reads what is
  there and writes the profile (:func:`het_plugin.core.cost.measured.measured_profile`). Nothing waits on another rank,
  except rank 0 at exit, at most ``exit_wait_s``, for the others' final sums: a rank that is gone cannot hang
  it.
* **Warning.** When rank 0 writes and the measured stage imbalance exceeds the plan's predicted one by more
  than ``warn_above``, it logs one warning naming the command that re-plans.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from ..core.cost.measured import (
    DEFAULT_IMBALANCE_THRESHOLD,
    RankTimes,
    imbalance_warning,
    measured_profile,
    reporting_ranks,
)
from ..core.plan import Plan
from ..core.errors import ConfigError
from ..core.replan_command import ReplanInputs, inputs_beside, new_plan_path, replan_command
from ..core.files import dump_data
from .restart_replan import ran_plan_path
from ..core.cost.plan_costs import plan_analysis
from ..core.inputs.cluster import load_cluster

log = logging.getLogger("het_plugin")

KEY = "het_plugin/core/cost/measured"
DEFAULT_EVERY = 100


@dataclass
class ProfileSettings:
    """Where and how often a run writes its measured profile (rank 0 writes it)."""
    path: str
    every: int = DEFAULT_EVERY           # iterations between writes (and at exit)
    warmup: int = 1                      # first iterations not counted
    warn_above: Optional[float] = DEFAULT_IMBALANCE_THRESHOLD   # None: no imbalance warning
    replan: str = ""                     # the command that re-plans (named in the warning; "": made from the plan)
    cluster: Optional[str] = None        # the run's cluster file (None: discovered, or a plan file)
    model: Optional[str] = None          # the run's model file or preset name (None: written beside the profile)
    replan_on_restart: bool = False      # also write the plan run beside the profile (runtime.restart_replan)
    exit_wait_s: float = 10.0            # rank 0 at exit: the longest wait for the other ranks' final sums

    def __post_init__(self):
        if not str(self.path):
            raise ConfigError("the measured-profile path is empty", field="profile_out", fix="name a .yaml or .json file")
        if Path(self.path).suffix.lower() not in (".yaml", ".yml", ".json"):
            raise ConfigError(f"cannot tell the format of {self.path!r}", field="profile_out",
                              fix="use a name ending in .yaml or .json")
        if int(self.every) < 1:
            raise ConfigError(f"profile interval {self.every} is not a positive number of iterations",
                              field="profile_every", fix="give 1 or more")


# ---- clocks -------------------------------------------------------------------------------------------


class WallClock:
    """CPU runs: a span is its wall time."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaEventClock:
    """GPU runs: a span is two CUDA events on the current stream (no synchronisation when recorded)."""

    def __init__(self):
        import torch
        self.torch = torch

    def mark(self):
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class FirstUseClock:
    """CUDA events or the wall clock, chosen at the first mark (the first timed micro-batch), not when the
    hooks go in: a script may not have touched CUDA yet when het_plugin initialises."""

    def __init__(self):
        self.chosen = None

    def mark(self):
        if self.chosen is None:
            self.chosen = _pick_clock()
            log.debug("het_plugin: measured profile timed with %s", type(self.chosen).__name__)
        return self.chosen.mark()

    def seconds(self, start, end) -> float:
        return self.chosen.seconds(start, end)


def _pick_clock():
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return CudaEventClock()
    except Exception:       # noqa: BLE001 -- no torch, or a CUDA that cannot answer: time on the CPU
        pass
    return WallClock()


def default_clock():
    """CUDA events where CUDA is in use by the first timed micro-batch, else the wall clock."""
    return FirstUseClock()


# ---- the timer ----------------------------------------------------------------------------------------


class StageTimer:
    """Sums of one rank's forward and backward compute per micro-batch, and its iteration times."""

    def __init__(self, rank: int, clock=None, warmup: int = 1, wall=time.perf_counter):
        self.clock = clock if clock is not None else WallClock()
        self.wall = wall                       # iteration boundaries and left-out spans (the host's clock)
        self._excluded_s = 0.0                 # left-out time since the last iteration ended
        self._excluded_in = 0.0                # ... of it inside the current iteration
        self._excluding = 0                    # nesting depth of excluded() (the outermost counts)
        self.warmup = warmup
        self.times = RankTimes(rank)
        self.active = False
        self.seen = 0                          # iterations ended, warm-up included
        self._spans: list[tuple[str, Any, Any]] = []
        self._chunks = 1
        self._pending: list[tuple[list, int]] = []     # ended iterations whose spans are not read yet
        self._last_end: Optional[float] = None
        self._start: Optional[float] = None

    def begin_iteration(self, chunks: int = 1) -> None:
        """From here forward and backward are timed (``chunks``: model chunks per micro-batch, each running its
        own forward: Megatron's interleaved schedule)."""
        self.active, self._spans, self._chunks = True, [], max(1, chunks)
        self._start = self.wall()
        self._excluded_in = 0.0

    def end_iteration(self) -> None:
        """The iteration is over: its spans are read one iteration later (a GPU has finished them by then)."""
        if not self.active:
            return
        now = self.wall()
        self.active = False
        counted = self.seen >= self.warmup
        self.seen += 1
        if counted:
            if self._start is not None:
                self.times.schedule_s += now - self._start - self._excluded_in
            if self._last_end is not None:
                self.times.iteration_s += now - self._last_end - self._excluded_s
                self.times.intervals += 1
                self.times.excluded_s += self._excluded_s
            self._pending.append((self._spans, self._chunks))
        self._last_end = now
        self._excluded_s = self._excluded_in = 0.0
        self._spans = []
        self._resolve(keep_last=True)

    @contextlib.contextmanager
    def iteration(self, chunks: int = 1) -> Iterator[None]:
        """One training iteration (the framework's forward-backward call)."""
        self.begin_iteration(chunks)
        try:
            yield
        finally:
            self.end_iteration()

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Work that is not a training iteration (a checkpoint save, an evaluation): its wall time is taken out of
        the iteration interval it falls in, so the measured iteration time is the training step's. Nested spans
        count once."""
        self._excluding += 1
        start = self.wall() if self._excluding == 1 else None
        try:
            yield
        finally:
            self._excluding -= 1
            if start is not None:
                spent = self.wall() - start
                self._excluded_s += spent
                if self.active:
                    self._excluded_in += spent

    @contextlib.contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        """One micro-batch's ``forward`` or ``backward`` (of one model chunk), or a ``reduce`` inside a backward span
        (subtracted from it); nothing outside an iteration."""
        if not self.active:
            yield
            return
        start = self.clock.mark()
        try:
            yield
        finally:
            self._spans.append((kind, start, self.clock.mark()))

    def _resolve(self, keep_last: bool) -> None:
        pending = self._pending[:-1] if keep_last else self._pending
        for spans, chunks in pending:
            forwards = 0
            for kind, start, end in spans:
                seconds = self.clock.seconds(start, end)
                if kind == "forward":
                    self.times.forward_s += seconds
                    forwards += 1
                elif kind == "reduce":           # a gradient reduction inside a backward span: not compute
                    self.times.backward_s -= seconds
                else:
                    self.times.backward_s += seconds
            self.times.micro_batches += forwards // chunks
            self.times.iterations += 1
        self._pending = self._pending[-1:] if keep_last else []

    def totals(self) -> RankTimes:
        """Everything counted so far (reads the pending spans)."""
        self._resolve(keep_last=False)
        return RankTimes(**self.times.to_dict())


# ---- publishing and writing ---------------------------------------------------------------------------


def default_store():
    """torch.distributed's default key-value store (None without a process group, or on the fake backend)."""
    try:
        import torch.distributed as tdist
        if not (tdist.is_available() and tdist.is_initialized()) or "fake" in str(tdist.get_backend()).lower():
            return None
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:       # noqa: BLE001 -- no store: this rank writes what it measured alone
        return None


class ProfileRecorder:
    """One rank's timer, its publication every ``settings.every`` iterations and at exit, and (rank 0) the
    profile file and the imbalance warning."""

    def __init__(self, plan: Plan, rank: int, settings: ProfileSettings, framework: str, *, clock=None,
                 store: Any = None, exit_handler: bool = True, cluster: Any = None,
                 schedule_holds_step: bool = False):
        self.plan, self.rank, self.settings, self.framework = plan, rank, settings, framework
        self.timer = StageTimer(rank, clock if clock is not None else default_clock(), settings.warmup)
        self.store = store
        self.written: Optional[str] = None       # the path, once rank 0 wrote a profile
        self.cluster = cluster                   # the Cluster the plan came from (discovery: written beside)
        self.schedule_holds_step = schedule_holds_step   # the timed schedule call holds the optimizer step
        self._fit: Optional[tuple[Any, Any]] = None   # (cluster, its analysis of the plan) for the slot-cost fit,
                                                      # made once; (None, None): no fit
        self._inputs = None                      # the re-plan command's cluster and model, once known
        self.warned = False
        self.warned_empty = False
        self.closed = False
        self._key = f"{KEY}/{plan.hash}"
        self.reporters = reporting_ranks(plan)
        self.reports = rank in self.reporters
        if exit_handler:
            atexit.register(self.close)

    def after_iteration(self) -> None:
        if self.timer.seen > self.settings.warmup and (self.timer.seen - self.settings.warmup) % self.settings.every == 0:
            self.flush()

    def publish(self, final: bool = False) -> RankTimes:
        times = self.timer.totals()
        times.final = final
        if self.reports and times.iterations and not times.micro_batches and not self.warned_empty:
            self.warned_empty = True
            log.warning("het_plugin: measured profile: rank %d timed %d training iterations but no micro-batch "
                        "forward/backward, so it adds nothing to %s. The schedule did not go through the hooked "
                        "calls (Megatron: a schedule that does not call forward_step, e.g. "
                        "overlap_moe_expert_parallel_comm's combined 1F1B, or a schedule function imported by name "
                        "before het_plugin's initialisation)", self.rank, times.iterations, self.settings.path)
        
        if self.store is not None and self.reports:
            try:
                self.store.set(f"{self._key}/{self.rank}", json.dumps(times.to_dict()))
            except Exception as exc:      # noqa: BLE001 -- rank 0 (the store) gone: its profile is written or lost
                log.debug("het_plugin: could not publish measured times: %s", exc)
        return times

    def gather(self, own: RankTimes, wait_final_s: float = 0.0) -> list[RankTimes]:
        """Every rank's latest sums in the store (rank 0); with ``wait_final_s``, up to that long for each rank's
        final ones."""
        if self.store is None:
            return [own]
        deadline = time.monotonic() + wait_final_s
        found: dict[int, RankTimes] = {self.rank: own}
        while True:
            for r in self.reporters:
                if r == self.rank or (r in found and found[r].final):
                    continue
                key = f"{self._key}/{r}"
                try:
                    if self.store.check([key]):
                        found[r] = RankTimes.from_dict(json.loads(self.store.get(key)))
                except Exception:         # noqa: BLE001 -- a store that cannot answer: write what we have
                    return list(found.values())
            missing = [r for r in self.reporters if r not in found or not found[r].final]
            if not missing or time.monotonic() >= deadline:
                return [found[r] for r in sorted(found)]
            time.sleep(0.05)

    def flush(self, final: bool = False) -> Optional[str]:
        """Publish this rank's sums; rank 0 also writes the profile (returns its path when written)."""
        own = self.publish(final)
        if self.rank != 0:
            return None
        ranks = self.gather(own, self.settings.exit_wait_s if final else 0.0)
        return self.write(ranks)

    def write(self, ranks: list[RankTimes]) -> Optional[str]:
        cluster, analysis = self._fit_inputs()
        try:
            prof = measured_profile(self.plan, ranks, self.framework, cluster=cluster, analysis=analysis,
                                    schedule_holds_step=self.schedule_holds_step)
        except (ValueError, ArithmeticError) as exc:     # the fit's predictions (a training run must not stop)
            if cluster is None:
                raise
            log.warning("het_plugin: the measured profile gets no pipeline-slot cost (predicting the plan for the "
                        "fit failed: %s)", exc)
            self._fit = (None, None)
            prof = measured_profile(self.plan, ranks, self.framework, schedule_holds_step=self.schedule_holds_step)
        if prof is None:
            return None
        try:
            prof.save(self.settings.path)
        except OSError as exc:
            log.warning("het_plugin: cannot write the measured profile %s: %s", self.settings.path, exc)
            return None
        if self.written is None and self.settings.replan_on_restart:
            try:
                self.plan.save(ran_plan_path(self.settings.path))
            except Exception as exc:      # noqa: BLE001 -- the next start then plans as usual
                log.warning("het_plugin: cannot write the plan beside the measured profile: %s", exc)
        self.written = self.settings.path
        if not self.warned and self.settings.warn_above is not None:
            message = imbalance_warning(prof.measured, self.settings.warn_above, self.replan_command())
            if message:
                self.warned = True
                log.warning("het_plugin: %s", message)
        return self.settings.path

    def _fit_inputs(self) -> tuple[Any, Any]:
        """The plan's cluster and its analysis for the slot-cost fit (core.cost.run_fit), made once: the Cluster
        the plan came from, else the settings' cluster file; (None, None) when neither is there or matches the
        plan (the slot cost is then not fitted)."""
        if self._fit is None:
            self._fit = (None, None)
            try:
                cluster = self.cluster
                if cluster is None and self.settings.cluster:
                    cluster = self.cluster = load_cluster(self.settings.cluster)
                if cluster is not None:
                    self._fit = (cluster, plan_analysis(self.plan, cluster))
            except (ConfigError, OSError, ValueError) as exc:
                log.warning("het_plugin: the measured profile gets no pipeline-slot cost (cannot predict the plan "
                            "on its cluster: %s)", exc)
        return self._fit

    def replan_command(self) -> str:
        """The complete re-plan command (het_plugin.core.replan_command): the run's cluster, model, degrees and
        micro-batch size; a model (or discovered cluster) that is no file is written beside the profile first."""
        if self.settings.replan:
            return self.settings.replan
        beside = inputs_beside(self.settings.path)
        cluster, model = self.settings.cluster, self.settings.model
        if self._inputs is None:
            if model is None:
                model = self._write_beside(beside.model, self.plan.model, "model")
            spec = getattr(self.cluster, "spec", None)
            if cluster is None and spec is not None:
                cluster = self._write_beside(beside.cluster, spec.model_dump(mode="json", exclude_none=True),
                                             "cluster")
            self._inputs = ReplanInputs(cluster, model)
        return replan_command(self.plan, self.settings.path, self._inputs, new_plan_path(self.settings.path))

    @staticmethod
    def _write_beside(path: str, data: dict, what: str) -> Optional[str]:
        try:
            dump_data(data, path)
            return path
        except (OSError, ConfigError) as exc:
            log.warning("het_plugin: cannot write the run's %s for the re-plan command to %s: %s", what, path, exc)
            return None

    def close(self) -> Optional[str]:
        """At exit (or when the script says so): the final sums, and rank 0's last write."""
        if self.closed:
            return None
        self.closed = True
        try:
            atexit.unregister(self.close)
        except Exception:   # noqa: BLE001
            pass
        if self.timer.seen == 0:
            return None
        path = self.flush(final=True)
        if path and self.rank == 0:
            print(f"het_plugin: measured profile written to {path}", flush=True)
        return path
