#!/usr/bin/env bash
# Context extension of a local Hugging Face Llama model: import it, continue pretraining at
# FACTOR × its context with Llama 3.1 RoPE scaling and MEMO, draw the validation loss by
# position, export the result back to a Hugging Face folder.
#
#   HF_DIR=Meta-Llama-3-8B DATA_PREFIX=data/long/text_document NPROC=8 \
#       EXTRA_ARGS="--bf16 --tensor-model-parallel-size 8 --sequence-parallel" \
#       bash scripts/extend_context.sh
#
# Hardware and time: sized by the model. An 8B Llama at 4 × 8K wants a GPU node (8 × 80 GB,
# TP 8 + SP through EXTRA_ARGS; its time is not measured here). On CPU, 2 cores run
# tests/dist/test_extend_context_script.py's tiny random Llama (context 64 → 256, 2 steps,
# one process) through all four steps in about 50 s.
#
# Models: config.json's model_type llama (Llama 2, 3, 3.1), without attention / MLP biases, with
# plain RoPE or Llama 3.1's scaling; it is exported back as one. Any other model (Mistral, Qwen2
# with its query / key / value biases, GPT-2's learned positions) is refused in one sentence
# before any work; tools.convert_hf imports those for pretrain_gpt_memo.py.
#
# Steps and files under OUT (default runs/extend_context):
#   0. before any work: the model is one of those, and every retrieval length holds the prompt
#      (python -m tools.eval_retrieval --shortest-length, seconds)
#   1. python -m tools.convert_hf import  → OUT/import (reused when it is already there)
#   2. python -m tools.eval_retrieval on the import: passkey and needle-in-a-haystack accuracy at
#      RETRIEVAL_LENGTHS (default SEQ_LENGTH, and the original context when it holds the
#      prompt) → OUT/retrieval_before
#   3. pretrain_gpt_memo.py --load OUT/import --finetune --memo at SEQ_LENGTH
#      (default FACTOR × the model's max_position_embeddings), evaluating every EVAL_INTERVAL
#      steps → OUT/ckpt, OUT/metrics.jsonl (val_loss_by_position and the retrieval grid at each
#      evaluation)
#   4. python -m tools.eval_retrieval on the trained checkpoint → OUT/retrieval_after, and both
#      grids side by side (printed, and drawn → OUT/retrieval.png)
#   5. python -m tools.plot_position_loss → OUT/position_loss.png
#   6. python -m tools.convert_hf export --family llama → OUT/hf
#
# RoPE: a model without scaling (Llama 2, Llama 3) gets --use-rope-scaling --rope-scaling-factor
# FACTOR. A model whose import already carries Llama 3.1 scaling keeps its own factor: another
# factor would rotate every position differently from the pretraining, so only the context
# grows. megatron-core's Llama 3.1 rule fixes the original context at 8192 tokens (wavelengths
# over 8192 divided by the factor, under 2048 kept); it is meant for 8K models, and for a model
# of another context (the test's 64) the bands do not move with it.
#
# Tokenizer: the data must be tokenized with the model's own vocabulary. Without DATA_PREFIX the
# demo corpus (python -m tools.demo_corpus) is used with ByteTokenizer, which only a model of 257
# ids (256 bytes + end of document) reads; any other model is refused before training. With
# DATA_PREFIX (tools.preprocess_data output) the tokenizer defaults to the HF folder's own
# (HuggingFaceTokenizer); TOKENIZER_ARGS overrides it.
#
# Retrieval prompts are made with the run's tokenizer; each length must hold the prompt's own text
# (118 tokens of the byte tokenizer; a shorter RETRIEVAL_LENGTHS is refused at once, naming the
# shortest that fits) and be cut evenly by the layout (2 × CP, TP with SP).
#
# Settings from the environment: HF_DIR (required), FACTOR, SEQ_LENGTH, DATA_PREFIX,
# TOKENIZER_ARGS, OUT, DATA_DIR, NPROC, TRAIN_ITERS, MICRO_BATCH, GLOBAL_BATCH, LR,
# EVAL_INTERVAL, EVAL_ITERS, RETRIEVAL_LENGTHS, RETRIEVAL_SAMPLES, EXTRA_ARGS (more trainer
# flags: layout, precision), MASTER_PORT, PYTHON, TORCHRUN.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-"$PYTHON -m memo_ext.launch"}
: "${HF_DIR:?give HF_DIR, a local Hugging Face Llama folder (config.json + *.safetensors)}"
OUT=${OUT:-runs/extend_context}
FACTOR=${FACTOR:-4}
NPROC=${NPROC:-2}
TRAIN_ITERS=${TRAIN_ITERS:-200}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-$((MICRO_BATCH * NPROC))}
LR=${LR:-2e-5}
EVAL_INTERVAL=${EVAL_INTERVAL:-50}
EVAL_ITERS=${EVAL_ITERS:-4}
DATA_DIR=${DATA_DIR:-data/demo}
read -ra EXTRA <<< "${EXTRA_ARGS:-}"

fail() {
    echo "extend_context: error: $*" >&2
    exit 2
}

# 0. before any work: the model is a Llama this script extends (config.json's family, biases
# and RoPE scaling), and its context is read (the importer's default 2048 when absent)
SUPPORTED="this script extends Llama models (model_type llama: Llama 2, 3, 3.1) without biases, \
with plain RoPE or Llama 3.1's scaling"
MODEL=$("$PYTHON" -c 'import json, sys
c = json.load(open(sys.argv[1]))
rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
biases = bool(c.get("attention_bias") or c.get("mlp_bias"))
scaling = rope.get("rope_type", rope.get("type", "default"))
print(c.get("model_type"), c.get("max_position_embeddings") or 2048, c.get("vocab_size"), biases,
      scaling)' "$HF_DIR/config.json" 2> /dev/null) ||
    fail "HF_DIR $HF_DIR holds no config.json that reads as JSON; give a Hugging Face model folder"
read -r FAMILY ORIGINAL VOCAB BIASES SCALING <<< "$MODEL"
[[ $FAMILY == llama ]] || fail "HF_DIR's model_type is $FAMILY; $SUPPORTED"
[[ $BIASES == False ]] || fail "HF_DIR's model has attention or MLP biases; $SUPPORTED"
[[ $SCALING == default || $SCALING == llama3 ]] ||
    fail "HF_DIR's model has RoPE scaling of type $SCALING; $SUPPORTED"
SEQ_LENGTH=${SEQ_LENGTH:-$((FACTOR * ORIGINAL))}

if [[ -z "${DATA_PREFIX:-}" ]]; then
    [[ $VOCAB == 257 ]] || fail "the demo corpus is byte-tokenized (257 ids) and this model has \
$VOCAB; give DATA_PREFIX tokenized with the model's tokenizer"
    TOKENIZER_ARGS=${TOKENIZER_ARGS:-"--tokenizer-type ByteTokenizer"}
fi
TOKENIZER_ARGS=${TOKENIZER_ARGS:-"--tokenizer-type HuggingFaceTokenizer --tokenizer-model $HF_DIR"}
read -ra TOKENIZER <<< "$TOKENIZER_ARGS"

# the retrieval lengths hold the prompt's own text, in this tokenizer's tokens
SHORTEST=$("$PYTHON" -m tools.eval_retrieval --shortest-length "${TOKENIZER[@]}" "${EXTRA[@]}")
if [[ -n "${RETRIEVAL_LENGTHS:-}" ]]; then
    for length in ${RETRIEVAL_LENGTHS//,/ }; do
        [[ $length =~ ^[0-9]+$ ]] ||
            fail "RETRIEVAL_LENGTHS must be comma-separated token counts, got $RETRIEVAL_LENGTHS"
        ((length >= SHORTEST)) ||
            fail "RETRIEVAL_LENGTHS $length is too short for the retrieval prompt, which takes \
at least $SHORTEST tokens with this tokenizer; give lengths of $SHORTEST or more"
    done
elif ((ORIGINAL >= SHORTEST)); then
    RETRIEVAL_LENGTHS=$ORIGINAL,$SEQ_LENGTH
elif ((SEQ_LENGTH >= SHORTEST)); then
    RETRIEVAL_LENGTHS=$SEQ_LENGTH
    echo "extend_context: retrieval at $SEQ_LENGTH tokens only: a prompt takes at least" \
        "$SHORTEST tokens with this tokenizer, more than the original context ($ORIGINAL)"
else
    fail "SEQ_LENGTH $SEQ_LENGTH is too short for the retrieval prompt, which takes at least \
$SHORTEST tokens with this tokenizer; give a larger FACTOR or SEQ_LENGTH"
fi

if [[ -z "${DATA_PREFIX:-}" ]]; then
    DATA_PREFIX=$("$PYTHON" -m tools.demo_corpus --out-dir "$DATA_DIR")
fi

# 1. import (once; the converter refuses a folder that is not empty)
if [[ ! -f "$OUT/import/latest_checkpointed_iteration.txt" ]]; then
    "$PYTHON" -m tools.convert_hf import --hf-dir "$HF_DIR" --out "$OUT/import"
fi
read -ra IMPORT_FLAGS < "$OUT/import/model_flags.txt"
LAYERS=$(sed -E 's/.*--num-layers ([0-9]+).*/\1/' "$OUT/import/model_flags.txt")
# MEMO keeps its last two layers on the device (its default), and one fewer than the model has
KEEP=$((LAYERS > 2 ? 2 : LAYERS - 1))
if grep -q -- "--use-rope-scaling" "$OUT/import/model_flags.txt"; then
    echo "extend_context: the model carries Llama 3.1 RoPE scaling already; it is kept (FACTOR only sets the context)"
    ROPE_ARGS=()
else
    ROPE_ARGS=(--use-rope-scaling --rope-scaling-factor "$FACTOR")
fi
# the extended model: the import's flags, the scaling, the new context (later flags win)
MODEL_ARGS=("${IMPORT_FLAGS[@]}" "${ROPE_ARGS[@]}" --max-position-embeddings "$SEQ_LENGTH")
echo "extend_context: context $ORIGINAL → $SEQ_LENGTH tokens"

RETRIEVAL_ARGS=(--eval-retrieval-lengths "$RETRIEVAL_LENGTHS"
    --eval-retrieval-samples "${RETRIEVAL_SAMPLES:-4}")
DATA_ARGS=(--data-path "$DATA_PREFIX" --split 98,2,0 "${TOKENIZER[@]}" --data-cache-path "$OUT/cache")
EVAL_RETRIEVAL=("$PYTHON" -m tools.eval_retrieval --nproc "$NPROC"
    --master-port "${MASTER_PORT:-29511}")

# 2. retrieval before the extension: the imported model at the lengths to reach
"${EVAL_RETRIEVAL[@]}" --load "$OUT/import" --out "$OUT/retrieval_before" "${DATA_ARGS[@]}" \
    "${RETRIEVAL_ARGS[@]}" "${EXTRA[@]}"

# 3. continue pretraining at the long context from the import's weights
TRAINING_ARGS=(
    --seq-length "$SEQ_LENGTH"
    --micro-batch-size "$MICRO_BATCH"
    --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --lr "$LR"
    --min-lr "$(awk "BEGIN { print $LR / 10 }")"
    --lr-decay-style cosine
    --lr-warmup-iters $((TRAIN_ITERS / 10))
    --weight-decay 0.1
    --clip-grad 1.0
    --seed 1234
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --memo
    --memo-keep-last-layers "$KEEP"
)
CHECKPOINT_ARGS=(--load "$OUT/import" --finetune --save "$OUT/ckpt" --save-interval "$TRAIN_ITERS")
EVAL_ARGS=(--eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS" "${RETRIEVAL_ARGS[@]}")
LOGGING_ARGS=(--log-interval 10 --metrics-file "$OUT/metrics.jsonl")

mkdir -p "$OUT"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} $TORCHRUN --nproc-per-node "$NPROC" \
    --master-port "${MASTER_PORT:-29511}" pretrain_gpt_memo.py "${MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" "${EXTRA[@]}"
# the trained checkpoint describes itself as the import does: its model flags and the source
# config (token ids, vocabulary) for the export and for tools.convert_hf's load_model
printf '%s\n' "${MODEL_ARGS[*]}" > "$OUT/ckpt/model_flags.txt"
cp "$OUT/import/hf_config.json" "$OUT/ckpt/hf_config.json"

# 4. retrieval after it, beside the one before
"${EVAL_RETRIEVAL[@]}" --load "$OUT/ckpt" --out "$OUT/retrieval_after" "${DATA_ARGS[@]}" \
    "${RETRIEVAL_ARGS[@]}" "${EXTRA[@]}"
"$PYTHON" -m tools.eval_retrieval --plot "$OUT/retrieval_before/retrieval.json" \
    "$OUT/retrieval_after/retrieval.json" --names before after --out "$OUT/retrieval.png"

# 5. the loss by position at the last evaluation: does the model use the longer context?
"$PYTHON" -m tools.plot_position_loss "$OUT/metrics.jsonl" --out "$OUT/position_loss.png"

# 6. back to a Hugging Face folder (config.json carries the rope_scaling and the new context)
rm -rf "$OUT/hf"
"$PYTHON" -m tools.convert_hf export --load "$OUT/ckpt" --out "$OUT/hf" --family llama
