#!/usr/bin/env bash
# The GPU session in one call: bench_gpu.py (the ring's CUDA ops against fp64 SDPA, attention timings at
# 102,400 tokens, the planner's memory terms against torch.cuda's allocator, bf16 zero2 vs fsdp2 on the same
# masks, the batch's pinned non-blocking copy against the old pageable cast-and-copy, the quickstart's steps;
# the held-out validation over NCCL: its figures need matplotlib, carried in the wheels too; a stop signal on
# the GPU (the stop flag read a step late) and the relaunch against the uninterrupted run; a 2-CPU-rank bf16
# checkpoint resumed on the GPU through the universal checkpoint; the fused attention's TFLOP/s by head dim 32 /
# 64 / 104 / 128 at 102,400 tokens beside plan.py's documented rates; the quickstart eager vs compile=True;
# embed.py on the GPU against embed.py on the CPU).
#
# The lent H200 machine has Python 3.12 and PyTorch but none of deepspeed, zarr, numcodecs, pydantic..., and
# no internet. So the missing wheels are fetched (and deepspeed's built) here, then carried there:
#   here:        bash gpu_check.sh wheels     -> ./wheels (about 40 MB; gitignored)
#   on the GPU:  bash gpu_check.sh            (the device tool: carry=["wheels"]; output in $OUT/gpu_check.log)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if [ "${1:-}" = wheels ]; then
  PIP=${PIP:-.venv/bin/pip}
  mkdir -p wheels
  # the versions requirements.txt resolves to on this machine, as CPython 3.12 manylinux wheels
  "$PIP" download -q --only-binary=:all: --python-version 3.12 --implementation cp --no-deps -d wheels \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 pydantic==2.14.4 \
    pydantic-core==2.50.5 hjson==3.1.0 annotated-types==0.8.0 typing-inspection==0.4.5 \
    matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 pyparsing==3.3.3 \
    pillow==13.0.0 python-dateutil==2.9.0.post0 six==1.17.0
  # deepspeed is published as source only: build a pure-Python wheel (its CUDA ops are built on first use,
  # and gpu-check uses none of them: the optimizer is torch's AdamW)
  DS_BUILD_OPS=0 "$PIP" wheel -q --no-deps --no-build-isolation -w wheels deepspeed==0.19.8
  ls -l wheels
  exit 0
fi

# on the GPU machine: install next to the repository, not into the machine's image
[ -d wheels ] || { echo "error: no ./wheels: run 'bash gpu_check.sh wheels' first and carry wheels" >&2; exit 2; }
"$PY" -m pip install -q --no-index --no-deps --target "$PWD/.gpu_site" wheels/*.whl
export PYTHONPATH="$PWD/.gpu_site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L
# NCCL in this sandbox, alone, first: 10 seconds instead of every check below failing one by one
timeout 60 "$PY" -c "
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29512')
dist.init_process_group('nccl', rank=0, world_size=1)
t = torch.ones(1, device='cuda'); dist.all_reduce(t); torch.cuda.synchronize()
print('nccl ok:', torch.__version__, torch.cuda.get_device_name(0)); dist.destroy_process_group()"
OUT=${OUT:-.}
timeout "${LIMIT:-480}" "$PY" bench_gpu.py 2>&1 | tee "$OUT/gpu_check.log"
