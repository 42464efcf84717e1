"""Run a function on W real gloo processes (torch.multiprocessing spawn) and re-raise any failure."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infra.distributed import free_port


def _worker(rank, world, port, fn, args):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world, fn, *args, timeout=600):
    """fn(rank, world, *args) on `world` processes; fn must be importable (module level)."""
    ctx = mp.start_processes(_worker, args=(world, free_port(), fn, args), nprocs=world, join=False,
                             start_method="spawn")
    while not ctx.join(timeout=timeout):
        pass
