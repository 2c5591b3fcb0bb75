"""A modeled GPU on a CPU machine: the program's CUDA branch run on an emulated device, timed.

``device`` is the device itself (fake tensors on ``cuda``, stand-in streams and events, NCCL as a
``cuda``-only process group, the pluggable allocator, pinned host memory), ``timing`` its clock
(every kernel, copy and collective given the time the device preset and calibration say),
``trace`` the step timeline a run leaves, ``process`` / ``run`` put it into every process of a
command, and ``memo-simulate`` (``memo_ext.commands.simulate``) is the user's command. The
``runtime`` module loads the C++ half before torch.

Nothing in the package imports this one but the commands: a training run on a real GPU never
loads it.
"""
