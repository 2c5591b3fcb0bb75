#!/usr/bin/env bash
# HotSPa: 7B GPT (MEMO paper shape) on 8 GPUs at 32K context with whole variable-length documents
# in four length buckets, each bucket in the layout the estimator predicts fastest (`auto`).
# Hardware: one node with 8 × 80 GB GPUs. Expected time: not yet measured on GPUs.
# Real data: replace DATA_ARGS with --data-path PREFIX --tokenizer-type ... (see docs/data.md).
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ=${SEQ:-32768}

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 16384 --num-attention-heads 32
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --position-embedding-type rope
    --attention-dropout 0.0 --hidden-dropout 0.0
)
HOTSPA_ARGS=(
    --variable-seq-lengths --hotspa --hotspa-buckets "4096,8192,16384,$SEQ"
    --hotspa-strategies "${STRATEGIES:-auto}" --hotspa-mode "${MODE:-switch}"
)
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 64 --train-iters 20 --bf16
    --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2 --lr-decay-style cosine --clip-grad 1.0
)
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256)
LOGGING_ARGS=(--log-interval 1 --metrics-file "${OUT:-runs/gpt7b_hotspa}/metrics.jsonl")

"${PYTHON:-python}" -m memo_ext.launch --nproc-per-node 8 pretrain_gpt_memo.py "${MODEL_ARGS[@]}" "${HOTSPA_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
