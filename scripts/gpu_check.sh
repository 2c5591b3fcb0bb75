#!/usr/bin/env bash
# GPU check on one lent GPU (an H200), in at most 6 minutes (BUDGET_S), stages in order of value.
# Each stage writes its files under $OUT when it ends, so what ran comes back even if a later
# stage is cut; a stage that would not fit the time left is skipped, with a line saying so in
# stages.txt. docs/gpu_check.md says what every file shows.
#   00_machine.txt     GPU, driver, host memory as read, the MEMO host budget used
#   10_install.log     offline install of the carried wheels and the package
#   20_gpu_tests.log   tests/gpu without training launches: streams, pinned buffers, the allocator
#                      core behind CUDA, MEMO layers (pytest, ~1 min)
#   30_steps.txt       one ~1B GPT (16 layers, h 2048) at $SEQ tokens per method: full
#                      recomputation, MEMO α auto, MEMO by sub-sequence chunks, MEMO + planned
#                      allocator; each run's last lines and its summarize_metrics line
#   30_steps.jsonl     every run's metrics records (key "run" says which)
#   40_compare.txt     tools.compare_methods on a one-GPU 7B-width proxy (if time is left)
#   40_compare.json    its runs, measured and predicted; 40_calibration.json the calibration
#   50_launch_tests.log tests/gpu's training launches (if time is left)
#   stages.txt         every stage: ran (seconds, exit status) or skipped (why)
# Hardware: 1 CUDA GPU with >= 48 GiB, a CUDA build of torch preinstalled, Python 3.12.
# Prepare wheels here first (the device cannot reach PyPI): bash scripts/gpu_wheels.sh, then run
# with the device tool, carrying wheels/:  OUT=$OUT bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
SEQ=${SEQ:-32768}
WORK=${WORK:-runs/gpu_check_work}  # per-job logs and metrics, not carried back
BUDGET_S=${BUDGET_S:-360}
# The lent machine's RAM grows as it is used (MemTotal reads low at start): MEMO's host budget
# comes from its documented memory, capped, and the check says what it read and what it used.
DOCUMENTED_HOST_GB=${DOCUMENTED_HOST_GB:-128}
DEADLINE=$((SECONDS + BUDGET_S))
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
: > "$OUT/stages.txt"

left() { echo $((DEADLINE - SECONDS)); }

# stage NAME NEEDS_S LIMIT_S command...: run within min(LIMIT_S, time left) when NEEDS_S fit
stage() {
    local name=$1 needs=$2 limit=$3
    shift 3
    local remaining
    remaining=$(left)
    if ((remaining < needs)); then
        echo "$name: skipped: ${remaining}s left, it needs ${needs}s" | tee -a "$OUT/stages.txt"
        return 0
    fi
    ((limit > remaining)) && limit=$remaining
    local start=$SECONDS
    timeout "$limit" "$@"
    local status=$?
    local how="exit $status"
    ((status == 124)) && how="cut at its ${limit}s limit"
    echo "$name: ran $((SECONDS - start))s, $how" | tee -a "$OUT/stages.txt"
}

machine() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    grep -E "MemTotal|MemAvailable" /proc/meminfo
    local read_gb
    read_gb=$(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo)
    HOST_GB=$((DOCUMENTED_HOST_GB * 4 / 10))
    ((HOST_GB > 48)) && HOST_GB=48
    echo "MEMO host budget: ${HOST_GB} GiB per process (40% of the documented" \
        "${DOCUMENTED_HOST_GB} GiB, at most 48; MemAvailable read ${read_gb} GiB)"
}
machine > "$OUT/00_machine.txt" 2>&1
HOST_GB=$(sed -n 's/^MEMO host budget: \([0-9]*\) GiB.*/\1/p' "$OUT/00_machine.txt")
echo "machine: $(head -2 "$OUT/00_machine.txt" | tail -1)" | tee -a "$OUT/stages.txt"

install() {
    pip install --quiet --no-index --find-links wheels megatron-core ortools highspy absl-py \
        immutabledict protobuf pandas tzdata ninja 2>&1 | tail -3
    pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | tail -3
    python -c "import memo_ext, megatron.core; print('installed', megatron.core.__version__)"
}

# ~1B GPT (16 layers, h 2048, 16 heads) at $SEQ tokens, bf16, SDPA's flash kernels (no value
# below holds a space: the flags travel word-split to the exported functions)
MODEL_FLAGS="--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192
    --seq-length $SEQ --position-embedding-type rope --micro-batch-size 1 --global-batch-size 1
    --train-iters 5 --lr 1e-4 --bf16 --mock-data --tokenizer-type NullTokenizer
    --vocab-size 50256 --loss-chunks 8 --log-interval 1 --no-create-attention-mask-in-dataloader
    --log-throughput --attention-backend sdpa"
MEMO_FLAGS="--memo --memo-alpha auto --memo-host-memory-gb $HOST_GB"

step() {  # name, extra flags...: one run, its lines and records appended to the stage's files
    local name=$1
    shift
    # shellcheck disable=SC2086
    python -m memo_ext.launch --nproc-per-node 1 pretrain_gpt_memo.py $MODEL_FLAGS "$@" \
        --metrics-file "$WORK/$name.jsonl" > "$WORK/$name.log" 2>&1
    local status=$?
    {
        echo "[$name] exit $status"
        tail -6 "$WORK/$name.log" | sed "s/^/[$name] /"
        python -m tools.summarize_metrics "$WORK/$name.jsonl" 2>&1 | sed "s/^/[$name] /"
    } >> "$OUT/30_steps.txt"
    python -c 'import json, pathlib, sys
path = pathlib.Path(sys.argv[1])
for line in path.read_text().splitlines() if path.exists() else []:
    print(json.dumps({"run": sys.argv[2], **json.loads(line)}))' "$WORK/$name.jsonl" "$name" \
        >> "$OUT/30_steps.jsonl"
    return $status
}

# The 7B-width proxy (h 4096, 32 heads, 4h GeLU MLP, vocabulary 50257, RoPE, 4 layers, so each
# layer costs what one of the paper's 7B costs): Megatron's full recomputation against MEMO at
# 32K tokens and their longest under a 40 GiB cap, then the estimator calibrated on the steps.
compare() {  # seconds it may take
    python -m tools.compare_methods --model gpt-7b --num-layers 4 --loss-chunks 16 \
        --memo-keep-last-layers 1 --methods full memo --seq-lengths 32768 --find-max \
        --granularity 32768 --max-seq-length 262144 --memory-limit-gb 40 --job-timeout-s 60 \
        --time-budget-s "$(($1 - 40))" --calibrate "$OUT/40_calibration.json" \
        --out "$WORK/compare" -- --bf16 > "$OUT/40_compare.txt" 2> "$WORK/compare.err"
    local status=$?
    cp "$WORK/compare/compare.json" "$OUT/40_compare.json" 2>/dev/null
    tail -5 "$WORK/compare.err" >> "$OUT/40_compare.txt"
    return $status
}
export -f install step compare
export OUT WORK MODEL_FLAGS

stage install 30 120 bash -c install > "$OUT/10_install.log" 2>&1
stage gpu_tests 60 100 python -m pytest -q -rs -p no:cacheprovider tests/gpu -m "not launch" \
    > "$OUT/20_gpu_tests.log" 2>&1
tail -3 "$OUT/20_gpu_tests.log"

: > "$OUT/30_steps.txt"
: > "$OUT/30_steps.jsonl"
stage step_full 40 75 bash -c "step full_recompute --recompute-granularity full \
    --recompute-method uniform --recompute-num-layers 1"
stage step_memo 40 75 bash -c "step memo_auto $MEMO_FLAGS"
stage step_memo_chunked 40 75 bash -c "step memo_chunked $MEMO_FLAGS --memo-chunk-tokens auto"
stage step_memo_plan 45 90 bash -c "step memo_plan $MEMO_FLAGS --memo-allocator plan \
    --memo-plan-cache $WORK/plans"
grep -h "exit\|loss" "$OUT/30_steps.txt" | head -12

stage compare 90 240 bash -c "compare $(left)"
stage launch_tests 60 240 python -m pytest -q -rs -p no:cacheprovider tests/gpu -m launch \
    > "$OUT/50_launch_tests.log" 2>&1
echo "gpu_check: ${SECONDS}s" | tee -a "$OUT/stages.txt"
