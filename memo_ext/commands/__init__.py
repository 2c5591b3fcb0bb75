"""The installed commands (``[project.scripts]`` in ``pyproject.toml``), one module each: its flags,
its ``main`` and nothing a library caller needs. ``pretrain_gpt_memo`` is the trainer, run under
``torchrun -m``; the rest are tools (``memo-estimate``, ``memo-compare``, …), each also
``python -m tools.NAME`` in the repository."""
