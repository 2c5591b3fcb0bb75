"""Megatron-LM launch scripts, unchanged: every flag of Megatron-LM's ``pretrain_gpt.py`` is known.

- ``megatron_lm_flags.json``: Megatron-LM's flags as data, extracted from its ``arguments.py`` at
  the commit the file names (``python -m tools.megatron_flags extract``);
- :mod:`.handling`: what this trainer does with each flag that is not one of its own (accepted
  because it is already our behaviour, mapped onto our flags, accepted without effect, or refused
  with the reason);
- :mod:`.translate`: turns a command line written for Megatron-LM into ours before parsing,
  naming every refused flag of it in one message.
"""
