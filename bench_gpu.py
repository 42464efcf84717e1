"""
The GPU checks in one process (gpu_check.sh runs `python bench_gpu.py` on a lent GPU machine): the ring's CUDA
op path against fp64 SDPA, attention timings at 102,400 tokens and by head dim beside plan.py's rates, the
planner's memory terms against torch.cuda's allocator, bf16 zero2 vs fsdp2 on the same masks, the batch's copy
to the GPU, the quickstart's steps eager and compiled, a stop signal, an elastic resume. It prints tables, then
one JSON line. It imports bench.py (which never imports it).
"""

import json
import os
import sys
import time

import numpy as np
import torch

from bench import GPU_MEMORY_CASES, bench_step, dtype_runs, memory_check, memory_table, rel_deviation
from plan import table


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
    table(rows, ["case", "out", "dq", "dk", "dv", "tol fp32 1e-5 / bf16 2e-2"])
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
    # the fused kernel's rate by head dim at 102,400 tokens, beside what plan.py assumes (ATTN_TFLOPS)
    try:
        import plan as P
        rates = attention_rates(dev)
        table([[d, f"{f:.0f}", f"{fb:.0f}", f"{P.attention_tflops(d):.0f}"] for d, (f, fb) in rates.items()],
              ["head dim", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "plan.py assumes (fwd)"])
        out["attention_tflops_by_head_dim"] = {str(d): [round(f, 1), round(fb, 1)] for d, (f, fb) in rates.items()}
    except Exception as e:
        out["attention_tflops_by_head_dim"] = f"FAILED: {type(e).__name__}: {e}"
        print(f"attention by head dim FAILED: {e}")
    # the planner's memory terms where they were only read from the source: the GPU's allocator counters
    # (separate processes, so this runs before anything below initialises DeepSpeed in this one)
    try:
        mrows, mworst = memory_check(GPU_MEMORY_CASES, device="cuda")
        print("\nplanner's weight/gradient/optimizer memory vs torch.cuda allocator counters (1 GPU, world 1: "
              "FSDP2 and ZeRO-3 skip their collectives' buffers there):")
        memory_table(mrows)
        out["gpu_memory_check_worst_rel_err"] = round(mworst, 4)
        out["gpu_memory_rows"] = mrows
    except (Exception, SystemExit) as e:  # report, do not hide the results above
        out["gpu_memory_check"] = f"FAILED: {type(e).__name__}: {e}"
        print(f"memory check on GPU FAILED: {e}")
    # bf16 on the GPU: zero2 and fsdp2 train on the same kept-token ids and follow each other (world 1; what
    # reached the model recorded by tests/train_hooks.py)
    try:
        out["bf16_strategies"] = gpu_bf16_check()
    except (Exception, SystemExit) as e:
        out["bf16_strategies"] = f"FAILED: {type(e).__name__}: {e}"
        print(f"bf16 strategies on GPU FAILED: {e}")
    # the batch's copy to the GPU: pinned bf16 with non_blocking (train.py) against pageable fp32 cast on the way
    try:
        out["batch_copy"] = gpu_copy_check(dev)
    except Exception as e:
        out["batch_copy"] = f"FAILED: {type(e).__name__}: {e}"
        print(f"batch copy check FAILED: {e}")
    # and the whole training path on this GPU (NCCL, bf16, DeepSpeed ZeRO-2): the quickstart's steps
    try:
        out["quickstart_step"] = bench_step(["config/quickstart.py", "--out_dir=/tmp/gpu_check_run"])
    except Exception as e:  # report, do not hide the attention results above
        out["quickstart_step"] = f"FAILED: {type(e).__name__}: {e}"
        print(f"quickstart step on GPU FAILED: {e}")
    try:  # torch.compile of the blocks on this GPU: eager vs compiled steps of the quickstart, side by side
        out["compile"] = bench_step(["config/quickstart.py", "--compile_compare=True", "--out_dir=/tmp/gpu_check_cc"])
    except Exception as e:
        out["compile"] = f"FAILED: {type(e).__name__}: {e}"
        print(f"compile check FAILED: {e}")
    try:
        out["stop_signal"] = gpu_stop_check()
    except Exception as e:
        out["stop_signal"] = f"FAILED: {type(e).__name__}: {e}"
        print(f"stop-signal check FAILED: {e}")
    try:
        out["embed"] = gpu_embed_check()
    except Exception as e:
        out["embed"] = f"FAILED: {type(e).__name__}: {e}"
        print(f"embed check FAILED: {e}")
    try:
        out["elastic_resume"] = gpu_elastic_check()
    except Exception as e:
        out["elastic_resume"] = f"FAILED: {type(e).__name__}: {e}"
        print(f"elastic-resume check FAILED: {e}")
    return out


def attention_rates(device, N=102_400, head_dims=(32, 64, 104, 128), width=1024, dtype=torch.bfloat16, reps=3):
    """The fused attention kernel's useful TFLOP/s (forward, and forward + backward) by head dim, as plan.py's
    ATTN_TFLOPS assumes them: one sequence of N tokens, about `width` / d heads of d, F.scaled_dot_product_attention
    (what the ring's blocks run). FLOPs: 4 N^2 H d forward, 2.5 x that backward. Returns {d: (fwd, fwd+bwd)}."""
    import torch.nn.functional as F
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    for d in head_dims:
        H = max(1, round(width / d))
        q, k, v, dout = (torch.randn(1, H, N, d, device=device, dtype=dtype) for _ in range(4))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        def fwd():
            F.scaled_dot_product_attention(q, k, v)

        def fwd_bwd():
            F.scaled_dot_product_attention(qg, kg, vg).backward(dout)
        times = []
        for fn in (fwd, fwd_bwd):
            fn()  # (warm-up)
            sync()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            times.append((time.perf_counter() - t) / reps)
        flops = 4 * N * N * H * d
        out[d] = (flops / times[0] / 1e12, 3.5 * flops / times[1] / 1e12)
    return out


def gpu_stop_check(steps=40):
    """SIGTERM to a 1-GPU quickstart run (fp32), then the relaunch, against the uninterrupted run. On a GPU the ranks
    read the agreed stop flag a step late (checkpoint.StopRequest.agreed: no host sync per step): this is the one
    place that path runs. Reported: the exit code (75), the checkpoint's step, and the relaunched trajectory's
    largest relative loss difference from the uninterrupted run."""
    import signal
    import subprocess
    import tempfile
    import checkpoint
    with tempfile.TemporaryDirectory() as d:
        base = [sys.executable, "train.py", "config/quickstart.py", f"--data_paths=['{d}/qs.mdio']",
                "--make_synthetic=True", f"--max_steps={steps}", "--dtype=float32", "--log_interval=1",
                "--ckpt_interval=1000", "--eval_interval=1000", "--figures=False"]

        def losses(run):
            with open(os.path.join(d, run, "log.jsonl")) as f:
                return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}  # the last record wins
        full = subprocess.run([*base, f"--out_dir={d}/full"], capture_output=True, text=True, timeout=600)
        assert full.returncode == 0, full.stderr[-2000:]
        p = subprocess.Popen([*base, f"--out_dir={d}/stop"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        log = os.path.join(d, "stop", "log.jsonl")
        while p.poll() is None and not (os.path.exists(log) and len(open(log).readlines()) >= 6):
            time.sleep(0.05)
        seen = len(open(log).readlines()) if os.path.exists(log) else 0
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=300)
        done = [s for s, _ in checkpoint.complete_checkpoints(os.path.join(d, "stop", "ckpt"))]
        again = subprocess.run([*base, f"--out_dir={d}/stop"], capture_output=True, text=True, timeout=600)
        a, b = losses("full"), losses("stop")
        diff = max(abs(a[s] - b.get(s, float("nan"))) / abs(a[s]) for s in a) if len(a) == len(b) else float("nan")
        res = {"rc": p.returncode, "records_before_signal": seen, "checkpoints": done,
               "relaunch_rc": again.returncode, "max_rel_diff": diff,
               "ok": p.returncode == checkpoint.RESUMABLE and len(done) == 1 and 0 < done[0] < steps
               and again.returncode == 0 and diff <= 1e-4}
    print(f"\nstop signal on the GPU: SIGTERM after {seen} logged steps -> exit {p.returncode}, checkpoints {done}; "
          f"relaunch exit {again.returncode}; largest relative loss difference from the uninterrupted run "
          f"{diff:.2e} -> {'ok' if res['ok'] else 'FAIL'}")
    if not res["ok"]:
        print(err[-2000:], again.stderr[-2000:])
    return res


def gpu_embed_check(steps=10):
    """embed.py on the GPU (NCCL, windows batched per forward) against embed.py on the CPU (CUDA hidden): a 10-step fp32
    quickstart run's encoder over the whole quickstart volume. Reported: the largest feature difference relative to
    the features' largest magnitude (cuDNN may run the patch embedding's conv in TF32: ~1e-3), both rates."""
    import subprocess
    import tempfile
    import zarr
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, "train.py", "config/quickstart.py", f"--data_paths=['{d}/qs.mdio']",
                            "--make_synthetic=True", f"--max_steps={steps}", "--dtype=float32", f"--out_dir={d}/run",
                            "--eval_interval=1000", "--figures=False"], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        rates, feats = {}, {}
        for where, env in (("gpu", os.environ), ("cpu", dict(os.environ, CUDA_VISIBLE_DEVICES=""))):
            e = subprocess.run([sys.executable, "embed.py", f"{d}/run", f"{d}/qs.mdio", f"--out={d}/{where}.zarr",
                                "--dtype=float32"], env=env, capture_output=True, text=True, timeout=600)
            assert e.returncode == 0, e.stderr[-2000:]
            rates[where] = json.loads(e.stdout.strip().splitlines()[-1])["tokens_per_s"]
            feats[where] = np.asarray(zarr.open_group(f"{d}/{where}.zarr", mode="r")["features"][:])
    err = float(np.abs(feats["gpu"] - feats["cpu"]).max() / max(np.abs(feats["cpu"]).max(), 1e-12))
    res = {"rel_err": err, "gpu_tokens_per_s": rates["gpu"], "cpu_tokens_per_s": rates["cpu"], "ok": err <= 1e-2}
    print(f"\nembed.py on the GPU vs the CPU: features differ by {err:.2e} of their largest magnitude "
          f"({'ok' if res['ok'] else 'FAIL'}); {rates['gpu']:,.0f} vs {rates['cpu']:,.0f} tokens/s")
    return res


def gpu_elastic_check(steps=16):
    """Elastic resume onto a GPU: a bf16 ZeRO-2 quickstart run on 2 CPU ranks (gloo) writes checkpoints at steps/2 and
    steps; a copy of the first goes on on this one GPU with the same global batch (micro_batch 16 = 2 x 8), through
    DeepSpeed's universal checkpoint: its fp32 masters and moments onto CUDA, the bf16 weights rebuilt from the
    masters. The CPU tests prove this exact in fp32 on CPU; here CPU and GPU bf16 kernels round differently, so the
    continued losses are compared with the CPU run's own within 5e-2 (reported: the largest relative difference)."""
    import shutil
    import subprocess
    import tempfile
    half = steps // 2
    with tempfile.TemporaryDirectory() as d:
        base = ["train.py", "config/quickstart.py", f"--data_paths=['{d}/qs.mdio']", "--make_synthetic=True",
                f"--max_steps={steps}", "--dtype=bfloat16", "--log_interval=1", f"--ckpt_interval={half}",
                "--eval_interval=1000", "--figures=False"]
        cpu_env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        cpu = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *base,
                              "--micro_batch=8", f"--out_dir={d}/cpu"], env=cpu_env, capture_output=True, text=True,
                             timeout=600)
        assert cpu.returncode == 0, cpu.stderr[-2000:]
        tag = f"step_{half:07d}"
        shutil.copytree(f"{d}/cpu/ckpt/{tag}", f"{d}/gpu/ckpt/{tag}")
        gpu = subprocess.run([sys.executable, *base, "--micro_batch=16", f"--out_dir={d}/gpu"], capture_output=True,
                             text=True, timeout=600)

        def losses(run):
            with open(os.path.join(d, run, "log.jsonl")) as f:
                return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
        a, b = losses("cpu"), (losses("gpu") if gpu.returncode == 0 else {})
        diff = max((abs(a[s] - b[s]) / abs(a[s]) for s in range(half, steps) if s in b), default=float("nan"))
        res = {"rc": gpu.returncode, "converted": "converted in" in gpu.stdout, "steps": sorted(b),
               "max_rel_diff": diff, "ok": gpu.returncode == 0 and sorted(b) == list(range(half, steps))
               and diff <= 5e-2}
    print(f"\nelastic resume onto the GPU: bf16 zero2 checkpoint of 2 CPU ranks at step {half} -> 1 GPU (universal "
          f"checkpoint converted: {res['converted']}), exit {gpu.returncode}; largest relative loss difference from "
          f"the CPU run's own continuation {diff:.2e} -> {'ok' if res['ok'] else 'FAIL'}")
    if not res["ok"]:
        print(gpu.stderr[-2000:])
    return res


def gpu_bf16_check(steps=20):
    """zero2 and fsdp2 in bf16 on one GPU: the same kept-token ids at every step, and their losses' mean relative
    difference (on 2 CPU ranks they agree within 2.4e-5 over 40 steps)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        def env_for(name):
            os.makedirs(os.path.join(d, "probe_" + name))
            return dict(os.environ, MAE_PROBE=os.path.join(d, "probe_" + name))
        losses = dtype_runs(["config/quickstart.py", f"--data_paths=['{d}/qs.mdio']", "--make_synthetic=True"], d,
                            steps, script="tests/train_hooks.py", env_for=env_for, names=("zero2", "fsdp2"), nproc=1)
        ids = {n: [json.loads(x)["ids_keep"] for x in open(os.path.join(d, "probe_" + n, "rank0.jsonl"))]
               for n in ("zero2", "fsdp2")}
    res = {"same_masks": ids["zero2"] == ids["fsdp2"] and len(ids["zero2"]) == steps,
           "mean_rel_diff": rel_deviation(losses["zero2"], losses["fsdp2"])[0]}
    print(f"\nbf16 on the GPU, {steps} quickstart steps: zero2 and fsdp2 same masks: {res['same_masks']}, "
          f"mean relative loss difference {res['mean_rel_diff']:.2e}")
    return res


def gpu_copy_check(dev, shape=(1, 1, 640, 640, 1024)):
    """One base_102k sample to the GPU, the way train.py copies it (prepared as pinned bf16 in the prefetch thread,
    then .to(non_blocking=True)) against the old way (pageable fp32 cast on the way): the training thread's host
    time, and the copy's time on the stream (CUDA events). Non-blocking on the compute stream frees the host;
    the copy itself still runs before the forward on that stream (a side stream would overlap it too)."""
    pinned = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True).normal_()
    pageable = torch.randn(shape)
    res = {}
    for name, fn in (("pinned bf16, non_blocking", lambda: pinned.to(dev, non_blocking=True)),
                     ("pageable fp32 -> bf16", lambda: pageable.to(dev, torch.bfloat16))):
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        fn()
        b.record()
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        res[name] = {"host_ms": round(1000 * host, 2), "stream_ms": round(a.elapsed_time(b), 2)}
    print(f"\none {shape} sample to the GPU ({pinned.numel() * 2 / 1e9:.2f} GB in bf16):")
    table([[k, v["host_ms"], v["stream_ms"]] for k, v in res.items()], ["copy", "training thread ms", "stream ms"])
    return res


if __name__ == "__main__":
    result = gpu_check(sys.argv[1:])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    print(json.dumps(result))
