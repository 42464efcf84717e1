"""
The GPU check's sections on the training path (bench/gpu.py runs each in its own process): bf16_step, memory,
bf16_strategies, compile, stop_signal, embed, segment, elastic: train.py, scripts/embed.py and the strategies on this
device, against the CPU or each other (the batch's copy to the device: bench/gpu_model.py's data_copy). Each sec_NAME(smoke, dev, out_dir) returns a dict with "ok" and what it
measured.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from bench.gpu_attention import HERE, _sync

# --cpu-smoke: the quickstart steps at a micro batch of 2, not 8. The code path is the same; a CPU without bf16
# instructions multiplies bf16 at about 1 GFLOP/s (bench/step.py's matmul_flops), so the full batch made the smoke
# run for many minutes
SMOKE_BATCH = ["--micro_batch=2"]
# --cpu-smoke: no kriging floor at the validations of stop_signal's, embed's, bf16_strategies' and elastic's runs,
# which do not check it: at the quickstart's crops a CPU takes longer for it than for the runs' steps (eval_s of each
# run's first validation record), and tests/test_floor.py proves it on CPU. On the GPU these runs compute it as every
# run does
SMOKE_NO_FLOOR = ["--val_floor=False"]


def sec_bf16_step(smoke, dev, out_dir):
    """The whole training path on this device (NCCL, bf16, DeepSpeed ZeRO-2): quickstart steps. Pass: every loss
    finite and the mean of the last third below the first step's."""
    import configurator
    import train
    steps, warmup = (6, 2) if smoke else (30, 5)
    cfg = configurator.defaults()
    configurator.apply(cfg, [os.path.join(HERE, "config/quickstart.py"), "--dtype=bfloat16", "--strategy=zero2",
                             f"--out_dir={out_dir}/bf16_step", f"--data_paths=['{out_dir}/bf16_step/qs.mdio']"]
                    + (SMOKE_BATCH if smoke else []))
    configurator.check_config(cfg)
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
    from bench.plan import GPU_MEMORY_CASES, memory_check, memory_table
    # smoke: zero2 only, on crops of 8 x 8 x 32 (32 tokens: the state terms, which do not depend on the crop,
    # are the large ones; tests/test_planner.py checks every strategy at the full crop)
    cases = GPU_MEMORY_CASES if not smoke else [(c[0], c[1], c[2][:1], [*c[3], "--crop=(8,8,32)"])
                                                for c in GPU_MEMORY_CASES]
    rows, worst = memory_check(cases, device=dev.type)
    memory_table(rows)
    return {"worst_rel_err": round(worst, 4), "rows": rows, "ok": bool(worst <= 0.25)}


def sec_bf16_strategies(smoke, dev, out_dir, steps=None):
    """zero2 and fsdp2 in bf16 on one device: the same kept-token ids at every step (what reached the model, as
    tests/train_hooks.py records it), losses within 2 % on average (on 2 CPU ranks they agree within 2.4e-5)."""
    from bench.step import dtype_runs, rel_deviation
    steps = steps or (4 if smoke else 20)
    d = os.path.join(out_dir, "bf16_strategies")

    def env_for(name):
        os.makedirs(os.path.join(d, "probe_" + name))
        return dict(os.environ, MAE_PROBE=os.path.join(d, "probe_" + name))
    losses = dtype_runs([os.path.join(HERE, "config/quickstart.py"), f"--data_paths=['{d}/qs.mdio']",
                         "--make_synthetic=True", *(SMOKE_BATCH + SMOKE_NO_FLOOR if smoke else [])], d, steps,
                        script="tests/train_hooks.py", env_for=env_for, names=("zero2", "fsdp2"), nproc=1)
    ids = {n: [json.loads(x)["ids_keep"] for x in open(os.path.join(d, "probe_" + n, "rank0.jsonl"))]
           for n in ("zero2", "fsdp2")}
    same = ids["zero2"] == ids["fsdp2"] and len(ids["zero2"]) == steps
    mean = rel_deviation(losses["zero2"], losses["fsdp2"])[0]
    print(f"bf16, {steps} quickstart steps: zero2 and fsdp2 same masks: {same}, mean relative loss difference "
          f"{mean:.2e}")
    return {"same_masks": same, "mean_rel_diff": mean, "ok": same and mean <= 2e-2}


def sec_compile(smoke, dev, out_dir):
    """The quickstart eager and with compile=True (each block torch.compile'd) in bf16 on this device, the same
    steps on the same data: time per step side by side, and the losses. Pass: compiled losses within 3e-2 of the
    eager ones (relative; bf16 kernels fused differently round differently)."""
    from bench.step import bench_step
    steps, warmup = (2, 1) if smoke else (10, 3)
    r = bench_step([os.path.join(HERE, "config/quickstart.py"), "--compile_compare=True", "--dtype=bfloat16",
                    f"--out_dir={out_dir}/compile", f"--data_paths=['{out_dir}/compile/qs.mdio']",
                    *(SMOKE_BATCH if smoke else [])],
                   warmup=warmup, steps=steps)
    diff = max(abs(a - b) / abs(a) for a, b in zip(r["losses_eager"], r["losses_compiled"]))
    r.update(max_rel_loss_diff=diff, ok=bool(diff <= 3e-2))
    print(f"compiled vs eager: largest relative loss difference {diff:.2e}")
    return r


def sec_stop_signal(smoke, dev, out_dir, steps=None):
    """SIGTERM to a 1-device quickstart run (fp32), then the relaunch, against the uninterrupted run. On a GPU the
    ranks read the agreed stop flag a step late (stop.StopRequest.agreed: no host sync per step): this is
    the one place that path runs. Pass: exit 75, one checkpoint in between, the relaunch done, losses equal to
    the uninterrupted run's within 1e-4."""
    from infra import checkpoint
    from infra import stop
    steps = steps or (12 if smoke else 40)
    d = os.path.join(out_dir, "stop_signal")
    base = [sys.executable, os.path.join(HERE, "train.py"), os.path.join(HERE, "config/quickstart.py"),
            f"--data_paths=['{d}/qs.mdio']", "--make_synthetic=True", f"--max_steps={steps}", "--dtype=float32",
            "--log_interval=1", "--ckpt_interval=1000", "--eval_interval=1000", "--figures=False",
            *(SMOKE_NO_FLOOR if smoke else [])]

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
           "max_rel_diff": diff, "ok": p.returncode == stop.RESUMABLE and len(done) == 1 and 0 < done[0] < steps
           and again.returncode == 0 and diff <= 1e-4}
    print(f"stop signal: SIGTERM after {seen} logged steps -> exit {p.returncode}, checkpoints {done}; relaunch exit "
          f"{again.returncode}; largest relative loss difference from the uninterrupted run {diff:.2e}")
    if not res["ok"]:
        print(err[-2000:], again.stderr[-2000:])
    return res


def sec_embed(smoke, dev, out_dir, steps=None):
    """scripts/embed.py on this device (NCCL, windows batched per forward) against scripts/embed.py on the CPU (CUDA hidden): a
    short fp32 quickstart run's encoder over the whole quickstart volume. Pass: features within 1e-2 of their
    largest magnitude (cuDNN may run the patch embedding in TF32: ~1e-3), and scripts/embed.py's JSON line from both."""
    import zarr
    steps = steps or (4 if smoke else 10)
    d = os.path.join(out_dir, "embed")
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), os.path.join(HERE, "config/quickstart.py"),
                        f"--data_paths=['{d}/qs.mdio']", "--make_synthetic=True", f"--max_steps={steps}",
                        "--dtype=float32", f"--out_dir={d}/run", "--eval_interval=1000", "--figures=False"]
                       + (["--synthetic_shape=(32,32,128)", "--val_frac=0.5", *SMOKE_NO_FLOOR] if smoke else []),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rates, feats = {}, {}
    for where, env in (("device", os.environ), ("cpu", dict(os.environ, CUDA_VISIBLE_DEVICES=""))):
        e = subprocess.run([sys.executable, "-m", "scripts.embed", f"{d}/run", f"{d}/qs.mdio",
                            f"--out={d}/{where}.zarr", "--dtype=float32"], env=env, capture_output=True, text=True,
                           timeout=600, cwd=HERE)
        assert e.returncode == 0, e.stderr[-2000:]
        rates[where] = json.loads(e.stdout.strip().splitlines()[-1])["tokens_per_s"]
        feats[where] = np.asarray(zarr.open_group(f"{d}/{where}.zarr", mode="r")["features"][:])
    err = float(np.abs(feats["device"] - feats["cpu"]).max() / max(np.abs(feats["cpu"]).max(), 1e-12))
    print(f"scripts/embed.py on {dev.type} vs the CPU: features differ by {err:.2e} of their largest magnitude; "
          f"{rates['device']:,.0f} vs {rates['cpu']:,.0f} tokens/s")
    return {"rel_err": err, "device_tokens_per_s": rates["device"], "cpu_tokens_per_s": rates["cpu"], "ok": err <= 1e-2}


def sec_segment(smoke, dev, out_dir, steps=None):
    """Fine-tuning on this device: the quickstart's store with its fault labels, task="segment" in bf16 under ZeRO-2
    (every token through the encoder, no cls; the decoder blocks as the head; the labels as channel 1 of the pinned
    batch). Pass: finite losses that fall, and a validation record with IoU and Dice for both classes."""
    steps = steps or (6 if smoke else 30)
    d = os.path.join(out_dir, "segment")
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), os.path.join(HERE, "config/quickstart.py"),
                        f"--data_paths=['{d}/qs.mdio']", "--make_synthetic=True", f"--max_steps={steps}",
                        "--task=segment", "--dtype=bfloat16", "--log_interval=1", f"--eval_interval={steps}",
                        f"--out_dir={d}/run", "--figures=False"]
                       + (["--synthetic_shape=(32,32,128)", "--val_frac=0.5", "--eval_samples=2", *SMOKE_BATCH]
                          if smoke else []),  # (smoke: 2 validation samples, not 16; bf16 is slow on a CPU)
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    log = [json.loads(x) for x in open(f"{d}/run/log.jsonl")]
    losses = [x["loss"] for x in log if "loss" in x]
    val = [x for x in log if "val_iou" in x]
    ok = (all(np.isfinite(losses)) and np.mean(losses[-3:]) < np.mean(losses[:3]) and len(val) == 2
          and all(len(v["val_iou"]) == len(v["val_dice"]) == 2 for v in val))
    print(f"fine-tuning on {dev.type}, bf16: loss {losses[0]:.4f} -> {losses[-1]:.4f}; validation {val[-1]}")
    return {"first_loss": losses[0], "last_loss": losses[-1], "val": val[-1], "ok": bool(ok)}


def sec_elastic(smoke, dev, out_dir, steps=None):
    """Elastic resume onto this device: a bf16 ZeRO-2 quickstart run on 2 CPU ranks (gloo) checkpoints at steps/2;
    a copy goes on on one device with the same global batch (micro_batch 16 = 2 x 8) through DeepSpeed's
    universal checkpoint. Pass: the continued losses within 5e-2 of the CPU run's own (CPU and GPU bf16 kernels
    round differently; the CPU tests prove this exact in fp32)."""
    import shutil
    steps = steps or (8 if smoke else 16)
    half = steps // 2
    mb = 2 if smoke else 8  # per CPU rank; the device's is twice that (the same global batch)
    d = os.path.join(out_dir, "elastic")
    base = [os.path.join(HERE, "train.py"), os.path.join(HERE, "config/quickstart.py"), f"--data_paths=['{d}/qs.mdio']",
            "--make_synthetic=True", f"--max_steps={steps}", "--dtype=bfloat16", "--log_interval=1",
            f"--ckpt_interval={half}", "--eval_interval=1000", "--figures=False", *(SMOKE_NO_FLOOR if smoke else [])]
    cpu_env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cpu = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *base,
                          f"--micro_batch={mb}", f"--out_dir={d}/cpu"], env=cpu_env, capture_output=True, text=True,
                         timeout=600)
    assert cpu.returncode == 0, cpu.stderr[-2000:]
    tag = f"step_{half:07d}"
    shutil.copytree(f"{d}/cpu/ckpt/{tag}", f"{d}/dev/ckpt/{tag}")
    run = subprocess.run([sys.executable, *base, f"--micro_batch={2 * mb}", f"--out_dir={d}/dev"], capture_output=True,
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
