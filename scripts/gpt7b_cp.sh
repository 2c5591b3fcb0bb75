#!/usr/bin/env bash
# Megatron baseline: 7B GPT (MEMO paper shape) at 64K tokens on 8 GPUs with TP 4 + SP and
# context parallelism 2 (load-balanced chunks), full recomputation.
# Hardware: one node with 8 × 80 GB GPUs. Expected time: ~15 minutes for 20 steps after start-up.
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ=${SEQ:-65536}

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 16384 --num-attention-heads 32
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --position-embedding-type rope
    --attention-dropout 0.0 --hidden-dropout 0.0
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 4 --sequence-parallel --context-parallel-size 2
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 8 --train-iters 20 --bf16
    --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2 --lr-decay-style cosine --clip-grad 1.0
)
# no [s, s] attention mask in the data loader: the attention kernels mask causally themselves
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256
    --no-create-attention-mask-in-dataloader)
LOGGING_ARGS=(--log-interval 1 --metrics-file "${OUT:-runs/gpt7b_cp2}/metrics.jsonl")

"${PYTHON:-python}" -m memo_ext.launch --nproc-per-node 8 pretrain_gpt_memo.py "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
