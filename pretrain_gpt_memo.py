"""GPT pretraining on megatron-core with MEMO and HotSPa: :mod:`memo_ext.commands.pretrain_gpt_memo`
as a script, for ``torchrun`` and ``python -m memo_ext.launch`` (the installed package runs the
same with ``-m memo_ext.commands.pretrain_gpt_memo``). ``python pretrain_gpt_memo.py --help``
lists every flag."""

import sys

from memo_ext.commands.pretrain_gpt_memo import main

if __name__ == "__main__":
    sys.exit(main())
