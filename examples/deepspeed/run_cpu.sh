#!/usr/bin/env bash
# Runnable on any machine with het_plugin[deepspeed] installed: wrap the config for the example cluster,
# then train the toy GPT as 4 CPU ranks (gloo) with the plan's placement and layer split.
set -euo pipefail
cd "$(dirname "$0")"
WRAPPED="${TMPDIR:-/tmp}/het_plugin_ds_example_wrapped.json"
het-plugin wrap-config ds_config.json --cluster cluster-cpu.yaml --model tiny-model.yaml --pp 2 \
    --layer-pattern Block -o "$WRAPPED"
OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 4 \
    train.py --deepspeed_config "$WRAPPED" --cpu --pp 2 "$@"
