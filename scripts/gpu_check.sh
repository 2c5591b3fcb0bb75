#!/usr/bin/env bash
# GPU check on one lent GPU (e.g. an H200): installs what the device lacks, runs tests/gpu and a
# short training benchmark, and writes logs and metrics under $OUT.
# Hardware: 1 CUDA GPU with torch preinstalled (CUDA build). Expected time: ~5 minutes.
# Prepare wheels here first (the device cannot reach PyPI):
#   pip download --only-binary=:all: --python-version 3.12 --no-deps -d wheels \
#       megatron-core==0.16.1 einops ortools highspy
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
pip install --quiet --no-index --find-links wheels megatron-core einops 2>&1 | tail -3
pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | tail -3

python -m pytest -q tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"

# ~1B GPT at 16K tokens on one GPU, bf16, SDPA flash kernels: throughput, TFLOP/s, MFU, memory
torchrun --nproc-per-node 1 pretrain_gpt_memo.py \
    --num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 \
    --seq-length 16384 --position-embedding-type rope --attention-dropout 0 --hidden-dropout 0 \
    --micro-batch-size 1 --global-batch-size 1 --train-iters 8 --lr 1e-4 --bf16 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 50256 \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --log-interval 1 --metrics-file "$OUT/full_recompute.jsonl" 2>&1 | tail -12 | tee "$OUT/bench.log"
python -m tools.summarize_metrics "$OUT/full_recompute.jsonl" | tee -a "$OUT/bench.log"
