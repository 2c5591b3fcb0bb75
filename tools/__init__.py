"""The installed commands (``memo_ext.commands``) as ``python -m tools.NAME`` in the repository,
and two scripts that keep the repository's own files current: ``flag_reference`` (docs/flags.md's
flag tables) and ``megatron_flags`` (the table of Megatron-LM's flags, read from its source)."""
