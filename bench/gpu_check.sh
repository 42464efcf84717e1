#!/usr/bin/env bash
# The GPU check in one call on a single-GPU machine without internet access: bench/gpu.py, each section in its own
# process with its own timeout, each section's JSON line appended to $OUT/gpu_check.jsonl as it ends, the whole
# log in $OUT/gpu_check.log, the summary in $OUT/gpu_check_summary.json (and as the log's last line).
#
# Such a machine typically has Python and PyTorch but not deepspeed, zarr or numcodecs, and cannot download them.
# So the wheels are fetched (and deepspeed's built) on a machine with internet and copied with the repository:
#   with internet:  bash bench/gpu_check.sh wheels     -> ./wheels (about 40 MB; gitignored)
#   on the GPU:     bash bench/gpu_check.sh [--budget_s=480] [--only=ops,self_ring]   (arguments go to bench/gpu.py)
# There only the wheels whose package the machine lacks (or has in an older version) are installed, beside the
# repository (./.gpu_site), never over the machine's own packages.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository's root: wheels/ and .gpu_site/ live there
PY=${PYTHON:-python3}

if [ "${1:-}" = wheels ]; then
  PIP=${PIP:-.venv/bin/pip}
  mkdir -p wheels
  # the versions requirements.txt resolves to on the development machine, as CPython 3.12 manylinux wheels
  "$PIP" download -q --only-binary=:all: --python-version 3.12 --implementation cp --no-deps -d wheels \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 pydantic==2.14.4 \
    pydantic-core==2.50.5 hjson==3.1.0 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  # deepspeed is published as source only: build a pure-Python wheel (its CUDA ops are built on first use,
  # and the check uses none of them: the optimizer is torch's AdamW)
  DS_BUILD_OPS=0 "$PIP" wheel -q --no-deps --no-build-isolation -w wheels deepspeed==0.19.8
  ls -l wheels
  exit 0
fi

[ -d wheels ] || { echo "error: no ./wheels: run 'bash bench/gpu_check.sh wheels' on a machine with internet first" >&2; exit 2; }
# which wheels does this machine lack? (by distribution name and version; an older installed version is shadowed)
NEED=$("$PY" - wheels/*.whl <<'EOF'
import importlib.metadata as md, os, sys
from packaging.version import Version
for w in sys.argv[1:]:
    name, version = os.path.basename(w).split("-")[:2]
    try:
        if Version(md.version(name)) >= Version(version):
            continue
    except md.PackageNotFoundError:
        pass
    print(w)
EOF
)
if [ -n "$NEED" ]; then
  echo "installing into .gpu_site: $(echo $NEED | xargs -n1 basename | tr '\n' ' ')"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$PWD/.gpu_site" $NEED
fi
export PYTHONPATH="$PWD/.gpu_site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_NCCL_HIGH_PRIORITY=1  # as launch.sh's GPU environment
nvidia-smi -L || true
OUT=${OUT:-.}
mkdir -p "$OUT"
"$PY" -m bench.gpu --out="$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
