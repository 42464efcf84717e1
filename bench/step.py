"""
Training-path measurements: the step's throughput against the matmul peak, attention (full SDPA against the
ring and PyTorch's ring), the strategies side by side, bf16 against fp32, and embedding's tokens/s beside
training's. `python -m bench step|attention|strategies|bf16|embed ...` runs them (bench/__main__.py).
"""


import json
import os
import sys
import time

import torch

from infra.plan import activation_bytes, checkpointed, ckpt_order, flops_per_sample, recompute_flops, table
from model import build_model


def matmul_flops(device, dtype, n=None, iters=10):
    """This machine's dense matmul FLOP/s for an n x n x n product: the ceiling a training step is
    compared against (measured, not a datasheet number). n: 2048 on a GPU, 512 on a CPU, where a CPU without
    bf16 matrix instructions multiplies bf16 at a few GFLOP/s and 2048^3 would take minutes."""
    n = n or (2048 if device.type == "cuda" else 512)
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
    """Time `steps` training steps of a config after `warmup` untimed ones, in one process. A config in bf16 is
    also run in fp32 right after, in the same process, and the two are printed side by side.
    --ckpt_sweep=True: the config with no block, half the blocks (the first of plan.ckpt_order) and every block
    checkpointed, one after another in this process: time per step, the planner's FLOPs executed per sample
    (recompute included) and the planned activation bytes, side by side.
    --compile_compare=True: the config eager, then with compile=True (each block torch.compile'd; the compile
    happens in the warm-up steps and is timed apart), side by side; the ratio in the JSON line."""
    import configurator
    cfg = configurator.defaults()
    extra = {"ckpt_sweep": False, "compile_compare": False}
    args = [a for a in argv if not any(a.startswith(f"--{k}=") for k in extra)]
    configurator.apply(extra, [a for a in argv if a not in args])
    configurator.apply(cfg, args)
    configurator.check_config(cfg)
    if extra["ckpt_sweep"]:
        return _ckpt_sweep(cfg, args, warmup, steps)
    if extra["compile_compare"]:
        runs = {c: _time_steps({**cfg, "compile": c}, args, warmup, steps, quiet=True) for c in (False, True)}
        out = {"bench": "step_compile", "config": args[0] if args else "defaults", "device": runs[False]["device"],
               "ms_per_step_eager": runs[False]["ms_per_step"], "ms_per_step_compiled": runs[True]["ms_per_step"],
               "warmup_s_eager": runs[False]["warmup_s"], "warmup_s_compiled": runs[True]["warmup_s"],
               "speedup_compiled": round(runs[False]["ms_per_step"] / runs[True]["ms_per_step"], 3),
               "losses_eager": runs[False]["losses"], "losses_compiled": runs[True]["losses"]}
        table([[name, f"{runs[c]['ms_per_step']:.1f}", f"{runs[c]['warmup_s']:.1f}"]
               for name, c in (("eager", False), ("compiled", True))], ["blocks", "ms/step", f"{warmup} warm-up steps, s"])
        print(f"compiled vs eager in this run: {out['speedup_compiled']:.2f}x the speed")
        return out
    res = _time_steps(cfg, argv, warmup, steps)
    if res["dtype"] == "bfloat16":
        fp32 = _time_steps({**cfg, "dtype": "float32"}, argv, warmup, steps)
        res.update(fp32_ms_per_step=fp32["ms_per_step"], bf16_speedup=round(fp32["ms_per_step"] / res["ms_per_step"], 3))
        print(f"bf16 vs fp32 in this run: {res['bf16_speedup']:.2f}x the speed")
    return res


def _ckpt_sweep(cfg, argv, warmup, steps):
    n_blocks = len(ckpt_order(build_model(cfg, device="meta")))
    rows, out = [], {"bench": "step_ckpt", "config": argv[0] if argv else "defaults", "blocks": n_blocks}
    for name, ckpt in (("none", 0), ("half", n_blocks // 2), ("all", n_blocks)):
        c = {**cfg, "grad_ckpt": ckpt > 0, "ckpt_blocks": ckpt}
        m = build_model(c, device="meta")
        m.set_grad_ckpt(checkpointed(m, c))
        act = sum(activation_bytes(m, c["micro_batch"], c["cp"], 4 if c["dtype"] != "bfloat16" else 2))
        r = _time_steps(c, argv, warmup, steps, quiet=True)
        executed = flops_per_sample(m) + recompute_flops(m)
        out[f"ms_per_step_{name}"] = r["ms_per_step"]
        out[f"planned_activation_mib_{name}"] = round(act / 2 ** 20, 2)
        rows.append([name, ckpt, f"{r['ms_per_step']:.1f}", f"{executed / flops_per_sample(m):.3f}",
                     f"{act / 2 ** 20:.1f}"])
    for name in ("half", "all"):
        out[f"time_ratio_{name}_vs_none"] = round(out[f"ms_per_step_{name}"] / out["ms_per_step_none"], 3)
        rows[("none", "half", "all").index(name)].append(f"{out[f'time_ratio_{name}_vs_none']:.3f}")
    rows[0].append("1.000")
    print(f"{out['config']}: activation checkpointing of none / half / every block ({n_blocks}), side by side")
    table(rows, ["ckpt", "blocks", "ms/step", "planned FLOPs executed / model FLOPs", "planned activations MiB",
                 "time vs none"])
    return out


def _time_steps(cfg, argv, warmup, steps, quiet=False):
    import train
    job = train.setup(cfg)
    batches = train.micro_batches(job, 0, warmup + steps)
    sync = torch.cuda.synchronize if job.on_gpu else (lambda: None)
    try:
        t0 = time.perf_counter()
        for s in range(warmup):
            train.train_step(job, s, batches)
        sync()
        warm = time.perf_counter() - t0
        t, wait, losses = time.perf_counter(), 0.0, []
        for s in range(warmup, warmup + steps):
            loss, _, w = train.train_step(job, s, batches)
            losses.append(loss)  # (a device tensor: read after the timing, no host sync per step)
            wait += w
        sync()
        dt = (time.perf_counter() - t) / steps
    finally:
        batches.close()
        job.sampler.close()
    threads = torch.get_num_threads()
    peak = matmul_flops(job.device, job.dtype)
    sps = job.global_batch / dt
    achieved = flops_per_sample(job.model) * sps
    res = {"bench": "step", "config": argv[0] if argv else "defaults", "device": job.device.type,
           "dtype": str(job.dtype).replace("torch.", ""), "threads": threads, "tokens": job.model.L,
           "global_batch": job.global_batch, "ms_per_step": round(1000 * dt, 2), "samples_per_s": round(sps, 3),
           "achieved_flops": achieved, "matmul_flops": peak, "frac_of_matmul": round(achieved / peak, 4),
           "data_wait_frac": round(wait / (dt * steps), 4), "warmup_s": round(warm, 2),
           "losses": [round(x.item(), 6) for x in losses]}
    if quiet:
        return res
    table([[res["config"], res["device"], res["threads"], res["tokens"], res["global_batch"],
            f"{res['ms_per_step']:.1f}", f"{sps:.2f}", f"{achieved / 1e9:.2f}", f"{peak / 1e9:.2f}",
            f"{100 * achieved / peak:.1f}%", f"{100 * res['data_wait_frac']:.1f}%"]],
          ["config", "device", "threads", "tokens", "batch", "ms/step", "samples/s", "GFLOP/s", "matmul GFLOP/s",
           "of matmul", "data wait"])
    return res


# -----------------------------------------------------------------------------
# attention: the same total sequence as full SDPA in one process, as our ring on P processes, and as
# PyTorch's own ring (cp_impl='torch') on P processes; the same total threads (P threads for SDPA, 1 per rank).


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _attention_worker(rank, world, port, variant, B, H, N, D, iters, out_path):
    import resource

    import torch.distributed as dist
    import torch.nn.functional as F

    import ring_attention as RA
    from infra.torch_cp import torch_cp_attention
    torch.set_num_threads(1 if variant != "sdpa" else world)
    if variant != "sdpa":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    n = N if variant == "sdpa" else N // world  # tokens held by this process
    fn = {"sdpa": F.scaled_dot_product_attention, "ring": RA.ring_attention, "torch": torch_cp_attention}[variant]
    g = torch.Generator().manual_seed(rank)
    small = [torch.randn(B, H, 256, D, generator=g, requires_grad=True) for _ in range(3)]
    fn(*small).sum().backward()  # warm-up: kernels and communicators initialised outside the timing
    base = _rss_bytes()
    q, k, v = (torch.randn(B, H, n, D, generator=g, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, n, D, generator=g)
    times, waits = [], []
    for _ in range(iters):
        if variant != "sdpa":
            dist.barrier()
        RA.comm_wait_s(reset=True)
        t = time.perf_counter()
        o = fn(q, k, v)
        o.backward(dout)
        times.append(time.perf_counter() - t)
        waits.append(RA.comm_wait_s())
        del o
        q.grad = k.grad = v.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base  # above the process baseline
    i = min(range(iters), key=times.__getitem__)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"time_s": times[i], "comm_wait_s": waits[i], "peak_bytes": peak}, f)
    if variant != "sdpa":
        dist.destroy_process_group()


def _run_attention(variant, ranks, B, H, N, D, iters):
    import tempfile

    import torch.multiprocessing as mp

    from infra.distributed import free_port
    port = free_port()
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
    from infra import cli
    configurator.apply(opts, argv)
    cli.positive(opts)
    B, H, N, D, P = opts["batch"], opts["heads"], opts["n"], opts["dim"], opts["ranks"]
    configurator.need(N % P == 0, f"--n={N} must divide by --ranks={P}")
    variants = opts["only"].split(",")
    configurator.need(set(variants) <= {"sdpa", "ring", "torch"}, f"--only={opts['only']!r}: some of sdpa, ring, torch")
    res = {v: _run_attention(v, P, B, H, N, D, opts["iters"]) for v in variants}
    rows = []
    flops = 4 * B * H * N * N * D  # forward matmul FLOPs of the whole attention
    for v, r in res.items():
        procs = 1 if v == "sdpa" else P
        work = flops * 3.5  # backward ~2.5x forward
        rows.append([v, procs, P if v == "sdpa" else 1, "fwd+bwd", f"{r['time_s']:.3f}",
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


def bench_embed(argv, steps=20):
    """scripts/embed.py's throughput (tokens encoded per second, every token visible) beside training's (tokens per second
    through the whole MAE step) on this machine, one process each, on the quickstart's volume and model shape: a
    quickstart run of `steps` steps is trained first, and scripts/embed.py encodes the whole volume with its checkpoint."""
    import subprocess
    import tempfile
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else ""))
    with tempfile.TemporaryDirectory() as d:
        qs = [os.path.join(here, "config/quickstart.py"), f"--data_paths=['{d}/qs.mdio']", "--make_synthetic=True",
              f"--out_dir={d}/run", f"--max_steps={steps}", "--figures=False", "--val_frac=0.0", *argv]
        t = bench_step(qs, warmup=3, steps=10)  # (also writes the store)
        r = subprocess.run([sys.executable, os.path.join(here, "train.py"), *qs], env=env, capture_output=True,
                           text=True, cwd=here)
        if r.returncode != 0:
            raise SystemExit(f"training for bench embed failed: {r.stderr[-2000:]}")
        runs = {}
        for name, extra in (("one", ["--batch=1"]), ("batched", [])):  # one window per forward, then scripts/embed.py's default
            e = subprocess.run([sys.executable, "-m", "scripts.embed", f"{d}/run", f"{d}/qs.mdio",
                                f"--out={d}/features_{name}.zarr", *extra], env=env, capture_output=True, text=True,
                               cwd=here)
            if e.returncode != 0:
                raise SystemExit(f"scripts/embed.py failed: {e.stderr[-2000:]}")
            runs[name] = json.loads(e.stdout.strip().splitlines()[-1])
    emb, one = runs["batched"], runs["one"]
    train_tok = t["samples_per_s"] * t["tokens"]
    out = {"bench": "embed", "device": t["device"], "embed_tokens_per_s": emb["tokens_per_s"],
           "embed_batch": emb["batch"], "embed_one_window_tokens_per_s": one["tokens_per_s"],
           "train_tokens_per_s": round(train_tok, 1), "embed_vs_train": round(emb["tokens_per_s"] / train_tok, 3),
           "windows": emb["windows"], "grid": emb["grid"]}
    print(f"\nquickstart volume, one process ({t['device']}): the whole volume in {emb['windows']} windows")
    table([["train (fwd + bwd, 25 % visible to the encoder)", f"{train_tok:,.0f}"],
           ["embed, one window per forward (--batch=1)", f"{one['tokens_per_s']:,.0f}"],
           [f"embed, {emb['batch']} windows per forward (default)", f"{emb['tokens_per_s']:,.0f}"]],
          ["what", "tokens/s"])
    return out


# -----------------------------------------------------------------------------
# strategies: the same config under zero2, zero3 and fsdp2 as real 2-rank jobs on this machine, beside the
# published figures on 128 H200 (ZeRO-2 1,974, FSDP2 1,833, ZeRO-3 869 samples/s).

PUBLISHED = {"zero2": 1974, "fsdp2": 1833, "zero3": 869}


def run_2ranks(argv, out, script="train.py", env=None, nproc=2):
    """train.py (or a wrapper of it, as the tests' train_hooks.py) on 2 CPU ranks (gloo, 1 thread each), writing to
    out; on a GPU machine on nproc GPUs. Returns (its log.jsonl rows, its stdout)."""
    import subprocess
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    e = dict(env or os.environ)
    if not torch.cuda.is_available():
        e.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                        os.path.join(here, script), *argv, f"--out_dir={out}"],
                       env=e, capture_output=True, text=True, cwd=here)
    if r.returncode != 0:
        print(r.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{script} {' '.join(argv)} failed")
    rows = [json.loads(x) for x in open(os.path.join(out, "log.jsonl"))]
    return [x for x in rows if "loss" in x], r.stdout  # the training records (not the validation ones)


def bench_strategies(argv, steps=40, warmup=10):
    import statistics
    import tempfile
    res = {}
    with tempfile.TemporaryDirectory() as d:
        for strategy in ("zero2", "fsdp2", "zero3"):
            log, stdout = run_2ranks([*argv, f"--strategy={strategy}", f"--max_steps={steps}",
                                      f"--ckpt_interval={10 ** 6}", "--log_interval=1000"], os.path.join(d, strategy))
            gb = int(stdout.split("global batch ")[1].split()[0])
            step_s = statistics.median(x["step_s"] for x in log[warmup:])
            res[strategy] = {"samples_per_s": gb / step_s, "ms_per_step": 1000 * step_s, "final_loss": log[-1]["loss"]}
    rows = []
    for k in ("zero2", "fsdp2", "zero3"):
        rows.append([k, f"{res[k]['ms_per_step']:.1f}", f"{res[k]['samples_per_s']:.2f}",
                     f"{res[k]['samples_per_s'] / res['zero2']['samples_per_s']:.3f}", PUBLISHED[k],
                     f"{PUBLISHED[k] / PUBLISHED['zero2']:.3f}", f"{res[k]['final_loss']:.6f}"])
    print(f"{argv[0] if argv else 'defaults'}: 2 CPU ranks (gloo, 1 thread each), median of steps {warmup}..{steps - 1}; "
          f"published: 128 H200, their model and crops")
    table(rows, ["strategy", "ms/step", "samples/s", "vs zero2", "published samples/s", "published vs zero2",
                 "loss at last step"])
    return {"bench": "strategies", "config": argv[0] if argv else None,
            **{f"{k}_samples_per_s": round(v["samples_per_s"], 3) for k, v in res.items()},
            **{f"{k}_final_loss": v["final_loss"] for k, v in res.items()}}


def dtype_runs(argv, root, steps=40, script="train.py", env_for=None, names=("fp32", "zero2", "zero3", "fsdp2"),
               nproc=2):
    """The config for `steps` steps on 2 CPU ranks (nproc GPUs on a GPU machine): in fp32 (zero2: in fp32 the
    strategies agree to 1e-5, tested), then in bf16 under zero2, zero3 and fsdp2 (those of `names`), each into
    root/NAME. env_for(NAME): the environment of that run. Returns {NAME: [loss per step]}."""
    runs = {"fp32": ["--dtype=float32", "--strategy=zero2"],
            **{s: ["--dtype=bfloat16", f"--strategy={s}"] for s in ("zero2", "zero3", "fsdp2")}}
    out = {}
    for name in names:
        log, _ = run_2ranks([*argv, *runs[name], f"--max_steps={steps}", f"--ckpt_interval={10 ** 6}",
                             "--log_interval=1000"], os.path.join(root, name), script,
                            env_for(name) if env_for else None, nproc)
        out[name] = [x["loss"] for x in log]
    return out


def rel_deviation(a, ref):
    """(mean, max) over steps of |a - ref| / |ref|."""
    d = [abs(x - y) / abs(y) for x, y in zip(a, ref)]
    return sum(d) / len(d), max(d)


def bench_bf16(argv, steps=40):
    """How far bf16 training strays from fp32, per strategy: the same steps, samples and masks in both."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        losses = dtype_runs(argv, d, steps)
    dev = {s: rel_deviation(losses[s], losses["fp32"]) for s in ("zero2", "zero3", "fsdp2")}
    rows = [[s, f"{m:.2e}", f"{mx:.2e}", f"{m / dev['fsdp2'][0]:.2f}", f"{losses[s][-1]:.6f}"] for s, (m, mx) in dev.items()]
    print(f"{argv[0] if argv else 'defaults'}: {steps} steps on 2 CPU ranks, bf16 against the same run in fp32 "
          f"(loss at the last step in fp32: {losses['fp32'][-1]:.6f})")
    table(rows, ["strategy (bf16)", "mean |rel. dev.| from fp32", "max", "vs fsdp2", "loss at last step"])
    return {"bench": "bf16", "config": argv[0] if argv else None, "steps": steps,
            **{f"{s}_mean_rel_dev": float(f"{m:.3e}") for s, (m, _) in dev.items()}}
