#!/usr/bin/env bash
# A smoke check of this project on your own GPU machine, in at most BUDGET_S seconds (6 minutes
# by default), stages in order of value: the CUDA tests (in-process, then the training launches
# that hold MEMO and the planned allocator against plain runs), one short training run per memory
# method on a ~1B GPT, then a one-GPU comparison of Megatron's full recomputation against MEMO
# with the estimator calibrated on it. Each stage writes its files under $OUT when it ends, so
# what ran is kept even if a later stage is cut; a stage that would not fit the time left is
# skipped, with a line saying so, and one cut at its limit is interrupted (SIGINT), so pytest
# still prints the failures it saw. STAGES="install gpu_tests ..." runs those stages alone.
# The last lines list the stages cut or skipped for time (INCOMPLETE) and those that failed
# (FAILED). Exit status: 0 every stage ran and passed, 1 no GPU (nothing run), 3 INCOMPLETE,
# 4 FAILED (with or without INCOMPLETE).
# docs/gpu_check.md says what every file shows. At most 8 files:
#   stages.txt          the machine (GPU, driver, host memory, MEMO's host budget), then every
#                       stage: ran (seconds, exit status or cut) or skipped (why), the total,
#                       the INCOMPLETE and FAILED lines
#   10_install.log      the install of the package (and of wheels/ offline, when there is one)
#   20_gpu_tests.log    tests/gpu: in-process CUDA tests first, the training launches last
#   30_steps.txt        per method run: exit status, last lines, summarize_metrics' summary
#                       (a run cut at its limit: a line saying so)
#   30_steps.jsonl      every run's metrics records (key "run" says which)
#   40_compare.txt      tools.compare_methods' table and summary
#   40_compare.json     its runs, measured and predicted
#   40_calibration.json the estimator calibrated on those runs (tools.estimate --calibration)
# Hardware: one CUDA GPU with >= 48 GiB and a CUDA build of torch; the package installed
# (python -m pip install -e .), or wheels/ from scripts/gpu_wheels.sh for a machine without
# PyPI. Expected time: 6 minutes.
#   bash scripts/gpu_check.sh                         # results in runs/gpu_check
#   OUT=/tmp/check HOST_GB=64 bash scripts/gpu_check.sh
# REHEARSAL=1 runs the same stages on a tiny model (make test does, on the emulated GPU of
# tests/emulated: python -m memo_ext.simulate.run -- bash scripts/gpu_check.sh), with every
# time (BUDGET_S, each stage's) TIME_SCALE (3) times as long: there a stage's time is the Python
# processes it starts, on whatever CPU the machine has to spare.
set -uo pipefail

left() { echo $((DEADLINE - SECONDS)); }

INCOMPLETE=()  # "name (why)" of each stage cut at its limit or skipped for lack of time
FAILED=()      # "name (exit S)" of each stage that ran to a non-zero exit
STAGE_CUT=""   # after stage: "cut at its Ns limit" when the stage just run was cut, else empty

# stage NAME NEEDS_S LIMIT_S command...: run within min(LIMIT_S, time left) when NEEDS_S fit
# (both times TIME_SCALE); at its limit it gets SIGINT (pytest then reports the failures so far,
# a training job stops as at Ctrl-C), and SIGKILL 10 s later
stage() {
    local name=$1 needs=$(($2 * TIME_SCALE)) limit=$(($3 * TIME_SCALE))
    shift 3
    STAGE_CUT=""
    if [[ -n ${STAGES:-} && " $STAGES " != *" $name "* ]]; then
        echo "$name: skipped: not in STAGES" | tee -a "$OUT/stages.txt"
        return 0
    fi
    local remaining
    remaining=$(left)
    if ((remaining < needs)); then
        local why="skipped: ${remaining}s left, it needs ${needs}s"
        echo "$name: $why" | tee -a "$OUT/stages.txt"
        INCOMPLETE+=("$name ($why)")
        return 0
    fi
    ((limit > remaining - 10)) && limit=$((remaining - 10))
    local start=$SECONDS
    STAGE_LIMIT_S=$limit timeout -s INT -k 10 "$limit" "$@"
    local status=$? took=$((SECONDS - start))
    # timeout's own statuses: 124 when the command ended after SIGINT, 137 after SIGKILL (a
    # command killed before its limit, by the kernel's OOM killer say, is no cut)
    if ((status == 124 || (status == 137 && took >= limit - 1))); then
        STAGE_CUT="cut at its ${limit}s limit"
        INCOMPLETE+=("$name ($STAGE_CUT)")
        echo "$name: ran ${took}s, $STAGE_CUT" | tee -a "$OUT/stages.txt"
        return 0
    fi
    ((status == 0)) || FAILED+=("$name (exit $status)")
    echo "$name: ran ${took}s, exit $status" | tee -a "$OUT/stages.txt"
}

# step_stage NAME RUN NEEDS_S LIMIT_S flags...: stage NAME trains RUN (step below); a run cut at
# its limit is mostly killed before it writes its lines, so 30_steps.txt gets one saying so
step_stage() {
    local name=$1 run=$2 needs=$3 limit=$4
    shift 4
    stage "$name" "$needs" "$limit" bash -c "step $run $*"
    if [[ -n $STAGE_CUT ]]; then
        echo "[$run] $STAGE_CUT: no summary (the log so far: $WORK/$run.log)" \
            >> "$OUT/30_steps.txt"
    fi
}

# the last lines: what did not finish, what failed; the exit status (see the header)
finish() {
    local status=0 listed
    if ((${#INCOMPLETE[@]})); then
        listed=$(printf '%s, ' "${INCOMPLETE[@]}")
        echo "gpu_check: INCOMPLETE: ${listed%, }" | tee -a "$OUT/stages.txt"
        status=3
    fi
    if ((${#FAILED[@]})); then
        listed=$(printf '%s, ' "${FAILED[@]}")
        echo "gpu_check: FAILED: ${listed%, }" | tee -a "$OUT/stages.txt"
        status=4
    fi
    return $status
}

# MEMO's host budget per process: HOST_GB, else 40% of MemTotal, at most 48 GiB (on machines
# whose memory grows as it is used, MemTotal reads low at start: set HOST_GB there)
machine() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    grep -E "MemTotal|MemAvailable" /proc/meminfo
    local total_gb
    total_gb=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)
    if [[ -n ${HOST_GB:-} ]]; then
        echo "MEMO host budget: ${HOST_GB} GiB per process (HOST_GB)"
    else
        HOST_GB=$((total_gb * 4 / 10))
        ((HOST_GB > 48)) && HOST_GB=48
        ((HOST_GB < 1)) && HOST_GB=1
        echo "MEMO host budget: ${HOST_GB} GiB per process (40% of MemTotal, at most 48)"
    fi
}

install() {
    if [[ -d wheels ]]; then  # a machine without PyPI: the wheels scripts/gpu_wheels.sh fetched
        "$PYTHON" -m pip install --quiet --no-index --find-links wheels megatron-core ortools \
            highspy absl-py immutabledict protobuf pandas tzdata ninja 2>&1 | tail -3
        "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | tail -3
    fi
    "$PYTHON" -c "import memo_ext, megatron.core; print('installed', megatron.core.__version__)"
}

step() {  # name, extra flags...: one run, its lines and records appended to the stage's files
    local name=$1
    shift
    # shellcheck disable=SC2086
    "$PYTHON" -m memo_ext.launch --nproc-per-node 1 pretrain_gpt_memo.py $MODEL_FLAGS "$@" \
        --metrics-file "$WORK/$name.jsonl" > "$WORK/$name.log" 2>&1
    local status=$?
    {
        echo "[$name] exit $status"
        tail -6 "$WORK/$name.log" | sed "s/^/[$name] /"
        "$PYTHON" -m tools.summarize_metrics "$WORK/$name.jsonl" 2>&1 | sed "s/^/[$name] /"
    } >> "$OUT/30_steps.txt"
    "$PYTHON" -c 'import json, pathlib, sys
path = pathlib.Path(sys.argv[1])
for line in path.read_text().splitlines() if path.exists() else []:
    print(json.dumps({"run": sys.argv[2], **json.loads(line)}))' "$WORK/$name.jsonl" "$name" \
        >> "$OUT/30_steps.jsonl"
    return $status
}

# Megatron's full recomputation against MEMO at the first length and their longest under a
# 40 GiB cap, then the estimator calibrated on the steps; its own budget ends 40 s before its
# stage's limit (STAGE_LIMIT_S, set by stage), so it stops searching rather than being cut
compare() {
    # shellcheck disable=SC2086
    "$PYTHON" -m tools.compare_methods --model gpt-7b $COMPARE_FLAGS \
        --memo-keep-last-layers 1 --methods full memo --find-max --memory-limit-gb 40 \
        --job-timeout-s $((60 * TIME_SCALE)) --time-budget-s "$((STAGE_LIMIT_S - 40))" \
        --calibrate "$OUT/40_calibration.json" --out "$WORK/compare" -- --bf16 \
        > "$OUT/40_compare.txt" 2> "$WORK/compare.err"
    local status=$?
    cp "$WORK/compare/compare.json" "$OUT/40_compare.json" 2> /dev/null
    tail -5 "$WORK/compare.err" >> "$OUT/40_compare.txt"
    return $status
}

# sourced (tests/unit/test_gpu_check_script.py): the functions above, nothing run
[[ ${BASH_SOURCE[0]} != "$0" ]] && return 0

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-runs/gpu_check}
WORK=${WORK:-runs/gpu_check_work}  # per-job logs and metrics, not results

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
    2> /dev/null; then
    echo "gpu_check: no CUDA GPU is visible to $PYTHON's torch (a CUDA build of torch and a" \
        "GPU are needed); nothing was run" >&2
    exit 1
fi
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
: > "$OUT/stages.txt"

if [[ ${REHEARSAL:-0} == 1 ]]; then
    # every stage reaches its end in a minute or two on a quiet machine (on the emulated GPU
    # its time is the Python processes it starts: TIME_SCALE leaves room for a busy one)
    TIME_SCALE=${TIME_SCALE:-3}
    SEQ=${SEQ:-512}
    ITERS=3
    LM=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256
        --vocab-size 512 --loss-chunks 2)
    COMPARE=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 512
        --loss-chunks 2 --seq-lengths 512 --granularity 512 --max-seq-length 512)
else
    TIME_SCALE=${TIME_SCALE:-1}
    SEQ=${SEQ:-32768}
    ITERS=5
    # ~1B GPT (16 layers, h 2048, 16 heads)
    LM=(--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192
        --vocab-size 50256 --loss-chunks 8)
    # the 7B width (h 4096, 32 heads, 4h GeLU MLP, vocabulary 50257, RoPE) with 4 layers, so
    # each layer costs what one of the 7B's does
    COMPARE=(--num-layers 4 --loss-chunks 16 --seq-lengths 32768 --granularity 32768
        --max-seq-length 262144)
fi
BUDGET_S=${BUDGET_S:-$((360 * TIME_SCALE))}
DEADLINE=$((SECONDS + BUDGET_S))

machine > "$WORK/machine.txt" 2>&1
cat "$WORK/machine.txt" >> "$OUT/stages.txt"
HOST_GB=$(sed -n 's/^MEMO host budget: \([0-9.]*\) GiB.*/\1/p' "$WORK/machine.txt")
echo "machine: $(sed -n 2p "$WORK/machine.txt")"

# bf16, SDPA's flash kernels, synthetic tokens (no value below holds a space: the flags travel
# word-split to the exported functions)
MODEL_FLAGS="${LM[*]} --seq-length $SEQ --position-embedding-type rope --micro-batch-size 1
    --global-batch-size 1 --train-iters $ITERS --lr 1e-4 --bf16 --mock-data
    --tokenizer-type NullTokenizer --log-interval 1 --no-create-attention-mask-in-dataloader
    --log-throughput --attention-backend sdpa"
MEMO_FLAGS="--memo --memo-alpha auto --memo-host-memory-gb $HOST_GB"
COMPARE_FLAGS="${COMPARE[*]}"
export -f install step compare
export OUT WORK PYTHON MODEL_FLAGS COMPARE_FLAGS TIME_SCALE

stage install 30 120 bash -c install > "$OUT/10_install.log" 2>&1
stage gpu_tests 60 100 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/gpu -m "not launch" \
    > "$OUT/20_gpu_tests.log" 2>&1
tail -3 "$OUT/20_gpu_tests.log"
echo "--- training launches ---" >> "$OUT/20_gpu_tests.log"
stage launch_tests 60 200 bash -c "'$PYTHON' -m pytest -q -rs -p no:cacheprovider tests/gpu \
    -m launch >> '$OUT/20_gpu_tests.log' 2>&1"
tail -3 "$OUT/20_gpu_tests.log"

: > "$OUT/30_steps.txt"
: > "$OUT/30_steps.jsonl"
step_stage step_full full_recompute 40 75 --recompute-granularity full \
    --recompute-method uniform --recompute-num-layers 1
step_stage step_memo memo_auto 40 75 "$MEMO_FLAGS"
step_stage step_memo_chunked memo_chunked 40 75 "$MEMO_FLAGS" --memo-chunk-tokens auto
step_stage step_memo_plan memo_plan 45 90 "$MEMO_FLAGS" --memo-allocator plan \
    --memo-plan-cache "$WORK/plans"
grep -h "exit\|loss\|cut at" "$OUT/30_steps.txt" | head -12

stage compare 90 240 bash -c compare
echo "gpu_check: ${SECONDS}s" | tee -a "$OUT/stages.txt"
finish
