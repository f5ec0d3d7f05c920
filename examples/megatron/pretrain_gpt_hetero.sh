#!/bin/bash
# Megatron-LM GPT pre-training on a heterogeneous GPU cluster: the usual launch plus one flag.
#
# Run on every node (node_rank 0..NNODES-1, in the cluster file's node order), from a Megatron-LM
# checkout (core_v0.16.x), with het_plugin pip-installed in the same environment:
#
#   NODE_RANK=0 MASTER_ADDR=ib-node-0 bash pretrain_gpt_hetero.sh /path/to/Megatron-LM cluster.yaml
#
# The pip-installed import hook reads --heterogeneous-nic; no change to Megatron-LM is needed
# (or apply the patch: het-plugin patch megatron /path/to/Megatron-LM). Leave the flag's value out
# to discover the cluster instead (--heterogeneous-nic with no FILE). Check the plan first with
#   het-plugin plan cluster.yaml --model <model.yaml> --tp 8 --pp 4
set -euo pipefail

MEGATRON=${1:?usage: pretrain_gpt_hetero.sh MEGATRON_LM_DIR CLUSTER_OR_PLAN_FILE}
CLUSTER=${2:?usage: pretrain_gpt_hetero.sh MEGATRON_LM_DIR CLUSTER_OR_PLAN_FILE}
NNODES=${NNODES:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
DATA_PATH=${DATA_PATH:-/data/gpt/my-gpt_text_document}
VOCAB_FILE=${VOCAB_FILE:-/data/gpt/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-/data/gpt/gpt2-merges.txt}
CHECKPOINTS=${CHECKPOINTS:-/checkpoints/gpt-7.5b}

# Megatron-Core needs this for its sequence-parallel/TP overlap; het_plugin sets no NCCL variables
# process-wide: each communicator gets its network (IB or Socket) from the per-group config file.
export CUDA_DEVICE_MAX_CONNECTIONS=1

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)

# GPT 7.5B (the Holmes paper's model). Degrees are optional with the flag: the ones given are kept,
# the planner chooses the rest; het_plugin sets the placement, the per-stage layer counts
# (--pipeline-model-parallel-layout: do not pass it, nor --decoder-first/last-pipeline-num-layers)
# and --overlap-grad-reduce where the plan assumed it.
GPT_ARGS=(
    --num-layers 36 --hidden-size 4096 --num-attention-heads 32 --seq-length 2048
    --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 512
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4
    --lr 1.5e-4 --min-lr 1.0e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
    --train-iters 500000 --lr-warmup-fraction 0.01 --bf16 --use-distributed-optimizer
)

DATA_ARGS=(
    --data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --split 949,50,1
)

OUTPUT_ARGS=(
    --log-interval 10 --save-interval 1000 --eval-interval 1000 --eval-iters 10
    --save "$CHECKPOINTS" --load "$CHECKPOINTS"
)

HETEROGENEOUS_ARGS=(
    --heterogeneous-nic "$CLUSTER"
    --heterogeneous-plan-out "$CHECKPOINTS/het_plugin_plan.json"
)

cd "$MEGATRON"
torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${HETEROGENEOUS_ARGS[@]}"
