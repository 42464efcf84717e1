"""launch.sh: the dry run, a simulated two-node run, and what happens when a rank dies."""
import os
import re
import signal
import subprocess
import time

import train
from conftest import ROOT, job_env, read_log, small_args


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


def test_slurm_mode_detection_inside_steps():
    """Our own srun step is MODE=node (launch.sh exports it); without MODE, a step with a terminal (a user's
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
    assert "MODE=node" in line and line.rstrip().endswith("launch.sh config/big_context.py"), line
    r = launch(["config/big_context.py"], SLURM_STEP_ID="0", **base)
    assert r.returncode == 0 and "mode here: node" in r.stdout, r.stdout + r.stderr[-2000:]
    for step in ("4294967294", "4294967291", "4294967290", None):  # batch (old, new), interactive, no step
        r = launch(["config/big_context.py"], **base, **({"SLURM_STEP_ID": step} if step else {}))
        assert r.returncode == 0 and "mode here: slurm" in r.stdout, (step, r.stdout + r.stderr[-2000:])
        line = srun_line(r.stdout)
        assert " --nodes=16 --ntasks=16 " in line and "--overlap" not in line, (step, line)


def test_dry_run_bad_input_is_a_clear_error():
    r = launch(["config/big_context.py", "--cp=3"], DRY_RUN="1")
    assert r.returncode == 2 and "not divisible by cp=3" in r.stderr
    r = launch(["config/big_context.py"], DRY_RUN="1", SLURM_JOB_NUM_NODES="8")
    assert r.returncode == 2 and "nodes=16 but this SLURM allocation has 8" in r.stderr
    r = launch(["config/big_context.py", "--grad_ckpt=False"], DRY_RUN="1")
    assert r.returncode == 2 and "does not fit in GPU memory" in r.stderr and "GB per GPU" in r.stderr


def test_two_nodes_from_a_hostfile_match_one_node(small_store, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n127.0.0.1\n")
    common = small_args(small_store, tmp_path / "x", max_steps=10, cp=2)
    two = launch(["config/quickstart.py", *common, f"--out_dir={tmp_path / 'two'}", "--make_synthetic=False",
                  "--nodes=2"], HOSTFILE=str(hosts), NPROC="2", LOG_DIR=str(tmp_path / "logs"), PORT="29631")
    assert two.returncode == 0, two.stderr[-3000:]
    assert (tmp_path / "logs" / "node_0.log").exists() and (tmp_path / "logs" / "node_1.log").exists()
    assert_matches_one_node(common, tmp_path, tmp_path / "two", 10)


def assert_matches_one_node(common, tmp_path, multi_dir, steps):
    """The same run launched as one node with 4 ranks follows the same losses (within 1e-5)."""
    one = launch(["config/quickstart.py", *common, f"--out_dir={tmp_path / 'one'}", "--make_synthetic=False"],
                 NPROC="4")
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = read_log(tmp_path / "one"), read_log(multi_dir)
    assert len(a) == len(b) == steps
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (a, b)


def _pids_of(out_dir):
    r = subprocess.run(["pgrep", "-f", f"train.py.*{out_dir}"], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def test_killed_rank_stops_the_job_and_relaunch_resumes(small_store, tmp_path):
    args = ["config/quickstart.py", *small_args(small_store, tmp_path, max_steps=400, ckpt_interval=5),
            "--make_synthetic=False"]
    e = job_env(PATH=os.path.dirname(__import__("sys").executable) + os.pathsep + os.environ["PATH"], NPROC="2")
    p = subprocess.Popen(["bash", "launch.sh", *args], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not train.complete_checkpoints(str(tmp_path / "ckpt")):
        time.sleep(0.5)
    assert train.complete_checkpoints(str(tmp_path / "ckpt")), "no checkpoint was written"
    workers = _pids_of(tmp_path)
    assert len(workers) >= 2, workers
    victim = max(workers)  # a worker (the launcher started before them)
    os.kill(victim, signal.SIGKILL)
    t = time.time()
    out, err = p.communicate(timeout=120)
    assert time.time() - t < 60, "the job did not stop within 60 s"
    assert p.returncode != 0
    # torchrun's summary names the failed rank and how it died
    assert re.search(r"rank\s*:\s*\d+ \(local_rank", err) and ("Signal 9" in err or "SIGKILL" in err), err[-3000:]
    done = train.complete_checkpoints(str(tmp_path / "ckpt"))
    r = launch([*args, "--max_steps=" + str(done[-1][0] + 3)], NPROC="2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"(step {done[-1][0]})" in r.stdout


def test_death_during_checkpoint_write_leaves_the_previous_one_loadable(small_store, tmp_path):
    args = ["config/quickstart.py", *small_args(small_store, tmp_path, max_steps=6, ckpt_interval=2),
            "--make_synthetic=False"]
    r = launch(args, NPROC="2", MAE_FAULT="die_in_checkpoint:4:1")
    assert r.returncode != 0
    assert [s for s, _ in train.complete_checkpoints(str(tmp_path / "ckpt"))] == [2]
    assert (tmp_path / "ckpt" / "step_0000004").exists()  # the partial write is there, not marked complete
    again = launch(args, NPROC="2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(step 2)" in again.stdout  # resumed from the last complete checkpoint
    assert [s for s, _ in train.complete_checkpoints(str(tmp_path / "ckpt"))] == [4, 6]


def test_slurm_mode_end_to_end_with_stand_in_slurm_commands(small_store, tmp_path):
    """No SLURM here: tests/slurm_shim has stand-ins for sbatch, srun and scontrol that run every 'node' on
    this machine with the variables SLURM would set. launch.sh goes the whole way: sbatch for the config's
    node count, srun one task per node inside the allocation, head computed in the step, torchrun per node."""
    shim = os.path.join(ROOT, "tests", "slurm_shim")
    common = small_args(small_store, tmp_path / "x", max_steps=6, cp=2)
    r = launch(["config/quickstart.py", *common, f"--out_dir={tmp_path / 'slurm'}", "--make_synthetic=False",
                "--nodes=2"], NPROC="2", LOG_DIR=str(tmp_path / "logs"), PORT="29641",
               PATH=shim + os.pathsep + os.path.dirname(__import__("sys").executable) + os.pathsep + os.environ["PATH"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Submitted batch job" in r.stdout
    logs = sorted(os.listdir(tmp_path / "logs"))
    assert "node_0.log" in logs and "node_1.log" in logs, logs
    assert "node 1 of 2, head 127.0.0.1:29641" in (tmp_path / "logs" / "node_1.log").read_text()
    assert_matches_one_node(common, tmp_path, tmp_path / "slurm", 6)
