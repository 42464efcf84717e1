#!/usr/bin/env bash
# Launch train.py:   bash launch.sh CONFIG [--key=value ...]
#
# The mode is chosen automatically (MODE=... overrides):
#   local      one machine: torchrun --standalone, one rank per GPU, or NPROC CPU ranks (default 2) without GPU
#   slurm      outside an allocation (sbatch on PATH, nodes > 1 in the config): submits itself with sbatch for
#              the config's node count. Inside the allocation (the batch script, an salloc shell, or an
#              interactive `srun --pty bash`, whose resources the new step shares: --overlap, Slurm >= 20.11):
#              srun starts one `node` task per node (with --auto-resume=1 on SageMaker HyperPod), each
#              writing its own log.
#   hostfile   HOSTFILE=path (one host per line; the first is the head): ssh starts one `node` on each host
#              (a host named 127.0.0.1 or localhost runs here without ssh: how the tests simulate 2 nodes)
#   node       what runs on each node: torchrun with c10d rendezvous on the head node. Under SLURM the head is
#              computed here, inside the step, because HyperPod re-runs the step on replaced nodes.
# DRY_RUN=1: print the environment and the exact command every node would run, for the config's node count,
# then run train.py's validation and the memory planner only (no GPU, no data, no training).
#
# Knobs: NPROC (ranks per node; default: the config's gpus_per_node, else every GPU, else 2 on CPU),
# THREADS (CPU threads per rank), PYTHON (interpreter; default python3 on PATH), PORT (rendezvous, 29500),
# LOG_DIR (per-node logs, default logs/).
set -euo pipefail
# the repository: under sbatch, $0 is a copy in slurmd's spool directory, so the submitting call passes the
# real location down in LAUNCH_ROOT
ROOT=${LAUNCH_ROOT:-$(cd "$(dirname "$0")" && pwd)}
cd "$ROOT"

if [ $# -lt 1 ]; then
  echo "usage: bash launch.sh CONFIG [--key=value ...]   e.g. bash launch.sh config/quickstart.py" >&2
  exit 2
fi
if [ ! -f "$1" ]; then
  echo "error: config file '$1' not found (configs live in config/)" >&2
  exit 2
fi

PYTHON=${PYTHON:-python3}
PORT=${PORT:-29500}
LOG_DIR=${LOG_DIR:-logs}
NGPU=0
if command -v nvidia-smi >/dev/null 2>&1; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi

# ---- what the config asks for: train.py's dry run prints "LAUNCH nodes=N gpus_per_node=G world=W"
if [ "$NGPU" -eq 0 ]; then export DS_ACCELERATOR=cpu; fi
PLAN=$(NPROC=${NPROC:-2} "$PYTHON" train.py "$@" --dry_run=True 2>&1) || { echo "$PLAN" >&2; exit 2; }
NODES=$(echo "$PLAN" | sed -n 's/^LAUNCH nodes=\([0-9]*\).*/\1/p')
GPN=$(echo "$PLAN" | sed -n 's/^LAUNCH .*gpus_per_node=\([0-9]*\).*/\1/p')
NPROC=${NPROC:-$GPN}

# Inside an srun step (a numeric SLURM_STEP_ID: not the batch script, not salloc's interactive step):
IN_STEP=0
if [ -n "${SLURM_JOB_ID:-}" ] && [[ "${SLURM_STEP_ID:-}" =~ ^[0-9]+$ ]] && [ "${SLURM_STEP_ID}" -lt 4294967290 ]; then
  IN_STEP=1
fi
if [ -z "${MODE:-}" ]; then
  # our own srun passes MODE=node; a step with a terminal (srun --pty bash) is a user's interactive shell:
  # start the node steps from there, as from the batch script; any other step is one task per node: a node
  if [ "$IN_STEP" = 1 ] && [ -z "${SLURM_PTY_PORT:-}" ]; then MODE=node
  elif [ -n "${SLURM_JOB_ID:-}" ]; then MODE=slurm                  # inside an allocation: start the steps
  elif [ -n "${HOSTFILE:-}" ]; then MODE=hostfile
  elif [ "$NODES" -gt 1 ] && command -v sbatch >/dev/null 2>&1; then MODE=slurm
  else MODE=local
  fi
fi

# ---- environment for multi-node GPU jobs (AWS P5 / EFA), each with its reason. NCCL_ALGO and NCCL_PROTO are
# deliberately not set: NCCL's tuner picks them per message size and topology better than a fixed choice.
gpu_env() {
  unset DS_ACCELERATOR OMP_NUM_THREADS MKL_NUM_THREADS  # a CPU login node's settings must not follow the job
  export FI_PROVIDER=efa                     # libfabric over the EFA NICs (3200 Gbps per P5 node)
  export FI_EFA_USE_HUGE_PAGE=0              # avoid hugepage exhaustion with many processes per node
  export FI_EFA_SET_CUDA_SYNC_MEMOPS=0       # the aws-ofi-nccl plugin handles CUDA memory ordering itself
  export NCCL_SOCKET_IFNAME='^docker,lo,veth' # bootstrap over the real interface, never docker/loopback
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}      # quiet unless asked; INFO shows the chosen transport (check: EFA)
  export LD_LIBRARY_PATH=/opt/amazon/efa/lib:/opt/amazon/ofi-nccl/lib:${LD_LIBRARY_PATH:-}  # aws-ofi-nccl
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # less fragmentation at 100+ GB working sets
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a failed rank tears the job down instead of hanging the others
  export TORCH_NCCL_DUMP_ON_TIMEOUT=1        # on a hang, each rank dumps its flight recorder...
  export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}  # ...of its last 2000 collectives, to find the stuck one
  export TORCH_NCCL_TRACE_BUFFER_SIZE=$TORCH_FR_BUFFER_SIZE  # (the older name of the same setting)
}
cpu_env() {
  export DS_ACCELERATOR=cpu                  # DeepSpeed's CPU accelerator; train.py uses gloo
  local cores; cores=$(nproc)
  THREADS=${THREADS:-$(( cores / NPROC > 0 ? cores / NPROC : 1 ))}
  export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS  # split the cores between the ranks
}
if [ "$NGPU" -gt 0 ] || { [ "${DRY_RUN:-0}" = "1" ] && [ "$NODES" -gt 1 ]; }; then gpu_env; else cpu_env; fi
if [ "$MODE" = local ] && [ "$NODES" -gt 1 ] && [ "${DRY_RUN:-0}" != "1" ]; then
  echo "error: the config asks for $NODES nodes: run inside a SLURM allocation, where sbatch is, or with HOSTFILE=" >&2
  exit 2
fi

# the command one node runs; HEAD and the node count decide the rendezvous
node_cmd() {  # $1 = head address, then train.py's arguments
  local head=$1
  shift
  echo "$PYTHON -m torch.distributed.run --nnodes=$NODES --nproc_per_node=$NPROC --rdzv_backend=c10d" \
       "--rdzv_endpoint=$head:$PORT --rdzv_id=${SLURM_JOB_ID:-${RDZV_ID:-mae}} --max_restarts=0 train.py $(printf '%q ' "$@")"
}

# the step that starts one node per host of the allocation (slurm mode)
srun_cmd() {  # train.py's arguments
  local extra=""
  if [ -d /opt/sagemaker_cluster ]; then extra+=" --auto-resume=1"; fi  # HyperPod: replace bad nodes, rerun
  # from an interactive step (srun --pty bash), that step holds the allocation's resources: share them
  # (--overlap: Slurm >= 20.11)
  if [ "$IN_STEP" = 1 ]; then extra+=" --overlap"; fi
  # one task per node; each node's output in its own log (%t = node index within the step). --cpu-bind=none:
  # the one task per node starts 8 ranks, which must not share the task's single core
  # --ntasks explicitly: srun would otherwise take the enclosing step's or salloc's SLURM_NTASKS as its own
  echo "srun$extra --nodes=$NODES --ntasks=$NODES --ntasks-per-node=1 --gpus-per-node=$NPROC --cpu-bind=none" \
       "--kill-on-bad-exit=1" \
       "--output=$(printf '%q' "$LOG_DIR/node_%t.log") --export=ALL,MODE=node,LAUNCH_ROOT=$(printf '%q' "$ROOT")" \
       "bash $(printf '%q' "$ROOT/launch.sh") $(printf '%q ' "$@")"
}

if [ "${DRY_RUN:-0}" = "1" ]; then
  echo "launch.sh dry run: $NODES node(s) x $NPROC rank(s) = world $((NODES * NPROC)); mode here: $MODE" \
       "$([ "$MODE" = local ] && [ "$NODES" -gt 1 ] && echo '(no SLURM or HOSTFILE here; on the cluster: slurm)')"
  echo "environment:"
  env | grep -E '^(FI_|NCCL_|TORCH_NCCL|TORCH_FR|PYTORCH_CUDA|DS_ACCELERATOR|OMP_NUM_THREADS)' | sort | sed 's/^/  /'
  if [ "$MODE" = slurm ]; then
    echo "in the allocation: $(srun_cmd "$@")"
  fi
  if [ "$NODES" -gt 1 ]; then
    for ((i = 0; i < NODES; i++)); do
      echo "node $i runs: $(node_cmd "\$HEAD" "$@")"
    done
    echo "(HEAD = the first host of the allocation or hostfile, computed on each node at start)"
  else
    echo "node 0 runs: $PYTHON -m torch.distributed.run --standalone --nproc_per_node=$NPROC train.py $*"
  fi
  echo "validation (train.py --dry_run=True):"
  echo "$PLAN" | grep -v '^LAUNCH' | sed 's/^/  /'
  exit 0
fi

case "$MODE" in
  local)
    echo "launch.sh: local mode, $NPROC rank(s), $NGPU GPU(s)" >&2
    exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train.py "$@"
    ;;
  slurm)
    if [ -z "${SLURM_JOB_ID:-}" ]; then  # not in an allocation yet: submit this script for the config's nodes
      mkdir -p "$LOG_DIR"
      exec sbatch --job-name=seismic-mae --nodes="$NODES" --ntasks-per-node=1 --gpus-per-node="$NPROC" --exclusive \
        --chdir="$ROOT" --output="$LOG_DIR/%x_%j.out" --export=ALL,MODE=slurm,LAUNCH_ROOT="$ROOT" \
        "$ROOT/launch.sh" "$@"
    fi
    if [ "${SLURM_JOB_NUM_NODES:-1}" -lt "$NODES" ]; then
      echo "error: the config asks for $NODES nodes but this allocation has ${SLURM_JOB_NUM_NODES:-1}" >&2
      exit 2
    fi
    mkdir -p "$LOG_DIR"
    if [ "$IN_STEP" = 1 ]; then  # the interactive step's own task layout must not become the new step's
      unset SLURM_NTASKS SLURM_NPROCS SLURM_CPUS_PER_TASK SLURM_TRES_PER_TASK SLURM_NTASKS_PER_NODE
    fi
    eval "exec $(srun_cmd "$@")"
    ;;
  node)
    if [ -z "${HEAD:-}" ]; then  # under SLURM: the head is the first host of the (possibly replaced) node list
      # (sed, not head: head would close the pipe early, and under pipefail scontrol's SIGPIPE kills the step)
      HEAD=$(scontrol show hostnames "${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}" | sed -n 1p)
    fi
    echo "launch.sh: node ${SLURM_NODEID:-${NODE_RANK:-?}} of $NODES, head $HEAD:$PORT, $NPROC rank(s)" >&2
    eval "exec $(node_cmd "$HEAD" "$@")"
    ;;
  hostfile)
    mapfile -t HOSTS < <(grep -v '^\s*#' "$HOSTFILE" | grep -v '^\s*$')
    if [ "${#HOSTS[@]}" -lt "$NODES" ]; then
      echo "error: the config asks for $NODES nodes but $HOSTFILE lists ${#HOSTS[@]} hosts" >&2
      exit 2
    fi
    HEAD=${HOSTS[0]}
    mkdir -p "$LOG_DIR"
    ARGS=$(printf '%q ' "$@")
    pids=()
    for ((i = 0; i < NODES; i++)); do
      host=${HOSTS[$i]}
      cmd="cd $(printf '%q' "$PWD") && MODE=node HEAD=$HEAD NODE_RANK=$i NPROC=$NPROC PORT=$PORT RDZV_ID=${RDZV_ID:-mae$$} PYTHON=$PYTHON bash launch.sh $ARGS"
      # each node in its own process group (setsid), so that stopping it stops its ranks too
      if [ "$host" = "127.0.0.1" ] || [ "$host" = "localhost" ]; then
        setsid bash -c "$cmd" > "$LOG_DIR/node_$i.log" 2>&1 &
      else
        # -tt: closing this ssh hangs up the remote shell, so a stopped node does not leave its ranks running
        setsid ssh -tt -o BatchMode=yes "$host" "$cmd" > "$LOG_DIR/node_$i.log" 2>&1 &
      fi
      pids+=($!)
    done
    # the job fails as soon as one node fails: stop the others rather than let them wait in a collective.
    # Poll (portable to old bash): every node that has ended is reaped with `wait PID` for its exit status.
    rc=0
    while [ "${#pids[@]}" -gt 0 ] && [ "$rc" -eq 0 ]; do
      alive=()
      for p in "${pids[@]}"; do
        if kill -0 "$p" 2>/dev/null; then alive+=("$p"); else wait "$p" || rc=$?; fi
      done
      pids=("${alive[@]+"${alive[@]}"}")
      [ "$rc" -eq 0 ] && [ "${#pids[@]}" -gt 0 ] && sleep 1
    done
    if [ "$rc" -ne 0 ]; then
      echo "error: a node failed (exit $rc); stopping the others. Per-node logs: $LOG_DIR/node_*.log" >&2
      grep -h -E "error|Error|rank" "$LOG_DIR"/node_*.log 2>/dev/null | grep -iE "fail|error" | head -5 >&2 || true
      for p in "${pids[@]}"; do kill -- -"$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done
      wait || true
      exit "$rc"
    fi
    ;;
  *)
    echo "error: unknown MODE='$MODE' (known: local, slurm, node, hostfile)" >&2
    exit 2
    ;;
esac
