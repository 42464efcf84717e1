"""
The GPU check: one call on a GPU machine (gpu_check.sh runs it there), built so that no failure wastes it.

    python bench_gpu.py [--out=DIR] [--budget_s=480] [--only=ops,self_ring] [--limit_s=S]   on the GPU
    python bench_gpu.py --cpu-smoke [--out=DIR]                       the same code paths on CPU

Each section runs in a process of its own, with a clean environment (no MASTER_PORT, RANK, WORLD_SIZE or
LOCAL_RANK inherited: a section that starts a process group, or train.py, picks its own port) and its own
timeout (SECTIONS, capped by what is left of --budget_s and by --limit_s), and appends its JSON line (its
numbers and "ok", its pass/fail against a stated threshold) to DIR/gpu_check.jsonl the moment it ends: a crash,
a hang or the call's time limit loses that section only. Sections run most decisive first:

  env              devices, versions, the project's imports (the wheels gpu_check.sh installed)
  nccl             an NCCL all-reduce and broadcast on this GPU
  self_p2p         batch_isend_irecv to this rank itself: can the ring's real exchange run on one GPU?
  ops              the ring's block ops (bf16: the kernel SDPA picks, and flash pinned; fp32: memory-efficient)
                   against fp64 SDPA, head dims 32..128
  self_ring        the real RingAttention, W ranks simulated on this one (ring_attention.SelfRing), forward and
                   backward against SDPA: the exchange through NCCL to itself where it runs, else side-stream copies
  torch_cp         cp_impl='torch' (PyTorch's ring functions with this GPU's flash / efficient / cuDNN ops) and
                   its guard against our ring
  big_blocks       one ViT-G encoder block and one decoder block at big_context's per-rank shapes, W = 8
                   self-ring: time and max_memory_allocated beside plan.py's terms, output against SDPA's
  attention_rates  SDPA fwd and fwd+bwd TFLOP/s by backend (flash, efficient, cuDNN, pinned) and head dim
                   (32 / 64 / 104 / 128) at 102,400 tokens, beside plan.py's attention_tflops
  bf16_step        quickstart steps in bf16 under ZeRO-2 on NCCL: finite, decreasing losses; ms/step
  then, while time remains: memory (the planner's state terms against torch.cuda's allocator), bf16_strategies
  (zero2 vs fsdp2 on the same masks), batch_copy (pinned non-blocking vs pageable), compile (eager vs compiled
  steps, losses compared), stop_signal (SIGTERM, the stop flag read a step late, the relaunch), embed (embed.py
  on the GPU against the CPU), elastic (a 2-CPU-rank checkpoint resumed on the GPU).

--cpu-smoke runs every section's exact code path on CPU (CUDA hidden, gloo, small sizes), each in its own
process as on the GPU, so that nothing fails on the GPU for a reason a CPU can show (tests/test_gpu_check.py).
It prints a line per section as it ends, a table, and one JSON line last.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SECTIONS = [  # (name, seconds it may take on the GPU)
    ("env", 60), ("nccl", 60), ("self_p2p", 45), ("ops", 90), ("self_ring", 90), ("torch_cp", 60),
    ("big_blocks", 150), ("attention_rates", 120), ("bf16_step", 150),
    ("memory", 180), ("bf16_strategies", 150), ("batch_copy", 45), ("compile", 240), ("stop_signal", 180),
    ("embed", 150), ("elastic", 180),
]
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def table(rows, header):
    from plan import table as plan_table
    plan_table(rows, header)


def rel_err(a, b):
    """Largest absolute difference relative to the reference's largest magnitude (at least 1)."""
    return (a.double() - b.double()).abs().max().item() / max(1.0, b.double().abs().max().item())


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, dev, reps):
    """Median seconds of fn() over reps runs after one warm-up (CUDA events on the GPU)."""
    fn()
    _sync(dev)
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 1000)
        else:
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def _init_world_1():
    """A process group of one rank on this device (NCCL on the GPU, gloo on CPU), on a free port."""
    import torch.distributed as dist

    import train
    train.dist_env()
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    return dist


def _earlier(out_dir, name):
    """The JSON line an earlier section of this run wrote, or {}."""
    path = os.path.join(out_dir, "gpu_check.jsonl")
    found = {}
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            if r.get("section") == name:
                found = r
    return found


# -----------------------------------------------------------------------------
# the sections: each returns a dict with "ok" (and whatever it measured)


def sec_env(smoke, dev, out_dir):
    import importlib
    res = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
           "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
           "cudnn": torch.backends.cudnn.version() if dev.type == "cuda" else None,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if dev.type == "cuda" else None,
           "TORCH_NCCL_HIGH_PRIORITY": os.environ.get("TORCH_NCCL_HIGH_PRIORITY")}
    missing = []
    for mod in ("deepspeed", "zarr", "numcodecs", "matplotlib", "train", "embed", "export", "probe"):
        try:
            m = importlib.import_module(mod)
            res[f"{mod}_version"] = getattr(m, "__version__", "")
        except Exception as e:  # noqa: BLE001 (every import failure is a finding)
            missing.append(f"{mod}: {type(e).__name__}: {e}")
    import ring_attention as RA
    try:
        RA._torch_ring()
        res["torch_ring_functions"] = True
    except RuntimeError as e:
        missing.append(str(e))
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        res.update(sms=p.multi_processor_count, mem_gib=round(p.total_memory / 2 ** 30, 1),
                   capability=f"{p.major}.{p.minor}")
    print("\n".join(f"{k}: {v}" for k, v in res.items()))
    for m in missing:
        print("MISSING", m)
    res.update(missing=missing, ok=not missing and (smoke or dev.type == "cuda"))
    return res


def sec_nccl(smoke, dev, out_dir):
    dist = _init_world_1()
    t = torch.full((1000,), 2.0, device=dev)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    x = torch.ones(64 * 2 ** 20 // 4, device=dev)  # 64 MiB
    s = _timed(lambda: dist.all_reduce(x), dev, 3)
    ok = bool((t == 2.0).all()) and bool((x > 0).all())
    res = {"backend": dist.get_backend(), "all_reduce_64mib_ms": round(1000 * s, 3), "ok": ok}
    print(res)
    dist.destroy_process_group()
    return res


def sec_self_p2p(smoke, dev, out_dir):
    """The ring's own exchange (ring_attention._exchange: batch_isend_irecv) with this rank as both neighbours."""
    import ring_attention as RA
    dist = _init_world_1()
    a, b = torch.randn(3, 1000, device=dev), torch.randn(5, 77, device=dev)
    res = {"supported": False}
    try:
        works, bufs = RA._exchange([a, b], 0, 0, None, tag=0)
        for w in works:
            w.wait()
        _sync(dev)
        res.update(supported=True, exact=bool(torch.equal(bufs[0], a) and torch.equal(bufs[1], b)))
    except Exception as e:  # noqa: BLE001 (a refusal is a finding, not a failure: the self-ring copies instead)
        res["refused"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    # gloo cannot send to itself (a known refusal); NCCL can, inside a group call: there a refusal is a FAIL
    res["ok"] = res.get("exact", False) if dev.type == "cuda" else True
    print(res)
    dist.destroy_process_group()
    return res


def sec_ops(smoke, dev, out_dir):
    """simulate_ring: the ring's block ops and merge over P blocks in one process against fp64 SDPA."""
    import torch.nn.functional as F

    import ring_attention as RA
    cases = ((2, 1000, 64), (4, 4100, 104), (8, 8 * 1031, 128), (3, 3 * 509, 32), (5, 5 * 300, 80))
    if smoke:
        cases = tuple((P, P * 13, d) for P, _, d in cases)
    rows, worst = [], {}
    for dtype, tol in ((torch.float32, 5e-5), (torch.bfloat16, 2e-2)):
        for pin in _pins(dev, dtype):
            for P, N, Dh in cases:
                g = torch.Generator(device=dev).manual_seed(P * N)
                q, k, v, dout = (torch.randn(1, 4, N, Dh, device=dev, generator=g) for _ in range(4))
                qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
                ref = F.scaled_dot_product_attention(qr, kr, vr)  # fp64 reference (math kernel)
                ref.backward(dout.double())
                x = [t.to(dtype) for t in (q, k, v)]
                with _pinned(pin):
                    kernel = RA.block_kernel(*x, Dh ** -0.5)
                    got, grads = RA.simulate_ring(*x, P, dout=dout.to(dtype))
                errs = [rel_err(a, b) for a, b in zip((got, *grads), (ref, qr.grad, kr.grad, vr.grad))]
                name = f"{str(dtype)[6:]} {kernel} P={P} N={N} D={Dh}"
                worst[name] = max(errs)
                rows.append([name, *(f"{e:.2e}" for e in errs), "ok" if max(errs) <= tol else "FAIL"])
    table(rows, ["case (dtype, kernel)", "out", "dq", "dk", "dv", "tol fp32 5e-5 / bf16 2e-2"])
    return {"max_rel_err": worst, "ok": all(r[-1] == "ok" for r in rows)}


def _pins(dev, dtype):
    """The kernels to try for the ring's blocks: SDPA's own choice (None), and on CUDA in 16 bits FlashAttention-2
    pinned too (SDPA picks cuDNN there on an H200: both must be right)."""
    return [None] + ([[_backend("FLASH_ATTENTION")]] if dev.type == "cuda" and dtype != torch.float32 else [])


def _backend(name):
    from torch.nn.attention import SDPBackend
    return getattr(SDPBackend, name)


def _pinned(pin):
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel(pin) if pin is not None else _nothing()


def _self_ring_vias(dev, out_dir):
    """How the self-ring can exchange here: NCCL to itself when self_p2p showed it exact, and side-stream copies."""
    return (["p2p"] if _earlier(out_dir, "self_p2p").get("exact") else []) + ["copy"]


def sec_self_ring(smoke, dev, out_dir):
    """The real RingAttention (its exchange, waits, double buffers, backward's travelling accumulators) with W ranks
    simulated on this one: the same K/V comes back at every step, so the result must be SDPA's on the local
    q, k, v, forward and backward (ring_attention.SelfRing)."""
    import torch.nn.functional as F

    import ring_attention as RA
    dist = _init_world_1()
    n = 24 if smoke else 1000
    rows = []
    for via in _self_ring_vias(dev, out_dir):
        for dtype, tol, pin in [(dt, tl, p) for dt, tl in ((torch.float32, 5e-5), (torch.bfloat16, 2e-2))
                                for p in _pins(dev, dt)]:
            for d in (32, 104):
                for W in (2, 4, 8):
                    g = torch.Generator(device=dev).manual_seed(W * d)
                    q, k, v, dout = (torch.randn(1, 4, n, d, device=dev, generator=g) for _ in range(4))
                    ref = [t.double().requires_grad_() for t in (q, k, v)]
                    o = F.scaled_dot_product_attention(*ref)
                    o.backward(dout.double())
                    errs = []
                    for _ in range(2):  # called again: nothing stale from the first call
                        x = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]  # (fresh leaves)
                        with _pinned(pin):
                            kernel = RA.block_kernel(*x, d ** -0.5)
                            out = RA.ring_attention(*x, group=RA.SelfRing(W, via))
                            out.backward(dout.to(dtype))
                        errs.append(max(rel_err(a, b) for a, b in zip((out.detach(), *(t.grad for t in x)),
                                                                     (o, *(t.grad for t in ref)))))
                    rows.append([via, str(dtype)[6:], kernel, d, W, f"{max(errs):.2e}",
                                 "ok" if max(errs) <= tol else "FAIL"])
    table(rows, ["exchange", "dtype", "kernel", "head dim", "W", "max rel err (out, dq, dk, dv; 2 calls)",
                 "tol 5e-5 / 2e-2"])
    dist.destroy_process_group()
    return {"vias": sorted({r[0] for r in rows}), "worst": max(float(r[-2]) for r in rows),
            "ok": all(r[-1] == "ok" for r in rows)}


def sec_torch_cp(smoke, dev, out_dir):
    """cp_impl='torch' on this device: PyTorch's ring functions with the op SDPA picks (each backend pinned in
    turn), forward and backward against fp64 SDPA; then its guard against our ring. (One rank: the ring has no
    neighbours, so this checks the ops, their arguments and the autograd wiring; CPU tests prove the ring.)"""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import ring_attention as RA
    dist = _init_world_1()
    n = 40 if smoke else 1000
    backends = [None] if dev.type == "cpu" else [None, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                  SDPBackend.CUDNN_ATTENTION]
    rows = []
    for dtype, tol in ((torch.float32, 5e-5), (torch.bfloat16, 2e-2)):
        for d in (32, 104):
            g = torch.Generator(device=dev).manual_seed(d)
            q, k, v, dout = (torch.randn(1, 4, n, d, device=dev, generator=g) for _ in range(4))
            ref = [t.double().requires_grad_() for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*ref)
            o.backward(dout.double())
            for b in backends:
                x = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
                name = b.name if b is not None else "default"
                try:
                    with sdpa_kernel(b) if b is not None else _nothing():
                        out = RA.TorchRingAttention.apply(*x, dist.group.WORLD, d ** -0.5)
                        out.backward(dout.to(dtype))
                except RuntimeError as e:  # this backend does not take these inputs: not a defect of ours
                    rows.append([str(dtype)[6:], d, name, "-", f"unavailable: {str(e).splitlines()[0][:60]}"])
                    continue
                err = max(rel_err(a, c) for a, c in zip((out.detach(), *(t.grad for t in x)),
                                                          (o, *(t.grad for t in ref))))
                rows.append([str(dtype)[6:], d, name, f"{err:.2e}", "ok" if err <= tol else "FAIL"])
            RA.verify_torch_cp(dist.group.WORLD, dev, dtype, d)  # raises CPMismatchError
    table(rows, ["dtype", "head dim", "backend", "max rel err", "tol 5e-5 / 2e-2"])
    dist.destroy_process_group()
    return {"rows": rows, "ok": all(r[-1] != "FAIL" for r in rows) and any(r[-1] == "ok" for r in rows)}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def sec_big_blocks(smoke, dev, out_dir):
    """One ViT-G encoder block and one decoder block at big_context's per-rank shapes (1,179,648 tokens over cp 8:
    the encoder's 294,912 visible tokens + cls -> 36,864 per rank at width 1664, heads of 104; the decoder's
    147,456 per rank at width 512, heads of 32), bf16, the ring a W = 8 self-ring: forward + backward time and
    max_memory_allocated beside plan.py's attention time at its kernel rates and its matmul time at the MFU
    assumption, and its memory terms; the output and input gradient against the same block on plain SDPA at the
    local shapes. Pass (GPU): within SDPA's bf16 tolerance, the planned time within a third of the measured one,
    the measured peak under the planner's bound."""
    import configurator
    import model as M
    import plan as P
    import ring_attention as RA
    dist = _init_world_1()
    cfg = configurator.defaults()
    configurator.apply(cfg, [os.path.join(HERE, "config/big_context.py")])
    m = P.meta_model(cfg)
    W = 8 if not smoke else 4
    dtype = torch.bfloat16 if not smoke else torch.float32
    via = _self_ring_vias(dev, out_dir)[0]
    stacks = (("encoder", m.dim, m.blocks[0].heads, (m.n_keep() + 1) // cfg["cp"]),
              ("decoder", m.dec_dim, m.decoder_blocks[0].heads, m.L // cfg["cp"]))
    if smoke:  # the same two head dims, tiny
        stacks = (("encoder", 208, 2, 48), ("decoder", 64, 2, 64))
    rows, res = [], {"W": W, "via": via}
    for name, C, H, n in stacks:
        torch.manual_seed(0)
        blk = M.Block(C, H).to(dev, dtype)
        x = torch.randn(1, n, C, device=dev, dtype=dtype)
        dout = torch.randn(1, n, C, device=dev, dtype=dtype)
        ring = (RA.SelfRing(W, via), "ring")

        def fwd_bwd(cp):
            xi = x.clone().requires_grad_()
            y = blk(xi, cp)
            y.backward(dout)
            return y.detach(), xi.grad

        blk.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        y_ring, g_ring = fwd_bwd(ring)  # (also the warm-up)
        t = _timed(lambda: fwd_bwd(ring), dev, 1)
        peak = torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else 0
        y_ref, g_ref = fwd_bwd(None)  # plain SDPA over the local tokens: what the self-ring must reproduce
        err = max(rel_err(y_ring, y_ref), rel_err(g_ring, g_ref))
        d = C // H
        q1 = torch.empty(1, H, 8, d, device=dev, dtype=dtype)
        kernel = RA.block_kernel(q1, q1, q1, d ** -0.5)
        attn_flops = 3.5 * 4 * n * (W * n) * C  # fwd + bwd of this rank's rows against W blocks
        mm_flops = 3 * 24 * n * C * C  # qkv, proj, fc1, fc2 (mlp 4): 2 n (3C^2 + C^2 + 8C^2) fwd, x3 with bwd
        gpu = P.GPUS["H200"]
        planned = attn_flops / (P.attention_tflops(d) * 1e12) + mm_flops / (0.4 * gpu["flops"])
        # the planner's memory for one block: what it saves for backward (activation_bytes' 17 C per token, and the
        # attention's fp32 lse) and what the ring's backward holds (ring_bytes): an upper bound on its peak, since
        # the MLP's saved tensors are freed before the attention's backward runs
        plan_mem = P.BLOCK_SAVED * C * n * dtype.itemsize + 4 * H * n + P.ring_bytes(n, C, d, dtype.itemsize, W)
        tol = 3e-2 if dtype == torch.bfloat16 else 5e-5
        ok = err <= tol and (smoke or (0.75 <= planned / t <= 1.33 and peak <= plan_mem))
        res[name] = {"kernel": kernel, "tokens_per_rank": n, "width": C, "head_dim": d, "ms": round(1000 * t, 1),
                     "planned_ms": round(1000 * planned, 1), "peak_gib": round(peak / 2 ** 30, 3),
                     "planned_peak_gib": round(plan_mem / 2 ** 30, 3),
                     "attention_tflops": round(attn_flops / t / 1e12, 1),
                     "rel_err_vs_sdpa": err, "ok": ok}
        rows.append([name, kernel, f"{n:,}", C, d, f"{1000 * t:.1f}", f"{1000 * planned:.1f}",
                     f"{attn_flops / t / 1e12:.0f}",
                     f"{P.attention_tflops(d):.0f}", f"{peak / 2 ** 30:.2f}", f"{plan_mem / 2 ** 30:.2f}", f"{err:.1e}",
                     "ok" if ok else "FAIL"])
    print(f"one block at big_context's per-rank shapes, {str(dtype)[6:]}, self-ring W={W} ({via})")
    table(rows, ["block", "kernel", "tokens/rank", "width", "head dim", "fwd+bwd ms", "plan.py ms", "attn TFLOP/s",
                 "plan.py attn TFLOP/s", "peak GiB", "plan.py GiB (bound)", "err vs SDPA", "ok"])
    dist.destroy_process_group()
    res["ok"] = all(res[s[0]]["ok"] for s in stacks)
    return res


def attention_rates(device, N=102_400, head_dims=(32, 64, 104, 128), width=1024, dtype=torch.bfloat16, reps=3,
                    backends=None):
    """Useful TFLOP/s of F.scaled_dot_product_attention by backend and head dim: one sequence of N tokens, about
    width / d heads of d, each backend pinned (torch.nn.attention.sdpa_kernel; None: SDPA's own choice). FLOPs:
    4 N^2 H d forward, 2.5 x that backward. Returns {backend name: {d: (fwd, fwd+bwd) or None if unavailable}}."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    out = {}
    for b in backends or [None]:
        name = b.name if b is not None else "default"
        out[name] = {}
        for d in head_dims:
            H = max(1, round(width / d))
            q, k, v, dout = (torch.randn(1, H, N, d, device=device, dtype=dtype) for _ in range(4))
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            try:
                with sdpa_kernel(b) if b is not None else _nothing():
                    tf = _timed(lambda: F.scaled_dot_product_attention(q, k, v), device, reps)
                    tfb = _timed(lambda: F.scaled_dot_product_attention(qg, kg, vg).backward(dout), device, reps)
            except RuntimeError:  # "No available kernel": this backend does not take these inputs
                out[name][d] = None
                continue
            flops = 4 * N * N * H * d
            out[name][d] = (flops / tf / 1e12, 3.5 * flops / tfb / 1e12)
    return out


def sec_attention_rates(smoke, dev, out_dir):
    """Pass: at the head dims the configs use (32, 64, 104, 128), the fwd+bwd rate of the kernel SDPA picks (the
    one the ring's blocks run: 'default') is within a third of what plan.py assumes (ATTN_TFLOPS): else its step
    times, samples/s and stop lead are off by more; put the measured numbers there)."""
    from torch.nn.attention import SDPBackend

    import plan as P
    backends = [None, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    if smoke:
        rates = attention_rates(dev, N=256, dtype=torch.float32, reps=1, backends=backends[:2])
    else:
        rates = attention_rates(dev, backends=backends, reps=2)
    rows, ratio = [], {}
    for d in (32, 64, 104, 128):
        got = {b: r[d] for b, r in rates.items()}
        ratio[d] = (got["default"] or (0, 0))[1] / P.attention_tflops(d)
        rows.append([d, *(f"{x[0]:.0f} / {x[1]:.0f}" if x else "-" for x in got.values()),
                     f"{P.attention_tflops(d):.0f}", f"{ratio[d]:.2f}"])
    print("SDPA at N = 102,400 tokens, bf16, about 1024 / d heads of d: fwd / fwd+bwd TFLOP/s by pinned backend"
          if not smoke else "SDPA (smoke: N = 256, fp32)")
    table(rows, ["head dim", *rates, "plan.py assumes (fwd+bwd)", "default / assumed"])
    ok = all(r > 0 for r in ratio.values()) and (smoke or all(0.75 <= r <= 1.33 for r in ratio.values()))
    return {"tflops": {b: {str(d): ([round(x, 1) for x in v] if v else None) for d, v in r.items()}
                       for b, r in rates.items()},
            "default_fwdbwd_over_planned": {str(d): round(r, 3) for d, r in ratio.items()}, "ok": ok}


def sec_bf16_step(smoke, dev, out_dir):
    """The whole training path on this device (NCCL, bf16, DeepSpeed ZeRO-2): quickstart steps. Pass: every loss
    finite and the mean of the last third below the first step's."""
    import configurator
    import train
    steps, warmup = (6, 2) if smoke else (30, 5)
    cfg = configurator.defaults()
    configurator.apply(cfg, [os.path.join(HERE, "config/quickstart.py"), "--dtype=bfloat16", "--strategy=zero2",
                             f"--out_dir={out_dir}/bf16_step", f"--data_paths=['{out_dir}/bf16_step/qs.mdio']"])
    train.validate(cfg)
    job = train.setup(cfg)
    batches = train.micro_batches(job, 0, steps)
    losses = []
    try:
        for s in range(steps):
            if s == warmup:
                _sync(job.device)
                t = time.perf_counter()
            losses.append(train.train_step(job, s, batches)[0])
        _sync(job.device)
        ms = 1000 * (time.perf_counter() - t) / (steps - warmup)
    finally:
        batches.close()
        job.sampler.close()
    losses = [x.item() for x in losses]
    tail = losses[-max(1, steps // 3):]
    ok = all(np.isfinite(losses)) and sum(tail) / len(tail) < losses[0]
    print(f"{steps} quickstart steps, bf16 zero2 on {job.device}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"{ms:.1f} ms/step")
    return {"losses": [round(x, 5) for x in losses], "ms_per_step": round(ms, 2), "ok": ok}


def sec_memory(smoke, dev, out_dir):
    """The planner's weight/gradient/optimizer terms against the allocator (torch.cuda's counters on the GPU): 1
    rank, bf16, zero2 / zero3 / fsdp2. Pass: every term within 25 % (the CPU tests' tolerance)."""
    from bench import GPU_MEMORY_CASES, memory_check, memory_table
    cases = GPU_MEMORY_CASES if not smoke else [(c[0], c[1], c[2][:1], c[3]) for c in GPU_MEMORY_CASES]  # (zero2)
    rows, worst = memory_check(cases, device=dev.type)
    memory_table(rows)
    return {"worst_rel_err": round(worst, 4), "rows": rows, "ok": bool(worst <= 0.25)}


def sec_bf16_strategies(smoke, dev, out_dir, steps=None):
    """zero2 and fsdp2 in bf16 on one device: the same kept-token ids at every step (what reached the model, as
    tests/train_hooks.py records it), losses within 2 % on average (on 2 CPU ranks they agree within 2.4e-5)."""
    from bench import dtype_runs, rel_deviation
    steps = steps or (4 if smoke else 20)
    d = os.path.join(out_dir, "bf16_strategies")

    def env_for(name):
        os.makedirs(os.path.join(d, "probe_" + name))
        return dict(os.environ, MAE_PROBE=os.path.join(d, "probe_" + name))
    losses = dtype_runs([os.path.join(HERE, "config/quickstart.py"), f"--data_paths=['{d}/qs.mdio']",
                         "--make_synthetic=True"], d, steps, script="tests/train_hooks.py", env_for=env_for,
                        names=("zero2", "fsdp2"), nproc=1)
    ids = {n: [json.loads(x)["ids_keep"] for x in open(os.path.join(d, "probe_" + n, "rank0.jsonl"))]
           for n in ("zero2", "fsdp2")}
    same = ids["zero2"] == ids["fsdp2"] and len(ids["zero2"]) == steps
    mean = rel_deviation(losses["zero2"], losses["fsdp2"])[0]
    print(f"bf16, {steps} quickstart steps: zero2 and fsdp2 same masks: {same}, mean relative loss difference "
          f"{mean:.2e}")
    return {"same_masks": same, "mean_rel_diff": mean, "ok": same and mean <= 2e-2}


def sec_batch_copy(smoke, dev, out_dir):
    """One base_102k sample to the device the way train.py copies it (pinned bf16, non_blocking) against a pageable
    fp32 cast on the way: the training thread's time and the copy's time on the stream. Pass (GPU): the pinned
    copy frees the training thread (its host time is below the pageable one's)."""
    shape = (1, 1, 64, 64, 64) if smoke else (1, 1, 640, 640, 1024)
    pin = dev.type == "cuda"
    src = torch.empty(shape, dtype=torch.bfloat16, pin_memory=pin).normal_()
    pageable = torch.randn(shape)
    res = {}
    for name, fn in (("pinned bf16, non_blocking", lambda: src.to(dev, non_blocking=True)),
                     ("pageable fp32 -> bf16", lambda: pageable.to(dev, torch.bfloat16))):
        fn()
        _sync(dev)
        t = time.perf_counter()
        fn()
        host = time.perf_counter() - t
        res[name] = {"host_ms": round(1000 * host, 3), "stream_ms": round(1000 * _timed(fn, dev, 2), 3)}
    table([[k, v["host_ms"], v["stream_ms"]] for k, v in res.items()], ["copy", "training thread ms", "total ms"])
    ok = (not pin) or res["pinned bf16, non_blocking"]["host_ms"] < res["pageable fp32 -> bf16"]["host_ms"]
    return {"shape": list(shape), **res, "ok": ok}


def sec_compile(smoke, dev, out_dir):
    """The quickstart eager and with compile=True (each block torch.compile'd) in bf16 on this device, the same
    steps on the same data: time per step side by side, and the losses. Pass: compiled losses within 3e-2 of the
    eager ones (relative; bf16 kernels fused differently round differently)."""
    from bench import bench_step
    steps, warmup = (2, 1) if smoke else (10, 3)
    r = bench_step([os.path.join(HERE, "config/quickstart.py"), "--compile_compare=True", "--dtype=bfloat16",
                    f"--out_dir={out_dir}/compile", f"--data_paths=['{out_dir}/compile/qs.mdio']"],
                   warmup=warmup, steps=steps)
    diff = max(abs(a - b) / abs(a) for a, b in zip(r["losses_eager"], r["losses_compiled"]))
    r.update(max_rel_loss_diff=diff, ok=bool(diff <= 3e-2))
    print(f"compiled vs eager: largest relative loss difference {diff:.2e}")
    return r


def sec_stop_signal(smoke, dev, out_dir, steps=None):
    """SIGTERM to a 1-device quickstart run (fp32), then the relaunch, against the uninterrupted run. On a GPU the
    ranks read the agreed stop flag a step late (checkpoint.StopRequest.agreed: no host sync per step): this is
    the one place that path runs. Pass: exit 75, one checkpoint in between, the relaunch done, losses equal to
    the uninterrupted run's within 1e-4."""
    import checkpoint
    steps = steps or (12 if smoke else 40)
    d = os.path.join(out_dir, "stop_signal")
    base = [sys.executable, os.path.join(HERE, "train.py"), os.path.join(HERE, "config/quickstart.py"),
            f"--data_paths=['{d}/qs.mdio']", "--make_synthetic=True", f"--max_steps={steps}", "--dtype=float32",
            "--log_interval=1", "--ckpt_interval=1000", "--eval_interval=1000", "--figures=False"]

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
    res = {"rc": p.returncode, "records_before_signal": seen, "checkpoints": done, "relaunch_rc": again.returncode,
           "max_rel_diff": diff, "ok": p.returncode == checkpoint.RESUMABLE and len(done) == 1 and 0 < done[0] < steps
           and again.returncode == 0 and diff <= 1e-4}
    print(f"stop signal: SIGTERM after {seen} logged steps -> exit {p.returncode}, checkpoints {done}; relaunch exit "
          f"{again.returncode}; largest relative loss difference from the uninterrupted run {diff:.2e}")
    if not res["ok"]:
        print(err[-2000:], again.stderr[-2000:])
    return res


def sec_embed(smoke, dev, out_dir, steps=None):
    """embed.py on this device (NCCL, windows batched per forward) against embed.py on the CPU (CUDA hidden): a
    short fp32 quickstart run's encoder over the whole quickstart volume. Pass: features within 1e-2 of their
    largest magnitude (cuDNN may run the patch embedding in TF32: ~1e-3), and embed.py's JSON line from both."""
    import zarr
    steps = steps or (4 if smoke else 10)
    d = os.path.join(out_dir, "embed")
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), os.path.join(HERE, "config/quickstart.py"),
                        f"--data_paths=['{d}/qs.mdio']", "--make_synthetic=True", f"--max_steps={steps}",
                        "--dtype=float32", f"--out_dir={d}/run", "--eval_interval=1000", "--figures=False"]
                       + (["--synthetic_shape=(32,32,128)", "--val_frac=0.5"] if smoke else []),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rates, feats = {}, {}
    for where, env in (("device", os.environ), ("cpu", dict(os.environ, CUDA_VISIBLE_DEVICES=""))):
        e = subprocess.run([sys.executable, os.path.join(HERE, "embed.py"), f"{d}/run", f"{d}/qs.mdio",
                            f"--out={d}/{where}.zarr", "--dtype=float32"], env=env, capture_output=True, text=True,
                           timeout=600)
        assert e.returncode == 0, e.stderr[-2000:]
        rates[where] = json.loads(e.stdout.strip().splitlines()[-1])["tokens_per_s"]
        feats[where] = np.asarray(zarr.open_group(f"{d}/{where}.zarr", mode="r")["features"][:])
    err = float(np.abs(feats["device"] - feats["cpu"]).max() / max(np.abs(feats["cpu"]).max(), 1e-12))
    print(f"embed.py on {dev.type} vs the CPU: features differ by {err:.2e} of their largest magnitude; "
          f"{rates['device']:,.0f} vs {rates['cpu']:,.0f} tokens/s")
    return {"rel_err": err, "device_tokens_per_s": rates["device"], "cpu_tokens_per_s": rates["cpu"], "ok": err <= 1e-2}


def sec_elastic(smoke, dev, out_dir, steps=None):
    """Elastic resume onto this device: a bf16 ZeRO-2 quickstart run on 2 CPU ranks (gloo) checkpoints at steps/2;
    a copy goes on on one device with the same global batch (micro_batch 16 = 2 x 8) through DeepSpeed's
    universal checkpoint. Pass: the continued losses within 5e-2 of the CPU run's own (CPU and GPU bf16 kernels
    round differently; the CPU tests prove this exact in fp32)."""
    import shutil
    steps = steps or (8 if smoke else 16)
    half = steps // 2
    d = os.path.join(out_dir, "elastic")
    base = [os.path.join(HERE, "train.py"), os.path.join(HERE, "config/quickstart.py"), f"--data_paths=['{d}/qs.mdio']",
            "--make_synthetic=True", f"--max_steps={steps}", "--dtype=bfloat16", "--log_interval=1",
            f"--ckpt_interval={half}", "--eval_interval=1000", "--figures=False"]
    cpu_env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cpu = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *base,
                          "--micro_batch=8", f"--out_dir={d}/cpu"], env=cpu_env, capture_output=True, text=True,
                         timeout=600)
    assert cpu.returncode == 0, cpu.stderr[-2000:]
    tag = f"step_{half:07d}"
    shutil.copytree(f"{d}/cpu/ckpt/{tag}", f"{d}/dev/ckpt/{tag}")
    run = subprocess.run([sys.executable, *base, "--micro_batch=16", f"--out_dir={d}/dev"], capture_output=True,
                         text=True, timeout=600)

    def losses(name):
        with open(os.path.join(d, name, "log.jsonl")) as f:
            return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    a, b = losses("cpu"), (losses("dev") if run.returncode == 0 else {})
    diff = max((abs(a[s] - b[s]) / abs(a[s]) for s in range(half, steps) if s in b), default=float("nan"))
    res = {"rc": run.returncode, "converted": "converted in" in run.stdout, "steps": sorted(b), "max_rel_diff": diff,
           "ok": run.returncode == 0 and sorted(b) == list(range(half, steps)) and diff <= 5e-2}
    print(f"elastic resume: bf16 zero2 checkpoint of 2 CPU ranks at step {half} -> 1 {dev.type} rank (universal "
          f"checkpoint converted: {res['converted']}), exit {run.returncode}; largest relative loss difference "
          f"{diff:.2e}")
    if not res["ok"]:
        print(run.stderr[-2000:])
    return res


# -----------------------------------------------------------------------------
# the runner: each section in its own process


def run_section(name, smoke, out_dir):
    """In the section's own process: run it, append its JSON line, exit 0 when it passed."""
    dev = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    if smoke:
        torch.set_num_threads(1)
    t = time.perf_counter()
    try:
        res = globals()[f"sec_{name}"](smoke, dev, out_dir)
    except Exception as e:  # noqa: BLE001 (recorded as this section's failure; the next section runs)
        import traceback
        traceback.print_exc()
        res = {"ok": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"}
    res = {"section": name, "ok": bool(res.pop("ok")), "s": round(time.perf_counter() - t, 1), **res}
    with open(os.path.join(out_dir, "gpu_check.jsonl"), "a") as f:
        f.write(json.dumps(res, default=float) + "\n")
    return 0 if res["ok"] else 1


def kill_tree(p):
    """Kill a section's process and everything it started: its process group, and the descendants that left it
    (torchrun starts its ranks in sessions of their own: left alone they would hold the GPU for the next sections)."""
    import psutil  # (installed with deepspeed)
    try:
        family = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for q in family:
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=30)
    p.wait()


def clean_env(smoke):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")])))
    if smoke:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    else:
        env.pop("DS_ACCELERATOR", None)
        env.setdefault("TORCH_NCCL_HIGH_PRIORITY", "1")  # as launch.sh's GPU environment
    return env


def main(argv):
    opts = {"out": os.environ.get("OUT", "."), "budget_s": 480, "only": "", "limit_s": 0}
    smoke = "--cpu-smoke" in argv
    for a in argv:
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            if k not in opts:
                raise SystemExit(f"bench_gpu.py: unknown option {a} (known: --cpu-smoke, "
                                 f"{', '.join('--' + k for k in opts)})")
            opts[k] = v
        elif a != "--cpu-smoke":
            raise SystemExit(f"bench_gpu.py: unknown argument {a}")
    out_dir = os.path.abspath(opts["out"])
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(os.path.join(out_dir, "gpu_check.jsonl")):
        os.remove(os.path.join(out_dir, "gpu_check.jsonl"))
    names = [n for n, _ in SECTIONS if not opts["only"] or n in opts["only"].split(",")]
    budget, t0, env = float(opts["budget_s"]), time.time(), clean_env(smoke)
    status = {}
    for name in names:
        left = budget - (time.time() - t0)
        limit = int(min(dict(SECTIONS)[name] * (3 if smoke else 1), left, float(opts["limit_s"]) or left))
        if left < 15:
            status[name] = "skipped (budget)"
            print(f"== {name}: skipped, {left:.0f} s of the budget left", flush=True)
            continue
        print(f"== {name} (up to {limit} s)", flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), f"--section={name}", f"--out={out_dir}"] + (
            ["--cpu-smoke"] if smoke else [])
        p = subprocess.Popen(cmd, env=env, cwd=HERE, start_new_session=True)  # its own group: a timeout kills all
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_tree(p)
            rc = "timeout"
            with open(os.path.join(out_dir, "gpu_check.jsonl"), "a") as f:
                f.write(json.dumps({"section": name, "ok": False, "s": limit, "error": f"timed out after {limit} s"})
                        + "\n")
        if not _earlier(out_dir, name):
            with open(os.path.join(out_dir, "gpu_check.jsonl"), "a") as f:  # died without its line (a crash)
                f.write(json.dumps({"section": name, "ok": False, "error": f"exit code {rc}"}) + "\n")
        r = _earlier(out_dir, name)
        status[name] = "ok" if r.get("ok") else "FAIL"
        print(f"== {name}: {status[name]} in {r.get('s', '?')} s" + (f" ({r['error']})" if "error" in r else ""),
              flush=True)
    results = {n: _earlier(out_dir, n) for n in names}
    print()
    table([[n, status[n], results[n].get("s", "-")] for n in names], ["section", "result", "seconds"])
    summary = {"bench": "gpu-check", "cpu_smoke": smoke, "ok": all(s == "ok" for s in status.values()),
               "wall_s": round(time.time() - t0, 1), "status": status, "sections": results}
    with open(os.path.join(out_dir, "gpu_check_summary.json"), "w") as f:
        json.dump(summary, f, default=float)
    print(json.dumps(summary, default=float))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    section = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--section=")), None)
    if section:
        out = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--out="))
        sys.exit(run_section(section, "--cpu-smoke" in sys.argv, out))
    sys.exit(main(sys.argv[1:]))
