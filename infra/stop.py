"""
The stop protocol: a stop signal becomes a checkpoint that every rank agrees on, then a resumable exit.

    interruptible_start()    a Ctrl-C during a command's imports (seconds, before StopRequest): one line, not a traceback
    StopRequest()            installs SIGTERM / SIGUSR1 / SIGINT handlers; infra/ops.py arms it once training starts
    RESUMABLE                the exit code of a stopped run (75): run the same command again to continue
    INTERRUPTED              a Ctrl-C's (130, 128 + SIGINT): with a checkpoint or without, the shell's code for it
    write_stopped(path, msg) out_dir/STOPPED (a command's: launch.sh's MAE_STOPPED), the one line launch.sh repeats last
    launched(rc)             a rank's exit code: a stop's 75 or 130 is 0 under launch.sh, which ends with it itself

A stop signal (SIGTERM: SLURM's time limit and preemption, a scheduler's kill; SIGUSR1: SLURM's warning before
the time limit, which launch.sh asks for) is a request: the ranks agree at the next step boundary, write a
complete checkpoint of that step (infra/checkpoint.py), out_dir/STOPPED says so, and they exit RESUMABLE. Running the
same command again continues exactly where the run stopped.

Ctrl-C (SIGINT) is the same request, made by a person at a terminal: the first one stops at the next step boundary
with a checkpoint, and the run ends with INTERRUPTED; a second one stops at once (KeyboardInterrupt: no checkpoint
of the steps since the last one; the last line names the newest complete checkpoint). Outside training (start-up,
an evaluation, after the last step) the first one stops at once: there is nothing to save. launch.sh passes each
Ctrl-C to the ranks once (torchrun, which would kill them 30 s after passing on its own, ignores it).
"""
import os
import signal

# torch is imported where it is used, not here: train.py imports this file before torch (interruptible_start)

RESUMABLE = 75  # exit code: stopped cleanly at a complete checkpoint; run the same command again to continue
#                 (sysexits.h's EX_TEMPFAIL, "a temporary failure: the user is invited to retry")
INTERRUPTED = 130  # exit code of a run a Ctrl-C ended (the shell's 128 + SIGINT), with a checkpoint or at once
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
interrupted = False  # a Ctrl-C reached this process: a failure after it (a peer that stopped at once) is its doing


def interruptible_start():
    """A Ctrl-C while train.py's imports run (seconds, before StopRequest exists) ends the process with one line.
    Under launch.sh the ranks inherit torchrun's ignored SIGINT and launch.sh passes each Ctrl-C on: the rank exits 0
    and launch.sh says how the run ended; else the shell's 130."""
    def interrupted_at_start(*_):
        if os.environ.get("RANK", "0") == "0":
            os.write(2, b"interrupted (Ctrl-C) during start-up, before anything was written\n")
        os._exit(0 if os.environ.get("MAE_LAUNCHER") == "launch.sh" else INTERRUPTED)
    signal.signal(signal.SIGINT, interrupted_at_start)


class Interrupted(KeyboardInterrupt):
    """Stopped at once by a Ctrl-C; the message says where the run stands and how to go on (infra/cli.py prints it)."""


class StopRequest:
    """SIGTERM and SIGUSR1 on this rank, turned into a stop that all ranks agree on at a step boundary.

    The handler only notes the signal (a Python handler runs between bytecodes of the main thread; nothing can be
    saved from inside it), so a step or a checkpoint write in progress finishes first. Repeats are ignored: under
    SLURM every process of the step gets the signal and launch.sh forwards it to the ranks as well, so one stop
    arrives as two. The hard stop is SIGKILL (SLURM's KillWait after SIGTERM): a checkpoint cut short by it has no
    COMPLETE marker, so resume never takes it. Outside training (start-up, an evaluation-only run, after the last
    step) there is nothing to save: a signal then ends the process as if no handler were installed.

    Agreement: at each step boundary infra/ops.py all-reduces every rank's flag (`local`); the sum is the same on
    every rank, so all stop after the same step. Reading that sum on the host is a sync; on a GPU it is therefore
    copied without blocking and read one step later (`agreed`), when it has long arrived: the stop comes one step
    later, and no step waits. After a checkpoint write (rare, and a sync anyway) the
    ranks agree once more (`agree_now`), so a signal that arrived during the write stops at that checkpoint."""

    def __init__(self, at="at the next step boundary with a checkpoint"):
        self.signal, self.armed, self._pending, self.interrupts = None, False, None, 0
        self.at = at  # what a stop does, in the line a signal prints
        for s in STOP_SIGNALS:
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum, frame):
        global interrupted
        if signum == signal.SIGINT:
            interrupted, self.interrupts = True, self.interrupts + 1
            if not self.armed or self.interrupts > 1:  # nothing to save, or a second Ctrl-C: at once
                raise KeyboardInterrupt
        elif not self.armed:  # nothing to save: die of the signal, as without this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            rank = os.environ.get("RANK", "0")  # (os.write: a print() inside a handler may re-enter its lock)
            again = " (Ctrl-C again: at once, without one)" if signum == signal.SIGINT else ""
            os.write(2, f"rank {rank}: {self.signal} received: stopping {self.at}{again}\n".encode())

    def finished(self):
        """The stop is complete (checkpoint and STOPPED written): further stop signals (a Ctrl-C too) are ignored, to
        the end of the process. A repeat can arrive late (over ssh, say); with the default action restored it would
        kill the rank while it exits, and torchrun would report a failure (on multi-node, hold the others at its exit
        barrier). Python's shutdown leaves an ignored signal ignored."""
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)

    def local(self):
        """This rank's flag, for the all-reduce at a step boundary: 1.0 once a stop signal arrived."""
        return 1.0 if self.signal else 0.0

    def agreed(self, total):
        """True when the ranks agree to stop after this step. `total`: the all-reduced flags (a 1-element
        tensor). On CPU it is read now; on a GPU the previous step's is read (see the class docstring)."""
        if total.device.type != "cuda":
            return total.item() > 0
        import torch
        host = torch.empty(1, pin_memory=True)
        host.copy_(total, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self._pending = self._pending, (host, event)
        if previous is None:
            return False
        previous[1].synchronize()
        return previous[0].item() > 0

    def agree_now(self, device):
        """One small all-reduce of the flags, read at once: after a checkpoint write (predict: after each tile)."""
        import torch
        t = torch.tensor([self.local()], device=device)
        torch.distributed.all_reduce(t)
        return t.item() > 0

    def signals(self, world):
        """Once the ranks agree to stop, the signals that reached any of them ("SIGTERM", "SIGINT and SIGTERM"), the
        same on every rank (launch.sh requeues only after SIGUSR1; a Ctrl-C's stop ends with INTERRUPTED)."""
        import torch.distributed
        names = [None] * world
        torch.distributed.all_gather_object(names, self.signal)
        return " and ".join(sorted({n for n in names if n}))


def write_stopped(path, message):
    """`path`, out_dir/STOPPED for a run (rank 0, after the checkpoint is complete; a command under launch.sh: its
    MAE_STOPPED): the one line launch.sh repeats last."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(message + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def launched(rc):
    """A rank's exit code. A stopped (RESUMABLE) or interrupted (INTERRUPTED) rank under launch.sh exits 0: launch.sh
    finds STOPPED (or its Ctrl-C) and ends with the code itself, and a non-zero rank would make torchrun report a
    failure."""
    return 0 if rc in (RESUMABLE, INTERRUPTED) and os.environ.get("MAE_LAUNCHER") == "launch.sh" else rc
