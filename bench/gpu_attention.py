"""
The GPU check's sections on the GPU itself, its collectives and attention (bench/gpu.py runs each in its own
process; its docstring says what each shows and why in this order): env, nccl, self_p2p, ops, self_ring, torch_cp,
big_blocks, attention_rates. And the helpers every section shares. Each sec_NAME(smoke, dev, out_dir) returns a
dict with "ok" (its pass/fail against the threshold its docstring states) and what it measured.
"""

import json
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch

from infra.plan import table
from model import build_model

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    """A process group of one rank on this device (NCCL on the GPU, gloo on CPU), its rendezvous in-process."""
    import torch.distributed as dist

    from infra import distributed
    distributed.init()  # (the runner starts each section without a launcher's variables: a world of 1)
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
    for mod in ("deepspeed", "zarr", "numcodecs", "matplotlib", "train", "scripts.embed", "scripts.export",
                "scripts.probe"):
        try:
            m = importlib.import_module(mod)
            res[f"{mod}_version"] = getattr(m, "__version__", "")
        except Exception as e:  # noqa: BLE001 (every import failure is a finding)
            missing.append(f"{mod}: {type(e).__name__}: {e}")
    from infra import torch_cp
    try:
        torch_cp._torch_ring()
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
    from bench.ring_sim import simulate_ring
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
                    got, grads = simulate_ring(*x, P, dout=dout.to(dtype))
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
    return sdpa_kernel(pin) if pin is not None else nullcontext()


def _self_ring_vias(dev, out_dir):
    """How the self-ring can exchange here: NCCL to itself when self_p2p showed it exact, and side-stream copies."""
    return (["p2p"] if _earlier(out_dir, "self_p2p").get("exact") else []) + ["copy"]


def sec_self_ring(smoke, dev, out_dir):
    """The real RingAttention (its exchange, waits, double buffers, backward's travelling accumulators) with W ranks
    simulated on this one: the same K/V comes back at every step, so the result must be SDPA's on the local
    q, k, v, forward and backward (bench/ring_sim.py's SelfRing)."""
    import torch.nn.functional as F

    import ring_attention as RA
    from bench.ring_sim import SelfRing
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
                            out = RA.ring_attention(*x, group=SelfRing(W, via))
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

    from infra import torch_cp
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
                    with sdpa_kernel(b) if b is not None else nullcontext():
                        out = torch_cp.TorchRingAttention.apply(*x, dist.group.WORLD, d ** -0.5)
                        out.backward(dout.to(dtype))
                except RuntimeError as e:  # this backend does not take these inputs: not a defect of ours
                    rows.append([str(dtype)[6:], d, name, "-", f"unavailable: {str(e).splitlines()[0][:60]}"])
                    continue
                err = max(rel_err(a, c) for a, c in zip((out.detach(), *(t.grad for t in x)),
                                                          (o, *(t.grad for t in ref))))
                rows.append([str(dtype)[6:], d, name, f"{err:.2e}", "ok" if err <= tol else "FAIL"])
            torch_cp.verify_torch_cp(dist.group.WORLD, dev, dtype, d)  # raises CPMismatchError
    table(rows, ["dtype", "head dim", "backend", "max rel err", "tol 5e-5 / 2e-2"])
    dist.destroy_process_group()
    return {"rows": rows, "ok": all(r[-1] != "FAIL" for r in rows) and any(r[-1] == "ok" for r in rows)}


def sec_big_blocks(smoke, dev, out_dir):
    """One ViT-G encoder block and one decoder block at big_context's per-rank shapes (1,179,648 tokens over cp 8:
    the encoder's 294,912 visible tokens + cls -> 36,864 per rank at width 1664; the decoder's 147,456 per rank
    at width 512; each at the config's heads: 13 and 4 of 128, where the H200 runs of docs/gpu_check/ had ViT-G's
    own 16 of 104 and 16 of 32), bf16, the ring a W = 8 self-ring: forward + backward time and
    max_memory_allocated beside infra/plan.py's attention time at its kernel rates and its matmul time at the MFU
    assumption, and its memory terms; the output and input gradient against the same block on plain SDPA at the
    local shapes. Pass (GPU): within SDPA's bf16 tolerance, the planned time within a third of the measured one,
    the measured peak under the planner's bound."""
    import configurator
    import model as M
    import ring_attention as RA
    from bench.ring_sim import SelfRing
    from infra import plan as P
    dist = _init_world_1()
    cfg = configurator.defaults()
    configurator.apply(cfg, [os.path.join(HERE, "config/big_context.py")])
    m = build_model(cfg, device="meta")
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
        ring = (SelfRing(W, via), RA.ring_attention)  # a Block's ring: (group, attention over the split sequence)

        def fwd_bwd(ring):
            xi = x.clone().requires_grad_()
            y = blk(xi, ring)
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
    table(rows, ["block", "kernel", "tokens/rank", "width", "head dim", "fwd+bwd ms", "infra/plan.py ms", "attn TFLOP/s",
                 "infra/plan.py attn TFLOP/s", "peak GiB", "infra/plan.py GiB (bound)", "err vs SDPA", "ok"])
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
                with sdpa_kernel(b) if b is not None else nullcontext():
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
    one the ring's blocks run: 'default') is within a third of what infra/plan.py assumes (ATTN_TFLOPS): else its step
    times, samples/s and stop lead are off by more; put the measured numbers there)."""
    from torch.nn.attention import SDPBackend

    from infra import plan as P
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
    table(rows, ["head dim", *rates, "infra/plan.py assumes (fwd+bwd)", "default / assumed"])
    ok = all(r > 0 for r in ratio.values()) and (smoke or all(0.75 <= r <= 1.33 for r in ratio.values()))
    return {"tflops": {b: {str(d): ([round(x, 1) for x in v] if v else None) for d, v in r.items()}
                       for b, r in rates.items()},
            "default_fwdbwd_over_planned": {str(d): round(r, 3) for d, r in ratio.items()}, "ok": ok}
