#!/usr/bin/env bash
# CPU demo: a small GPT (RoPE, RMSNorm, SwiGLU, GQA) trained on the standard-library corpus.
# Hardware: 2 CPU cores, no GPU. Expected time: about 2-3 minutes on idle cores (plus ~5 s to
# build the corpus once; measured: README, Quick start).
# Two processes (torchrun via memo_ext.launch), data-parallel; metrics in runs/demo/metrics.jsonl.
# At the last step it evaluates once (validation loss by position, a small passkey / needle grid)
# and saves a checkpoint (runs/demo/ckpt), and ends with the commands that read them ("next:").
# Run again without --load, it moves the previous outputs to runs/demo.previous first.
# Settings from the environment: TRAIN_ITERS, OUT, DATA_DIR, REQUIRE_LOSS_DROP, MASTER_PORT,
# PYTHON, TORCHRUN (tests/dist/test_demo_script.py runs it for 3 steps). Arguments are further
# trainer flags: `bash scripts/demo_cpu.sh --bf16 --use-distributed-optimizer
# --overlap-grad-reduce` trains in a GPU run's configuration (`make demo DEMO_ARGS="..."`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-"$PYTHON -m memo_ext.launch"}
OUT=${OUT:-runs/demo}
TRAIN_ITERS=${TRAIN_ITERS:-300}
DATA_DIR=${DATA_DIR:-data/demo}
# the check at the end: the loss must fall by more than this many nats
REQUIRE_LOSS_DROP=${REQUIRE_LOSS_DROP:-1.0}

DATA_PREFIX=$("$PYTHON" -m tools.demo_corpus --out-dir "$DATA_DIR")

MODEL_ARGS=(
    --num-layers 4
    --hidden-size 128
    --ffn-hidden-size 352
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --seq-length 256
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 8
    --global-batch-size 16
    --train-iters "$TRAIN_ITERS"
    --lr 3e-3
    --min-lr 3e-4
    --lr-decay-style cosine
    --lr-warmup-iters $((TRAIN_ITERS / 10))  # 30 of the default 300
    --weight-decay 0.1
    --clip-grad 1.0
    --seed 1234
)
DATA_ARGS=(
    --data-path "$DATA_PREFIX"
    --split 98,2,0
    --tokenizer-type ByteTokenizer
    --data-cache-path "$OUT/cache"
)
LOGGING_ARGS=(
    --log-interval 10
    --metrics-file "$OUT/metrics.jsonl"
)
# one evaluation at the end (loss by position; retrieval at the trained length and twice it),
# and the checkpoint the next steps start from
EVAL_ARGS=(
    --eval-interval "$TRAIN_ITERS"
    --eval-iters 2
    --eval-retrieval-lengths 256,512
    --eval-retrieval-samples 2
    --save "$OUT/ckpt"
)

# a fresh run (no --load) moves the previous demo's outputs aside: its checkpoints would
# otherwise stop it (a --save folder of another run), and the next steps read these outputs
if [[ -d "$OUT/ckpt" && " $* " != *" --load "* ]]; then
    rm -rf "$OUT.previous"
    mv "$OUT" "$OUT.previous"
    echo "the previous demo's outputs are in $OUT.previous; this run starts $OUT anew"
fi
mkdir -p "$OUT"
OMP_NUM_THREADS=1 $TORCHRUN --nproc-per-node 2 --master-port "${MASTER_PORT:-29510}" \
    pretrain_gpt_memo.py "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" "${EVAL_ARGS[@]}" "$@"

"$PYTHON" -m tools.summarize_metrics "$OUT/metrics.jsonl" --require-loss-drop "$REQUIRE_LOSS_DROP"

cat <<NEXT
next:
  python -m tools.plot_position_loss $OUT/metrics.jsonl --out $OUT/position_loss.png
  python -m tools.eval_retrieval --load $OUT/ckpt --out $OUT/retrieval --eval-retrieval-lengths 256,512,1024
  python -m tools.convert_hf export --load $OUT/ckpt --out $OUT/hf --family llama
  bash scripts/demo_cpu.sh --load $OUT/ckpt --train-iters $((TRAIN_ITERS + 100)) --use-checkpoint-opt_param-scheduler   # 100 steps more
NEXT
