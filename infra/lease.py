"""
One run per out_dir: a lease that the run's rank 0 takes before any work and keeps fresh while it trains.

    check(cfg)                  the dry run (launch.sh, before torchrun): LeaseHeld if a live run holds out_dir
    acquire(cfg, log) -> Lease  rank 0, at setup: take it, take over a stale one (a warning), or raise LeaseHeld
    Lease.refresh()             at step boundaries (infra/ops.py: at most once a second) and around every
                                checkpoint write: its mtime; LeaseLost if it is not ours
    Lease.release()             the run's end (clean, stopped, failed on rank 0, or its launcher killed)
    for_output(path, what, log) -> Lease   a command's lease on its output (predict's, embed's): PATH.lease

The same lease guards a command's output (scripts/predict.py, scripts/embed.py): two commands into one --out both
compute everything and then collide in its arrays, so the second is refused naming the first. Its file is the
output's path with ".lease" added (beside the store, a file of the command's own; with predict's --variable,
STORE.VARIABLE.lease), held by rank 0 from before the output is looked at until the command ends, and refreshed
after every tile or window written. Local paths and shared file systems only: an object store has no
create-exclusive that every S3-compatible store honours, so an s3:// output is not leased.

Why: two runs in one out_dir (a double sbatch, a requeue racing a manual relaunch, an auto-resume while the old job
still drains) both resume, both append to log.jsonl, and each one's checkpoint rotation and leftover cleanup deletes
the other's checkpoints while they are written. Nothing else in the project can tell them apart.

The lease is out_dir/LEASE, a small JSON file naming its holder: host, pid (and that process's start time, so that
a reused pid is not taken for the holder), SLURM job id, start time, a random id, and the seconds it expects
between two refreshes. It works on shared file systems without a reliable flock (FSx for Lustre, NFS): it relies on
two operations those make atomic, create-exclusive (O_CREAT | O_EXCL) and rename (os.replace), and on mtime.

Taking it:
  * no LEASE: create it exclusively. Of two runs that start together exactly one creates it; the other sees it.
  * a LEASE that is live: refuse (LeaseHeld: one `error:` line naming the holder and what to do).
  * a LEASE that is stale, its holder gone, is taken over with a warning, so that a requeue, HyperPod's auto-resume
    and a relaunch after a crash resume on their own. Stale means one of:
      - its holder ran on this host and its process is gone (or the pid now belongs to another process);
      - its holder was an earlier incarnation of this very SLURM job (a requeue or an auto-resumed step keeps the
        job id, and SLURM ends a job's old processes before it starts them again);
      - it has not been refreshed for lease_stale x the time between two refreshes, and at least lease_min_s
        (a holder on another host, whose process this host cannot see). The time between two refreshes is
        taken as at most log_interval steps (a refresh comes at every step boundary a second after the last) at
        the step time measured last (out_dir/log.jsonl's newest records) or, before any
        step was logged, the planner's, plus an evaluation and a checkpoint write (the planner's).
    Two runs that find the same stale lease race for it by creating LEASE.takeover.<its id> exclusively: the one
    that creates it replaces LEASE (a rename), the other refuses. A takeover claim left by a run that died in
    between (older than a minute) is removed, and the race is run again.
  * a refresh reads LEASE back first: a run whose lease was taken over (judged stale while it was stuck) learns it
    at its next step boundary or checkpoint and stops (LeaseLost) before it can write into the out_dir again.
"""
import json
import os
import socket
import sys
import time
import uuid

import configurator

NAME = "LEASE"
CLAIM_STALE_S = 60.0  # a takeover claim older than this was left by a run that died while taking over
TORN_S = 10.0  # a lease that does not parse this long after it was written was torn by its writer's death


class LeaseHeld(configurator.ConfigError):
    """Another live run holds this out_dir (a bad launch: exit code 2, one line)."""


class LeaseLost(RuntimeError):
    """This run's lease was taken over by another run: stop before writing anything more."""


def _start_time(pid):
    """The start time of process `pid` (clock ticks since boot, /proc/PID/stat field 22), or None where there is no
    /proc: with the pid it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # (the name in parentheses may hold spaces)
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid, start):
    """Whether the process that took the lease (pid, start time) still runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    now = _start_time(pid)
    return start is None or now is None or now == start


def _measured_step_s(out_dir, n=50):
    """The median step time of the newest step records in out_dir/log.jsonl (its last 64 KB), or None."""
    path = os.path.join(out_dir, "log.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 65536))
            lines = f.read().decode(errors="replace").splitlines()[1:] or []
    except OSError:
        return None
    steps = []
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "step_s" in r:
            steps.append(float(r["step_s"]))
    steps = sorted(steps[-n:])
    return steps[len(steps) // 2] if steps else None


def stale_after_s(holder, cfg, out_dir):
    """Seconds without a refresh after which the holder's lease is stale: lease_stale x the time between two of its
    refreshes (log_interval steps at the step time measured last, else the planner's, plus an evaluation and a
    checkpoint write), and never less than lease_min_s."""
    step_s = None if cfg.get("lease_of") else _measured_step_s(out_dir)  # (a command's output: its own gap_s)
    gap = holder.get("gap_s") or 0.0  # the holder's own estimate: log_interval x the planner's step + eval + ckpt
    if step_s is not None:
        gap = holder.get("log_interval", cfg["log_interval"]) * step_s + holder.get("eval_ckpt_s", 0.0)
    return max(cfg["lease_min_s"], cfg["lease_stale"] * gap)


def _why_stale(holder, age, cfg, out_dir):
    """Why the lease `holder` (not refreshed for `age` seconds) may be taken over, or None while it is live."""
    if not holder and age > TORN_S:  # (a live run writes its lease whole in a moment: this one's writer died)
        return f"it does not parse, {age:.0f} s after it was written (torn: its writer died while writing it)"
    if holder.get("host") == socket.gethostname():
        if not _alive(int(holder.get("pid", -1)), holder.get("pid_start")):
            return f"its process {holder.get('pid')} on this host is gone"
        if holder.get("pid") == os.getpid():
            return "it is this process's own (an earlier run in it)"
        return None  # its process runs: live, however long ago it refreshed (a long step, a hang: not ours to end)
    job = os.environ.get("SLURM_JOB_ID", "")
    if job and holder.get("slurm_job_id") == job:
        return f"it was taken by an earlier incarnation of this SLURM job {job} (requeued or auto-resumed)"
    limit = stale_after_s(holder, cfg, out_dir)
    if age > limit:
        return f"not refreshed for {age:.0f} s (stale after {limit:.0f} s)"
    return None


def _read(path):
    """(the lease's JSON, seconds since its last refresh), or (None, None) if it is not there (released meanwhile).
    A lease still being written (empty, or half its JSON) reads as {}: live for TORN_S, then stale (torn)."""
    try:
        age = time.time() - os.stat(path).st_mtime
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None, None
    try:
        return json.loads(text), age
    except ValueError:
        return {}, age


def _describe(holder, age):
    job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"])) if "started" in holder else "?"
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}{job}, started {started}, refreshed "
            f"{age:.0f} s ago")


def _held(path, holder, age, cfg):
    if cfg.get("lease_of"):  # a command's output (for_output)
        return LeaseHeld(
            f"{cfg['lease_of']} is being written by another command ({_describe(holder, age)}): two commands into "
            f"one output compute everything twice and collide in its arrays. Wait for it to end (or stop it: kill "
            f"that pid), or give another output; if that command is certainly gone, remove {path}")
    return LeaseHeld(
        f"out_dir {cfg['out_dir']} is in use by another run ({_describe(holder, age)}): two runs in one out_dir "
        f"delete each other's checkpoints. Wait for it to end, stop it (scancel, or kill that pid), or use another "
        f"out_dir; if that run is certainly gone, remove {path}")


def check(cfg):
    """The dry run's check, before torchrun starts any rank: LeaseHeld if a live run holds out_dir."""
    path = os.path.join(cfg["out_dir"], NAME)
    holder, age = _read(path)
    if holder is not None and _why_stale(holder, age, cfg, cfg["out_dir"]) is None:
        raise _held(path, holder, age, cfg)


class Lease:
    def __init__(self, path, me):
        self.path, self.me = path, me

    def _ours(self):
        holder, _ = _read(self.path)
        return holder is not None and holder.get("id") == self.me["id"]

    def refresh(self):
        """Mark the lease fresh (its mtime), after checking it is still ours."""
        if not self._ours():
            holder, age = _read(self.path)
            raise LeaseLost(f"the lease {self.path} was taken over by another run "
                            f"({_describe(holder or {}, age or 0)}) while this one was not refreshing it: stopping "
                            f"before writing anything more; one of the two runs must go (raise lease_min_s or "
                            f"lease_stale if this run was only slow)")
        os.utime(self.path)

    def expect(self, gap_s):
        """Say (in the lease) that refreshes come gap_s apart: a command's measured time per tile, so that another
        host does not judge a slow command's lease stale after lease_min_s."""
        self.refresh()
        self.me = {**self.me, "gap_s": float(gap_s)}
        _write(self.path, self.me, exclusive=False)

    def release(self):
        """Remove the lease, if it is still ours (never another run's)."""
        if self._ours():
            try:
                os.remove(self.path)
            except FileNotFoundError:  # (rank 0's main thread and its launcher watch can both release it)
                pass


def _write(path, me, exclusive):
    """Write the lease: create-exclusive (FileExistsError if there is one), or through a temporary file renamed over
    the stale one (a rename is atomic: a reader sees the old lease or ours, never half of one)."""
    if exclusive:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    else:
        tmp = f"{path}.tmp.{me['id']}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
        f.flush()
        os.fsync(f.fileno())
    if not exclusive:
        os.replace(tmp, path)


def acquire(cfg, log, gap_s=0.0, eval_ckpt_s=0.0, path=None):
    """Rank 0: take out_dir's lease (see the top of this file). gap_s: the planner's time between two refreshes
    (log_interval steps, an evaluation, a checkpoint), eval_ckpt_s: its evaluation and checkpoint part; both only
    help another run judge this lease stale when it cannot see this process. path: the lease file (for_output's),
    else out_dir/LEASE."""
    out_dir = cfg["out_dir"]
    os.makedirs(out_dir, exist_ok=True)
    path = path or os.path.join(out_dir, NAME)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _start_time(os.getpid()),
          "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""), "started": time.time(), "id": uuid.uuid4().hex,
          "log_interval": cfg["log_interval"], "gap_s": gap_s, "eval_ckpt_s": eval_ckpt_s}
    for _ in range(5):  # (each round ends with the lease ours, a refusal, or a state that changed under us)
        try:
            _write(path, me, exclusive=True)
            return Lease(path, me)
        except FileExistsError:
            pass
        holder, age = _read(path)
        if holder is None:
            continue  # released between our create and our read: create again
        why = _why_stale(holder, age, cfg, out_dir)
        if why is None:
            raise _held(path, holder, age, cfg)
        claim = f"{path}.takeover.{holder.get('id', 'unnamed')}"
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            try:
                if time.time() - os.stat(claim).st_mtime > CLAIM_STALE_S:
                    os.remove(claim)  # left by a run that died while taking over: race again
                    continue
            except FileNotFoundError:
                continue
            raise LeaseHeld(f"{cfg.get('lease_of') or 'out_dir ' + out_dir}: another run is taking over the stale lease of "
                            f"{_describe(holder, age)} right now ({claim}): use another out_dir, or wait and look")
        try:
            again, _ = _read(path)
            if again is None or again.get("id") != holder.get("id"):
                continue  # the lease changed while we claimed it: judge the new one
            _write(path, me, exclusive=False)
        finally:
            os.remove(claim)
        log(f"WARNING: took over the stale lease on {out_dir} ({_describe(holder, age)}): {why}")
        return Lease(path, me)
    raise LeaseHeld(f"{cfg.get('lease_of') or 'out_dir ' + out_dir}: its lease keeps changing hands while this run tries to take it: another run "
                    f"is starting in it; use another out_dir")


def for_output(path, what, log=None):
    """Rank 0 of a command (predict, embed): the lease on its local output `path` (what: the output in words, for
    the refusal), as PATH.lease; None for an s3:// output (see the top of this file). Stale as a run's lease is: its
    holder's process gone on this host, or not refreshed for lease_min_s (the Lease's expect() raises that to
    lease_stale x the measured time between two refreshes once one is measured)."""
    if "://" in path and not path.startswith("file://"):
        return None
    path = path.removeprefix("file://").rstrip("/")
    cfg = {"out_dir": os.path.dirname(os.path.abspath(path)), "log_interval": 1, "lease_of": what,
           "lease_min_s": configurator.lease_min_s, "lease_stale": configurator.lease_stale}
    return acquire(cfg, log or (lambda line: print(line, file=sys.stderr, flush=True)), path=path + ".lease")
