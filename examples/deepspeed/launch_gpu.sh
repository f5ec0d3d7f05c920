#!/usr/bin/env bash
# GPU cluster launch (Holmes' shape: 4 InfiniBand + 4 RoCE nodes of 8 A100, joined by 25 GbE).
# 1. Wrap once, on any machine: the plan (placement, layers per stage, transports) goes into the config.
# 2. Launch with DeepSpeed's own launcher; the hostfile lists the nodes in the cluster file's order.
set -euo pipefail
cd "$(dirname "$0")"
het-plugin wrap-config ds_config_gpu.json --cluster ../clusters/holmes-ib-roce.yaml --model gpt-3.6b \
    --pp 2 --layer-pattern Block -o wrapped.json
# Per-group gloo interfaces (only for gloo groups; NCCL groups get net_name per communicator):
# export HET_PLUGIN_GLOO_IFNAMES="ib=ib0,roce=ens1f0,socket=eth0,local=lo"
deepspeed --hostfile "${HOSTFILE:-hostfile}" train.py --deepspeed_config wrapped.json \
    --pp 2 --layers 30 --hidden 3072 --vocab 51200 --seq 2048 --steps 100
