#!/usr/bin/env bash
# The MEMO paper's 7B comparison on one 8-GPU node (Fig. 8 / Table 3: longest sequence and MFU
# per method): Megatron full recomputation under TP 8 + SP, Megatron full recomputation under
# TP 4 + SP × CP 2, and MEMO (α by the rule) under TP 8 + SP, each at 32K, 64K and 128K tokens
# and at the longest length it trains at (searched by real runs, 64K steps), with the estimator's
# prediction next to every measurement, then calibrated on this machine.
# Hardware: one node with 8 × 80 GB GPUs (A100 / A800 / H100 / H800) and ≥ 1 TB host memory.
# Expected time: 2–4 hours (about 20 jobs; a long-sequence job takes 5–15 minutes, start-up
# included); rerunning resumes where it stopped. Results: $OUT/compare.{json,png}, table on the
# console, $OUT/calibration.json for python -m tools.estimate --calibration.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/compare_7b_8gpu}

METHODS=(full@tp8 full@tp4cp2 memo@tp8)
SEARCH=(--seq-lengths 32768 65536 131072 --find-max --granularity 65536
    --max-seq-length 1572864 --job-timeout-s 1800)
# the output layer and loss over 16 sequence slices, as the paper's 7B figures and the
# estimator's fit (docs/estimate.md): with the whole-sequence loss its logits, not the
# activations, cap every method's length (7B at 1M does not fit so on 80 GB)
LOSS=(--loss-chunks 16)
# passed to every job: bf16, the paper's 7B GPT (--model gpt-7b), synthetic tokens
TRAINER_ARGS=(--bf16 --attention-dropout 0.0 --hidden-dropout 0.0 --use-distributed-optimizer)

"${PYTHON:-python}" -m tools.compare_methods --model gpt-7b --nproc-per-node 8 \
    --methods "${METHODS[@]}" "${SEARCH[@]}" "${LOSS[@]}" --warmup-steps 1 --measure-steps 2 \
    --calibrate "$OUT/calibration.json" --out "$OUT" "$@" -- "${TRAINER_ARGS[@]}"
