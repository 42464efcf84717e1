#!/usr/bin/env bash
# Launch train.py: bash launch.sh CONFIG [--key=value ...]
#
# Modes (MODE=... overrides the automatic choice):
#   local   one machine: torchrun --standalone, one process per GPU, or NPROC CPU processes (default 2)
#           when there is no GPU.
#   (multi-node modes, SLURM / HyperPod and hostfile, slot in below as further cases of $MODE.)
#
# Environment knobs:
#   NPROC            processes on this machine (default: number of GPUs, else 2)
#   THREADS          CPU threads per process (default: cores / NPROC, at least 1)
#   PYTHON           the interpreter (default: python3 on PATH, e.g. an activated venv)
set -euo pipefail
cd "$(dirname "$0")"

if [ $# -lt 1 ]; then
  echo "usage: bash launch.sh CONFIG [--key=value ...]   e.g. bash launch.sh config/quickstart.py" >&2
  exit 2
fi
if [ ! -f "$1" ]; then
  echo "error: config file '$1' not found (configs live in config/)" >&2
  exit 2
fi

PYTHON=${PYTHON:-python3}
NGPU=0
if command -v nvidia-smi >/dev/null 2>&1; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
MODE=${MODE:-local}

case "$MODE" in
  local)
    if [ "$NGPU" -gt 0 ]; then
      NPROC=${NPROC:-$NGPU}
    else
      NPROC=${NPROC:-2}
      # no GPU: DeepSpeed's CPU accelerator and the gloo backend; split the cores between the ranks
      # so that 2 ranks on 2 cores do not fight over threads.
      export DS_ACCELERATOR=cpu
      CORES=$(nproc)
      THREADS=${THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}
      export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
    fi
    echo "launch.sh: local mode, $NPROC process(es), $NGPU GPU(s)" >&2
    exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train.py "$@"
    ;;
  *)
    echo "error: unknown MODE='$MODE' (known: local)" >&2
    exit 2
    ;;
esac
