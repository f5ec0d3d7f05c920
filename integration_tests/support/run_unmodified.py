"""Run a DeepSpeed training script unmodified, the way an installed het_plugin runs it (test-only).

    python run_unmodified.py SCRIPT [ARGS...]

1. setup.py's ``DS_PTH_TEXT`` is executed first, as site.py executes ``het_plugin_deepspeed.pth`` at start-up
   (the test venv holds an editable install of another checkout, so the line is taken from this one);
   ``HET_TEST_NO_PTH=1`` skips it (a process without the hook).
2. CPU shims (as in deepspeed_cpu.py): DeepSpeed's CPU accelerator without the shared-memory op build, and
   ``torch.cuda.set_device`` a no-op (the scripts call it; CPU torch has no CUDA).
   ``HET_TEST_SYNTHETIC_CIFAR=1``: torchvision importable on CPU torch and CIFAR-10 without the download
   (support/torchvision_cpu.py), for the original DeepSpeedExamples script.
3. Instrumentation outside the script: ``PipelineEngine.train_batch`` is wrapped to record each returned loss;
   after the script ends, each rank reports (``RESULT <json>``) its stage, layer range and ``parts``, the losses,
   the topology's mapping and the plan's hash (None: DeepSpeed's own run).
"""
from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def pth_line() -> str:
    text = (REPO / "setup.py").read_text()
    start = text.index("DS_PTH_TEXT = (")
    ns: dict = {}
    exec(text[start:text.index("\n", text.index("\\n')", start))], ns)
    return ns["DS_PTH_TEXT"]


def main() -> None:
    from integration_tests.support.launch import arm_watchdog, report
    arm_watchdog()
    if os.environ.get("HET_TEST_NO_PTH", "") in ("", "0"):
        exec(pth_line(), {})
    script, *args = sys.argv[1:]
    from integration_tests.support.deepspeed_cpu import skip_shm_build
    skip_shm_build()
    import torch
    torch.cuda.set_device = lambda *a, **k: None
    if os.environ.get("HET_TEST_SYNTHETIC_CIFAR", "") not in ("", "0"):
        from integration_tests.support.torchvision_cpu import install
        install()
    from deepspeed.runtime.pipe.engine import PipelineEngine
    seen: dict = {"losses": [], "engine": None}
    original = PipelineEngine.train_batch

    def train_batch(self, *a, **k):
        loss = original(self, *a, **k)
        seen["engine"] = self
        seen["losses"].append(float(loss))
        return loss

    PipelineEngine.train_batch = train_batch
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))      # as `python SCRIPT` does
    runpy.run_path(script, run_name="__main__")
    engine = seen["engine"]
    import torch.distributed as dist
    module = engine.module
    plan = getattr(module, "het_plan", None)
    report({"rank": engine.global_rank, "stage": engine.stage_id, "parts": [int(x) for x in module.parts],
            "layers": [int(module._local_start), int(module._local_stop)], "losses": seen["losses"],
            "data_id": engine.grid.get_data_parallel_rank(),
            "mapping": sorted([list(c), r] for c, r in module._topo.mapping.items()),
            "plan_hash": plan.hash if plan is not None else None,
            "plan": json.loads(plan.canonical_json()) if plan is not None else None})
    if dist.is_initialized():       # (a script may have destroyed it itself)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
