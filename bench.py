"""
The measured numbers. Each subcommand prints a table, then one JSON line as the last line of output.

    python bench.py step config/quickstart.py [--key=value ...]   training-step throughput vs matmul peak

Speed is shown here, side by side in one run, never asserted in tests: the machine is noisy, ratios
measured together are what carry over.
"""

import json
import math
import os
import sys
import time

import torch


def table(rows, header):
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))  # noqa: E731
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def matmul_flops(device, dtype, n=2048, iters=10):
    """This machine's dense matmul FLOP/s for an n x n x n product: the ceiling a training step is
    compared against (measured, not a datasheet number)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync()
    return 2 * n ** 3 * iters / (time.perf_counter() - t)


def bench_step(argv, warmup=3, steps=10):
    """Time `steps` training steps of a config after `warmup` untimed ones, in one process."""
    import configurator
    import data
    import train
    cfg = {k: getattr(train, k) for k in train.CONFIG_KEYS}
    configurator.apply(cfg, argv)
    train.validate(cfg)
    job = train.setup(cfg)
    batches = data.Prefetcher(job.sampler, 0, warmup + steps)
    sync = torch.cuda.synchronize if job.on_gpu else (lambda: None)
    try:
        for s in range(warmup):
            train.train_step(job, s, batches)
        sync()
        t, wait = time.perf_counter(), 0.0
        for s in range(warmup, warmup + steps):
            wait += train.train_step(job, s, batches)[2]
        sync()
        dt = (time.perf_counter() - t) / steps
    finally:
        batches.close()
    threads = torch.get_num_threads()
    peak = matmul_flops(job.device, job.dtype)
    sps = job.global_batch / dt
    achieved = job.model.flops_per_sample() * sps
    res = {"bench": "step", "config": argv[0] if argv else "defaults", "device": job.device.type,
           "dtype": str(job.dtype).replace("torch.", ""), "threads": threads, "tokens": job.model.L,
           "global_batch": job.global_batch, "ms_per_step": round(1000 * dt, 2), "samples_per_s": round(sps, 3),
           "achieved_flops": achieved, "matmul_flops": peak, "frac_of_matmul": round(achieved / peak, 4),
           "data_wait_frac": round(wait / (dt * steps), 4)}
    table([[res["config"], res["device"], res["threads"], res["tokens"], res["global_batch"],
            f"{res['ms_per_step']:.1f}", f"{sps:.2f}", f"{achieved / 1e9:.2f}", f"{peak / 1e9:.2f}",
            f"{100 * achieved / peak:.1f}%", f"{100 * res['data_wait_frac']:.1f}%"]],
          ["config", "device", "threads", "tokens", "batch", "ms/step", "samples/s", "GFLOP/s", "matmul GFLOP/s",
           "of matmul", "data wait"])
    return res


if __name__ == "__main__":
    cmds = {"step": bench_step}
    if len(sys.argv) < 2 or sys.argv[1] not in cmds:
        print(f"usage: python bench.py {{{'|'.join(cmds)}}} [CONFIG] [--key=value ...]", file=sys.stderr)
        sys.exit(2)
    result = cmds[sys.argv[1]](sys.argv[2:])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    print(json.dumps(result))
