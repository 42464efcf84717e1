"""
How every command ends: the project's own errors as one `error:` line and an exit code, never a traceback.

    sys.exit(cli.run(main, sys.argv[1:]))

A command's (inline, crossline, time) options are read by triple(), its other checks made by configurator.need().

Exit codes: 0 done; 2 bad input (configurator.ConfigError, reader.DataError, a ring that disagrees with
PyTorch's: infra/torch_cp.py's CPMismatchError; another live run in out_dir: lease.LeaseHeld); 3 a diverged run
(FloatingPointError); 4 the run's surroundings refused it (outputs.StorageError: no space, over quota, read-only;
lease.LeaseLost: another run took out_dir over); train.py's stopped-at-a-checkpoint code (stop.RESUMABLE, 75)
passes through. Under torchrun only rank 0 prints the line (every rank would say the same; the others give it
time to, see run). Under launch.sh (MAE_ERROR_FILE set) every failing rank also appends its first line to that
file, after the exit code it ends with ("2 error: ..."), so that launch.sh ends with the first rank's reason rather
than with torchrun's traceback, and with that rank's code rather than torchrun's 1 (torchrun reports any failed
rank as 1); a bug (any other exception) is noted there too, as 1, and then raised, traceback and all.
"""
import gc
import os
import signal
import sys
import time

import torch

from configurator import ConfigError
from infra import distributed, stop
from infra.lease import LeaseLost
from infra.outputs import StorageError
from infra.reader import DataError
from infra.torch_cp import CPMismatchError

BAD_INPUT = (ConfigError, DataError, CPMismatchError)
RANK_0_GRACE_S = 10.0  # how long another rank's bad input waits for rank 0 to report the same (see run)
REFUSED = (StorageError, LeaseLost)  # not the input, not a bug: the disk, or another run
INTERRUPTED = stop.INTERRUPTED


def positive(opts, zero_ok=()):
    """A bench's numeric options (a dict of numbers and tuples of them), each > 0 (>= 0 for those in zero_ok): else
    one ConfigError naming the first that is not."""
    for k, v in opts.items():
        for x in (v if isinstance(v, tuple) else (v,)):
            if isinstance(x, (int, float)) and not isinstance(x, bool) and not (x >= 0 if k in zero_ok else x > 0):
                raise ConfigError(f"--{k}={v!r} must be {'>= 0' if k in zero_ok else '> 0'}")


def triple(text, what, least=1):
    """A command line's (inline, crossline, time) triple: "64,64,128", "(64,64,128)" or "[64, 64, 128]" -> a tuple of
    3 ints >= least (1: positive, 0: non-negative); "" -> None (the caller's default). Anything else is a ConfigError naming the option."""
    if not text:
        return None
    try:
        v = tuple(int(x) for x in text.strip("()[] ").split(","))
    except ValueError:
        v = ()
    if len(v) != 3 or min(v) < least:
        raise ConfigError(f"--{what}={text!r}: give 3 {'positive' if least else 'non-negative'} integers (inline, "
                          f"crossline, time), e.g. --{what}=64,64,128")
    return v


def add_read_arguments(ap):
    """A command's options for how it reads stores (argparse): --s3_anon, --s3_endpoint, --read_timeout_s,
    --read_retries; read_options(args) turns them into ReadOptions."""
    ap.add_argument("--s3_anon", action="store_true", help="read s3:// without credentials (public buckets)")
    ap.add_argument("--s3_endpoint", default="", help="an S3-compatible endpoint URL")
    ap.add_argument("--read_timeout_s", type=float, default=30.0, help="a request not answered by then is retried")
    ap.add_argument("--read_retries", type=int, default=6, help="retries of a failing request, then an error")


def read_options(a):
    from infra.reader import ReadOptions
    return ReadOptions(anon=a.s3_anon, endpoint_url=a.s3_endpoint or None, retries=a.read_retries,
                       timeout_s=a.read_timeout_s)


def note_error(line, code):
    """One line appended to launch.sh's MAE_ERROR_FILE, "CODE LINE": the exit code this rank ends with, then its line
    (O_APPEND, one write: the ranks' lines do not interleave, and each code stays with its line)."""
    path = os.environ.get("MAE_ERROR_FILE")
    if path:
        with open(path, "a") as f:
            f.write(f"{code} " + line.replace("\n", " ") + "\n")


def run(main, argv, interrupted="nothing of this command's was left half-written"):
    """main(argv) -> its exit code, with the project's errors turned into one line on stderr. A Ctrl-C ends it with
    one line too (the KeyboardInterrupt's own message, stop.Interrupted's, else `interrupted`: what it leaves) and
    the shell's code for it (a process of its own dies of the SIGINT, as shells expect; a rank exits 130)."""
    rank = os.environ.get("RANK", "0")
    try:
        rc = main(argv)
    except KeyboardInterrupt as e:  # a Ctrl-C (infra/stop.py)
        line = str(e) if str(e) else f"interrupted (Ctrl-C): {interrupted}"
        if rank == "0":  # (every rank got it: rank 0 says it for all; launch.sh repeats its line last)
            note_error(line, INTERRUPTED)
            print(line, file=sys.stderr, flush=True)
        rc = INTERRUPTED
    except BAD_INPUT + REFUSED + (FloatingPointError,) as e:  # nothing is half-written: one line says why
        why = " ".join(str(e).split())  # one line, even where the cause quoted a library's multi-line message
        line = f"error: {why}" if rank == "0" else f"error: (rank {rank}) {why}"
        rc = 3 if isinstance(e, FloatingPointError) else 4 if isinstance(e, REFUSED) else 2
        note_error(line, rc)
        if rank != "0" and isinstance(e, BAD_INPUT) and os.environ.get("TORCHELASTIC_RUN_ID"):
            # Every rank checks the same input and rank 0 says it for all, but torchrun ends the other ranks as soon
            # as one exits: had this rank exited first, rank 0 would be killed before its line (seen: a bad crop
            # showed torchrun's report alone). So this rank waits for torchrun to end it once rank 0 has exited;
            # still here after the wait, the input was bad on this rank alone (its own data), and it says so.
            time.sleep(RANK_0_GRACE_S)
            print(line, file=sys.stderr, flush=True)
        elif rank == "0" or (isinstance(e, REFUSED) and not getattr(e, "agreed", False)):  # (one rank's alone)
            print(line, file=sys.stderr, flush=True)
    except Exception as e:  # a bug, or a failure of a peer: the traceback follows; launch.sh names the first
        if stop.interrupted:  # a peer stopped at once by the same Ctrl-C (its line is rank 0's): not a failure
            if rank == "0":
                line = "interrupted (Ctrl-C): stopped at once, as the other ranks did"
                note_error(line, INTERRUPTED)
                print(line, file=sys.stderr, flush=True)
            return finish(INTERRUPTED)
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        lost = distributed.lost_a_peer(e)
        dead = distributed.dead_peers() if lost else []
        if dead:  # a rank of this node died without a word (kill -9, the OOM killer, a crash): it is the cause, and
            # the last line names it, not this rank that noticed (one line, no traceback: the cause is known)
            line = (f"error: rank {dead[0][0]} (pid {dead[0][1]}) died first, without an error of its own (killed by "
                    f"a signal: kill -9, the out-of-memory killer, a crash in native code); rank {rank} lost it: {why}")
            if not already_noted():  # (a rank that failed with an error of its own has said it first)
                note_error(line, 1)
            print(line, file=sys.stderr, flush=True)
            return finish(1)
        elsewhere = lost and len(distributed.siblings) < int(os.environ.get("WORLD_SIZE", "1")) - 1
        note_error(f"error: (rank {rank}) " + ("lost a peer on another node (that node's log names the rank that "
                                               "died first): " if elsewhere else "") + why, 1)
        raise
    return finish(rc)


def finish(rc):
    """The end of every command: the process group closed, the code returned; after a Ctrl-C a process of its own
    dies of SIGINT (a shell's loop around it stops too, as shells expect), a rank returns 130 (torchrun's)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.freeze()  # the interpreter's last collection at exit walked every object torch and DeepSpeed made: seconds
    if rc == INTERRUPTED and not os.environ.get("TORCHELASTIC_RUN_ID"):
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return rc or 0


def already_noted():
    """Whether a rank has already put its first line into launch.sh's MAE_ERROR_FILE."""
    path = os.environ.get("MAE_ERROR_FILE")
    return bool(path) and os.path.exists(path) and os.path.getsize(path) > 0
