"""Run a function on W real gloo processes (torch.multiprocessing spawn) and re-raise any failure."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infra.distributed import free_port


def _worker(rank, world, port, fn, args):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    fn(rank, world, *args)  # (a failure: spawn reports it, and ends the other ranks)
    dist.barrier()  # every rank is done: the process ends here without tearing gloo down, as a teardown racing a
    sys.stdout.flush()  # peer's exit can end in std::terminate (SIGABRT) after the test has passed
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world, fn, *args, timeout=600):
    """fn(rank, world, *args) on `world` processes; fn must be importable (module level)."""
    ctx = mp.start_processes(_worker, args=(world, free_port(), fn, args), nprocs=world, join=False,
                             start_method="spawn")
    while not ctx.join(timeout=timeout):
        pass
