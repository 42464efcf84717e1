#!/usr/bin/env bash
# Launch train.py:   bash launch.sh CONFIG [--key=value ...]
# or a survey-wide command on the same ranks:   bash launch.sh -m scripts.predict MODEL SURVEY --out=PATH [...]
#
# The mode is chosen automatically (MODE=local|slurm|hostfile overrides):
#   local      one machine: torchrun --standalone, one rank per GPU, or NPROC CPU ranks (default 2) without GPU
#   slurm      outside an allocation (sbatch on PATH, nodes > 1 in the config): submits itself with sbatch for
#              the config's node count. Inside the allocation (the batch script, an salloc shell, or an
#              interactive `srun --pty bash`, whose resources the new step shares: --overlap, Slurm >= 20.11):
#              ONE srun step starts one node task per node (with --auto-resume=1 on SageMaker HyperPod), each
#              writing its own log.
#   hostfile   HOSTFILE=path (one host per line; the first is the head): ssh starts one node on each host
#              (a host named 127.0.0.1 or localhost runs here without ssh)
#   node       what runs on each node: torchrun with c10d rendezvous on the head node. Under SLURM the head is
#              computed there, inside the step, because HyperPod re-runs the step on replaced nodes.
#
# How a node is started, and why it cannot start anything itself: srun and ssh run `launch.sh --node CONFIG ...`.
# The --node argument, not the environment, makes a node: a node runs torchrun and nothing else, so it can
# never start srun again, whatever it inherits. (It once did: SLURM's `srun --export=ALL,MODE=node` keeps an
# inherited MODE, because with ALL "the user environment takes precedence over any explicitly given
# variables" (srun(1)), and every node started another step, recursively.) What a node needs from here it
# gets on its command line as `env NAME=value`, which sets the value in the task itself: the interpreter and
# the repository as absolute paths resolved here (a remote login shell has another PATH), NPROC, PORT, HEAD.
#
# DRY_RUN=1: print the environment and the exact command every node would run, for the config's node count,
# then run train.py's validation and the memory planner only (no GPU, no data, no training).
#
# A command (-m scripts.predict) has no config: NODES says how many nodes (default 1; inside a SLURM allocation, its
# nodes), and its paths are relative to the repository, as a config's are. It stops as a run does, after its ranks'
# current output tiles, which are kept: the line it ends with (STOPPED_<job> in LOG_DIR while it runs) says so, and
# the same command goes on from them. Its SLURM warning comes STOP_LEAD seconds before the time limit.
#
# Stopping (infra/stop.py's StopRequest): SIGTERM or SIGUSR1 to this script (or, under SLURM, to the job)
# makes the ranks write a checkpoint at the next step boundary and exit; this script then ends with the line of
# out_dir/STOPPED and exit code 75 ("stopped, resumable": run the same command again to continue). Under SLURM
# the step asks for SIGUSR1 stop_lead_s before the time limit (srun --signal; the dry run prints the planner's
# lead), and REQUEUE=1 makes a job stopped by that warning requeue itself (scontrol requeue) to go on in a new
# allocation (a SIGTERM stop, from scancel or preemption, never requeues from here).
# When the ranks fail, the last line repeats the first `error:` line any rank printed (the cause, not the
# traceback of a rank that lost its peer), and this script exits with that rank's code (infra/cli.py: 2 bad input,
# 3 diverged, 4 refused), not torchrun's 1.
#
# Knobs: NPROC (ranks per node; default: the config's gpus_per_node, else every GPU, else 2 on CPU),
# THREADS (CPU threads per rank), PYTHON (interpreter; default python3 on PATH), PORT (rendezvous, 29500),
# LOG_DIR (per-node logs, default logs/), SSH_OPTS (extra ssh options in hostfile mode, e.g. "-p 2222"),
# HYPERPOD (1/0: SageMaker HyperPod's srun --auto-resume; default: 1 where /opt/sagemaker_cluster exists),
# REQUEUE (1: sbatch --requeue, and a job stopped by its time-limit warning requeues itself; default 0); for a
# command: NODES (default 1) and STOP_LEAD (seconds, default 300: longer than a tile takes; predict's JSON line gives
# the seconds of its tiles). Each is checked first: a bad value is one error line.
set -euo pipefail
NODE=0
if [ "${1:-}" = "--node" ]; then NODE=1; shift; fi  # started by launch.sh itself on one node (see above)
# the repository: this file's folder (the sbatch job runs `bash /abs/path/launch.sh`, never a spool copy of it)
ROOT=$(cd "$(dirname "$0")" && pwd)
cd "$ROOT"

if [ $# -lt 1 ]; then
  echo "usage: bash launch.sh CONFIG [--key=value ...]   e.g. bash launch.sh config/quickstart.py" >&2
  echo "       bash launch.sh -m scripts.predict MODEL SURVEY --out=PATH [...]" >&2
  exit 2
fi
# what the ranks run: train.py and a config, or a command that speaks the stop protocol (its module after -m). "$@"
# stays whole (with -m NAME): it is what a node's launch.sh is given again.
COMMAND=0
PROGRAM=train.py
if [ "$1" = "-m" ]; then
  case "${2:-}" in
    scripts.predict) COMMAND=1; PROGRAM="" ;;
    *) echo "error: launch.sh runs train.py (a config) or -m scripts.predict, not '-m ${2:-}'" >&2; exit 2 ;;
  esac
elif [ ! -f "$1" ]; then
  echo "error: config file '$1' not found (configs live in config/)" >&2
  exit 2
fi

# the interpreter as an absolute path, resolved here, so that every node runs this one (the README's venv, say),
# not whatever python3 a remote login shell finds first. Not through symlinks: a venv's python3 is a symlink,
# and resolving it would leave the venv.
PYTHON=${PYTHON:-python3}
if [[ "$PYTHON" != /* ]]; then
  P=$(command -v "$PYTHON") || { echo "error: PYTHON='$PYTHON' is not on PATH: activate the venv or set PYTHON=/abs/path/python3" >&2; exit 2; }
  [[ "$P" == /* ]] || P="$PWD/$P"  # a relative PATH entry
  PYTHON=$P
fi
PORT=${PORT:-29500}
LOG_DIR=${LOG_DIR:-logs}
# the knobs, checked before anything runs: a bad one is one line naming it and what it takes
whole() {  # NAME VALUE LEAST [MOST]: a whole number in range, or the error line
  if ! [[ "$2" =~ ^[0-9]+$ ]] || [ "$((10#$2))" -lt "$3" ] || { [ -n "${4:-}" ] && [ "$((10#$2))" -gt "$4" ]; }; then
    echo "error: $1='$2' must be a whole number >= $3${4:+ and <= $4} (see the knobs at the top of launch.sh)" >&2
    exit 2
  fi
}
if [ -n "${NPROC:-}" ]; then whole NPROC "$NPROC" 1; NPROC=$((10#$NPROC)); fi
if [ -n "${THREADS:-}" ]; then whole THREADS "$THREADS" 1; THREADS=$((10#$THREADS)); fi
if [ "$COMMAND" = 1 ]; then
  if [ -n "${NODES:-}" ]; then whole NODES "$NODES" 1; NODES=$((10#$NODES)); fi
  STOP_LEAD=${STOP_LEAD:-300}
  whole STOP_LEAD "$STOP_LEAD" 1
fi
whole PORT "$PORT" 1 65535
for knob in DRY_RUN REQUEUE HYPERPOD; do
  case "${!knob:-0}" in 0|1) ;; *) echo "error: $knob='${!knob}' must be 1 or 0" >&2; exit 2 ;; esac
done
if [ -n "${HOSTFILE:-}" ] && { [ ! -f "$HOSTFILE" ] || [ ! -r "$HOSTFILE" ] || ! grep -qv '^\s*\(#\|$\)' "$HOSTFILE"; }; then
  echo "error: HOSTFILE='$HOSTFILE' is not a readable file listing hosts (one per line, the first the head; # comments)" >&2
  exit 2
fi
if [ -e "$LOG_DIR" ] && [ ! -d "$LOG_DIR" ]; then
  echo "error: LOG_DIR='$LOG_DIR' is a file, not a folder: set LOG_DIR to a folder for the per-node logs" >&2
  exit 2
fi
NGPU=0
if command -v nvidia-smi >/dev/null 2>&1; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi

# one id for the whole launch, on every node: the rendezvous's, and a command's STOPPED file's
RDZV_ID=${RDZV_ID:-mae$$}
# ---- what the config asks for: train.py's dry run prints "LAUNCH nodes=N gpus_per_node=G world=W"
if [ "$NGPU" -eq 0 ]; then export DS_ACCELERATOR=cpu; fi
if [ "$COMMAND" = 0 ]; then
  # (MAE_LAUNCH_NODE: on a node that launch.sh started, the job's own rank 0 may already hold out_dir's lease, which
  # the dry run checks on a user's launch: infra/lease.py)
  PLAN=$(NPROC=${NPROC:-2} MAE_LAUNCH_NODE=$NODE "$PYTHON" train.py "$@" --dry_run=True 2>&1) ||
    { echo "$PLAN" >&2; exit 2; }
  NODES=$(echo "$PLAN" | sed -n 's/^LAUNCH nodes=\([0-9]*\).*/\1/p')
  GPN=$(echo "$PLAN" | sed -n 's/^LAUNCH .*gpus_per_node=\([0-9]*\).*/\1/p')
  CONFIG_GPUS=$(echo "$PLAN" | sed -n 's/^LAUNCH .*config_gpus=\([0-9]*\).*/\1/p')
  OUT_DIR=$(echo "$PLAN" | sed -n 's/^LAUNCH_OUT_DIR=//p')          # where the ranks write STOPPED
  STOP_LEAD=$(echo "$PLAN" | sed -n 's/^LAUNCH_STOP_LEAD_S=//p')    # seconds: SLURM's warning before the time limit
  STOP_FILE=$OUT_DIR/STOPPED
  ASKS="the config asks for"
  STOPS_AFTER="write a checkpoint after their current step"  # (what a stop does, in this script's lines)
else  # a command: the node count from NODES (or the allocation's), every GPU of a node (or 2 CPU ranks)
  NODES=${NODES:-${SLURM_JOB_NUM_NODES:-1}}
  GPN=$([ "$NGPU" -gt 0 ] && echo "$NGPU" || echo 2)
  CONFIG_GPUS=0
  mkdir -p "$LOG_DIR"
  STOP_FILE=$(cd "$LOG_DIR" && pwd)/STOPPED_${SLURM_JOB_ID:-$RDZV_ID}  # (rank 0 writes it: MAE_STOPPED)
  ASKS="NODES=$NODES asks for"
  STOPS_AFTER="finish their current tile (every tile written is kept)"
fi
NPROC=${NPROC:-$GPN}

# Inside an srun step (a numeric SLURM_STEP_ID: not the batch script, not salloc's interactive step):
IN_STEP=0
if [ -n "${SLURM_JOB_ID:-}" ] && [[ "${SLURM_STEP_ID:-}" =~ ^[0-9]+$ ]] && [ "${SLURM_STEP_ID}" -lt 4294967290 ]; then
  IN_STEP=1
fi
if [ "$NODE" = 1 ]; then
  MODE=node
elif [ -n "${MODE:-}" ]; then
  case "$MODE" in local|slurm|hostfile) ;; *)
    echo "error: unknown MODE='$MODE' (known: local, slurm, hostfile; nodes are started by launch.sh itself)" >&2
    exit 2 ;;
  esac
elif [ "$IN_STEP" = 1 ] && [ -z "${SLURM_PTY_PORT:-}" ]; then
  MODE=node   # a user's own `srun --ntasks-per-node=1 bash launch.sh ...`: one task per node, each a node
elif [ -n "${SLURM_JOB_ID:-}" ]; then
  MODE=slurm  # the batch script, an salloc shell, or an interactive step (srun --pty bash): start the step
elif [ -n "${HOSTFILE:-}" ]; then
  MODE=hostfile
elif [ "$NODES" -gt 1 ] && command -v sbatch >/dev/null 2>&1; then
  MODE=slurm
else
  MODE=local
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
  export TORCH_NCCL_HIGH_PRIORITY=1          # NCCL's streams at high priority: the ring's K/V transfers are not
                                             # queued behind a saturating attention kernel on the compute stream
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
  echo "error: $ASKS $NODES nodes: run inside a SLURM allocation, where sbatch is, or with HOSTFILE=" >&2
  exit 2
fi

# the command one node runs; HEAD and the node count decide the rendezvous
node_cmd() {  # $1 = head address, then train.py's arguments
  local head=$1
  shift
  echo "$PYTHON -m torch.distributed.run --nnodes=$NODES --nproc_per_node=$NPROC --rdzv_backend=c10d" \
       "--rdzv_endpoint=$head:$PORT --rdzv_id=${SLURM_JOB_ID:-$RDZV_ID} --max_restarts=0" \
       "$PROGRAM $(printf '%q ' "$@")"
}

# ---- the ranks of one node, supervised: stop signals reach them, and the last line says how the run ended.
# torchrun runs with SIGTERM and SIGUSR1 ignored, and left out of the signals it handles (PET_SIGNALS_TO_HANDLE: its
# --signals_to_handle, torch >= 2.9). Handling them, it would forward the first and kill the ranks 30 s later,
# mid-checkpoint if need be; and SLURM signals every process of a step, so with this script's forward a rank can get
# one signal twice, and a repeat cuts torchrun's shutdown short. The ranks install their own handlers (they ignore
# repeats); this script forwards each signal to them. (An older torchrun handles SIGTERM whatever it inherits: the
# ranks then have 30 s for their checkpoint. SIGUSR1, SLURM's time-limit warning, stays theirs in every version.)
# Ctrl-C (SIGINT) is a stop too: torchrun ignores it (with it, it would pass it on and kill the ranks 30 s later) and
# so do the ranks until train.py's handler is in place; this script passes each Ctrl-C to the ranks once (they run
# in sessions of their own, out of the terminal's reach): the first stops at the next step boundary with a
# checkpoint, a second at once; either way the last line says where the run stands, and this script dies of the
# SIGINT (exit code 130 to the shell, and a shell loop around it stops too).
run_ranks() {  # the torchrun command line
  rm -f "$STOP_FILE"  # the ranks write it after a stop's checkpoint (a command's tiles) is complete
  # each failing rank appends "CODE LINE": the exit code it ends with and its first line (infra/cli.py note_error)
  MAE_ERROR_FILE=$(mktemp "${TMPDIR:-/tmp}/mae_errors.XXXXXX")
  export MAE_ERROR_FILE MAE_LAUNCHER=launch.sh  # (under launch.sh a rank that stopped cleanly exits 0, not 75)
  if [ "$COMMAND" = 1 ]; then export MAE_STOPPED=$STOP_FILE; fi
  export PET_SIGNALS_TO_HANDLE=SIGHUP,SIGQUIT
  INTS=0
  ( trap '' TERM USR1 INT; exec "$@" ) &
  local pid=$! rc=0 first
  # shellcheck disable=SC2064  # the pid, now
  trap "forward_stop TERM $pid" TERM
  # shellcheck disable=SC2064
  trap "forward_stop USR1 $pid" USR1
  # shellcheck disable=SC2064
  trap "forward_int $pid" INT
  while kill -0 "$pid" 2>/dev/null; do wait "$pid" 2>/dev/null || true; done  # (a trapped signal ends a wait)
  wait "$pid" 2>/dev/null || rc=$?  # bash keeps the status of a child it reaped
  trap - TERM USR1
  trap '' INT  # (from here to the end: the last line is being said)
  # the first rank's line; one that only lost a peer (on another node) comes after any rank's own reason. Its code
  # is what this script ends with: torchrun reports any failed rank as 1, whether bad input (2), a diverged run (3)
  # or a refusal (4)
  first=$(grep -v -m1 'lost a peer' "$MAE_ERROR_FILE" || sed -n 1p "$MAE_ERROR_FILE"); rm -f "$MAE_ERROR_FILE"
  local code=1
  if [[ "$first" =~ ^([0-9]+)\ (.*)$ ]]; then code=${BASH_REMATCH[1]}; first=${BASH_REMATCH[2]}; fi
  if [ -s "$STOP_FILE" ]; then
    echo "launch.sh: $(cat "$STOP_FILE")" >&2
    if [ "$INTS" -gt 0 ]; then return 130; fi
    return 75
  fi
  if [ "$INTS" -gt 0 ]; then
    case "$first" in interrupted*) echo "launch.sh: $first" >&2 ;;
      *) echo "launch.sh: interrupted (Ctrl-C): the ranks stopped at once; ${first:-see above for where they were}" >&2 ;;
    esac
    return 130
  fi
  if [ "$rc" -ne 0 ]; then
    echo "${first:-error: the ranks failed (torchrun exit $rc) and none printed an error: line; the first traceback above is the cause}" >&2
    if [ -n "$first" ]; then rc=$code; fi
  fi
  return "$rc"
}
forward_stop() {  # SIG torchrun-pid: to the ranks, torchrun's children
  echo "launch.sh: SIG$1: the ranks $STOPS_AFTER, then stop" >&2
  pkill "-$1" -P "$2" || true
}
forward_int() {  # torchrun-pid: a Ctrl-C to the ranks
  INTS=$((INTS + 1))
  if [ "$INTS" -eq 1 ]; then
    echo "launch.sh: Ctrl-C: the ranks $STOPS_AFTER, then stop (Ctrl-C again: at once, without one)" >&2
  else
    echo "launch.sh: Ctrl-C again: the ranks stop at once, without a checkpoint of their current steps" >&2
  fi
  pkill -INT -P "$1" || true
}
# how this script ends: with the ranks' code, or, after a Ctrl-C (130), by dying of the SIGINT as shells expect
end_with() {
  if [ "$1" -eq 130 ]; then trap - INT; kill -INT $$; fi
  exit "$1"
}

# GPUs per node that SLURM schedules as gres (`Gres=gpu:h200:8` in slurm.conf), 0 where it schedules none: CPU
# nodes, and clusters (HyperPod among them) whose GPUs are not gres, where --exclusive already gives the job
# the whole node. Asking for gres there is an error ("Invalid generic resource (gres) specification").
# $1 = a node list (inside an allocation), or empty: the partition sbatch will use (SBATCH_PARTITION or the default)
slurm_gres_gpus() {
  local lines g
  if [ -n "${1:-}" ]; then lines=$(sinfo -h -N -n "$1" -o '%G' 2>/dev/null || true)
  else
    lines=$(sinfo -h -o '%P %G' 2>/dev/null || true)
    if [ -n "${SBATCH_PARTITION:-}" ]; then lines=$(echo "$lines" | awk -v p="$SBATCH_PARTITION" '$1 == p {print $2}')
    else lines=$(echo "$lines" | awk '$1 ~ /\*$/ {print $2}'); fi
  fi
  g=$(echo "$lines" | grep -o 'gpu[^,(]*' | sed -n 1p)  # gpu | gpu:8 | gpu:h200:8
  if [ -z "$g" ]; then echo 0; elif [[ "${g##*:}" =~ ^[0-9]+$ ]]; then echo "${g##*:}"; else echo 1; fi
}
# Ask for GPUs only where SLURM schedules them: the config's gpus_per_node, else every gres GPU of a node.
slurm_gpu_flag() {  # $1 = node list or empty, as above
  local n; n=$(slurm_gres_gpus "${1:-}")
  if [ "$n" -gt 0 ]; then echo " --gpus-per-node=$([ "$CONFIG_GPUS" -gt 0 ] && echo "$CONFIG_GPUS" || echo "$n")"; fi
}

# the job launch.sh submits (slurm mode, outside an allocation). --signal without B: every step of the job, not the
# batch shell (which waits for srun), gets SIGUSR1 stop_lead_s before the time limit: the ranks checkpoint and
# stop. (srun's own --signal applies only to an allocation srun makes itself: inside one it is ignored.)
sbatch_flags() {
  echo "--job-name=seismic-mae --nodes=$NODES --ntasks-per-node=1$(slurm_gpu_flag "") --exclusive" \
       "--signal=USR1@$STOP_LEAD$([ "${REQUEUE:-0}" = 1 ] && echo ' --requeue')"
}

# the one step that starts one node per host of the allocation (slurm mode)
srun_cmd() {  # train.py's arguments
  local extra=""
  if [ "${HYPERPOD:-$([ -d /opt/sagemaker_cluster ] && echo 1 || echo 0)}" = 1 ]; then
    extra+=" --auto-resume=1"  # HyperPod's srun: replace a faulty node and run the step again
  fi
  # from an interactive step (srun --pty bash), that step holds the allocation's resources: share them
  # (--overlap: Slurm >= 20.11)
  if [ "$IN_STEP" = 1 ]; then extra+=" --overlap"; fi
  extra+=$(slurm_gpu_flag "${SLURM_JOB_NODELIST:-}")
  # --cpu-bind=none: the one task per node starts NPROC ranks, which must not share the task's single core. Only
  # where a task plugin binds at all (task/affinity, task/cgroup); with task/none srun would warn about it.
  local tp; tp=$(scontrol show config 2>/dev/null | sed -n 's/^TaskPlugin *= *//p')  # (sed reads all: no SIGPIPE)
  if [[ "$tp" == *affinity* || "$tp" == *cgroup* ]]; then extra+=" --cpu-bind=none"; fi
  # one task per node, each node's output in its own log (%t = node index within the step); --ntasks explicitly:
  # srun would otherwise take the enclosing step's or salloc's SLURM_NTASKS as its own
  echo "srun$extra --nodes=$NODES --ntasks=$NODES --ntasks-per-node=1 --kill-on-bad-exit=1" \
       "--output=$(printf '%q' "$LOG_DIR/node_%t.log")" \
       "env HEAD= PYTHON=$(printf '%q' "$PYTHON") NPROC=$NPROC PORT=$PORT NODES=$NODES" \
       "bash $(printf '%q' "$ROOT/launch.sh") --node $(printf '%q ' "$@")"
}

# each node's log ends with its first error line (run_ranks): the first of them, a node's own reason before a line
# that only says it lost a peer on another node (or nothing, status 1: no node said one)
first_node_error() {
  local first
  first=$({ grep -h '^error:' "$LOG_DIR"/node_*.log 2>/dev/null || true; } | { grep -v 'lost a peer' || true; } |
          sed -n 1p)
  first=${first:-$({ grep -h -m1 '^error:' "$LOG_DIR"/node_*.log 2>/dev/null || true; } | sed -n 1p)}
  [ -n "$first" ] && echo "$first"
}
# a command's result, its JSON line (rank 0's, on whichever node it ran), repeated here from the per-node logs
node_logs() { for ((i = 0; i < NODES; i++)); do echo "$LOG_DIR/node_$i.log"; done; }
command_result() { node_logs | xargs grep -h '^{' 2>/dev/null | tail -n 1 || true; }

if [ "${DRY_RUN:-0}" = "1" ]; then
  echo "launch.sh dry run: $NODES node(s) x $NPROC rank(s) = world $((NODES * NPROC)); mode here: $MODE" \
       "$([ "$MODE" = local ] && [ "$NODES" -gt 1 ] && echo '(no SLURM or HOSTFILE here; on the cluster: slurm)')"
  echo "environment:"
  env | grep -E '^(FI_|NCCL_|TORCH_NCCL|TORCH_FR|PYTORCH_CUDA|DS_ACCELERATOR|OMP_NUM_THREADS)' | sort | sed 's/^/  /'
  if [ "$MODE" = slurm ] && [ -z "${SLURM_JOB_ID:-}" ] || { [ "$MODE" = local ] && [ "$NODES" -gt 1 ]; }; then
    echo "submits: sbatch $(sbatch_flags) --export=ALL (the job runs this script again, in the allocation)"
  fi
  if [ "$MODE" = slurm ]; then
    echo "in the allocation: $(srun_cmd "$@")"
  fi
  if [ "$NODES" -gt 1 ]; then
    for ((i = 0; i < NODES; i++)); do
      echo "node $i runs: $(node_cmd "\$HEAD" "$@")"
    done
    echo "(HEAD = the first host of the allocation or hostfile, computed on each node at start)"
  else
    echo "node 0 runs: $PYTHON -m torch.distributed.run --standalone --nproc_per_node=$NPROC $PROGRAM${PROGRAM:+ }$*"
  fi
  if [ "$COMMAND" = 1 ]; then
    echo "(${2}: its inputs and --out are checked when it starts, before any work)"
  else
    echo "validation (train.py --dry_run=True):"
    echo "$PLAN" | grep -v '^LAUNCH' | sed 's/^/  /'
  fi
  exit 0
fi

case "$MODE" in
  local)
    echo "launch.sh: local mode, $NPROC rank(s), $NGPU GPU(s)" >&2
    rc=0
    # shellcheck disable=SC2086  # PROGRAM: train.py, or nothing before a command's -m NAME
    run_ranks "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" $PROGRAM "$@" || rc=$?
    if [ "$COMMAND" = 1 ]; then rm -f "$STOP_FILE"; fi  # (its line was said)
    end_with "$rc"
    ;;
  slurm)
    if [ -z "${SLURM_JOB_ID:-}" ]; then  # not in an allocation yet: submit this script for the config's nodes
      # SLURM installed but not answering (no slurm.conf, no controller): one line, before sbatch's own words (sinfo
      # itself retries a missing slurm.conf for a minute: 10 s is answer enough)
      if ! why=$(timeout 10 sinfo -h -o '%P' 2>&1 >/dev/null); then
        echo "error: SLURM is installed here (sbatch) but does not answer: sinfo says '$(echo "$why" | sed -n 1p)'." \
             "Configure it (slurm.conf, a running slurmctld), or launch without it: HOSTFILE=hosts bash launch.sh ..." \
             "over ssh, or MODE=local on one machine" >&2
        exit 2
      fi
      mkdir -p "$LOG_DIR"
      # the job is a two-line bash script (on stdin: no copy of this file in slurmd's spool, and bash, not sh,
      # reads the quoting) that runs `bash /abs/path/launch.sh ...` in the repository; it finds itself in the
      # allocation and starts the step. --export=ALL: this environment goes with the job (whatever a site's
      # SBATCH_EXPORT says), and nothing in it can make the batch script a node.
      # shellcheck disable=SC2046  # sbatch_flags: words
      exec sbatch $(sbatch_flags) --chdir="$ROOT" --output="$LOG_DIR/%x_%j.out" --export=ALL <<EOF
#!/bin/bash
exec env PYTHON=$(printf '%q' "$PYTHON") MAE_SUBMITTED=1 bash $(printf '%q' "$ROOT/launch.sh") $(printf '%q ' "$@")
EOF
    fi
    if [ "${SLURM_JOB_NUM_NODES:-1}" -lt "$NODES" ]; then
      echo "error: $ASKS $NODES nodes but this allocation has ${SLURM_JOB_NUM_NODES:-1}" >&2
      exit 2
    fi
    mkdir -p "$LOG_DIR"
    if [ "$IN_STEP" = 1 ]; then  # the interactive step's own task layout must not become the new step's
      unset SLURM_NTASKS SLURM_NPROCS SLURM_CPUS_PER_TASK SLURM_TRES_PER_TASK SLURM_NTASKS_PER_NODE
    fi
    rm -f "$STOP_FILE"
    if [ "${MAE_SUBMITTED:-0}" != 1 ]; then
      echo "launch.sh: in an allocation of your own: its time-limit warning is yours to ask for (sbatch or salloc" \
           "--signal=USR1@$STOP_LEAD), else the ranks get only SLURM's SIGTERM at the limit (KillWait to checkpoint)" >&2
    fi
    # srun in the foreground: a SIGTERM (preemption) reaches it directly and it passes it to the step; this shell
    # only waits (a trapped signal runs after srun returns), so the job lives until the ranks have checkpointed
    trap ':' TERM USR1
    rc=0
    eval "$(srun_cmd "$@")" || rc=$?
    if [ -s "$STOP_FILE" ]; then
      echo "launch.sh: $(cat "$STOP_FILE")" >&2
      # requeue after the time-limit warning only: a SIGTERM (scancel, preemption, the limit itself) is not a
      # request to go on (and SLURM requeues preempted jobs itself where PreemptMode=REQUEUE)
      if [ "${REQUEUE:-0}" = 1 ] && [ "$IN_STEP" = 0 ] && grep -q '^stopped by SIGUSR1 after' "$STOP_FILE"; then
        echo "launch.sh: REQUEUE=1: requeueing job $SLURM_JOB_ID; it goes on from where it stopped when it starts" \
             "again" >&2
        scontrol requeue "$SLURM_JOB_ID"
      fi
      if [ "$COMMAND" = 1 ]; then rm -f "$STOP_FILE"; fi  # (its line was said)
      exit 75
    fi
    if [ "$rc" -ne 0 ]; then
      first_node_error >&2 || echo "error: the step failed (srun exit $rc); per-node logs: $LOG_DIR/node_*.log" >&2
    elif [ "$COMMAND" = 1 ]; then
      command_result
    fi
    exit "$rc"
    ;;
  node)
    if [ -z "${HEAD:-}" ]; then  # under SLURM: the head is the first host of the (possibly replaced) node list,
      # at the address SLURM reaches it by (NodeAddr: the node's name unless slurm.conf says otherwise)
      # (sed, not head: head would close the pipe early, and under pipefail scontrol's SIGPIPE kills the step)
      first=$(scontrol show hostnames "${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}" | sed -n 1p)
      # (a node hidden by PrivateData, or a controller briefly away: fall back to the name, never die here)
      HEAD=$({ scontrol -o show node "$first" 2>/dev/null || true; } | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
      HEAD=${HEAD:-$first}
    fi
    echo "launch.sh: node ${SLURM_NODEID:-${NODE_RANK:-?}} of $NODES, head $HEAD:$PORT, $NPROC rank(s)" >&2
    rc=0
    eval "run_ranks $(node_cmd "$HEAD" "$@")" || rc=$?
    end_with "$rc"
    ;;
  hostfile)
    mapfile -t HOSTS < <(grep -v '^\s*#' "$HOSTFILE" | grep -v '^\s*$')
    if [ "${#HOSTS[@]}" -lt "$NODES" ]; then
      echo "error: $ASKS $NODES nodes but $HOSTFILE lists ${#HOSTS[@]} hosts" >&2
      exit 2
    fi
    HEAD=${HOSTS[0]}
    mkdir -p "$LOG_DIR"
    rm -f "$STOP_FILE"
    ARGS=$(printf '%q ' "$@")
    pids=()
    for ((i = 0; i < NODES; i++)); do
      host=${HOSTS[$i]}
      # the node's first line names its launch.sh's pid there (exec keeps it), for passing stop signals on
      cmd="cd $(printf '%q' "$ROOT") && echo \"launch.sh node pid \$\$\" && exec env HEAD=$HEAD NODE_RANK=$i NPROC=$NPROC"
      # (PATH: the interpreter's folder first, as where launch.sh was started: the venv's tools, e.g. the ninja that
      # DeepSpeed's JIT build uses, not those a remote login shell finds first)
      cmd+=" PORT=$PORT RDZV_ID=$RDZV_ID NODES=$NODES PYTHON=$(printf '%q' "$PYTHON")"
      cmd+=" PATH=$(printf '%q' "$(dirname "$PYTHON")"):\$PATH bash $(printf '%q' "$ROOT/launch.sh")"
      cmd+=" --node $ARGS"
      # each node in its own process group (setsid), so that stopping it stops its ranks too
      if [ "$host" = "127.0.0.1" ] || [ "$host" = "localhost" ]; then
        setsid bash -c "$cmd" > "$LOG_DIR/node_$i.log" 2>&1 &
      else
        # -tt: closing this ssh hangs up the remote shell, so a stopped node does not leave its ranks running
        # shellcheck disable=SC2086  # SSH_OPTS: words
        setsid ssh -tt -o BatchMode=yes ${SSH_OPTS:-} "$host" "$cmd" > "$LOG_DIR/node_$i.log" 2>&1 &
      fi
      pids+=($!)
    done
    # stop signals go to every node's launch.sh, which passes them to its ranks: a local node's process group,
    # a remote one's pid over ssh (this script's ssh client is in a session of its own: a signal to it would
    # only end the connection)
    stop_nodes() {  # TERM | USR1 | INT
      echo "launch.sh: SIG$1: passing it to the $NODES nodes (the ranks $STOPS_AFTER)" >&2
      for ((i = 0; i < NODES; i++)); do
        if [ "${HOSTS[$i]}" = "127.0.0.1" ] || [ "${HOSTS[$i]}" = "localhost" ]; then
          kill -s "$1" -- "-${all[$i]}" 2>/dev/null || true
        else
          rpid=$(sed -n 's/^launch.sh node pid \([0-9]*\).*/\1/p' "$LOG_DIR/node_$i.log" | sed -n 1p)
          # shellcheck disable=SC2086  # SSH_OPTS: words
          [ -n "$rpid" ] && ssh -o BatchMode=yes ${SSH_OPTS:-} "${HOSTS[$i]}" "kill -$1 $rpid" >/dev/null 2>&1 &
        fi
      done
    }
    all=("${pids[@]}")
    INTS=0
    trap 'stop_nodes TERM' TERM
    trap 'stop_nodes USR1' USR1
    trap 'INTS=$((INTS + 1)); stop_nodes INT' INT  # (each node's launch.sh: the first a checkpoint, a second at once)
    # the job fails as soon as one node fails: stop the others rather than let them wait in a collective. (A node
    # that stopped on a signal, exit 75, is not a failure: the others are stopping too.)
    # Poll (portable to old bash): every node that has ended is reaped with `wait PID` for its exit status.
    rc=0
    while [ "${#pids[@]}" -gt 0 ] && [ "$rc" -eq 0 ]; do
      alive=()
      for p in "${pids[@]}"; do
        if kill -0 "$p" 2>/dev/null; then alive+=("$p"); continue; fi
        r=0; wait "$p" || r=$?
        # 75: stopped on a signal, as the others will; 130: on a Ctrl-C
        if [ "$r" -ne 0 ] && [ "$r" -ne 75 ] && [ "$r" -ne 130 ]; then rc=$r; fi
      done
      pids=("${alive[@]+"${alive[@]}"}")
      [ "$rc" -eq 0 ] && [ "${#pids[@]}" -gt 0 ] && sleep 1
    done
    trap - TERM USR1
    trap '' INT
    if [ "$rc" -eq 0 ] && [ ! -s "$STOP_FILE" ] && [ "$COMMAND" = 1 ]; then  # (rank 0 on a remote host wrote it
      # there, not here: its node's own last line says the same)
      node_logs | xargs sed -n 's/^launch.sh: \(stopped by .*\)/\1/p' 2>/dev/null | sed -n 1p > "$STOP_FILE"
    fi
    if [ "$rc" -eq 0 ] && [ -s "$STOP_FILE" ]; then
      echo "launch.sh: $(cat "$STOP_FILE")" >&2
      if [ "$COMMAND" = 1 ]; then rm -f "$STOP_FILE"; fi  # (its line was said)
      if [ "$INTS" -gt 0 ]; then end_with 130; fi
      exit 75
    fi
    if [ "$COMMAND" = 1 ]; then rm -f "$STOP_FILE"; command_result; fi
    if [ "$rc" -eq 0 ] && [ "$INTS" -gt 0 ]; then  # stopped at once: node 0's log ends with where the run stands
      echo "$(grep -h -m1 '^launch.sh: interrupted' "$LOG_DIR/node_0.log" 2>/dev/null || echo 'launch.sh: interrupted (Ctrl-C): the nodes stopped at once')" >&2
      end_with 130
    fi
    if [ "$rc" -ne 0 ]; then
      echo "launch.sh: a node failed (exit $rc); stopping the others. Per-node logs: $LOG_DIR/node_*.log" >&2
      for p in "${pids[@]}"; do kill -- -"$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done
      wait || true
      first_node_error >&2 || echo "error: a node failed (exit $rc); per-node logs: $LOG_DIR/node_*.log" >&2
      exit "$rc"
    fi
    ;;
esac
