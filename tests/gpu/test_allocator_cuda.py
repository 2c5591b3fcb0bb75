"""The allocator core behind torch's pluggable CUDA allocator, on a real GPU. Skipped without CUDA.

The pluggable allocator must be installed before CUDA is initialised, so the program runs in its
own process: record a forward pass, give every recorded block its own range (a valid plan, no
reuse), serve it, and compare with the recorded run; and run out of memory under the core.
"""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCRIPT = r"""
import json
import torch
from memo_ext.allocator.core import AllocatorCore
from memo_ext.allocator.cuda import install_cuda_allocator

core = AllocatorCore()
install_cuda_allocator(core)  # the torch shim's memo_cuda_alloc / memo_cuda_free

generator = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(512, 256, device="cuda", generator=generator)
w1 = torch.randn(256, 1024, device="cuda", generator=generator)
w2 = torch.randn(1024, 256, device="cuda", generator=generator)

def forward():
    # Forward only: a CUDA backward runs on autograd's device thread, not the pass's owner.
    return torch.nn.functional.gelu(x @ w1).matmul(w2).square().sum(dim=1)

forward()  # warm up (cuBLAS workspaces)
torch.cuda.synchronize()
core.set_mode("record")
core.begin_pass(0)
recorded_out = forward()
core.end_pass()
torch.cuda.synchronize()
_, events = core.recorded()
allocs = [(i, size) for kind, i, size in events if kind == "alloc"]
freed = {i: k for k, (kind, i, _) in enumerate(events) if kind == "free"}
offsets, top = [], 0
for _, size in allocs:
    offsets.append(top)
    top += size
alloc_at = [k for k, (kind, _, _) in enumerate(events) if kind == "alloc"]
core.reserve_arena(top)
core.load_plan(0, [s for _, s in allocs], offsets, alloc_at,
               [freed.get(i, -1) for i, _ in allocs], top)
core.set_mode("serve")
core.reset_stats()
backend_allocs = []
for _ in range(4):
    core.begin_pass(0)
    out = forward()
    core.end_pass()
    torch.cuda.synchronize()
    same = bool(torch.equal(out, recorded_out))
    in_arena = 0 <= out.data_ptr() - core.arena_base() < core.arena_bytes()
    del out
    backend_allocs.append(core.stats()["fallback_backend_allocs"])
stats = core.stats()
print(json.dumps({"stats": stats, "same": same, "in_arena": in_arena, "planned": len(allocs),
                  "backend_allocs": backend_allocs}), flush=True)
"""


def test_a_recorded_cuda_forward_is_served_from_the_arena():
    # -X faulthandler: a crash in native code names the script's line it died on
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", SCRIPT], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    stats = out["stats"]
    assert out["planned"] > 2 and stats["hits"] == stats["requests"] == 4 * out["planned"]
    assert out["same"] and out["in_arena"]
    # After the first step (whose comparison may take a new block) nothing reaches cudaMalloc.
    assert len(set(out["backend_allocs"][1:])) == 1


OUT_OF_MEMORY = r"""
import json
import sys
import torch
from memo_ext.allocator.core import AllocatorCore, AllocatorCoreError
from memo_ext.allocator.cuda import install_cuda_allocator

core = AllocatorCore()
install_cuda_allocator(core)
kept = torch.ones(1024, device="cuda")  # a cached block, which the core hands back before failing
del kept
try:  # the core alone first (no torch, no raise in C++): a crash below it is the CUDA runtime's
    core.alloc(1 << 50)
    direct = "no error"
except AllocatorCoreError as err:
    direct = str(err)
print("the core alone:", direct, file=sys.stderr, flush=True)
try:  # far past the device: the core returns NULL, the shim raises (no illegal address)
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    oom = "no error"
except torch.OutOfMemoryError as err:
    oom = str(err)
usable = bool(torch.ones(4, device="cuda").sum().item() == 4)  # no sticky CUDA error after it
print(json.dumps({"direct": direct, "oom": oom, "usable": usable}), flush=True)
"""


def test_running_out_under_the_core_is_torch_out_of_memory():
    """The shim raises c10::OutOfMemoryError from the pluggable allocator's ``alloc``: torch
    turns it into torch.OutOfMemoryError, and CUDA stays usable."""
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", OUT_OF_MEMORY], capture_output=True,
        text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "could not allocate" in out["direct"]
    assert f"Tried to allocate {1 << 50} B" in out["oom"] and out["usable"]
