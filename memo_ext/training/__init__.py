"""The training loop on megatron-core: what ``pretrain_gpt_memo.py`` runs.

Entry point: :func:`memo_ext.training.loop.train`, called with the ``RunConfig`` that
``memo_ext.arguments.parse_args`` makes of the command line.

Modules:
    resolve: the parsed run resolved against its tokenizer and data (vocabulary, HotSPa layouts).
    initialize: process groups, devices and seeds.
    model: the GPT model of this pipeline stage (MEMO applied to its layer spec), wrapped in DDP.
    optimizer: megatron's optimizer on CUDA, AdamW on the CPU; megatron's LR schedule.
    inputs: the train and validation iterators of a run.
    step: one micro-batch's forward and loss.
    loop: steps, checks, checkpoints and metrics.
    session: what the loop and evaluation share; one global batch through the schedule.
    evaluation: validation loss, loss by position, retrieval accuracy; --skip-train.
    checkpointing, control: atomic sharded checkpoints; early stops and signals.
    metrics: the console line, the metrics file and TensorBoard.
"""
