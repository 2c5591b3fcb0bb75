#!/usr/bin/env bash
# GPU check on one lent GPU (e.g. an H200): installs what the device lacks, runs tests/gpu and a
# short comparison of MEMO (α auto) against Megatron's full recomputation on a ~1B GPT, and
# writes logs and metrics under $OUT.
# Hardware: 1 CUDA GPU with a CUDA build of torch preinstalled. Expected time: ~6 minutes.
# Prepare wheels here first (the device cannot reach PyPI), for its Python (3.12 there):
#   pip download --only-binary=:all: --python-version 3.12 --no-deps -d wheels \
#       megatron-core==0.16.1 einops psutil tokenizers
# then run with the device tool, carrying wheels/:  OUT=$OUT bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
SEQ=${SEQ:-32768}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
pip install --quiet --no-index --find-links wheels megatron-core einops psutil tokenizers \
    2>&1 | tail -3
pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | tail -3

python -m pytest -q -rP tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"

# ~1B GPT (16 layers, h 2048, 16 heads) at $SEQ tokens, bf16, SDPA flash kernels
MODEL=(
    --num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192
    --seq-length "$SEQ" --position-embedding-type rope --micro-batch-size 1
    --global-batch-size 1 --train-iters 6 --lr 1e-4 --bf16 --mock-data
    --tokenizer-type NullTokenizer --vocab-size 50256 --loss-chunks 8 --log-interval 1
    --no-create-attention-mask-in-dataloader --log-throughput
)
run() {  # name, extra flags...
    local name=$1
    shift
    torchrun --nproc-per-node 1 pretrain_gpt_memo.py "${MODEL[@]}" "$@" \
        --metrics-file "$OUT/$name.jsonl" 2>&1 | tail -8 | tee "$OUT/$name.log"
    python -m tools.summarize_metrics "$OUT/$name.jsonl" | tee -a "$OUT/summary.txt"
}
run full_recompute --recompute-granularity full --recompute-method uniform \
    --recompute-num-layers 1
run memo_auto --memo --memo-alpha auto
