"""What operators of a cluster meet: out_dir's lease (one run per out_dir; a stale lease taken over), a full disk during
a checkpoint write (a clear error, no partial step, the relaunch resumes), and a checkpoint load that fails on one rank
only (every rank falls back together: no hang). The launcher-level tests of the lease (two launches, kill -9 of the
launcher) are in test_preempt.py, beside the other launch.sh stop tests."""
import json
import os
import socket
import subprocess
import sys
import time
import zipfile

import pytest
import torch

import configurator
from infra import checkpoint, lease
from conftest import ROOT, job_env, read_log, read_val, run_train, small_args, tmpfs

# -----------------------------------------------------------------------------
# the lease's rules, on its own (infra/lease.py)


def cfg_for(out_dir, **kw):
    cfg = configurator.defaults()
    cfg.update(out_dir=str(out_dir), **kw)
    return cfg


def acquire_elsewhere(out_dir, what="acquire(cfg, print)"):
    """lease.acquire (or another call of infra/lease.py) in another process on this host: (exit code, its output).
    Exit 0: it took the lease and left it (a process that has exited is gone: its lease is then stale here)."""
    code = ("import sys; from infra import lease, cli; import configurator\n"
            f"cfg = configurator.defaults(); cfg.update(out_dir={str(out_dir)!r})\n"
            f"sys.exit(cli.run(lambda a: lease.{what} and 0, []))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=job_env(), capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def write_lease(out_dir, age_s=0.0, **holder):
    """A lease as another run would have left it: {host, pid, ...}, last refreshed age_s seconds ago."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, lease.NAME)
    me = {"host": "another-host", "pid": 1, "pid_start": None, "slurm_job_id": "", "started": time.time() - age_s,
          "id": "theirs", "log_interval": 10, "gap_s": 0.0, "eval_ckpt_s": 0.0, **holder}
    with open(path, "w") as f:
        json.dump(me, f)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def holder_of(out_dir):
    with open(os.path.join(out_dir, lease.NAME)) as f:
        return json.load(f)


def test_a_live_lease_is_refused_and_a_dead_holders_is_taken_over(tmp_path):
    """This process holds the lease: another process is refused, naming this one. Released, the other takes it; once
    that process has exited (its pid gone on this host), this one takes it over at once, with a warning."""
    cfg, said = cfg_for(tmp_path), []
    mine = lease.acquire(cfg, said.append)
    assert holder_of(tmp_path)["pid"] == os.getpid() and not said
    rc, out = acquire_elsewhere(tmp_path)
    assert rc == 2 and f"is in use by another run (pid {os.getpid()} on {socket.gethostname()}" in out, out
    assert out.strip().splitlines()[-1].startswith("error: ")
    rc, out = acquire_elsewhere(tmp_path, "check(cfg)")  # the dry run's check says the same
    assert rc == 2 and "is in use by another run" in out, out
    mine.release()
    assert not os.path.exists(tmp_path / lease.NAME)
    rc, out = acquire_elsewhere(tmp_path)
    assert rc == 0, out
    dead = holder_of(tmp_path)["pid"]  # that process has exited: its lease stays, stale
    lease.check(cfg)
    again = lease.acquire(cfg, said.append)
    assert said and f"took over the stale lease on {tmp_path} (pid {dead} on" in said[0], said
    assert f"its process {dead} on this host is gone" in said[0]
    again.refresh()
    again.release()


def test_another_hosts_lease_is_live_until_it_is_not_refreshed_for_lease_stale_times_its_step_time(tmp_path):
    """A holder on another host (its process unseen): live while refreshed; stale after lease_stale x (log_interval
    steps at the step time measured last), never sooner than lease_min_s. The measured step time (log.jsonl) sets the
    limit: with 10 s steps and 10 of them between two refreshes, 15 min without one is still live."""
    cfg = cfg_for(tmp_path, lease_stale=10.0, lease_min_s=60.0)
    write_lease(tmp_path, age_s=30)
    with pytest.raises(lease.LeaseHeld, match="another-host"):
        lease.acquire(cfg, print)
    write_lease(tmp_path, age_s=120)  # older than lease_min_s, nothing measured: stale
    said = []
    lease.acquire(cfg, said.append).release()
    assert "not refreshed for 120 s (stale after 60 s)" in said[0], said
    with open(tmp_path / "log.jsonl", "w") as f:  # 10 s steps, 10 per refresh: stale after 10 x 100 s
        for i in range(20):
            f.write(json.dumps({"step": i, "loss": 1.0, "lr": 1e-3, "step_s": 10.0, "wait_s": 0.0}) + "\n")
    write_lease(tmp_path, age_s=900)
    with pytest.raises(lease.LeaseHeld):
        lease.acquire(cfg, print)
    write_lease(tmp_path, age_s=900, log_interval=1)  # its refreshes come every step: stale after 10 x 10 s
    said = []
    lease.acquire(cfg, said.append).release()
    assert "not refreshed for 900 s (stale after 100 s)" in said[0], said


def test_a_requeued_slurm_job_takes_over_its_own_earlier_lease(tmp_path, monkeypatch):
    """The same SLURM job id (a requeue, HyperPod's auto-resume of the step): the earlier incarnation is over."""
    cfg = cfg_for(tmp_path)
    write_lease(tmp_path, slurm_job_id="4242")
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    with pytest.raises(lease.LeaseHeld, match="SLURM job 4242"):
        lease.acquire(cfg, print)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    said = []
    lease.acquire(cfg, said.append).release()
    assert "earlier incarnation of this SLURM job 4242" in said[0], said


def test_two_runs_taking_over_one_stale_lease_one_wins(tmp_path):
    """Both find the same stale lease: the takeover claim (create-exclusive) lets one through; the other is refused.
    A claim left by a run that died taking over (older than a minute) is cleared and the takeover goes on."""
    cfg = cfg_for(tmp_path, lease_min_s=10.0)
    path = write_lease(tmp_path, age_s=600)
    claim = f"{path}.takeover.theirs"
    open(claim, "w").close()  # the other run's claim, just made
    with pytest.raises(lease.LeaseHeld, match="is taking over"):
        lease.acquire(cfg, print)
    os.utime(claim, (time.time() - 120, time.time() - 120))  # ... and left by a run that died
    won = lease.acquire(cfg, print)
    assert holder_of(tmp_path)["id"] == won.me["id"] and not os.path.exists(claim)
    won.release()


def test_a_run_whose_lease_was_taken_over_stops_at_its_next_refresh(tmp_path):
    """Judged stale while it was stuck, the run learns it at its next refresh (a log line, a checkpoint): LeaseLost,
    and its release leaves the new holder's lease alone."""
    cfg = cfg_for(tmp_path)
    mine = lease.acquire(cfg, print)
    write_lease(tmp_path, age_s=0)  # the other run's, over ours
    with pytest.raises(lease.LeaseLost, match="taken over by another run"):
        mine.refresh()
    mine.release()
    assert holder_of(tmp_path)["id"] == "theirs"


def test_a_setup_that_fails_after_taking_the_lease_releases_it(small_store, tmp_path):
    """Bad input found after the lease is taken (here: fine-tuning on a store without the label variable, which
    data.samplers finds) is the one clear error line, and out_dir is free at once: a relaunch from another host
    would otherwise wait out lease_min_s."""
    r = run_train(small_args(small_store, tmp_path, task="segment", label_var="fault"), timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "fault" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert not os.path.exists(tmp_path / lease.NAME)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["plan", "setup"])
def test_a_ctrl_c_during_start_up_says_where_the_run_stands_and_frees_out_dir(small_store, tmp_path, where):
    """A Ctrl-C while the run starts (the ranks' rendezvous and the planner inside Operations' __enter__, before the
    lease; setup, after it): the last line says the run is interrupted before any step and how to go on, and out_dir
    holds no lease. (In __enter__ Python calls no __exit__: Operations turns it into the same end itself.)"""
    r = run_train(small_args(small_store, tmp_path), script="tests/train_hooks.py",
                  env=job_env(MAE_FAULT=f"interrupt_in:{where}"), timeout=300)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode in (130, -2) and last.startswith("interrupted (Ctrl-C) during start-up, before any step; "
                                                          "no checkpoint was written"), r.stderr[-2000:]
    assert not os.path.exists(tmp_path / lease.NAME)


# -----------------------------------------------------------------------------
# a full disk during a checkpoint write

ARGS = dict(max_steps=6, ckpt_interval=2, keep_ckpts=2, eval_interval=2)


@pytest.fixture(scope="module")
def uninterrupted(small_store, tmp_path_factory):
    """The 2-rank run with room: its training records and validation losses."""
    d = tmp_path_factory.mktemp("with_room")
    r = run_train(small_args(small_store, d, **ARGS), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_log(d), dict(read_val(d))


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 14 MB (a checkpoint of these runs is about 9 MB): room for one checkpoint, not two."""
    with tmpfs(tmp_path / "disk", "size=14m") as mnt:
        yield mnt


@pytest.mark.slow  # (the editing loop's subset leaves out this file's many-run tests: tests/README.md)
@pytest.mark.parametrize("where", ["before the write", "during the write"])
def test_a_full_disk_is_one_clear_error_and_the_relaunch_with_room_follows_the_uninterrupted_run(
        small_store, small_disk, uninterrupted, where):
    """The checkpoint at step 4 does not fit next to step 2's. Before the write: the ranks ask the file system for the
    planner's checkpoint size and agree it is not there. During the write (the question skipped, as when someone
    else fills the disk meanwhile): the write itself fails, torch's error hiding the errno. Either way: exit 4, the last
    line names out_dir, the cause and the bytes needed, no partial step_4 is left, step 2 is intact; after the disk
    grows, the same command resumes from step 2 and ends on the uninterrupted trajectory."""
    d = small_disk / "run"
    env = job_env(MAE_FAULT="no_room_check") if where == "during the write" else job_env()
    r = run_train(small_args(small_store, d, **ARGS), nproc=2, script="tests/train_hooks.py", env=env, timeout=300)
    assert r.returncode != 0, r.stdout[-2000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert errors and all("checkpoint step_0000004 cannot be written to" in x for x in errors), r.stderr[-3000:]
    first = errors[0]
    assert f"{d}/ckpt" in first and "No space left on device" in first and "needs about 0.0" in first, first
    assert ("nothing of it was written" if where == "before the write" else "partial directory was removed") in first
    if where == "before the write":
        assert r.stderr.strip().splitlines()[-1].startswith("error:") or "exitcode  : 4" in r.stderr
    steps = sorted(x for x in os.listdir(d / "ckpt") if x.startswith("step_"))  # (DeepSpeed's own files beside)
    assert steps == ["step_0000002"], steps  # no partial step_4
    assert [s for s, _ in checkpoint.complete_checkpoints(str(d / "ckpt"))] == [2]
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    rest = run_train(small_args(small_store, d, **ARGS), nproc=2, timeout=300)
    assert rest.returncode == 0 and "(step 2)" in rest.stdout, rest.stderr[-3000:]
    ref_log, ref_val = uninterrupted
    got = {x["step"]: x for x in read_log(d)}  # (steps 2, 3 logged twice: the last record is the resumed run's)
    assert sorted(got) == [x["step"] for x in ref_log]
    for a in ref_log:
        assert abs(got[a["step"]]["loss"] - a["loss"]) <= 1e-6 * abs(a["loss"]), (a, got[a["step"]])
    val = dict(read_val(d))
    assert all(abs(val[k] - v) <= 1e-6 * abs(v) for k, v in ref_val.items()), (val, ref_val)


def test_a_read_only_checkpoint_directory_is_the_same_clear_error(tmp_path):
    """A read-only file system (EROFS) is named as such by the question save() asks first."""
    with tmpfs(tmp_path / "ro", "size=1m,ro") as mnt:
        assert checkpoint.room(str(mnt / "ckpt"), 10) == "Read-only file system"
    assert checkpoint.room(str(tmp_path), 10) is None
    assert "No space left on device" in checkpoint.room(str(tmp_path), 10 ** 18)


# -----------------------------------------------------------------------------
# a lock left by a rank killed while DeepSpeed built its CPU comm op


@pytest.mark.slow
def test_runs_started_with_and_without_the_venv_on_path_build_deepspeeds_cpu_op_once():
    """`python train.py` (the venv's bin not on PATH: the system's ninja) and `bash launch.sh` (the venv's first: pip's
    ninja) used to rebuild each other's build of the op, a minute each, since two ninjas disagree about its build log:
    once built, loading it from either start adds nothing to the log (no command was run again)."""
    from torch.utils.cpp_extension import _get_build_directory
    log = os.path.join(_get_build_directory("deepspeed_shm_comm", False), ".ninja_log")
    here = os.path.dirname(sys.executable)
    bare = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != here)

    def load(path):
        r = subprocess.run([sys.executable, "-c", "from infra import strategies; strategies.load_cpu_comm_op()"],
                           cwd=ROOT, env=job_env(PATH=path), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        with open(log) as f:
            return f.read()
    built = load(bare)  # (built here if no run has yet)
    for path in (here + os.pathsep + bare, bare, here + os.pathsep + bare):
        assert load(path) == built, "the op was built again"


@pytest.mark.slow
def test_a_lock_left_by_a_killed_build_of_deepspeeds_cpu_op_is_removed(small_store, tmp_path):
    """torch's file baton is a bare lock file in the op's build folder: a rank killed inside it (a scancel, a kill -9,
    a timeout while DeepSpeed built or re-checked its CPU comm op) leaves it, and every later CPU run waited on it
    forever (seen: a GPU-check section killed at its time limit hung every DeepSpeed run after it). With
    infra/strategies.load_cpu_comm_op the next run names it, removes it and trains. The build folder is a copy of
    this machine's (TORCH_EXTENSIONS_DIR), so no other run meets the planted lock."""
    import shutil

    from torch.utils.cpp_extension import _get_build_directory
    ext = tmp_path / "extensions"
    built = _get_build_directory("deepspeed_shm_comm", False)
    if os.path.exists(os.path.join(built, "build.ninja")):  # (else this run builds it: a minute of g++)
        shutil.copytree(built, ext / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock*"))
    (ext / "deepspeed_shm_comm").mkdir(parents=True, exist_ok=True)
    (ext / "deepspeed_shm_comm" / "lock").touch()
    r = run_train(small_args(small_store, tmp_path / "run", max_steps=2, eval_interval=100), nproc=2, timeout=300,
                  env=job_env(TORCH_EXTENSIONS_DIR=str(ext)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "WARNING: removing" in r.stdout and "deepspeed_shm_comm/lock" in r.stdout, r.stdout[-2000:]
    assert not (ext / "deepspeed_shm_comm" / "lock").exists() and len(read_log(tmp_path / "run")) == 2


@pytest.mark.slow
def test_a_wait_for_another_process_building_deepspeeds_cpu_op_says_what_it_waits_for(small_store, tmp_path):
    """A run whose rank waits for another process's build of DeepSpeed's CPU comm op (the flock beside torch's baton,
    held here by a real process that never lets go, as a process stopped with Ctrl-Z would) once waited minutes
    without a word. Now, after a few seconds, one line names the lock file, its holder's pid and how to find it; the
    run goes on, and trains, once the holder ends. The build folder is a copy of this machine's, as above."""
    import shutil

    from torch.utils.cpp_extension import _get_build_directory
    ext = tmp_path / "extensions"
    built = _get_build_directory("deepspeed_shm_comm", False)
    if os.path.exists(os.path.join(built, "build.ninja")):  # (else this run builds it: a minute of g++)
        shutil.copytree(built, ext / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock*"))
    (ext / "deepspeed_shm_comm").mkdir(parents=True, exist_ok=True)
    lock = ext / "deepspeed_shm_comm" / "lock.holder"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(3600)", str(lock)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        out = open(tmp_path / "out.log", "w")
        run = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"),
                                *small_args(small_store, tmp_path / "run", max_steps=2, eval_interval=100)], cwd=ROOT,
                               env=job_env(TORCH_EXTENSIONS_DIR=str(ext)), stdout=out, stderr=subprocess.STDOUT,
                               text=True)
        deadline = time.time() + 300  # (a guard against a hang, not a measurement: the line comes after seconds)
        while time.time() < deadline and run.poll() is None and f"waiting for {lock}" not in open(out.name).read():
            time.sleep(0.2)
        assert run.poll() is None and not (tmp_path / "run" / "log.jsonl").exists(), open(out.name).read()[-3000:]
    finally:
        holder.kill()
        holder.wait()
    assert run.wait(timeout=300) == 0, open(out.name).read()[-3000:]
    said = [x for x in open(out.name).read().splitlines() if x.startswith("waiting for")]
    assert said == [f"waiting for {lock}: pid {holder.pid} holds it while building DeepSpeed's CPU comm op there (a "
                    f"minute of g++); this run goes on when it is done. A holder that died has let go already; one "
                    f"stopped or hung keeps it until it ends: `fuser -v {lock}` names it"], said
    assert len(read_log(tmp_path / "run")) == 2


# -----------------------------------------------------------------------------
# a checkpoint that fails to load on one rank only


def spoil_pickle(path):
    """Damage a torch.save archive so that it still passes the cheap file check (a zip with its directory: the same
    size, the same entries) but no longer unpickles: every byte of its data.pkl zeroed in place."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + name_len + extra_len)
        f.write(b"\0" * info.compress_size)
    assert zipfile.is_zipfile(path) and not checkpoint.unreadable_files(os.path.dirname(path))


def spoil_contents(path):
    """Damage a ZeRO optimizer shard so that it reads (a whole torch.save archive, every pickle intact) but DeepSpeed's
    load refuses what it holds: its flat fp32 partition 7 elements longer than the rank's partition."""
    sd = torch.load(path, map_location="cpu", weights_only=False)
    flat = sd["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    flat[0] = torch.cat([flat[0], flat[0][:7]])
    torch.save(sd, path)
    assert not checkpoint.unreadable_files(os.path.dirname(path)) and \
        checkpoint.unloadable_own_files(os.path.dirname(path), 1) is None


def test_an_assert_without_a_message_says_what_was_asserted(tmp_path):
    """DeepSpeed's load has many bare asserts (a damaged checkpoint once said only "rank 0: AssertionError:"): the
    line then quotes the statement, whole even where it runs over lines, and where it is. (The assert runs from a
    file of its own: pytest gives the asserts of a test file messages.)"""
    src = tmp_path / "loader.py"
    src.write_text("def load(partition):\n    assert (len(partition) ==\n            3)\n")
    scope = {}
    exec(compile(src.read_text(), str(src), "exec"), scope)
    with pytest.raises(AssertionError) as e:
        scope["load"]("ab")
    assert checkpoint.describe(e.value) == "AssertionError: `assert (len(partition) == 3)` failed (loader.py:2)"
    assert checkpoint.describe(AssertionError()) == "AssertionError: a file failed DeepSpeed's check"
    assert checkpoint.describe(ValueError("bad\n  value")) == "ValueError: bad value"


@pytest.mark.slow
@pytest.mark.parametrize("strategy,shard", [("zero3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                            ("zero2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                            ("zero2", "zero_pp_rank_1_mp_rank_00_optim_states.pt (contents)"),
                                            ("fsdp2", "__1_0.distcp")])
def test_a_load_that_fails_on_one_rank_only_makes_every_rank_fall_back(small_store, tmp_path, strategy, shard):
    """Rank 1's own shard of step 4 is damaged in a way rank 0's cheap file check cannot see. Under ZeRO-3 the ranks
    whose load succeeds would go on into the collectives inside DeepSpeed's load and wait there for rank 1 forever
    (the timeout catches that); instead every rank reads its own files first and all agree: they fall back to step 2
    together, and the run finishes. The warning names the file: one that no longer unpickles, or (contents) one
    that reads but whose contents DeepSpeed's own load refuses, with an error that names no file."""
    shard, contents = shard.split(" ")[0], shard.endswith("(contents)")
    args = dict(max_steps=5, ckpt_interval=2, strategy=strategy)
    first = run_train(small_args(small_store, tmp_path, stop_step=4, **args), nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    f = tmp_path / "ckpt" / "step_0000004" / shard
    if contents:
        spoil_contents(f)
    elif shard.endswith(".pt"):
        spoil_pickle(f)
    else:  # a DCP shard of the same length, its bytes gone: DCP's collective load fails on the rank that reads it
        f.write_bytes(b"\0" * f.stat().st_size)
        assert not checkpoint.unreadable_files(str(f.parent))
    rest = run_train(small_args(small_store, tmp_path, **args), nproc=2, timeout=240)
    assert rest.returncode == 0, rest.stderr[-3000:]
    said = next(x for x in rest.stdout.splitlines() if "step_0000004 is marked complete but does not load" in x)
    assert f"checkpoint {tmp_path / 'ckpt' / 'step_0000004'} is marked" in said and "rank 1: " in said, said
    if contents:
        assert f"rank 1: {shard} was read, but its contents did not load: RuntimeError: The size of" in said, said
    elif shard.endswith(".pt"):
        assert f"rank 1: {shard}: UnpicklingError" in said, said
    assert "(step 2)" in rest.stdout
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path / "ckpt"))] == [4, 5]
    assert (tmp_path / "ckpt" / "damaged_step_0000004" / shard).exists()
