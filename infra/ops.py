"""
The run's operations, which train.py enters once and its loop asks at each step boundary: out_dir's lease, the stop
signals, STOPPED, the checkpoints (when to write one, and writing it), and how a run that a Ctrl-C ended says where
it stands.

    with Operations(cfg, stop) as ops:  # rank 0 takes out_dir's lease before anything is written there
        ops.job = setup(cfg)             # (its readers are closed and the lease released however the run ends)
        ops.begin(end)                   # an earlier stop's STOPPED removed, stop signals armed
        ...after each step:
        stopping = ops.should_stop(step)     # the same answer on every rank: a stop signal reached one of them
        if stopping or ops.should_checkpoint(step + 1):
            stopping = ops.checkpoint(step + 1) or stopping     # (True also if a signal came during the write)
        ...after the loop:
        ops.close()                      # (in a finally) the stop signals disarmed, unless a stop is under way
        return ops.finish(done)          # 0; or STOPPED written, and RESUMABLE (75) or INTERRUPTED (130)
    # a Ctrl-C that stopped at once leaves the block as stop.Interrupted: the last line names the newest checkpoint

The lease (infra/lease.py: one run per out_dir) is refreshed at step boundaries, at most once every REFRESH_S,
and on both sides of every checkpoint write: before it, so that a run whose out_dir another run took over writes
nothing more (LeaseLost), and after it, as a write can take long. Another run judges it stale only after lease_stale
x (log_interval steps + an evaluation + a checkpoint) without a refresh, and never sooner than lease_min_s; before
this run has logged a step, those times are the planner's (infra/plan.py), which the lease carries.

The stop protocol (infra/stop.py): each rank's flag (1 once a stop signal reached it) is all-reduced at every step
boundary, one float, so every rank stops after the same step. Reading the sum on the host is a sync; on a GPU it is
read one step late (StopRequest.agreed), so no step waits for it. The stopped run writes a checkpoint of that step,
then STOPPED (the one line launch.sh repeats last), and exits RESUMABLE, or INTERRUPTED after a Ctrl-C.
"""
import os
import sys
import time

import torch

import configurator
from infra import checkpoint, distributed, lease, plan
from infra import stop as stop_signals
from infra.stop import INTERRUPTED, RESUMABLE, Interrupted, write_stopped

REFRESH_S = 1.0  # the lease's refresh at step boundaries, at most this often: a stat, a read and a utime on rank 0


class Operations:
    def __init__(self, cfg, stop):
        """cfg: the run's checked config; stop: a StopRequest, or None (no signal handling: a run driven from a
        thread that is not the main one). The job (train.py's Job) is set once setup has built it."""
        self.cfg, self.stop, self.job, self.lease = cfg, stop, None, None
        self.ckpt_dir = os.path.join(cfg["out_dir"], "ckpt")
        self.stopped = None  # the signals that stopped the run ("SIGTERM", "SIGINT and SIGTERM"), once agreed
        self.refreshed, self.end = time.time(), None

    def __enter__(self):
        """One run per out_dir, before anything is written there: rank 0 takes its lease (or takes over a stale one),
        and a live one held by another run is refused on every rank (infra/lease.py). A failure or a Ctrl-C in here
        (the ranks' rendezvous can take minutes) ends as one in the block does: Python calls no __exit__ for it."""
        try:
            self._take_lease()
        except BaseException:
            if not self.__exit__(*sys.exc_info()):
                raise
        return self

    def _take_lease(self):
        cfg = self.cfg
        rank, world, _ = distributed.init()  # (train.py's setup calls it again: it is started once)
        configurator.check_world(cfg, world)  # (before the planner splits the world into cp groups)
        p = plan.plan(cfg, world, gpus_per_node=max(1, world // cfg["nodes"]))  # what another host can't measure yet
        eval_ckpt_s = p["eval_s"] + p["ckpt_s"]
        log = print if rank == 0 else (lambda *a, **k: None)
        held = distributed.on_rank_0(lambda: lease.acquire(cfg, log, cfg["log_interval"] * p["step_s"] + eval_ckpt_s,
                                                           eval_ckpt_s))
        self.lease = held if rank == 0 else None
        if self.lease:  # (a kill -9 of the launcher: the rank ends at once, out_dir free)
            distributed.at_launcher_gone = self.lease.release

    def __exit__(self, kind, error, tb):
        """The run is over (done, stopped, or failed): its data readers closed, out_dir free for the next run. A
        Ctrl-C that stopped at once (or a peer's failure it caused) becomes where the run stands, as the last line."""
        for closing in (self.job.sampler, self.job.val_sampler) if self.job else ():
            if closing is not None:
                closing.close()
        if self.lease:
            self.lease.release()
        if kind is not None and not issubclass(kind, Interrupted) and (
                issubclass(kind, KeyboardInterrupt) or (issubclass(kind, Exception) and stop_signals.interrupted)):
            raise Interrupted(where_it_stands(self.cfg, started=self.job is not None)) from None
        return False

    def begin(self, end):
        """Training starts; it goes up to step `end` (stop_step or max_steps): an earlier stop's STOPPED goes (this
        run goes on from it), and from here a stop signal is a checkpoint at the next step boundary."""
        self.end = end
        stopped_file = os.path.join(self.cfg["out_dir"], "STOPPED")
        if self.job.rank == 0 and os.path.exists(stopped_file):
            os.remove(stopped_file)
        if self.stop:
            self.stop.armed = True

    def refresh(self):
        """Rank 0: the lease is still ours (LeaseLost otherwise), and fresh."""
        if self.lease:
            self.lease.refresh()
            self.refreshed = time.time()

    def should_stop(self, step):
        """After training step `step`: do the ranks stop here (a stop signal reached at least one)? The same answer
        on every rank. Also the lease's refresh, when REFRESH_S has passed."""
        if time.time() - self.refreshed >= REFRESH_S:
            self.refresh()
        if self.stop is None:
            return False
        flags = torch.full((1,), self.stop.local(), device=self.job.device)  # (on a GPU: a fill, no host sync)
        torch.distributed.all_reduce(flags)
        return self._agreed(self.stop.agreed(flags))

    def should_checkpoint(self, done):
        """A checkpoint of the weights after `done` steps is due: every ckpt_interval steps, and at the run's end."""
        return done % self.job.cfg["ckpt_interval"] == 0 or done == self.end

    def checkpoint(self, done):
        """Write the checkpoint of the weights after `done` steps (infra/checkpoint.py), with what a resume needs:
        the step, the config, the dtype, the samples the training stream has given (a resume's data position) and
        which stores it draws from. Returns True when the ranks now agree to stop: a signal that arrived during the
        write stops the run at this checkpoint, not one step later."""
        job = self.job
        self.refresh()  # never write (nor rotate) checkpoints in an out_dir that another run has taken over
        samples_seen = job.sampler.offset + done * job.global_batch  # (offset: see data.Sampler)
        checkpoint.save(job.engine, self.ckpt_dir, done, {"step": done, "config": job.cfg, "dtype": str(job.dtype),
                                                          "samples_seen": samples_seen, "stores": job.stores_digest},
                        job.cfg["keep_ckpts"], job.rank, plan.checkpoint_bytes(job.n_params, job.dtype))
        self.refresh()
        job.log(f"checkpoint step_{done:07d} written to {self.ckpt_dir}")
        return (self.stop is not None and self.stopped is None and done < self.end
                and self._agreed(self.stop.agree_now(job.device)))

    def _agreed(self, stopping):
        """Once the ranks agree to stop: which signals they got (launch.sh requeues only after SIGUSR1)."""
        if stopping and self.stopped is None:
            self.stopped = self.stop.signals(self.job.world)
        return stopping

    def close(self):
        """The loop is over (done, or an error): a stop signal now just ends the process. After an agreed stop the
        handlers stay armed, so that a repeat of the signal cannot kill a rank before STOPPED is written."""
        if self.stop and not self.stopped:
            self.stop.armed = False

    def finish(self, done):
        """The run's exit code after `done` steps: 0, or for a stopped run (before max_steps: a stop at the last step
        is just the end) STOPPED written, every rank past it, and RESUMABLE or INTERRUPTED (a Ctrl-C's)."""
        job = self.job
        if not self.stopped or done >= job.cfg["max_steps"]:
            return 0
        code = INTERRUPTED if "SIGINT" in self.stopped else RESUMABLE
        msg = (f"stopped by {self.stopped} after {done} steps: checkpoint {self.ckpt_dir}/step_{done:07d} is complete; "
               f"run the same command again to continue (exit code {code}: "
               f"{'interrupted by Ctrl-C' if code == INTERRUPTED else 'stopped'}, resumable)")
        if job.rank == 0:
            write_stopped(os.path.join(job.cfg["out_dir"], "STOPPED"), msg)
        job.log(msg)
        torch.distributed.barrier()  # no rank (no node's launch.sh) ends before STOPPED exists
        self.stop.finished()
        return code


def where_it_stands(cfg, started):
    """The last line of a run a Ctrl-C stopped at once: its newest complete checkpoint and how to go on."""
    ckpt_dir = os.path.join(cfg["out_dir"], "ckpt")
    done = checkpoint.complete_checkpoints(ckpt_dir)
    then = (f"{ckpt_dir}/{done[-1][1]} is the newest complete checkpoint: run the same command again to resume "
            f"from it" if done else "no checkpoint was written: the same command starts the run again from step 0")
    return (f"interrupted (Ctrl-C) at once, without a checkpoint of the steps since the last one; {then}" if started
            else f"interrupted (Ctrl-C) during start-up, before any step; {then}")
