"""Which nodes a wrapped DeepSpeed config runs on, as ``het-plugin wrap-config`` says it (issue 32).

``wrap`` with a cluster file plans every node of the file: DeepSpeed derives the data-parallel degree from the ranks
it launches and the config's batch (``train_batch_size`` = micro-batch x accumulation x dp) is written for that
launch, so a plan for fewer ranks would change the user's batch behind their back, and the launch (``deepspeed
--hostfile``) is the user's own. What wrap does not do, it says: :func:`every_node_lines` tells that the wrapped
plan uses every node and, where leaving whole node groups out is predicted faster (the subset search of
:mod:`het_plugin.core.subsets`, same model, tp, pp and micro-batch size, dp free), the nodes, the gain and the three
commands that run it instead (``het-plugin plan ... -o PLAN --hostfile-out HOSTS``, ``wrap-config --cluster
PLAN``, ``deepspeed --hostfile HOSTS``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from ..core.errors import ConfigError
from ..core.inputs.cluster import Cluster
from ..core.launch import ModelArg, load_source, model_from_arg
from ..core.plan import Plan
from ..core.subsets import plan_nodes
from .config import AUTO, BatchSettings, load_ds_config, model_for_config


def faster_without(config: Union[str, Path, dict], cluster: Cluster, model: ModelArg, *, pp: Optional[int] = None,
                   tp: Optional[int] = None) -> Optional[Plan]:
    """The best plan over subsets of ``cluster``'s node groups for the model wrap planned (the config's batch,
    micro-batch size, ``tp``/``pp``; dp free), when it leaves nodes out; None otherwise (or when it cannot be
    planned: wrap's own plan stands)."""
    cfg, source = load_ds_config(config)
    batch = BatchSettings.of(cfg, source)
    spec = model_from_arg(model)
    if spec is None:
        return None
    spec = model_for_config(spec, batch)
    try:
        plan = plan_nodes(cluster, spec, tp=tp or 1, pp=pp, micro_batch_size=batch.micro_batch_size,
                          optimizer_instances=False)
    except ConfigError:
        return None
    return plan if plan.left_out else None


def every_node_lines(config_path: str, cluster_arg: str, model_arg: Optional[str], plan_hash: Optional[str], *,
                     pp: Optional[int] = None, tp: Optional[int] = None) -> list[str]:
    """What ``wrap-config`` prints about the nodes: a cluster file's plan uses every node (and what leaving some
    out would gain); planning at start-up may leave nodes out and then refuses a launch of every node; a plan file
    runs on its own nodes."""
    if str(cluster_arg) == AUTO:
        return []
    loaded = load_source(str(cluster_arg))
    if isinstance(loaded, Plan):
        if not loaded.left_out:
            return []
        names = [n.name for n in loaded.nodes]
        return [f"the plan runs on its {len(names)} kept nodes only ({' '.join(names[:16])}"
                f"{' ...' if len(names) > 16 else ''}; it leaves out {' '.join(loaded.left_out['nodes'])}): "
                f"launch deepspeed --hostfile with them (`het-plugin plan {cluster_arg} --hostfile-out HOSTS`)"]
    if plan_hash is None:
        return [f"planned at start-up for the ranks launched on {cluster_arg}: the planner may leave node groups "
                "out, and a launch of every node then stops naming them (--use-all-nodes plans with every node)"]
    lines = [f"the plan uses every node of {cluster_arg} ({loaded.world_size} ranks on {len(loaded.nodes)} nodes): "
             "launch deepspeed on all of them; wrap-config never leaves nodes out (the config's batch fixes dp "
             "over every rank launched)"]
    better = faster_without(config_path, loaded, model_arg, pp=pp, tp=tp)
    if better is None:
        return lines
    every_s = better.left_out.get("all_nodes", {}).get("iteration_s")
    mine = better.prediction.iteration_s if better.prediction else None
    gain = (f" is predicted {every_s / mine:.2f}x faster ({mine:.4g} s against {every_s:.4g} s per iteration with "
            "every node)" if every_s and mine else " is predicted faster")
    degrees = f" --tp {better.tp} --pp {better.pp}"
    lines += [f"leaving out {' '.join(better.left_out['nodes'])}{gain}, at dp {better.dp} on "
              f"{len(better.nodes)} nodes; to run that instead:",
              f"  het-plugin plan {cluster_arg} --model {model_arg}{degrees} --micro-batch-size "
              f"{better.micro_batch_size} -o plan.json --hostfile-out hostfile",
              f"  het-plugin wrap-config {config_path} --cluster plan.json -o wrapped.json   (train_batch_size = "
              f"micro-batch x accumulation x {better.dp})",
              "  deepspeed --hostfile hostfile ... --deepspeed_config wrapped.json"]
    return lines
