"""launch.sh against the real things: a two-node SLURM (Debian's slurm-wlm, nodes n1 and n2 on this machine) and
an sshd on 127.0.0.2. Every way a user starts a job (sbatch from outside, inside salloc, from an interactive
`srun --pty` step; hostfile over ssh) trains and follows the one-node run's losses; scancel stops every rank.

Installed on first use when missing (root + apt-get); elsewhere these tests skip and say why, under CI they fail.
"""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr

from infra import checkpoint
import cluster_util
from conftest import ROOT, job_env, read_log, small_args

pytestmark = pytest.mark.slow  # (tests/README.md: the editing loop's subset leaves it out)

STEPS = 6
VENV_BIN = os.path.dirname(sys.executable)  # the README's venv under CI: launch.sh must find it on PATH alone


def _need(commands):
    why = cluster_util.ensure_installed(commands)
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the real-cluster tests: {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    _need(["slurmctld", "slurmd", "sbatch", "munged"])
    c = cluster_util.Cluster(str(tmp_path_factory.mktemp("slurm"))).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    _need(["sshd", "ssh"])
    s = cluster_util.Sshd(str(tmp_path_factory.mktemp("sshd"))).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def common(small_store, tmp_path_factory):
    """The run every launch mode repeats: 2 nodes x 2 ranks = dp 2 x cp 2, STEPS steps."""
    return small_args(small_store, tmp_path_factory.mktemp("unused"), max_steps=STEPS, cp=2) + ["--make_synthetic=False"]


@pytest.fixture(scope="module")
def one_node(common, tmp_path_factory):
    """The same run as one node of 4 ranks: the reference every multi-node launch must follow."""
    out = tmp_path_factory.mktemp("one_node")
    r = subprocess.run(["bash", "launch.sh", "config/quickstart.py", *common, f"--out_dir={out}"], cwd=ROOT,
                       env=_env(NPROC="4"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_log(out)


def _env(**extra):
    # PYTHON is not set: launch.sh must resolve the venv's interpreter from PATH and hand it to every node
    e = job_env(**{"PATH": VENV_BIN + os.pathsep + os.environ["PATH"], **extra})
    e.pop("PYTHON", None)
    return e


def _assert_follows(one_node, out_dir):
    b = read_log(out_dir)
    assert len(one_node) == len(b) == STEPS
    for x, y in zip(one_node, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (one_node, b)


def _launch_cmd(common, out_dir, *extra):
    return ["bash", os.path.join(ROOT, "launch.sh"), "config/quickstart.py", *common, f"--out_dir={out_dir}",
            "--nodes=2", *extra]


def _sbatch(cluster, args, tmp_path, port):
    """`bash launch.sh config/quickstart.py ARGS --nodes=2` from outside an allocation: the job id sbatch printed."""
    r = subprocess.run(["bash", "launch.sh", "config/quickstart.py", *args, "--make_synthetic=False", "--nodes=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=cluster.env(**_env(NPROC="2", LOG_DIR=str(tmp_path / "logs"), PORT=port)))
    assert r.returncode == 0, r.stdout + r.stderr
    return re.search(r"Submitted batch job (\d+)", r.stdout).group(1)


def _watch(proc, slurm, seen, timeout=600):
    """Wait for a local process (salloc, script) while recording the job steps SLURM runs."""
    deadline = time.time() + timeout
    while proc.poll() is None:
        seen.update(slurm.steps())
        assert time.time() < deadline, "the job did not end in time"
        time.sleep(0.5)
    out, err = proc.communicate()
    return proc.returncode, out, err


def test_sbatch_from_outside_an_allocation_runs_one_step_and_follows_one_node(slurm, common, one_node, tmp_path):
    """`bash launch.sh CONFIG --nodes=2` on a login node submits itself once; the job runs exactly one node step
    of 2 tasks (one per node), on CPU nodes asks for no GPUs, and trains as one node of 4 ranks does."""
    logs = tmp_path / "logs"
    r = subprocess.run(_launch_cmd(common, tmp_path / "out"), cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=slurm.env(**_env(NPROC="2", LOG_DIR=str(logs), PORT="29651")))
    assert r.returncode == 0, r.stdout + r.stderr
    job = re.search(r"Submitted batch job (\d+)", r.stdout).group(1)
    seen = set()
    state = slurm.wait_job(job, poll=lambda: seen.update(slurm.steps()))
    batch_out = (logs / f"seismic-mae_{job}.out").read_text()
    assert state["JobState"] == "COMPLETED", (state, batch_out[-3000:])
    # the batch script and one step of 2 tasks over both nodes: nothing else, ever (no storm of steps)
    assert {s[0] for s in seen} <= {f"{job}.batch", f"{job}.0"}, seen
    assert (f"{job}.0", "2", "n[1-2]") in seen, seen
    assert "gres" not in batch_out and "cpu binding" not in batch_out, batch_out[-2000:]
    assert "node 1 of 2, head 127.0.0.1:29651" in (logs / "node_1.log").read_text()
    _assert_follows(one_node, tmp_path / "out")


def test_gpus_asked_only_where_slurm_schedules_them(small_store, tmp_path):
    """On nodes that advertise GPUs as gres (here 2 per node; plain files stand for the devices) the job and the
    node step ask for them: an --exclusive job alone gives a step no gres (srun(1): "except those implicitly
    requested when a job is exclusive"). The CPU-node case is every other test in this file."""
    _need(["slurmctld", "slurmd", "sbatch", "munged"])
    c = cluster_util.Cluster(str(tmp_path / "slurm_gpu"), gpus=2).start()
    try:
        job = _sbatch(c, small_args(small_store, tmp_path / "out", max_steps=2, cp=2), tmp_path, "29657")
        assert "gres:gpu:2" in c.job(job).get("TresPerNode", ""), c.job(job)
        step = []

        def poll():
            s = subprocess.run(["scontrol", "-o", "show", "step", f"{job}.0"], env=c.env(), capture_output=True,
                               text=True).stdout
            if "StepId" in s:
                step.append(s)
        state = c.wait_job(job, poll=poll)
        assert state["JobState"] == "COMPLETED", (state, (tmp_path / "logs" / f"seismic-mae_{job}.out").read_text())
        assert step and "TresPerNode=gres:gpu:2" in step[0], step[:1]  # the node step holds 2 GPUs per node
        assert len(read_log(tmp_path / "out")) == 2
    finally:
        c.stop()


def test_inside_salloc_and_from_an_interactive_step(slurm, common, one_node, tmp_path):
    """Inside `salloc -N2` (a shell on the login node, no step) and from `srun --pty` (an interactive step, whose
    SLURM_PTY_PORT the node tasks inherit: they must not take themselves for one): one node step each."""
    # salloc's command runs here, in the allocation, like a user's salloc shell
    p = subprocess.Popen(["salloc", "-N2", *_launch_cmd(common, tmp_path / "salloc")], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=slurm.env(**_env(NPROC="2", LOG_DIR=str(tmp_path / "logs_a"), PORT="29652")))
    seen = set()
    rc, out, err = _watch(p, slurm, seen)
    assert rc == 0, out[-2000:] + err[-3000:]
    job = re.search(r"Granted job allocation (\d+)", err).group(1)
    assert {s[0] for s in seen} == {f"{job}.0"} and (f"{job}.0", "2", "n[1-2]") in seen, seen
    _assert_follows(one_node, tmp_path / "salloc")

    # an interactive step: `salloc -N2`, then `srun --pty bash`, then the user types the command. srun --pty needs
    # a terminal: script(1) gives it one.
    inner = shlex.join(["salloc", "-N2", "srun", "-N1", "-n1", "--pty", *_launch_cmd(common, tmp_path / "pty")])
    p = subprocess.Popen(["script", "-qec", inner, "/dev/null"], cwd=ROOT, text=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=slurm.env(**_env(NPROC="2", LOG_DIR=str(tmp_path / "logs_b"), PORT="29653")))
    seen = set()
    rc, out, err = _watch(p, slurm, seen)
    assert rc == 0, out[-3000:] + err[-3000:]
    job = re.search(r"Granted job allocation (\d+)", out + err).group(1)
    # step 0: the interactive shell (1 task); step 1: the node step (2 tasks, one per node, --overlap)
    assert {s[0] for s in seen} == {f"{job}.0", f"{job}.1"}, seen
    assert (f"{job}.1", "2", "n[1-2]") in seen and (f"{job}.0", "1", "n1") in seen, seen
    _assert_follows(one_node, tmp_path / "pty")


def _ranks(out_dir):
    r = subprocess.run(["pgrep", "-f", f"train.py.*{out_dir}"], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def test_scancel_ends_every_rank(slurm, small_store, tmp_path):
    job = _sbatch(slurm, small_args(small_store, tmp_path / "out", max_steps=100000, ckpt_interval=100000), tmp_path,
                  "29654")
    deadline = time.time() + 300
    while time.time() < deadline and not (tmp_path / "out" / "log.jsonl").exists():
        assert slurm.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), slurm.job(job)
        time.sleep(0.5)
    assert (tmp_path / "out" / "log.jsonl").exists(), "training never started"
    assert len(_ranks(tmp_path / "out")) >= 4, _ranks(tmp_path / "out")  # 2 nodes x 2 ranks (+ the launchers)
    t = time.time()
    subprocess.run(["scancel", job], env=slurm.env(), check=True)
    while _ranks(tmp_path / "out") and time.time() - t < 60:
        time.sleep(0.5)
    left = _ranks(tmp_path / "out")
    for pid in left:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks still running 60 s after scancel: {left}"
    assert slurm.wait_job(job, timeout=60)["JobState"] == "CANCELLED"


def test_hyperpod_auto_resume_reaches_srun(slurm, small_store, tmp_path):
    """STAND-IN: `srun --auto-resume=1` exists only in SageMaker HyperPod's SLURM; a local SLURM's srun rejects it.
    What the real SLURM cannot show is replaced by the least possible: an srun in front of the real one that records
    its arguments and drops --auto-resume=1. Everything else (salloc, the step, the nodes) is real."""
    shim = tmp_path / "hyperpod"
    shim.mkdir()
    real = subprocess.run(["bash", "-c", "command -v srun"], capture_output=True, text=True).stdout.strip()
    (shim / "srun").write_text(f"""#!/usr/bin/env bash
echo "$*" >> {shim}/calls
args=(); for a in "$@"; do [ "$a" = --auto-resume=1 ] || args+=("$a"); done
exec {real} "${{args[@]}}"
""")
    (shim / "srun").chmod(0o755)
    args = small_args(small_store, tmp_path / "out", max_steps=2, cp=2)
    r = subprocess.run(["salloc", "-N2", "bash", "launch.sh", "config/quickstart.py", *args, "--make_synthetic=False",
                        "--nodes=2"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=slurm.env(**_env(NPROC="2", LOG_DIR=str(tmp_path / "logs"), PORT="29655", HYPERPOD="1",
                                            PATH=f"{shim}:{VENV_BIN}:{os.environ['PATH']}")))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    calls = (shim / "calls").read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith("--auto-resume=1 "), calls
    assert len(read_log(tmp_path / "out")) == 2


def test_hostfile_over_real_ssh_follows_one_node(sshd, common, one_node, tmp_path):
    """127.0.0.1 runs here; 127.0.0.2 is reached only through ssh, whose login shell has its own PATH: the node
    must run the venv's interpreter all the same (PYTHON is not set)."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1\n{sshd.addr}\n")
    before = open(sshd.log).read().count("Accepted publickey")
    r = subprocess.run(["bash", "launch.sh", "config/quickstart.py", *common, f"--out_dir={tmp_path / 'out'}",
                        "--nodes=2"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=_env(HOSTFILE=str(hosts), NPROC="2", LOG_DIR=str(tmp_path / "logs"), PORT="29656",
                                SSH_OPTS=sshd.opts))
    assert r.returncode == 0, r.stderr[-3000:] + (tmp_path / "logs" / "node_1.log").read_text()[-3000:]
    assert open(sshd.log).read().count("Accepted publickey") == before + 1  # node 1 came in over ssh
    assert "head 127.0.0.1:29656" in (tmp_path / "logs" / "node_1.log").read_text()
    _assert_follows(one_node, tmp_path / "out")


def _release_requeued(slurm, job, timeout=60):
    """Start a requeued job now: SLURM holds one for a while (Reason=BeginTime), which only the test's clock minds.
    Only once both nodes are idle again and a second has passed: slurmd refuses a job whose credential is not newer,
    in whole seconds, than the revocation of its first run's ("Killing non-startable batch job: Job credential
    revoked": seen when it was released at once)."""
    deadline = time.time() + timeout
    time.sleep(2)
    while set(subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=slurm.env(), capture_output=True,
                             text=True).stdout.split()) != {"idle"}:
        assert time.time() < deadline, f"the nodes are not idle; job {slurm.job(job)}"
        time.sleep(0.25)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm.env(), check=True)


def test_time_limit_warning_checkpoints_and_the_requeued_job_resumes(slurm, small_store, tmp_path):
    """The job's --signal=USR1@stop_lead_s (sbatch's, from launch.sh) reaches the ranks before the time limit: they
    write a checkpoint at the step they are in and exit 75; with REQUEUE=1 the batch script requeues the job, which
    resumes from it. The limit is brought near while the job trains (scontrol update TimeLimit=2 with a 100 s lead:
    SLURM sends the warning at its next time-limit check), then moved away again for the requeued run, which is
    released at once. scancel then stops that one with SIGTERM: a checkpoint again, but no requeue (the user's cancel
    stands)."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    args = small_args(small_store, out, max_steps=100000, ckpt_interval=100000, eval_interval=100000)
    r = subprocess.run(["bash", "launch.sh", "config/quickstart.py", *args, "--make_synthetic=False", "--nodes=2",
                        "--stop_lead_s=100"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=slurm.env(**_env(NPROC="2", LOG_DIR=str(logs), PORT="29658", REQUEUE="1",
                                            SBATCH_TIMELIMIT="10", SBATCH_OPEN_MODE="append")))
    assert r.returncode == 0, r.stdout + r.stderr
    job = re.search(r"Submitted batch job (\d+)", r.stdout).group(1)

    def update(limit, *more):
        subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={limit}", *more], env=slurm.env(),
                       check=True)

    def wait_for(cond, what, timeout=240):
        deadline = time.time() + timeout
        while not cond():
            assert time.time() < deadline, f"{what}: not within {timeout} s; job {slurm.job(job)}"
            time.sleep(0.25)

    try:
        wait_for(lambda: (out / "log.jsonl").exists() and len(read_log(out)) >= 3, "training started")
        assert slurm.job(job)["JobState"] == "RUNNING"
        update(2)  # 120 s from the start, which is > 20 s ago: the 100 s warning is due at once
        wait_for(lambda: (out / "STOPPED").exists(), "the ranks stopped", timeout=120)
        wait_for(lambda: slurm.job(job).get("JobState") == "PENDING", "requeued", timeout=60)
        # the requeued run gets its time back (it would be warned again during its start-up), and starts now
        update(10)
        _release_requeued(slurm, job)
        stopped = (out / "STOPPED").read_text()
        n = int(re.search(r"after (\d+) steps", stopped).group(1))
        assert stopped.startswith(f"stopped by SIGUSR1 after {n} steps: checkpoint {out}/ckpt/step_{n:07d} is "
                                  f"complete"), stopped
        assert [s for s, _ in checkpoint.complete_checkpoints(str(out / "ckpt"))] == [n]
        # (rank 0, which says so, is on either node: c10d numbers the nodes in the order they join)
        node_logs = lambda: "".join((logs / f"node_{i}.log").read_text() for i in (0, 1))  # noqa: E731
        wait_for(lambda: "(step %d)" % n in node_logs(), "the requeued job resumed")
        assert f"resumed from {out}/ckpt/step_{n:07d} (step {n})" in node_logs()
        batch_out = (logs / f"seismic-mae_{job}.out").read_text()  # both runs (SBATCH_OPEN_MODE=append)
        assert f"launch.sh: {stopped.strip()}" in batch_out, batch_out[-3000:]
        assert f"REQUEUE=1: requeueing job {job}" in batch_out, batch_out[-3000:]
        wait_for(lambda: read_log(out)[-1]["step"] > n, "the resumed run trains")
    finally:
        subprocess.run(["scancel", job], env=slurm.env())
    state = slurm.wait_job(job, timeout=120)
    assert state["JobState"] == "CANCELLED" and int(state.get("Restarts", "0")) == 1, state
    assert (out / "STOPPED").read_text().startswith("stopped by SIGTERM after")  # scancel: a checkpoint too


def test_predict_under_slurm_stops_on_the_warning_requeues_and_finishes(slurm, predict_survey, tmp_path):
    """bash launch.sh -m scripts.predict with NODES=2 from outside an allocation: one step of 2 nodes x 2 ranks (dp 2 x
    cp 2). The time-limit warning (SIGUSR1 to the steps: scancel --signal, as SLURM sends it) stops the ranks after
    their current tiles, kept; with REQUEUE=1 the job requeues itself and the requeued job finishes the prediction,
    equal to one process's; the batch output ends with the JSON line."""
    store, _, sharp, _, _ = predict_survey
    base = [sharp, store, "--dtype=float32", "--tile=16,16,32"]  # 12 tiles
    ref, out, logs = tmp_path / "ref.zarr", tmp_path / "faults.zarr", tmp_path / "logs"
    r = subprocess.run([sys.executable, "-m", "scripts.predict", *base, f"--out={ref}"], cwd=ROOT, env=job_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    env = slurm.env(**_env(NODES="2", NPROC="2", LOG_DIR=str(logs), PORT="29659", REQUEUE="1",
                           SBATCH_OPEN_MODE="append"))
    r = subprocess.run(["bash", "launch.sh", "-m", "scripts.predict", *base, f"--out={out}", "--cp=2", "--slow_tile=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    job = re.search(r"Submitted batch job (\d+)", r.stdout).group(1)
    marks = out.parent / f"{out.name}.partial" / "predict_done"
    deadline = time.time() + 240
    try:
        while not (marks.is_dir() and len(os.listdir(marks)) >= 2):
            assert time.time() < deadline, f"no tiles written; job {slurm.job(job)}"
            time.sleep(0.25)
        subprocess.run(["scancel", "--signal=USR1", job], env=slurm.env(), check=True)
        while slurm.job(job).get("JobState") != "PENDING":
            assert time.time() < deadline, f"not requeued; job {slurm.job(job)}"
            time.sleep(0.25)
        n = len(os.listdir(marks))
        _release_requeued(slurm, job)
        state = slurm.wait_job(job, timeout=240)
    finally:
        subprocess.run(["scancel", job], env=slurm.env())
    batch_out = (logs / f"seismic-mae_{job}.out").read_text()  # both runs (SBATCH_OPEN_MODE=append)
    assert state["JobState"] == "COMPLETED" and int(state.get("Restarts", "0")) == 1, (state, batch_out[-3000:])
    assert "launch.sh: stopped by SIGUSR1 after " in batch_out and f"{n} of 12 tiles are written" in batch_out
    assert f"REQUEUE=1: requeueing job {job}" in batch_out, batch_out[-3000:]
    info = json.loads(batch_out.strip().splitlines()[-1])
    assert info["voxels"] == 48 * 32 * 64 - n * 16 * 16 * 32  # the tiles written before the stop were not redone
    a, b = (np.asarray(zarr.open_group(str(p), mode="r")["probability"][:]) for p in (ref, out))
    assert np.abs(a - b).max() <= 1e-5


def test_hostfile_stop_signal_reaches_the_node_behind_ssh(sshd, small_store, tmp_path):
    """SIGUSR1 to launch.sh in hostfile mode reaches the nodes behind ssh through their launch.sh's pid there (a
    signal to the local ssh client would only end the connection). Both nodes are behind ssh here, so the run can
    only stop if that path works: it stops with a checkpoint and exit 75. (A node on this host gets it through its
    process group: the tests of local mode.)"""
    hosts, out, logs = tmp_path / "hosts", tmp_path / "out", tmp_path / "logs"
    hosts.write_text(f"{sshd.addr}\n{sshd.addr}\n")
    args = small_args(small_store, out, max_steps=100000, ckpt_interval=100000, eval_interval=100000, cp=2)
    p = subprocess.Popen(["bash", "launch.sh", "config/quickstart.py", *args, "--make_synthetic=False", "--nodes=2"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=_env(HOSTFILE=str(hosts), NPROC="2", LOG_DIR=str(logs), PORT="29659", SSH_OPTS=sshd.opts))
    try:
        deadline = time.time() + 240
        while p.poll() is None and not ((out / "log.jsonl").exists() and len(read_log(out)) >= 3):
            assert time.time() < deadline, "training did not start"
            time.sleep(0.25)
        os.kill(p.pid, signal.SIGUSR1)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 75, err[-3000:]
    n = read_log(out)[-1]["step"] + 1
    assert err.strip().splitlines()[-1].startswith(f"launch.sh: stopped by SIGUSR1 after {n} steps: checkpoint"), err
    assert [s for s, _ in checkpoint.complete_checkpoints(str(out / "ckpt"))] == [n]
    logs = [(logs / f"node_{i}.log").read_text() for i in (0, 1)]
    assert sum(log.count(": SIGUSR1 received") for log in logs) >= 1, logs  # (the ranks agree: one is enough)


def test_slurm_installed_but_not_configured_is_one_line(small_store, tmp_path):
    """sbatch on PATH (Debian's real client) but no slurm.conf where it looks, no controller: a multi-node config
    would be submitted there; instead one line says SLURM does not answer, with sinfo's own words and the ways out."""
    _need(["sbatch", "sinfo"])
    args = ["config/quickstart.py", *small_args(small_store, tmp_path / "run"), "--make_synthetic=False", "--nodes=2"]
    r = subprocess.run(["bash", "launch.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=_env(SLURM_CONF=str(tmp_path / "no_such_slurm.conf")))
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("error: SLURM is installed here (sbatch) but does not answer"), \
        r.stdout + r.stderr
    assert "slurm.conf" in last and "HOSTFILE=" in last and "MODE=local" in last, last
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()
