"""launch.sh: the dry run, a simulated two-node run, and what happens when a rank dies."""
import os
import re
import signal
import subprocess
import time

import pytest

from infra import checkpoint
from conftest import ROOT, job_env, run_train, small_args

pytestmark = pytest.mark.slow  # (tests/README.md: the editing loop's subset leaves it out)


def launch(args, timeout=600, **env):
    path = os.path.dirname(__import__("sys").executable) + os.pathsep + os.environ["PATH"]
    e = job_env(**{"PATH": path, **env})
    return subprocess.run(["bash", "launch.sh", *args], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=timeout)


def test_dry_run_big_context_prints_the_cluster_commands_and_the_fit():
    r = launch(["config/big_context.py"], DRY_RUN="1")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "16 node(s) x 8 rank(s) = world 128" in out
    assert "world 128 = dp 16 x cp 8" in out
    assert out.count("runs: ") == 16
    assert "--nnodes=16 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500" in out
    assert "train.py config/big_context.py" in out
    assert "FI_PROVIDER=efa" in out and "NCCL_ALGO" not in out and "NCCL_PROTO" not in out
    assert "-> fits" in out and "GB of 129.7 GB usable" in out
    # the job launch.sh submits asks for SLURM's warning before the time limit, at the planner's lead
    lead = re.search(r"SIGUSR1 (\d+) s before the time limit", out)
    assert lead and int(lead.group(1)) > 60, out[-2000:]
    assert re.search(rf"^submits: sbatch .* --signal=USR1@{lead.group(1)} ", out, re.M), out[-3000:]


def test_slurm_mode_detection_inside_steps():
    """Our own srun step runs `launch.sh --node` (see the next test); without MODE, a step with a terminal (a user's
    `srun --pty bash`) starts the node steps itself, sharing the interactive step's resources (--overlap); a
    step without one (a user's `srun bash launch.sh` per node) is a node; the batch script, salloc's
    interactive step and a plain salloc shell (no step) start the steps."""
    base = dict(DRY_RUN="1", SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="16")

    def srun_line(out):
        return next((x for x in out.splitlines() if x.startswith("in the allocation: srun ")), "")

    r = launch(["config/big_context.py"], SLURM_STEP_ID="0", SLURM_PTY_PORT="4242", SLURM_NTASKS="1", **base)
    assert r.returncode == 0 and "mode here: slurm" in r.stdout, r.stdout + r.stderr[-2000:]
    line = srun_line(r.stdout)
    assert " --overlap " in line and " --nodes=16 --ntasks=16 --ntasks-per-node=1 " in line, line
    assert " --gpus-per-node" not in line and "MODE" not in line, line  # no GPU gres here; the mode is an argument
    assert line.rstrip().endswith("launch.sh --node config/big_context.py"), line
    r = launch(["config/big_context.py"], SLURM_STEP_ID="0", **base)
    assert r.returncode == 0 and "mode here: node" in r.stdout, r.stdout + r.stderr[-2000:]
    for step in ("4294967294", "4294967291", "4294967290", None):  # batch (old, new), interactive, no step
        r = launch(["config/big_context.py"], **base, **({"SLURM_STEP_ID": step} if step else {}))
        assert r.returncode == 0 and "mode here: slurm" in r.stdout, (step, r.stdout + r.stderr[-2000:])
        line = srun_line(r.stdout)
        assert " --nodes=16 --ntasks=16 " in line and "--overlap" not in line, (step, line)


def test_a_node_never_starts_srun_whatever_its_environment_says():
    """launch.sh --node is what srun and ssh start on each node: it is a node even with everything that once made
    a node start another step (an inherited MODE=slurm, an interactive step's SLURM_PTY_PORT)."""
    r = launch(["--node", "config/big_context.py"], DRY_RUN="1", MODE="slurm", SLURM_JOB_ID="7",
               SLURM_JOB_NUM_NODES="16", SLURM_STEP_ID="3", SLURM_PTY_PORT="4242")
    assert r.returncode == 0 and "mode here: node" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "in the allocation: srun" not in r.stdout
    r = launch(["config/quickstart.py"], MODE="node")
    assert r.returncode == 2 and "unknown MODE='node'" in r.stderr


def test_dry_run_bad_input_is_a_clear_error():
    r = launch(["config/big_context.py", "--cp=3"], DRY_RUN="1")
    assert r.returncode == 2 and "not divisible by cp=3" in r.stderr
    r = launch(["config/big_context.py"], DRY_RUN="1", SLURM_JOB_NUM_NODES="8")
    assert r.returncode == 2 and "nodes=16 but this SLURM allocation has 8" in r.stderr
    r = launch(["config/big_context.py", "--grad_ckpt=False"], DRY_RUN="1")
    assert r.returncode == 2 and "does not fit in GPU memory" in r.stderr and "GB per GPU" in r.stderr


def _pids_of(out_dir):
    r = subprocess.run(["pgrep", "-f", f"train.py.*{out_dir}"], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def _rank_of(pid):
    """A rank process's RANK (torchrun's environment for it), or None."""
    try:
        env = dict(x.split("=", 1) for x in open(f"/proc/{pid}/environ").read().split("\0") if "=" in x)
    except OSError:
        return None
    return env.get("RANK") if env.get("TORCHELASTIC_RUN_ID") else None


def test_a_ranks_own_exit_code_and_error_line_are_launch_shs(tmp_path):
    """Bad input that only the ranks can find (a data path that does not exist: the dry run reads no data) ends the
    ranks with exit code 2, which torchrun reports as 1 whatever the rank's code; launch.sh ends with the rank's own
    code (recorded with its line in MAE_ERROR_FILE), and the rank's error line is the last line, below torchrun's
    report."""
    args = ["config/quickstart.py", f"--data_paths=['{tmp_path / 'missing.mdio'}']", "--make_synthetic=False",
            f"--out_dir={tmp_path / 'run'}"]
    r = launch(args, NPROC="2")
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert "ChildFailedError" in r.stderr, r.stderr[-3000:]  # (torchrun did see a failed rank, and said so above)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert last.startswith("error: ") and f"'{tmp_path / 'missing.mdio'}' does not exist" in last, last
    # the same through a node (HOSTFILE: a host named 127.0.0.1 runs here, without ssh): the node's launch.sh ends
    # with the rank's code, and this one with the node's code and the rank's line, last
    (tmp_path / "hosts").write_text("127.0.0.1\n")
    r = launch(args, NPROC="2", HOSTFILE=str(tmp_path / "hosts"), LOG_DIR=str(tmp_path / "logs"), PORT="29671")
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert last.startswith("error: ") and f"'{tmp_path / 'missing.mdio'}' does not exist" in last, last


def test_killed_rank_stops_the_job_and_relaunch_resumes(small_store, tmp_path):
    args = ["config/quickstart.py", *small_args(small_store, tmp_path, max_steps=400, ckpt_interval=5),
            "--make_synthetic=False"]
    e = job_env(PATH=os.path.dirname(__import__("sys").executable) + os.pathsep + os.environ["PATH"], NPROC="2")
    p = subprocess.Popen(["bash", "launch.sh", *args], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not checkpoint.complete_checkpoints(str(tmp_path / "ckpt")):
        time.sleep(0.5)
    assert checkpoint.complete_checkpoints(str(tmp_path / "ckpt")), "no checkpoint was written"
    workers = _pids_of(tmp_path)
    assert len(workers) >= 2, workers
    victim = next(w for w in workers if _rank_of(w) == "0")  # rank 0, killed without a word (kill -9, an OOM kill)
    os.kill(victim, signal.SIGKILL)
    t = time.time()
    out, err = p.communicate(timeout=120)
    assert time.time() - t < 60, "the job did not stop within 60 s"
    assert p.returncode != 0
    # torchrun's summary names the failed rank and how it died; the last line names it too, not the rank that noticed
    assert re.search(r"rank\s*:\s*\d+ \(local_rank", err) and ("Signal 9" in err or "SIGKILL" in err), err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: rank 0 (pid {victim}) died first, without an error of its own") and \
        "rank 1 lost it" in last, last
    done = checkpoint.complete_checkpoints(str(tmp_path / "ckpt"))
    r = launch([*args, "--max_steps=" + str(done[-1][0] + 3)], NPROC="2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"(step {done[-1][0]})" in r.stdout


def test_death_during_checkpoint_write_leaves_the_previous_one_loadable(small_store, tmp_path):
    args = ["config/quickstart.py", *small_args(small_store, tmp_path, max_steps=6, ckpt_interval=2),
            "--make_synthetic=False"]
    # rank 1 dies after writing its shard of step 4, before the checkpoint is complete (a hook from outside)
    r = run_train(args, nproc=2, script="tests/train_hooks.py", env=job_env(MAE_FAULT="die_in_checkpoint:4:1"))
    assert r.returncode != 0 and "exitcode  : 17" in r.stderr, r.stderr[-3000:]
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path / "ckpt"))] == [2]
    assert (tmp_path / "ckpt" / "step_0000004").exists()  # the partial write is there, not marked complete
    again = launch(args, NPROC="2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(step 2)" in again.stdout  # resumed from the last complete checkpoint
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path / "ckpt"))] == [4, 6]
    # going on with 1 rank and the same micro_batch (half the global batch): refused by launch.sh's pre-flight
    # (train.py --dry_run) before torchrun starts any rank, the reason as the last line of the output
    log_before = (tmp_path / "log.jsonl").read_text()
    one = launch([*args, "--max_steps=8"], NPROC="1")
    assert one.returncode == 2, one.stderr[-3000:]
    last = (one.stdout + one.stderr).strip().splitlines()[-1]
    assert last.startswith("error: checkpoint") and "was trained with global batch 4" in last, last
    assert "torch.distributed" not in one.stdout + one.stderr and (tmp_path / "log.jsonl").read_text() == log_before
