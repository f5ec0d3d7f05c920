"""What a profile file may contain (pydantic schemas of both formats; docs/planner.md, "Measured profiles").

Format 1 (``het_plugin-profile/1``, also a file without ``format``): one compute entry per (device, kind,
micro-batch, TP), links per tier or named inter-cluster link. Its meaning is frozen: a format-1 file predicts
exactly as it did when it was written.

Format 2 (``het_plugin-profile/2``): compute as curves over the micro-batch size (``points``), an ``moe_layer``
kind and per-layer-index overrides, the optimizer step per parameter, a fixed per-iteration overhead, and links
per cluster, per direction (``"a->b"``) and by the number of concurrent senders per node (``concurrency``);
optionally the all-reduce bus bandwidth measured over a link (``allreduce``: recorded by ``het-plugin profile``,
not read by the predictor). Optional ``measured`` (added to format 2; a file without it reads as before): the
stage times a training run of one plan measured (:mod:`het_plugin.core.cost.measured`), which ``het-plugin plan --profile``
compares with its prediction.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

FORMAT_V1 = "het_plugin-profile/1"
FORMAT_V2 = "het_plugin-profile/2"
FORMATS = {FORMAT_V1: 1, FORMAT_V2: 2}
LINK_TIERS = ("local", "ib", "roce", "ethernet", "socket", "host-staged")
LayerKind = Literal["layer", "embedding", "output"]
LayerKindV2 = Literal["layer", "moe_layer", "embedding", "output"]
TIER_FIX = (f"use one of {list(LINK_TIERS)}, 'clusterA/clusterB' for a named link between two clusters (both "
            "directions) or 'clusterA->clusterB' for one direction of it")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _repeats(keys: list) -> list:
    return sorted({k for k in keys if keys.count(k) > 1}, key=repr)


def _increasing(values: list, what: str, fix: str) -> None:
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{what} {values} are not in increasing order, each once | fix: {fix}")


# ---- format 1 ---------------------------------------------------------------------------------------


class ComputeEntry(_Strict):
    device: str                      # accelerator name as in the cluster file / catalog (case-insensitive)
    kind: LayerKind
    micro_batch_size: PositiveInt
    tp: PositiveInt = 1
    forward_s: float = Field(ge=0)
    backward_s: float = Field(ge=0)


class BandwidthPoint(_Strict):
    bytes: PositiveInt
    gbps: PositiveFloat              # achieved Gbit/s for a message of this size


class LinkEntry(_Strict):
    """``tier`` is one of LINK_TIERS, or ``"clusterA/clusterB"`` for one named inter-cluster link."""
    tier: str
    latency_us: float = Field(default=0.0, ge=0)
    bandwidth: list[BandwidthPoint] = Field(min_length=1)

    @model_validator(mode="after")
    def _tier(self):
        if self.tier not in LINK_TIERS and self.tier.count("/") != 1:
            raise ValueError(f"unknown link tier {self.tier!r} | fix: use one of {list(LINK_TIERS)} "
                             "or 'clusterA/clusterB' for a named link")
        sizes = [p.bytes for p in self.bandwidth]
        if len(set(sizes)) != len(sizes):
            raise ValueError("bandwidth lists a message size twice | fix: one point per size")
        return self


class ProfileFile(_Strict):
    format: Literal["het_plugin-profile/1"] = FORMAT_V1
    description: str = ""
    compute: list[ComputeEntry] = []
    links: list[LinkEntry] = []

    @model_validator(mode="after")
    def _unique(self):
        keys = [(c.device.lower(), c.kind, c.micro_batch_size, c.tp) for c in self.compute]
        dup = _repeats(keys)
        if dup:
            raise ValueError(f"compute entries repeat (device, kind, micro_batch_size, tp): {dup}"
                             " | fix: keep one entry per combination")
        dup_t = _repeats([link.tier for link in self.links])
        if dup_t:
            raise ValueError(f"links repeat tiers {dup_t} | fix: one entry per tier")
        return self


# ---- format 2 ---------------------------------------------------------------------------------------


class CurvePoint(_Strict):
    micro_batch_size: PositiveInt
    forward_s: float = Field(ge=0)
    backward_s: float = Field(ge=0)


class ComputeCurve(_Strict):
    """Forward and backward seconds of one micro-batch on one rank at several micro-batch sizes."""
    device: str
    kind: LayerKindV2
    tp: PositiveInt = 1
    layer: Optional[NonNegativeInt] = None      # this decoder layer (0-based) only: it differs from the others
    points: list[CurvePoint] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self):
        _increasing([p.micro_batch_size for p in self.points], "points' micro_batch_size values",
                    "list each measured micro-batch size once, smallest first")
        if self.layer is not None and self.kind not in ("layer", "moe_layer"):
            raise ValueError(f"a per-layer override ('layer: {self.layer}') must have kind 'layer' or 'moe_layer', "
                             f"not {self.kind!r} | fix: drop 'layer' or change the kind")
        return self


class OptimizerEntry(_Strict):
    device: str
    tp: PositiveInt = 1
    seconds_per_param: float = Field(ge=0)      # one optimizer step, per parameter this rank updates


class OverheadEntry(_Strict):
    device: str
    seconds: float = Field(ge=0)                # once per iteration (schedule set-up, data loader, logging)


class BandwidthCurve(_Strict):
    senders: int = Field(ge=2)                  # ranks of one node sending at once
    bandwidth: list[BandwidthPoint] = Field(min_length=1)   # their total Gbit/s by each sender's message size

    @model_validator(mode="after")
    def _sorted(self):
        _increasing([p.bytes for p in self.bandwidth], "bandwidth sizes", "list each message size once, smallest first")
        return self


class LinkEntryV2(_Strict):
    tier: str
    cluster: Optional[str] = None               # with a tier kind: the hop inside this cluster only
    latency_us: float = Field(default=0.0, ge=0)
    bandwidth: list[BandwidthPoint] = Field(min_length=1)   # one sender per node
    concurrency: list[BandwidthCurve] = []
    allreduce: list[BandwidthPoint] = []        # a ring all-reduce's bus bandwidth over the link (for reference)

    @model_validator(mode="after")
    def _check(self):
        named = "/" in self.tier or "->" in self.tier
        if self.tier not in LINK_TIERS and not (_pair(self.tier, "/") or _pair(self.tier, "->")):
            raise ValueError(f"unknown link tier {self.tier!r} | fix: {TIER_FIX}")
        if named and self.cluster is not None:
            raise ValueError(f"'cluster' scopes a tier kind to one cluster; {self.tier!r} already names its clusters "
                             "| fix: drop 'cluster'")
        _increasing([p.bytes for p in self.bandwidth], "bandwidth sizes", "list each message size once, smallest first")
        _increasing([c.senders for c in self.concurrency], "concurrency senders",
                    "one curve per sender count, smallest first")
        _increasing([p.bytes for p in self.allreduce], "allreduce sizes", "list each message size once, smallest first")
        return self

    @property
    def key(self) -> tuple:
        if "->" in self.tier:
            return (self.tier, None)
        if "/" in self.tier:
            return ("/".join(sorted(self.tier.split("/"))), None)
        return (self.tier, self.cluster)


def _pair(tier: str, sep: str) -> bool:
    parts = tier.split(sep)
    return len(parts) == 2 and all(parts) and all("/" not in p and "->" not in p for p in parts)


class MeasuredStage(_Strict):
    """One pipeline stage of a measured run: its slowest rank's mean forward and backward of one micro-batch."""
    stage: NonNegativeInt
    layers: NonNegativeInt
    device: str                                 # the device type of that slowest rank
    forward_s: float = Field(ge=0)
    backward_s: float = Field(ge=0)
    predicted_s: Optional[float] = Field(default=None, ge=0)   # the plan's forward + backward for this stage
    ranks: PositiveInt = 1                      # ranks of the stage that reported


class MeasuredRun(_Strict):
    """What a training run of plan ``plan_hash`` measured (the adapters' ``--heterogeneous-profile-out``)."""
    plan_hash: str
    framework: str = ""
    micro_batch_size: PositiveInt
    tp: PositiveInt = 1
    num_micro_batches: PositiveInt
    layers_per_stage: list[NonNegativeInt] = Field(min_length=1)
    iterations: PositiveInt                     # iterations averaged (after the warm-up ones)
    iteration_s: float = Field(ge=0)            # mean wall time from one iteration's end to the next
    schedule_s: Optional[float] = Field(default=None, ge=0)    # mean forward-backward schedule call, slowest rank
    schedule_holds_step: bool = False           # the schedule call includes the optimizer step (DeepSpeed)
    predicted_iteration_s: Optional[float] = Field(default=None, ge=0)
    stages: list[MeasuredStage] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self):
        numbers = [st.stage for st in self.stages]
        if numbers != list(range(len(self.layers_per_stage))):
            raise ValueError(f"measured stages {numbers} are not 0..{len(self.layers_per_stage) - 1}, one each in "
                             f"order (layers_per_stage has {len(self.layers_per_stage)}) | fix: one entry per stage")
        return self


class ProfileFileV2(_Strict):
    format: Literal["het_plugin-profile/2"]
    description: str = ""
    compute: list[ComputeCurve] = []
    optimizer: list[OptimizerEntry] = []
    iteration_overhead: list[OverheadEntry] = []
    # added to format 2 (issue 23; a file without it reads as before): seconds of the schedule's own work per
    # forward or backward of one micro-batch on one stage (the hand-off: p2p set-up, loss, hooks)
    pipeline_slot: list[OverheadEntry] = []
    links: list[LinkEntryV2] = []
    measured: Optional[MeasuredRun] = None      # added to format 2: the stage times of one measured run

    @model_validator(mode="after")
    def _unique(self):
        dup = _repeats([(c.device.lower(), c.kind, c.tp, c.layer) for c in self.compute])
        if dup:
            raise ValueError(f"compute curves repeat (device, kind, tp, layer): {dup} | fix: one curve per "
                             "combination, its sizes in 'points'")
        dup = _repeats([(o.device.lower(), o.tp) for o in self.optimizer])
        if dup:
            raise ValueError(f"optimizer entries repeat (device, tp): {dup} | fix: one entry per combination")
        dup = _repeats([o.device.lower() for o in self.iteration_overhead])
        if dup:
            raise ValueError(f"iteration_overhead repeats devices {dup} | fix: one entry per device")
        dup = _repeats([o.device.lower() for o in self.pipeline_slot])
        if dup:
            raise ValueError(f"pipeline_slot repeats devices {dup} | fix: one entry per device")
        dup = _repeats([link.key for link in self.links])
        if dup:
            raise ValueError(f"links repeat (tier, cluster) {dup} ('a/b' and 'b/a' are the same link) | fix: one "
                             "entry per tier and cluster; 'a->b' and 'b->a' for the two directions")
        return self
