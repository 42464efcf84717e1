"""
The measured numbers. Each subcommand prints a table, then one JSON line as the last line of output.

    python bench.py step config/quickstart.py [--key=value ...]   training-step throughput vs matmul peak
    python bench.py attention [--n=16384] [--ranks=2] [--only=ring] full SDPA vs ring vs torch CP, per rank
    python bench.py gpu-check                                      the ring's CUDA op path, on a GPU

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
        job.sampler.close()
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


# -----------------------------------------------------------------------------
# attention: the same total sequence as full SDPA in one process, as our ring on P processes, and as
# PyTorch's context_parallel on P processes; the same total threads (P threads for SDPA, 1 per rank).


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _attention_worker(rank, world, port, variant, B, H, N, D, iters, out_path):
    import resource

    import torch.distributed as dist
    import torch.nn.functional as F

    import ring_attention as RA
    torch.set_num_threads(1 if variant != "sdpa" else world)
    if variant != "sdpa":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    n = N if variant == "sdpa" else N // world  # tokens held by this process
    fn = {"sdpa": F.scaled_dot_product_attention, "ring": RA.ring_attention, "torch": RA.torch_cp_attention}[variant]
    backward = variant != "torch"  # torch 2.13 has no CPU backward for context_parallel
    g = torch.Generator().manual_seed(rank)
    small = [torch.randn(B, H, 256, D, generator=g, requires_grad=True) for _ in range(3)]
    o = fn(*small)  # warm-up: kernels and communicators initialised outside the timing
    if backward:
        o.sum().backward()
    base = _rss_bytes()
    q, k, v = (torch.randn(B, H, n, D, generator=g, requires_grad=backward) for _ in range(3))
    dout = torch.randn(B, H, n, D, generator=g)
    times, waits = [], []
    for _ in range(iters):
        if variant != "sdpa":
            dist.barrier()
        RA.STATS["comm_wait_s"] = 0.0
        t = time.perf_counter()
        o = fn(q, k, v)
        if backward:
            o.backward(dout)
        times.append(time.perf_counter() - t)
        waits.append(RA.STATS["comm_wait_s"])
        del o
        q.grad = k.grad = v.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base  # above the process baseline
    i = min(range(iters), key=times.__getitem__)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"time_s": times[i], "comm_wait_s": waits[i], "peak_bytes": peak}, f)
    if variant != "sdpa":
        dist.destroy_process_group()


def _run_attention(variant, ranks, B, H, N, D, iters):
    import socket
    import tempfile

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = 1 if variant == "sdpa" else ranks
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r")
        mp.start_processes(_attention_worker, args=(procs if variant != "sdpa" else ranks, port, variant, B, H, N,
                                                    D, iters, out), nprocs=procs, start_method="spawn")
        per_rank = []
        for r in range(procs):
            with open(f"{out}.{r}") as f:
                per_rank.append(json.load(f))
    return {"time_s": max(p["time_s"] for p in per_rank), "comm_wait_s": max(p["comm_wait_s"] for p in per_rank),
            "peak_bytes": max(p["peak_bytes"] for p in per_rank)}


def bench_attention(argv):
    opts = {"n": 16384, "ranks": 2, "batch": 1, "heads": 4, "dim": 64, "iters": 2, "only": "sdpa,ring,torch"}
    import configurator
    configurator.apply(opts, argv)
    B, H, N, D, P = opts["batch"], opts["heads"], opts["n"], opts["dim"], opts["ranks"]
    assert N % P == 0, f"n={N} must divide by ranks={P}"
    variants = opts["only"].split(",")
    res = {v: _run_attention(v, P, B, H, N, D, opts["iters"]) for v in variants}
    rows = []
    flops = 4 * B * H * N * N * D  # forward matmul FLOPs of the whole attention
    for v, r in res.items():
        procs = 1 if v == "sdpa" else P
        work = flops * (3.5 if v != "torch" else 1.0)  # backward ~2.5x forward
        rows.append([v, procs, P if v == "sdpa" else 1, "fwd" if v == "torch" else "fwd+bwd", f"{r['time_s']:.3f}",
                     f"{work / r['time_s'] / 1e9:.1f}", f"{r['peak_bytes'] / 2 ** 20:.1f}",
                     f"{100 * r['comm_wait_s'] / r['time_s']:.1f}%" if v == "ring" else "-"])
    print(f"attention B={B} H={H} N={N:,} (total) D={D}; ring and torch over {P} ranks, 1 thread each; "
          f"SDPA in 1 process with {P} threads; time = slowest rank; memory = peak RSS above the process baseline")
    table(rows, ["impl", "procs", "threads/proc", "pass", "seconds", "GFLOP/s", "peak MiB/rank", "comm wait"])
    out = {"bench": "attention", "B": B, "H": H, "N": N, "D": D, "ranks": P}
    for v, r in res.items():
        out[f"{v}_s"] = round(r["time_s"], 4)
        out[f"{v}_peak_mib"] = round(r["peak_bytes"] / 2 ** 20, 1)
    if "ring" in res:
        out["comm_wait_frac"] = round(res["ring"]["comm_wait_s"] / res["ring"]["time_s"], 4)
    if "ring" in res and "sdpa" in res:
        out["ring_over_sdpa"] = round(res["ring"]["time_s"] / res["sdpa"]["time_s"], 4)
        out["mem_ratio"] = round(res["ring"]["peak_bytes"] / max(1, res["sdpa"]["peak_bytes"]), 4)
    return out


# -----------------------------------------------------------------------------
# gpu-check: the ring's CUDA op path (flash for bf16, memory-efficient for fp32) simulated over P blocks in
# one process against full SDPA, forward and backward; then attention timings at 102,400 tokens.


def gpu_check(argv):
    import torch.nn.functional as F

    import ring_attention as RA
    assert torch.cuda.is_available(), "gpu-check needs a CUDA GPU"
    dev = torch.device("cuda")
    rows, out = [], {"bench": "gpu-check", "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    worst = {}
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for P, N, Dh in ((2, 1000, 64), (4, 4100, 64), (8, 8 * 1031, 128), (3, 3 * 509, 80)):
            g = torch.Generator(device=dev).manual_seed(P * N)
            q, k, v, dout = (torch.randn(1, 4, N, Dh, device=dev, generator=g) for _ in range(4))
            qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(qr, kr, vr)  # fp64 reference (math kernel)
            ref.backward(dout.double())
            got, grads = RA.simulate_ring(*(t.to(dtype) for t in (q, k, v)), P, dout=dout.to(dtype))
            errs = []
            for a, b in zip((got, *grads), (ref, qr.grad, kr.grad, vr.grad)):
                errs.append((a.double() - b).abs().max().item() / max(1.0, b.abs().max().item()))
            name = f"{str(dtype)[6:]} P={P} N={N} D={Dh}"
            worst[name] = max(errs)
            rows.append([name, *(f"{e:.2e}" for e in errs), "ok" if max(errs) <= tol else "FAIL"])
    table(rows, ["case", "out", "dq", "dk", "dv", f"tol fp32 1e-5 / bf16 2e-2"])
    out["max_rel_err"] = worst
    out["all_ok"] = all(r[-1] == "ok" for r in rows)
    # timings at 102,400 tokens (the base_102k decoder length), bf16, B=1, H=8, D=64
    N, H, Dh = 102_400, 8, 64
    q, k, v, dout = (torch.randn(1, H, N, Dh, device=dev, dtype=torch.bfloat16) for _ in range(4))

    def timed(fn, reps=3):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    def sdpa_fb():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(qq, kk, vv).backward(dout)

    flops = 4 * N * N * Dh * H
    t_sdpa_f = timed(lambda: F.scaled_dot_product_attention(q, k, v))
    t_sdpa_fb = timed(sdpa_fb)
    t_sim_f = timed(lambda: RA.simulate_ring(q, k, v, 8))
    t_sim_fb = timed(lambda: RA.simulate_ring(q, k, v, 8, dout=dout))
    trows = [["sdpa fwd", f"{1000 * t_sdpa_f:.1f}", f"{flops / t_sdpa_f / 1e12:.0f}"],
             ["sdpa fwd+bwd", f"{1000 * t_sdpa_fb:.1f}", f"{3.5 * flops / t_sdpa_fb / 1e12:.0f}"],
             ["ring blocks P=8 fwd", f"{1000 * t_sim_f:.1f}", f"{flops / t_sim_f / 1e12:.0f}"],
             ["ring blocks P=8 fwd+bwd", f"{1000 * t_sim_fb:.1f}", f"{3.5 * flops / t_sim_fb / 1e12:.0f}"]]
    print(f"\nattention at N = {N:,} tokens, bf16, H={H}, D={Dh} (one process; the ring's 8 blocks run in sequence)")
    table(trows, ["what", "ms", "TFLOP/s"])
    out.update(sdpa_fwd_ms=round(1000 * t_sdpa_f, 2), sdpa_fwdbwd_ms=round(1000 * t_sdpa_fb, 2),
               ring_sim_fwd_ms=round(1000 * t_sim_f, 2), ring_sim_fwdbwd_ms=round(1000 * t_sim_fb, 2),
               peak_mem_gb=round(torch.cuda.max_memory_allocated() / 2 ** 30, 2))
    return out


if __name__ == "__main__":
    cmds = {"step": bench_step, "attention": bench_attention, "gpu-check": gpu_check}
    if len(sys.argv) < 2 or sys.argv[1] not in cmds:
        print(f"usage: python bench.py {{{'|'.join(cmds)}}} [CONFIG] [--key=value ...]", file=sys.stderr)
        sys.exit(2)
    result = cmds[sys.argv[1]](sys.argv[2:])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    print(json.dumps(result))
