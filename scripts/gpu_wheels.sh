#!/usr/bin/env bash
# Downloads, on a CPU machine with PyPI, the Python 3.12 wheels the lent GPU machine lacks, into
# wheels/ (git-ignored), for scripts/gpu_check.sh to install offline. That machine has torch 2.11
# (CUDA 13), numba, einops, psutil, tokenizers, tensorboard and matplotlib; it lacks
# megatron-core, the planner's solvers (ortools, highspy, with ortools' own dependencies) and
# ninja (the allocator's torch shim is compiled on first use).
# Everything carried to it must stay under 64 MiB: the script fails if the wheels are larger.
# Hardware: any Linux machine with pip and network access to PyPI. Expected time: < 1 minute.
#   bash scripts/gpu_wheels.sh            # then carry wheels/ with the GPU run
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-wheels}
LIMIT_MIB=${LIMIT_MIB:-60}  # of the 64 MiB that may travel; the working tree takes the rest

# the versions this project is tested with on CPU; --no-deps: the GPU machine has the rest
# (numpy, typing-extensions, python-dateutil); ortools' CP-SAT imports pandas
WHEELS=(
    megatron-core==0.16.1 ortools==9.15.6755 highspy==1.16.0
    absl-py immutabledict "protobuf>=6.33.1,<6.34" pandas==3.1.1 tzdata
    ninja  # torch.utils.cpp_extension builds the allocator's torch shim with it
)
rm -rf "$DEST" && mkdir -p "$DEST"
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    --dest "$DEST" "${WHEELS[@]}"
ls -l "$DEST"
TOTAL_KIB=$(du -sk "$DEST" | cut -f1)
echo "wheels: $((TOTAL_KIB / 1024)) MiB in $DEST"
if (( TOTAL_KIB > LIMIT_MIB * 1024 )); then
    echo "gpu_wheels.sh: error: $DEST holds $((TOTAL_KIB / 1024)) MiB, over $LIMIT_MIB MiB" >&2
    exit 1
fi
