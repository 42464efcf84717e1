"""Stop signals (infra/stop.py's StopRequest, launch.sh): SIGTERM or SIGUSR1 mid-run becomes a complete checkpoint at
the step where the run stopped and exit code 75; the relaunch continues on the uninterrupted run's trajectory.
When ranks fail, launch.sh's last line is the first rank's `error:` line. And the launches an operator gets wrong: a
second launch into a running out_dir is refused (its lease, infra/lease.py); a `kill -9` of the launcher takes its
ranks with it and frees the lease, and the relaunch resumes."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from infra import checkpoint

from infra import stop
from conftest import ROOT, job_env, read_log, read_val, run_train, small_args

pytestmark = pytest.mark.slow  # (tests/README.md: the editing loop's subset leaves it out)

# 60 steps of 2 micro steps; no checkpoint but the end's unless a stop asks for one; validation every 10 steps
ARGS = dict(max_steps=60, grad_accum=2, ckpt_interval=1000, eval_interval=10)


def launch_env(**extra):
    return job_env(PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], NPROC="2", **extra)


def launch_args(store, out_dir, **kw):
    return ["config/quickstart.py", *small_args(store, out_dir, **{**ARGS, **kw}), "--make_synthetic=False"]


@pytest.fixture(scope="module")
def reference(small_store, tmp_path_factory):
    """The uninterrupted 2-rank run (plain torchrun): its training records and validation losses."""
    d = tmp_path_factory.mktemp("uninterrupted")
    r = run_train(launch_args(small_store, d), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_log(d), dict(read_val(d))


def same_trajectory(reference, out_dir):
    """Every step's last record (steps logged twice: before a stop and after the resume) equals the reference."""
    ref_log, ref_val = reference
    got = {r["step"]: r for r in read_log(out_dir)}
    assert sorted(got) == [r["step"] for r in ref_log]
    for a in ref_log:
        b = got[a["step"]]
        assert a["lr"] == b["lr"] and abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a, b)
    val = dict(read_val(out_dir))
    assert sorted(val) == sorted(ref_val) == list(range(0, ARGS["max_steps"] + 1, 10))
    for k in ref_val:
        assert abs(val[k] - ref_val[k]) <= 1e-6 * abs(ref_val[k]), (k, val, ref_val)


def run_until_steps(store, out_dir, n, **kw):
    """Start `bash launch.sh` (own session, output in out_dir.log) and return it once log.jsonl has n steps."""
    out = open(f"{out_dir}.log", "w")
    p = subprocess.Popen(["bash", "launch.sh", *launch_args(store, out_dir, **kw)], cwd=ROOT, env=launch_env(),
                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline and p.poll() is None:
        if os.path.exists(out_dir / "log.jsonl") and len(read_log(out_dir)) >= n:
            return p
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach {n} steps: {open(f'{out_dir}.log').read()[-3000:]}")


def job_processes(out_dir):
    """The pids of every process of the job: launch.sh, torchrun, the ranks (their command lines name out_dir)."""
    r = subprocess.run(["pgrep", "-f", "--", f"--out_dir={out_dir}( |$)"], capture_output=True, text=True)
    return [int(x) for x in r.stdout.split()]


def check_stopped(p, out_dir, sig, before):
    """The run stopped cleanly: exit 75 (a Ctrl-C: launch.sh died of SIGINT, the shell's 130), the reason last, a
    complete checkpoint at the stop step (besides the earlier ones, `before`: keep_ckpts is 2), STOPPED."""
    rc = p.wait(timeout=120)
    out = open(f"{out_dir}.log").read()
    code, how = (stop.INTERRUPTED, "interrupted by Ctrl-C") if sig == "SIGINT" else (stop.RESUMABLE, "stopped")
    assert rc == (-signal.SIGINT if sig == "SIGINT" else code), out[-3000:]
    done = checkpoint.complete_checkpoints(str(out_dir / "ckpt"))
    steps = [r["step"] for r in read_log(out_dir)]
    n = steps[-1] + 1  # steps done
    assert [s for s, _ in done] == [*before, n] and 0 < n < ARGS["max_steps"], (done, steps)  # not multiples of 1000
    last = out.strip().splitlines()[-1]
    assert last == (f"launch.sh: stopped by {sig} after {n} steps: checkpoint {out_dir}/ckpt/step_{n:07d} is "
                    f"complete; run the same command again to continue (exit code {code}: {how}, resumable)"), last
    assert (out_dir / "STOPPED").read_text().strip() == last[len("launch.sh: "):]
    assert "Traceback" not in out and "FAILED" not in out, out[-3000:]  # torchrun saw the ranks end normally
    return n


def resume_to_the_end(store, out_dir, n):
    r = subprocess.run(["bash", "launch.sh", *launch_args(store, out_dir)], cwd=ROOT, env=launch_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {out_dir}/ckpt/step_{n:07d} (step {n})" in r.stdout, r.stdout[-2000:]
    assert not (out_dir / "STOPPED").exists()


def test_sigterm_sigusr1_and_ctrl_c_each_checkpoint_where_they_stop_and_the_run_ends_on_the_uninterrupted_trajectory(
        small_store, tmp_path, reference):
    """One run stopped four times, each relaunch resuming from the stop before:
    - SIGTERM to launch.sh (which forwards it to the ranks);
    - SIGUSR1 the way SLURM sends it: to every process of the job (launch.sh, torchrun, each rank), so that the ranks
      get it twice (from SLURM and from launch.sh);
    - Ctrl-C as a terminal sends it (SIGINT to launch.sh's process group: launch.sh and torchrun; the ranks are in
      sessions of their own): the STOPPED line last, no traceback, launch.sh dies of the SIGINT (the shell's 130);
    - SIGINT to launch.sh alone, the same.
    Each stop is one checkpoint at its step (keep_ckpts 2: with the one before); the last relaunch finishes, and the
    whole trajectory (training and validation losses) equals the uninterrupted run's."""
    d = tmp_path / "run"
    p = run_until_steps(small_store, d, 5)
    os.kill(p.pid, signal.SIGTERM)
    stops = [check_stopped(p, d, "SIGTERM", [])]
    p = run_until_steps(small_store, d, stops[-1] + 5)  # the relaunch resumes from there (the log grows past it)
    pids = job_processes(d)
    assert p.pid in pids and len(pids) >= 4, pids  # launch.sh, torchrun, 2 ranks
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    stops.append(check_stopped(p, d, "SIGUSR1", stops[-1:]))
    assert f"resumed from {d}/ckpt/step_{stops[0]:07d} (step {stops[0]})" in open(f"{d}.log").read()
    p = run_until_steps(small_store, d, stops[-1] + 5)
    os.killpg(p.pid, signal.SIGINT)
    stops.append(check_stopped(p, d, "SIGINT", stops[-1:]))
    assert "launch.sh: Ctrl-C: the ranks write a checkpoint after their current step" in open(f"{d}.log").read()
    p = run_until_steps(small_store, d, stops[-1] + 5)
    os.kill(p.pid, signal.SIGINT)
    stops.append(check_stopped(p, d, "SIGINT", stops[-1:]))
    resume_to_the_end(small_store, d, stops[-1])
    same_trajectory(reference, d)


def test_a_second_ctrl_c_stops_at_once_and_names_the_newest_checkpoint(small_store, tmp_path, reference):
    """Step 12 takes a minute (a hook); Ctrl-C reaches the ranks as launch.sh passes it on (each rank, once), then
    again: they stop at once, with no checkpoint of steps 10-11, and quietly (no traceback); the one line left says
    that step 10's checkpoint is the newest and how to go on. The relaunch resumes there, on the trajectory."""
    d = tmp_path / "run"
    errors = tmp_path / "errors"
    errors.write_text("")
    env = job_env(MAE_FAULT="slow_step:12:120", MAE_LAUNCHER="launch.sh", MAE_ERROR_FILE=str(errors))
    log = open(tmp_path / "out.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          os.path.join(ROOT, "tests/train_hooks.py"), *launch_args(small_store, d, ckpt_interval=10)],
                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline and not (os.path.exists(d / "log.jsonl") and len(read_log(d)) >= 12):
        time.sleep(0.1)
    ranks = [pid for pid in job_processes(d) if pid != p.pid]
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGINT)
    while time.time() < deadline and open(tmp_path / "out.log").read().count("SIGINT received") < 2:
        time.sleep(0.1)
    for pid in ranks:
        os.kill(pid, signal.SIGINT)
    assert p.wait(timeout=60) == 0  # (ranks under launch.sh exit 0: it says how the run ended)
    out = open(tmp_path / "out.log").read()
    assert "Traceback" not in out, out[-3000:]
    assert errors.read_text().splitlines()[0] == (  # (the code rank 0 ends with, then its line: launch.sh's last)
        f"130 interrupted (Ctrl-C) at once, without a checkpoint of the steps since the last one; {d}/ckpt/step_0000010 "
        f"is the newest complete checkpoint: run the same command again to resume from it"), errors.read_text()
    assert [s for s, _ in checkpoint.complete_checkpoints(str(d / "ckpt"))] == [10]
    assert not (d / "STOPPED").exists() and not (d / "LEASE").exists()
    rest = run_train(launch_args(small_store, d, ckpt_interval=10), nproc=2)
    assert rest.returncode == 0 and f"resumed from {d}/ckpt/step_0000010 (step 10)" in rest.stdout, rest.stderr[-3000:]
    same_trajectory(reference, d)


def test_a_signal_during_a_checkpoint_write_finishes_it_and_stops_there(small_store, tmp_path, reference):
    """Rank 1 gets SIGTERM as it starts writing checkpoint 12 (an interval checkpoint); rank 0 gets none. The write
    completes, the ranks agree right after it, and stop there: checkpoint 12 is the stop's, no step 13 is run. Here
    under plain torchrun (no launch.sh): the ranks themselves exit 75, which torchrun reports."""
    d = tmp_path / "run"
    args = launch_args(small_store, d, ckpt_interval=12)
    r = run_train(args, nproc=2, script="tests/train_hooks.py",
                  env=job_env(MAE_FAULT="signal_in_checkpoint:12:1:TERM"))
    assert r.returncode != 0 and "exitcode  : 75" in r.stderr, r.stderr[-3000:]
    assert "rank 1: SIGTERM received" in r.stderr, r.stderr[-3000:]
    assert [s for s, _ in checkpoint.complete_checkpoints(str(d / "ckpt"))] == [12]
    assert [x["step"] for x in read_log(d)] == list(range(12))
    assert (d / "STOPPED").read_text().startswith("stopped by SIGTERM after 12 steps")  # (rank 0's words)
    rest = run_train(args, nproc=2)
    assert rest.returncode == 0 and "(step 12)" in rest.stdout, rest.stderr[-3000:]
    same_trajectory(reference, d)


def test_a_rank_failing_after_the_pre_flight_ends_launch_sh_with_its_error_line(small_store, tmp_path):
    """A store that does not exist is found by the ranks, not by the pre-flight (which opens no data): the last line
    of launch.sh's output is the rank's error, not torchrun's traceback."""
    missing = str(tmp_path / "nowhere.mdio")
    args = ["config/quickstart.py", *small_args(small_store, tmp_path / "run", data_paths=[missing]),
            "--make_synthetic=False"]
    r = subprocess.run(["bash", "launch.sh", *args], cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0
    assert "Traceback" in r.stderr or "FAILED" in r.stderr or "error:" in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "nowhere.mdio" in last, r.stderr[-3000:]


def test_a_second_launch_into_a_running_out_dir_is_refused_and_the_first_runs_on_undisturbed(
        small_store, tmp_path, reference):
    """While a run trains (its processes paused, so that it is certainly still running when the others try), a second
    `bash launch.sh` into its out_dir is refused by the dry run, before torchrun starts: exit 2, the last line names
    the holder. A torchrun started by hand is refused by its ranks the same way. The first run then finishes on the
    trajectory of a run alone (1e-6), each step logged once, and releases the lease."""
    d = tmp_path / "run"
    p = run_until_steps(small_store, d, 5)
    holder = json.loads((d / "LEASE").read_text())
    paused = [pid for pid in job_processes(d) if pid != p.pid]  # torchrun and its ranks
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    try:
        r = subprocess.run(["bash", "launch.sh", *launch_args(small_store, d)], cwd=ROOT, env=launch_env(),
                           capture_output=True, text=True, timeout=120)
        by_hand = run_train(launch_args(small_store, d), nproc=2, timeout=120)
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
    held = f"error: out_dir {d} is in use by another run (pid {holder['pid']} on {socket.gethostname()}, started "
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(held), r.stderr[-3000:]
    assert "local mode" not in r.stderr  # (launch.sh's line as it starts torchrun)
    assert by_hand.returncode != 0 and held in by_hand.stderr, by_hand.stderr[-3000:]
    assert p.wait(timeout=300) == 0, open(f"{d}.log").read()[-3000:]
    same_trajectory(reference, d)
    steps = [x["step"] for x in read_log(d)]
    assert steps == list(range(ARGS["max_steps"])), steps  # nobody else wrote to its log
    assert not (d / "LEASE").exists()


def test_a_kill_9_of_the_launcher_takes_its_ranks_frees_the_lease_and_the_relaunch_resumes_past_torn_files(
        small_store, tmp_path, reference):
    """kill -9 of launch.sh's process group (launch.sh and torchrun; the ranks are in sessions of their own) after the
    step-20 checkpoint (or a later one): the ranks are gone within seconds (no step after the kill is logged), rank 0
    released the lease on its way out (whichever rank saw the launcher gone first). What a crash can leave is planted
    on top: the log's last line cut short, and the newest checkpoint's COMPLETE marker torn (a partial copy). The same
    command again drops the torn line and moves that checkpoint aside (a warning each), resumes from the one before
    and ends on the uninterrupted trajectory. (Taking over a lease that a dead rank 0 left: test_operations.py.)"""
    d = tmp_path / "run"
    p = run_until_steps(small_store, d, 24, ckpt_interval=10)
    pids = job_processes(d)
    assert p.pid in pids and len(pids) >= 4, pids  # launch.sh, torchrun, 2 ranks
    os.killpg(p.pid, signal.SIGKILL)
    deadline = time.time() + 10
    while time.time() < deadline and job_processes(d):
        time.sleep(0.1)
    assert not job_processes(d), f"ranks outlived their launcher: {job_processes(d)}"
    logged = len(read_log(d))
    time.sleep(1)
    assert len(read_log(d)) == logged  # nothing trains on unseen
    assert not (d / "LEASE").exists()  # out_dir free, for a relaunch from this host or any other
    # the ranks see the launcher gone within their watch's poll (infra/distributed.py), a few steps on a fast machine:
    # the newest checkpoint is step 20's or a later one, always with the one before it (keep_ckpts 2)
    done = [s for s, _ in checkpoint.complete_checkpoints(str(d / "ckpt"))]
    newest = done[-1]
    assert newest >= 20 and done == [newest - 10, newest] and logged < ARGS["max_steps"], (done, logged)
    torn = f'{{"step": {logged}, "loss": 0.9'
    with open(d / "log.jsonl", "a") as f:
        f.write(torn)
    marker = d / "ckpt" / f"step_{newest:07d}" / "COMPLETE"
    marker.write_text(marker.read_text()[:100])
    r = subprocess.run(["bash", "launch.sh", *launch_args(small_store, d, ckpt_interval=10)], cwd=ROOT,
                       env=launch_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"WARNING: {d}/log.jsonl ends with {len(torn)} bytes that are not a whole record" in r.stdout, \
        r.stdout[-3000:]
    assert f"checkpoint {d}/ckpt/step_{newest:07d} has a COMPLETE marker that does not parse" in r.stdout, \
        r.stdout[-3000:]
    assert f"resumed from {d}/ckpt/step_{newest - 10:07d} (step {newest - 10})" in r.stdout, r.stdout[-3000:]
    assert (d / "ckpt" / f"damaged_step_{newest:07d}").is_dir()  # kept aside, never deleted
    same_trajectory(reference, d)
    assert not (d / "LEASE").exists()
