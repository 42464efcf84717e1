"""
The planner (infra/plan.py) checked against measurements on this machine (`python -m bench plan` runs it and prints
the JSON line):

    python -m bench plan CONFIG [--key=value ...]     the plan of CONFIG, then these checks

calibrate(): its FLOP and activation terms on small models, and the ring's backward memory; memory_check(): its
weight/gradient/optimizer terms per strategy against real 2- and 4-rank training (GPU_MEMORY_CASES: on one GPU,
bench/gpu_training.py). tests/test_planner.py holds them to 25 %.
"""

import json
import math
import os
import sys

import torch

from infra.plan import (activation_bytes, ckpt_order, config_plan, flops_per_sample, param_counts, recompute_flops,
                        report, state_bytes, step_bytes, table)
from model import build_model



def calibrate():
    """The planner's FLOP and activation terms against measurements on small configs, on this machine (fp32):
    FLOPs counted by torch's FlopCounterMode over forward + backward (attention through the math kernel, whose
    matmuls it can see: it does not count the CPU flash kernel); persistent activations as the bytes of the
    tensors autograd saves during forward (saved_tensors_hooks, each storage once, parameters excluded). And
    the ring's backward memory (plan.ring_bytes) against the CPU allocator, in fp32 and bf16.
    Returns the table rows and the worst relative error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    import model as M
    rows, worst = [], 0.0
    for name, kw in (("tiny 4x4x8", dict(grid=(4, 4, 8), patch=(4, 4, 4))),
                     ("tiny 8x8x8", dict(grid=(8, 8, 8), patch=(2, 2, 16))),
                     ("small 4x8x8", dict(grid=(4, 8, 8), patch=(4, 4, 4)))):
        size = name.split()[0]
        n_blocks = len(ckpt_order(M.mae(size, grid=kw["grid"], patch=kw["patch"])))
        for ckpt in (False, n_blocks // 2, True):  # none, the first half of ckpt_order(), every block
            torch.manual_seed(0)
            m = M.mae(size, grid=kw["grid"], patch=kw["patch"])
            m.set_grad_ckpt(ckpt_order(m)[:n_blocks if ckpt is True else int(ckpt)])
            x = torch.randn(2, 1, *(g * p for g, p in zip(kw["grid"], kw["patch"])))
            params = {p.untyped_storage().data_ptr() for p in m.parameters()}
            seen, saved = set(), [0]

            def pack(t):
                st = t.untyped_storage()
                if st.data_ptr() not in params and st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    saved[0] += st.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss, _, _ = m(x)
            act_measured = saved[0]
            loss.backward()
            act_model = activation_bytes(m, 2, 1, 4, ckpt)[0]
            label = {False: "", True: " (every block ckpt)"}.get(ckpt, f" ({ckpt} blocks ckpt)")
            if ckpt is not True:  # FLOPs executed: the model's, plus the checkpointed blocks' forward again
                with FlopCounterMode(display=False) as fc, sdpa_kernel(SDPBackend.MATH):
                    m(x)[0].backward()
                flops_measured = fc.get_total_flops() / 2  # per sample (batch 2)
                planned = flops_per_sample(m) + recompute_flops(m)
                e = flops_measured / planned - 1
                worst = max(worst, abs(e))
                rows.append([name, f"FLOPs/sample{label}", f"{planned:.3g}", f"{flops_measured:.3g}", f"{100 * e:+.1f}%"])
            e = act_measured / act_model - 1
            worst = max(worst, abs(e))
            rows.append([name, f"activations{label}", f"{act_model / 2 ** 20:.2f} MiB",
                         f"{act_measured / 2 ** 20:.2f} MiB", f"{100 * e:+.1f}%"])
    # The ring's backward: what one rank's RingAttention.backward allocates beyond what it is handed, at its
    # peak, counted by the profiler's CPU allocation events (each allocation and free, from the start of backward).
    # One rank of a W-rank ring in this process (bench/ring_sim.py's SelfRing: the exchange done as a local copy, the
    # "received" blocks this rank's own): the receive buffers are the only tensors the real exchange allocates,
    # and 2, 3 and 4 gloo ranks allocated exactly the same bytes at these shapes. Wide and short (N 256, 16 heads of 64): the per-token terms dwarf the CPU
    # kernel's scratch tiles per thread (fixed sizes, which ring_bytes leaves out: under 3 % here).
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    import ring_attention as RA
    from bench.ring_sim import SelfRing
    from infra.plan import ring_bytes

    def walk(events):
        for ev in events:
            yield ev
            yield from walk(ev.children)

    def ring_backward_peak(W, N, H, d, dtype):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, H, N, d, generator=g, dtype=dtype, requires_grad=True) for _ in range(3))
        dout = torch.randn(1, N, H, d, generator=g, dtype=dtype).transpose(1, 2)  # as proj's backward hands it on
        out = RA.ring_attention(q, k, v, group=SelfRing(W))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out.backward(dout)
        allocs = sorted((ev.start_time_ns, ev.extra_fields.alloc_size)
                        for ev in walk(prof.profiler.kineto_results.experimental_event_tree())
                        if ev.tag == _EventType.Allocation and ev.extra_fields.device.type == "cpu")
        held = peak = 0
        for _, size in allocs:
            held += size
            peak = max(peak, held)
        return peak

    N, H, d = 256, 16, 64
    for dtype, W in ((torch.float32, 2), (torch.float32, 4), (torch.bfloat16, 4)):
        ring_backward_peak(W, 64, H, d, dtype)  # warm-up: the kernels' first calls
        measured = ring_backward_peak(W, N, H, d, dtype)
        planned = ring_bytes(N, H * d, d, dtype.itemsize, W, on_gpu=False)
        e = measured / planned - 1
        worst = max(worst, abs(e))
        rows.append([f"ring W={W}, {N} x {H} x {d}", f"ring backward ({str(dtype)[6:]})",
                     f"{planned / 2 ** 20:.2f} MiB", f"{measured / 2 ** 20:.2f} MiB", f"{100 * e:+.1f}%"])
    return rows, worst


def _memory_worker(argv):
    """One rank of memory_check (run under torchrun): train 3 steps of the config in argv with every CPU tensor
    allocation counted, and write to $MEMORY_OUT<rank> the bytes held at the start of the last step (the state
    between steps) and the most held during it: in forward/backward, in the optimizer step, overall."""
    import ctypes

    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    import configurator
    import train
    torch.set_num_threads(1)
    cfg = configurator.defaults()
    configurator.apply(cfg, argv)
    configurator.check_config(cfg)
    steps = 3  # step 0 creates Adam's state; steps 1 and 2 are alike; we read step 2
    if torch.cuda.is_available():  # on a GPU (bench/gpu.py): the caching allocator's own counters
        job = train.setup(cfg)
        out = {}

        def then_peak(f, name):  # run a phase, then read (and reset) the peak since the last reset
            def wrapped(*a, **k):
                r = f(*a, **k)
                torch.cuda.synchronize()
                out[name] = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                return r
            return wrapped

        job.engine.backward = then_peak(job.engine.backward, "peak in fwd/bwd")
        job.engine.step = then_peak(job.engine.step, "peak in optimizer step")
        batches = train.micro_batches(job, 0, steps, depth=1)
        for s in range(steps):
            torch.cuda.synchronize()
            # cuBLAS keeps a workspace per thread and stream in the caching allocator (the forward's and
            # autograd's backward thread: ~70 MB); the planner counts it in its separate workspace allowance,
            # so it is freed here, measured, and taken off the peaks (it comes back during the step)
            before = torch.cuda.memory_allocated()
            torch._C._cuda_clearCublasWorkspaces()
            out["cublas_workspace"] = before - torch.cuda.memory_allocated()
            out["state between steps"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            train.train_step(job, s, batches)
        batches.close()
        job.sampler.close()
        for k in ("peak in fwd/bwd", "peak in optimizer step"):
            out[k] -= out["cublas_workspace"]
        out["peak"] = max(out["peak in fwd/bwd"], out["peak in optimizer step"])
        with open(f"{os.environ['MEMORY_OUT']}{job.rank}", "w") as f:
            json.dump(out, f)
        torch.distributed.destroy_process_group()
        return
    # On CPU there are no allocator counters. The profiler sees allocations made on this thread only; DeepSpeed's and gloo's threads free tensors too,
    # and those frees would be missed (the count would creep up step after step). This c10 flag makes the CPU
    # allocator keep its running total for every thread; the profiler's events then report that total.
    try:
        libc10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(libc10, "FLAGS_caffe2_report_cpu_memory_usage").value = True
    except (OSError, ValueError) as e:
        raise SystemExit(f"memory_check needs c10's FLAGS_caffe2_report_cpu_memory_usage (a CPU build of torch "
                         f"on Linux, as in requirements): {e}")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        job = train.setup(cfg)
        for name in ("backward", "step"):  # mark the phases of a step
            def marked(*a, _f=getattr(job.engine, name), _n=name, **k):
                with record_function("phase_" + _n):
                    return _f(*a, **k)
            setattr(job.engine, name, marked)
        batches = train.micro_batches(job, 0, steps, depth=1)
        for s in range(steps):
            with record_function(f"step_{s}"):
                train.train_step(job, s, batches)
        batches.close()
        job.sampler.close()
    allocs, spans = [], {}

    def walk(events):
        for e in events:
            yield e
            yield from walk(e.children)

    for e in walk(prof.profiler.kineto_results.experimental_event_tree()):
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            allocs.append((e.start_time_ns, e.extra_fields.total_allocated))
        elif e.name.startswith(("step_", "phase_")):
            spans.setdefault(e.name, []).append((e.start_time_ns, e.end_time_ns))
    allocs.sort()
    a, b = spans[f"step_{steps - 1}"][0]
    bw = next(x for x in spans["phase_backward"] if a <= x[0] <= b)
    st = next(x for x in spans["phase_step"] if a <= x[0] <= b)

    def held(t):  # the running total at time t: the last event before it
        return next((tot for tt, tot in reversed(allocs) if tt <= t), 0)

    def peak(t0, t1):
        return max([held(t0)] + [tot for tt, tot in allocs if t0 <= tt <= t1])

    out = {"state between steps": held(a), "peak in fwd/bwd": peak(a, bw[1]), "peak in optimizer step": peak(*st),
           "peak": peak(a, b)}
    with open(f"{os.environ['MEMORY_OUT']}{job.rank}", "w") as f:
        json.dump(out, f)
    torch.distributed.destroy_process_group()


MEMORY_BASE = ["config/quickstart.py", "--model_size=small", "--micro_batch=1", "--zero_bucket=2000000"]
MEMORY_CASES = (  # (label, ranks, strategies, train.py overrides beyond MEMORY_BASE)
    ("fp32", 2, ("zero2", "zero3", "fsdp2"), ["--dtype=float32"]),
    ("bf16", 2, ("zero2", "zero3", "fsdp2"), ["--dtype=bfloat16"]),
    ("fp32, 4 ranks", 4, ("zero2", "zero3", "fsdp2"), ["--dtype=float32", "--zero3_max_live=4000000"]),
    # DeepSpeed's buckets and ZeRO-3's gathered weights are small beside the state above (on a GPU they are
    # the largest state terms), so they are also checked in runs where they are the largest terms
    ("bf16, zero_bucket 16e6", 2, ("zero2", "zero3"), ["--dtype=bfloat16", "--zero_bucket=16000000"]),
    ("fp32, 4 ranks, zero3_max_live 16e6", 4, ("zero3",), ["--dtype=float32", "--zero3_max_live=16000000"]),
)


GPU_MEMORY_CASES = (  # bench/gpu.py: one GPU, bf16, where overlap_comm, foreach AdamW and NCCL are real;
    # buckets of 5e7 elements, so that the two reduce buckets of overlap_comm are a large term
    ("bf16, 1 GPU, zero_bucket 5e7", 1, ("zero2", "zero3", "fsdp2"), ["--dtype=bfloat16", "--zero_bucket=50000000"]),
)


def memory_check(cases=MEMORY_CASES, device="cpu"):
    """The planner's state terms (state_bytes) and its peak against what each strategy really allocates:
    2 or 4 CPU ranks of the quickstart data with the `small` model (24.6 M parameters) on a micro batch of 1
    (activations small beside the state), DeepSpeed buckets of 2e6 elements unless a case says otherwise
    (`cases`: MEMORY_CASES or some of them). Measured on every rank (the largest is kept): the CPU
    allocator's running total (every tensor, every thread) at the start of step 2 (state between steps), its
    maximum during forward/backward, during the optimizer step, and overall. device='cuda' (gpu-check): the
    same on one GPU from torch.cuda's allocator counters, against the planner's GPU terms.
    Returns rows of {case, strategy, term, planner, measured, error} (bytes) and the worst relative error."""
    import subprocess
    import tempfile

    import configurator
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = [os.path.join(here, MEMORY_BASE[0]), *MEMORY_BASE[1:]]
    on_gpu = device == "cuda"

    def run(ranks, strategy, extra):  # -> (measured, planned): dicts of the four terms, in bytes
        cfg = configurator.defaults()
        configurator.apply(cfg, base + extra)
        m = build_model(cfg, device="meta")
        elem = 2 if cfg["dtype"] == "bfloat16" or (cfg["dtype"] == "auto" and on_gpu) else 4
        act = sum(activation_bytes(m, cfg["micro_batch"], 1, elem, cfg["grad_ckpt"]))
        planned = step_bytes(state_bytes(param_counts(m), strategy, ranks, elem, cfg, on_gpu=on_gpu), act)
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, OMP_NUM_THREADS="1", MEMORY_OUT=os.path.join(d, "rank"), PYTHONPATH=here)
            if not on_gpu:  # CUDA hidden: on a GPU machine train.setup would otherwise train there
                env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
            r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc_per_node={ranks}", "-m", "bench.plan", "_memory_worker",
                                *base, *extra, f"--strategy={strategy}", f"--out_dir={os.path.join(d, 'o')}"],
                               env=env, capture_output=True, text=True, cwd=d, timeout=300)
            if r.returncode != 0:
                print(r.stdout[-2000:], r.stderr[-3000:], file=sys.stderr)
                raise RuntimeError(f"memory_check: {strategy} on {ranks} rank(s) with {extra} failed")
            per_rank = []
            for i in range(ranks):
                with open(os.path.join(d, f"rank{i}")) as f:
                    per_rank.append(json.load(f))
        return {k: max(x[k] for x in per_rank) for k in planned}, planned

    rows = []
    for label, ranks, strategies, extra in cases:
        for strategy in strategies:
            try:
                measured, planned = run(ranks, strategy, extra)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                if not on_gpu:
                    raise SystemExit(str(e)) from None
                # on a GPU session's scarce minutes: keep the runs that worked, mark this one
                print(f"FAILED: {e}", file=sys.stderr)
                rows.append({"case": label, "strategy": strategy, "term": "run FAILED", "planner": math.nan,
                             "measured": math.nan, "error": math.nan})
                continue
            rows += [{"case": label, "strategy": strategy, "term": k, "planner": planned[k], "measured": measured[k],
                      "error": planned[k] / measured[k] - 1} for k in planned]
    return rows, max([abs(r["error"]) for r in rows if not math.isnan(r["error"])] or [math.nan])


def memory_table(rows):
    table([[r["case"], r["strategy"], r["term"], f"{r['planner'] / 2 ** 20:.1f} MiB", f"{r['measured'] / 2 ** 20:.1f} MiB",
            f"{100 * r['error']:+.1f}%"] for r in rows], ["case", "strategy", "term", "planner", "measured", "error"])


def bench_plan(argv):
    """The plan of a config (infra/plan.py) with the checks of its terms on this machine, JSON last."""
    import configurator
    cfg, p = config_plan(argv, configurator.check_config)
    report(p, " ".join(a for a in argv if not a.startswith("--")) or "defaults")
    crow, worst = calibrate()
    print("\nplanner terms vs measurements on small configs (fp32, this machine):")
    table(crow, ["config", "term", "planner", "measured", "error"])
    mrow, mworst = memory_check()
    print(f"\nplanner's weight/gradient/optimizer memory vs what each strategy allocates on 2-4 CPU ranks here "
          f"({' '.join(MEMORY_BASE)}):")
    memory_table(mrow)
    p["calibration_worst_rel_err"] = round(worst, 4)
    p["memory_check_worst_rel_err"] = round(mworst, 4)
    return p


if __name__ == "__main__":
    if sys.argv[1:2] == ["_memory_worker"]:  # one rank of memory_check (started by torchrun)
        _memory_worker(sys.argv[2:])
