"""Rank script for integration_tests/test_bounded_failures.py: start het_plugin's Megatron drop-in or the
DeepSpeed PipelineModule, with one rank made to fail at a chosen point (test-only hooks, read from env).

    HET_TEST_DIE_RANK=3 HET_TEST_DIE_AT=new_group:3 python bounded_failures.py --framework megatron ...

HET_TEST_DIE_AT (on rank HET_TEST_DIE_RANK only; the rank SIGKILLs itself, so it says nothing):
  before-planning   right before het_plugin is called (imports done)
  agreement         in the plan check, right after publishing its plan hash (the others see it, agree, go on)
  new_group:N       at its N-th call of torch.distributed.new_group (before torch does anything)
HET_TEST_DEATH_FILE: the dying rank writes time.time() there just before it dies.
HET_TEST_INIT_TIMEOUT: init_process_group's timeout in seconds (torch's rendezvous, before het_plugin).

Every rank prints ``HET_TEST_CALL <time.time()>`` on stderr right before calling het_plugin,
``HET_TEST_WAIT <time.time()>`` when its plan check starts (its planning done), and
``HET_TEST_END <time.time()>`` when it ends with an exception (or het_plugin ends it), and reports
``{"rank", "groups"}`` when het_plugin returned.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from integration_tests.support.launch import arm_watchdog, report  # noqa: E402

RANK = int(os.environ["RANK"])


def die() -> None:
    path = os.environ.get("HET_TEST_DEATH_FILE")
    if path:
        Path(path).write_text(repr(time.time()))
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install_hooks() -> None:
    if os.environ.get("HET_TEST_DIE_RANK") != str(RANK):
        return
    at = os.environ.get("HET_TEST_DIE_AT", "")
    if at == "before-planning":
        pass                    # called() does it, with the imports done
    elif at == "agreement":
        from het_plugin.runtime import exchange
        collect = exchange.Exchange._collect

        def collect_then_die(self, *args, **kwargs):
            if "/agree/" in self.prefix:
                die()
            return collect(self, *args, **kwargs)

        exchange.Exchange._collect = collect_then_die
    elif at.startswith("new_group:"):
        import torch.distributed as dist
        nth = int(at.split(":", 1)[1])
        original = dist.new_group
        calls = [0]

        def new_group(*args, **kwargs):
            calls[0] += 1
            if calls[0] == nth:
                die()
            return original(*args, **kwargs)

        dist.new_group = new_group
    elif at:
        raise SystemExit(f"unknown HET_TEST_DIE_AT={at!r}")


def called() -> None:
    """Right before het_plugin is called: stamp the time; and when the plan check starts (after this rank's
    planning, which is work, not waiting) stamp that too -- a rank's bounded waits start there."""
    sys.stderr.write(f"HET_TEST_CALL {time.time()!r}\n")
    if os.environ.get("HET_TEST_DIE_RANK") == str(RANK) and os.environ.get("HET_TEST_DIE_AT") == "before-planning":
        die()
    from het_plugin.runtime import agreement
    check = agreement.check_plan_agreement

    def stamped(*args, **kwargs):
        sys.stderr.write(f"HET_TEST_WAIT {time.time()!r}\n")
        return check(*args, **kwargs)

    agreement.check_plan_agreement = stamped


def end_hook() -> None:
    """HET_TEST_END <time> on stderr when the rank stops: an exception, or het_plugin's hard exit."""
    default = sys.excepthook

    def hook(kind, value, tb):
        sys.stderr.write(f"HET_TEST_END {time.time()!r}\n")
        default(kind, value, tb)

    sys.excepthook = hook
    from het_plugin.runtime import guard
    hard_exit = guard._hard_exit

    def stamped(message):
        sys.stderr.write(f"HET_TEST_END {time.time()!r}\n")
        hard_exit(message)

    guard._hard_exit = stamped


def run_megatron(a) -> dict:
    from integration_tests.support.megatron_tiny import TinyGPT
    cfg = TinyGPT(num_layers=4)
    from het_plugin.megatron import current_plan, initialize_model_parallel
    called()
    initialize_model_parallel(a.tp, a.pp, cluster=a.cluster, model=cfg.model_spec(),
                              micro_batch_size=cfg.micro_batch_size, timeout_s=a.timeout_s)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    timeouts = {name: pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for name, pg in vars(ps).items() if name.startswith("_") and isinstance(pg, dist.ProcessGroup)}
    return {"rank": RANK, "groups": len(current_plan().records), "timeouts": timeouts}


def run_deepspeed(a) -> dict:
    from integration_tests.support.deepspeed_layers import block_pipeline
    config = json.loads(Path(a.config).read_text())
    called()
    model = block_pipeline(config, num_stages=a.pp)
    return {"rank": RANK, "groups": len(model.het_applied.records)}


def main() -> int:
    arm_watchdog()
    end_hook()
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=["megatron", "deepspeed"], default="megatron")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--cluster", default=os.environ.get("HET_TEST_CLUSTER"))
    p.add_argument("--config", help="a wrapped DeepSpeed config (--framework deepspeed)")
    p.add_argument("--timeout-s", type=float, help="initialize_model_parallel(timeout_s=)")
    a = p.parse_args()

    import torch.distributed as dist
    init_timeout = os.environ.get("HET_TEST_INIT_TIMEOUT")
    kwargs = {"timeout": datetime.timedelta(seconds=float(init_timeout))} if init_timeout else {}
    started = time.time()
    try:
        if a.framework == "deepspeed":
            from integration_tests.support.deepspeed_cpu import skip_shm_build
            skip_shm_build()
            import deepspeed
            deepspeed.init_distributed(dist_backend="gloo", **kwargs)
        else:
            dist.init_process_group("gloo", rank=RANK, world_size=int(os.environ["WORLD_SIZE"]), **kwargs)
    except Exception:
        sys.stderr.write(f"HET_TEST_INIT_FAILED after {time.time() - started:.1f}s\n")
        raise
    install_hooks()
    result = run_megatron(a) if a.framework == "megatron" else run_deepspeed(a)
    report(result)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
