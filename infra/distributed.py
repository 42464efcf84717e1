"""
Distributed setup, in one place: the environment torch.distributed reads, the process group, the context-parallel
groups, and work that rank 0 does for everyone.

    free_port()               a free TCP port on this machine (a test's rendezvous, a loopback server)
    init()                    torch.distributed started for this process -> (rank, world, device)
    group_kwargs(on_gpu, lr)  init_process_group's arguments: NCCL bound to the local rank's GPU, or gloo
    die_with_launcher()       under torchrun: this rank ends as soon as its torchrun is gone (init calls it)
    cp_groups(cp)             (cp_rank, dp_rank, dp_size, cp_group): ranks [i*cp, (i+1)*cp) share sample stream i
    on_rank_0(work)           work() on rank 0, the others waiting; its result on every rank

train.py, the scripts (embed) and the benches all start their ranks through init(), so a rank is a rank
whichever of them runs: torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or a world of 1 for a bare `python`.
"""
import datetime
import os
import signal
import socket
import threading
import time

import torch
import torch.distributed as dist


def free_port():
    """A TCP port nobody listens on now (the kernel picks it; a race with another process is possible, and rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init():
    """Start torch.distributed: torchrun's environment, or a world of 1 (a bare python) whose rendezvous is an
    in-process store: a lone process opens no port, so two commands started at once (a predict and a second one
    the lease refuses) cannot collide on one (a free port found, closed and bound again is a race a busy machine
    loses). NCCL on GPUs (one per local rank), gloo on CPU. DeepSpeed's accelerator is chosen here, before
    anything imports deepspeed: it reads DS_ACCELERATOR once, at import. Returns (rank, world, device)."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", "0")  # (read by nobody when alone; DeepSpeed only checks that it is set)
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    elif os.environ.get("DS_ACCELERATOR") == "cpu":
        del os.environ["DS_ACCELERATOR"]  # inherited from a CPU machine (a login node): wrong here
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    if dist.is_initialized():  # (started already: train.py's Operations, then its setup): the same answer
        return rank, world, device
    alone = world == 1 and not os.environ.get("TORCHELASTIC_RUN_ID")
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # (torchrun sets it for the ranks it starts)
        die_with_launcher()
    if on_gpu:
        torch.cuda.set_device(local)
    lone = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if alone else {}
    dist.init_process_group(**group_kwargs(on_gpu, local), **lone)
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # (every rank has joined: its node's peers exist)
        siblings.update(find_siblings())
    return rank, world, device


def group_kwargs(on_gpu, local_rank):
    """init_process_group's arguments: NCCL bound to this rank's GPU (device_id: NCCL then knows the rank's device
    from the start instead of guessing it from the global rank at the first collective, which hangs when ranks and
    GPUs do not map one to one, and barrier() no longer warns), or gloo on CPU."""
    if on_gpu:
        return {"backend": "nccl", "device_id": torch.device("cuda", local_rank)}
    return {"backend": "gloo"}


at_launcher_gone = None  # what a rank does before die_with_launcher ends it: infra/ops.py sets rank 0's lease release
siblings = {}  # {pid: rank} of the other ranks torchrun started on this node (init finds them): dead_peers()


def find_siblings():
    """{pid: RANK} of the other processes of this rank's parent (torchrun) that are ranks: read from /proc (Linux;
    elsewhere nothing). Once every rank has joined the process group they all exist."""
    me, parent, out = os.getpid(), os.getppid(), {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()) if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{pid}/stat") as f:
                if pid == me or int(f.read().rsplit(")", 1)[1].split()[1]) != parent:
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
            if b"RANK" in env:
                out[pid] = int(env[b"RANK"])
        except (OSError, ValueError, IndexError):
            continue
    return out


def _gone(pid):
    """Whether process `pid` has ended (it is gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def dead_peers(wait_s=1.0):
    """[(rank, pid)] of the ranks of this node that have ended, waiting up to wait_s for one (a peer's sockets close as
    it dies, a moment before /proc says so). infra/cli.py names the first in the last line."""
    deadline = time.time() + wait_s
    while True:
        dead = sorted((r, p) for p, r in siblings.items() if _gone(p))
        if dead or time.time() > deadline:
            return dead
        time.sleep(0.05)


def lost_a_peer(exc):
    """Whether a collective's failure is a lost peer (its connection closed, reset or timed out: gloo's and NCCL's
    words), not a bug of this rank."""
    text = f"{type(exc).__name__}: {exc}"
    return isinstance(exc, getattr(dist, "DistNetworkError", ())) or any(
        w in text for w in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ECONNRESET",
                            "remote process exited", "Socket Timeout", "NCCL communicator was aborted"))


def die_with_launcher(poll_s=0.5):
    """Under torchrun: end this rank (SIGKILL, no checkpoint) as soon as its parent, torchrun, is gone.
    torchrun starts each rank in a session of its own, so a `kill -9` of launch.sh's process group, an OOM kill of
    torchrun or a dropped ssh session ends torchrun alone, and without this its ranks would train on unseen: holding
    the GPUs, writing checkpoints, and making the relaunch a second run in the same out_dir. A thread watches the
    parent pid (when the parent dies the rank is handed to init or a subreaper: getppid changes). Nothing is saved
    (COMPLETE markers keep what is on disk safe) but out_dir's lease: rank 0 releases it first (at_launcher_gone),
    so that the relaunch finds out_dir free from any host. It would release it anyway, and just as fast, whenever
    the other rank's kill came first and its next collective failed; now it does either way.
    (prctl's PR_SET_PDEATHSIG would be instant, but it fires when the *thread* that started the rank ends, and
    torchrun's threads are its own business.)"""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        try:  # (stderr may be a pipe whose reader was the launcher: a write can fail, the kill must not)
            os.write(2, f"rank {os.environ.get('RANK', '?')}: its launcher (torchrun, pid {parent}) is gone: "
                        f"stopping now, without a checkpoint\n".encode())
        except OSError:
            pass
        try:
            if at_launcher_gone:
                at_launcher_gone()
        finally:
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die_with_launcher", daemon=True).start()


def cp_groups(cp):
    """The context-parallel layout of the world: ranks [i*cp, (i+1)*cp) hold the slabs of one sample (contiguous,
    so that a group stays on one node's NVLink) and form data-parallel group i. Every rank creates every group, in
    the same order (new_group is collective). Returns (cp_rank, dp_rank, dp_size, this rank's cp group or None)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = rank // cp, world // cp
    group = None
    if cp > 1:
        for i in range(dp_size):
            g = dist.new_group(list(range(i * cp, (i + 1) * cp)))
            if i == dp_rank:
                group = g
    return rank % cp, dp_rank, dp_size, group


def on_rank_0(work):
    """All ranks: work() runs on rank 0 while the others wait; returns its result (picklable) on every rank. Bad input
    found there (a ValueError: ConfigError, DataError) is raised on every rank as it was. The others wait on a
    gloo group of their own with a long timeout: the work (converting or exporting the state of 1.6 B parameters,
    indexing a library of stores) takes minutes, longer than a training collective should ever be allowed to hang.
    Any other failure ends rank 0, and the launcher then ends the rest."""
    wait = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=6))  # (collective: before the work)
    box = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = work()
        except ValueError as e:
            box[1] = e
    dist.broadcast_object_list(box, src=0, group=wait)
    dist.destroy_process_group(wait)
    if box[1] is not None:
        raise box[1]
    return box[0]
