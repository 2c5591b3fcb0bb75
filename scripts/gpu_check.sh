#!/usr/bin/env bash
# GPU check on one lent GPU (e.g. an H200), within 8 minutes, writing 7 files under $OUT:
#   gpu_tests.log       the GPU, the offline install, tests/gpu
#   bench.log           MEMO (α auto; whole layers, and by sub-sequence chunks, auto) against
#                       Megatron's full recomputation on a ~1B GPT at $SEQ
#   bench_metrics.jsonl both runs' metrics records (key "run" says which)
#   compare.txt         tools.compare_methods' table and summary on the one-GPU 7B proxy below
#   compare.json        every run of that comparison, measured and predicted
#   compare.png         its MFU against sequence length, estimator against measurement
#   calibration.json    the estimator calibrated on this GPU (tools.estimate --calibration)
# Hardware: 1 CUDA GPU with ≥ 48 GiB and a CUDA build of torch preinstalled. Expected time: 7–8
# minutes (a deadline keeps it under 8).
# Prepare wheels here first (the device cannot reach PyPI), for its Python (3.12 there):
#   bash scripts/gpu_wheels.sh
# then run with the device tool, carrying wheels/:  OUT=$OUT bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
SEQ=${SEQ:-32768}
WORK=${WORK:-runs/gpu_check_work}  # per-job logs and metrics, not carried back
DEADLINE=$((SECONDS + ${BUDGET_S:-470}))
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    pip install --quiet --no-index --find-links wheels megatron-core ortools highspy absl-py \
        immutabledict protobuf pandas tzdata 2>&1 | tail -3
    pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | tail -3
    timeout 110 python -m pytest -q -rP tests/gpu 2>&1
} > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"

# 1. ~1B GPT (16 layers, h 2048, 16 heads) at $SEQ tokens, bf16, SDPA flash kernels
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
    timeout 90 torchrun --nproc-per-node 1 pretrain_gpt_memo.py "${MODEL[@]}" "$@" \
        --metrics-file "$WORK/$name.jsonl" 2>&1 | tail -8 | sed "s/^/[$name] /" >> "$OUT/bench.log"
    python -m tools.summarize_metrics "$WORK/$name.jsonl" | sed "s/^/[$name] /" >> "$OUT/bench.log"
}
: > "$OUT/bench.log"
run full_recompute --recompute-granularity full --recompute-method uniform \
    --recompute-num-layers 1
run memo_auto --memo --memo-alpha auto
run memo_chunked --memo --memo-alpha auto --memo-chunk-tokens auto
python - "$WORK" > "$OUT/bench_metrics.jsonl" <<'PY'
import json, pathlib, sys
for name in ("full_recompute", "memo_auto", "memo_chunked"):
    path = pathlib.Path(sys.argv[1]) / f"{name}.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        print(json.dumps({"run": name, **json.loads(line)}))
PY
tail -4 "$OUT/bench.log"

# 2. Megatron's full recomputation against MEMO on a one-GPU proxy of the paper's 7B: its width
#    (h 4096, 32 heads, 4h GeLU MLP, vocabulary 50257, RoPE) with 4 layers, so each layer costs
#    what one of the paper's costs; MEMO offloads 3 of them (keeps the last). Device memory capped
#    at 40 GiB, so the longest lengths are reached in seconds per step. 32K tokens each, then the
#    longest each trains at (32K steps), then the estimator calibrated on the measured steps.
LEFT=$((DEADLINE - SECONDS - 75))  # the last job, the kernels' timing and the report
python -m tools.compare_methods --model gpt-7b --num-layers 4 --loss-chunks 16 \
    --memo-keep-last-layers 1 --methods full memo --seq-lengths 32768 --find-max \
    --granularity 32768 --max-seq-length 262144 --memory-limit-gb 40 --job-timeout-s 75 \
    --time-budget-s "$((LEFT > 30 ? LEFT : 30))" --calibrate "$OUT/calibration.json" \
    --out "$WORK/compare" -- --bf16 > "$OUT/compare.txt" 2> "$WORK/compare.err"
cp "$WORK/compare/compare.json" "$WORK/compare/compare.png" "$OUT/" 2>/dev/null
tail -5 "$WORK/compare.err" >> "$OUT/compare.txt"
cat "$OUT/compare.txt"
echo "gpu_check: $SECONDS s"
