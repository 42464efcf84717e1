"""
The GPU check: one call on a GPU machine (bench/gpu_check.sh runs it there), built so that no failure wastes it.

    python -m bench.gpu [--out=DIR] [--budget_s=480] [--only=ops,self_ring] [--limit_s=S]   on the GPU
    python -m bench.gpu --cpu-smoke [--out=DIR]                       the same code paths on CPU

Each section runs in a process of its own, with a clean environment (no MASTER_PORT, RANK, WORLD_SIZE or
LOCAL_RANK inherited: a section that starts a process group, or train.py, picks its own port) and its own
timeout (SECTIONS, capped by what is left of --budget_s and by --limit_s), and appends its JSON line (its
numbers and "ok", its pass/fail against a stated threshold) to DIR/gpu_check.jsonl the moment it ends: a crash,
a hang or the call's time limit loses that section only. Sections run most decisive first:

  env              devices, versions, the project's imports (the wheels bench/gpu_check.sh installed)
  nccl             an NCCL all-reduce and broadcast on this GPU
  self_p2p         batch_isend_irecv to this rank itself: can the ring's real exchange run on one GPU?
  ops              the ring's block ops (bf16: the kernel SDPA picks, and flash pinned; fp32: memory-efficient)
                   against fp64 SDPA, head dims 32..128
  self_ring        the real RingAttention, W ranks simulated on this one (bench/ring_sim.py's SelfRing), forward and
                   backward against SDPA: the exchange through NCCL to itself where it runs, else side-stream copies
  torch_cp         cp_impl='torch' (PyTorch's ring functions with this GPU's flash / efficient / cuDNN ops) and
                   its guard against our ring
  base_step        base_102k's training step on this GPU through train.py (bf16, ZeRO-2, a synthetic store of one
                   sample's size): step time, MFU, the encoder's and decoder's time, peak memory and the
                   allocator's retries, against infra/plan.py's plan of the same config (within 20 %)
  rank_step        one cp rank's exact share of a big_context step (model G, rank 0's slab, a W = 8 self-ring, the
                   config's checkpointed blocks): forward, loss, backward, per-block time and the ring's wait, against
                   the planner's per-rank step time (within 20 %); the peak under the GPU's memory
  base_step_aligned, rank_step_aligned   the same two at heads of 128 (the configs' heads; the two above run ViT's
                   own heads of 64 / 32 and 104 / 32), so that one run measures what aligned heads gain
  data_copy        prepare_batch and the copy to the device as train.py did it and does now (pinned buffers reused,
                   the copy on a side stream): their time and the copy's exposed time on the GPU
  big_blocks       one ViT-G encoder block and one decoder block at big_context's per-rank shapes, W = 8
                   self-ring: time and max_memory_allocated beside infra/plan.py's terms, output against SDPA's
  attention_rates  SDPA fwd and fwd+bwd TFLOP/s by backend (flash, efficient, cuDNN, pinned) and head dim
                   (32 / 64 / 104 / 128) at 102,400 tokens, beside infra/plan.py's attention_tflops
  bf16_step        quickstart steps in bf16 under ZeRO-2 on NCCL: finite, decreasing losses; ms/step
  then, while time remains: memory (the planner's state terms against torch.cuda's allocator), bf16_strategies
  (zero2 vs fsdp2 on the same masks), compile (eager vs compiled steps, losses compared), stop_signal (SIGTERM, the
  stop flag read a step late, the relaunch), embed (scripts/embed.py on the GPU against the CPU), segment
  (fine-tuning steps in bf16: falling losses, IoU and Dice), elastic (a 2-CPU-rank checkpoint resumed on the GPU).
  From big_blocks on, the sections repeat results the H200 has already given (docs/gpu_check/): with the whole-model
  sections ahead of them, the 480 s budget reaches about bf16_step. A section the budget ends is "skipped
  (budget)" or "cut (budget)", not a failure: the summary's ok is that every section that ran to its end passed.

The sections: bench/gpu_attention.py (env .. torch_cp, big_blocks, attention_rates, and the helpers they share),
bench/gpu_model.py (base_step .. data_copy) and bench/gpu_training.py (bf16_step .. elastic); this file is the runner.

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

import torch

from bench import gpu_attention
from bench import gpu_model
from bench import gpu_training
from bench.gpu_attention import _earlier
from infra.plan import table

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = [  # (name, seconds it may take on the GPU)
    ("env", 60), ("nccl", 60), ("self_p2p", 45), ("ops", 90), ("self_ring", 90), ("torch_cp", 60),
    # the whole-model steps, as the planner prices them (base_step: 7 steps, ~3 s each, after writing the 1.7 GB
    # store; rank_step: a ~70 s step after a short warm-up; the aligned ones faster): before anything repeated
    ("base_step", 120), ("base_step_aligned", 75), ("rank_step", 150), ("rank_step_aligned", 110),
    ("data_copy", 60),
    # results the H200 has given before (docs/gpu_check/): about twice the time they took there
    ("big_blocks", 60), ("attention_rates", 90), ("bf16_step", 45),
    ("memory", 180), ("bf16_strategies", 150), ("compile", 240), ("stop_signal", 180),
    ("embed", 150), ("segment", 120), ("elastic", 180),
]
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


# -----------------------------------------------------------------------------
# the runner: each section in its own process


def run_section(name, smoke, out_dir):
    """In the section's own process: run it, append its JSON line, exit 0 when it passed."""
    dev = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    if smoke:
        torch.set_num_threads(1)
    t = time.perf_counter()
    try:
        section = next(getattr(m, f"sec_{name}") for m in (gpu_attention, gpu_model, gpu_training)
                       if hasattr(m, f"sec_{name}"))
        res = section(smoke, dev, out_dir)
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
    smoke = "--cpu-smoke" in argv
    # the budget is the GPU session's minutes; a CPU smoke has none (tests/test_gpu_check.py bounds it)
    opts = {"out": os.environ.get("OUT", "."), "budget_s": 3600 if smoke else 480, "only": "", "limit_s": 0}
    for a in argv:
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            if k not in opts:
                raise SystemExit(f"bench/gpu.py: unknown option {a} (known: --cpu-smoke, "
                                 f"{', '.join('--' + k for k in opts)})")
            opts[k] = v
        elif a != "--cpu-smoke":
            raise SystemExit(f"bench/gpu.py: unknown argument {a}")
    out_dir = os.path.abspath(opts["out"])
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(os.path.join(out_dir, "gpu_check.jsonl")):
        os.remove(os.path.join(out_dir, "gpu_check.jsonl"))
    names = [n for n, _ in SECTIONS if not opts["only"] or n in opts["only"].split(",")]
    budget, t0, env = float(opts["budget_s"]), time.time(), clean_env(smoke)
    status = {}
    for name in names:
        left = budget - (time.time() - t0)
        allowance = dict(SECTIONS)[name] * (3 if smoke else 1)
        limit = int(min(allowance, left, float(opts["limit_s"]) or left))
        by_budget = limit == int(left) < allowance  # the budget's end, not the section's allowance, bounds it
        if left < 15:
            status[name] = "skipped (budget)"
            print(f"== {name}: skipped, {left:.0f} s of the budget left", flush=True)
            continue
        print(f"== {name} (up to {limit} s)", flush=True)
        cmd = [sys.executable, "-m", "bench.gpu", f"--section={name}", f"--out={out_dir}"] + (
            ["--cpu-smoke"] if smoke else [])
        p = subprocess.Popen(cmd, env=env, cwd=HERE, start_new_session=True)  # its own group: a timeout kills all
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_tree(p)
            rc = "timeout"
            why = f"timed out after {limit} s" + (f", the budget's end (its allowance: {allowance} s)" if by_budget
                                                  else "")
            with open(os.path.join(out_dir, "gpu_check.jsonl"), "a") as f:
                f.write(json.dumps({"section": name, "ok": False, "s": limit, "error": why, "cut": by_budget})
                        + "\n")
        if not _earlier(out_dir, name):
            with open(os.path.join(out_dir, "gpu_check.jsonl"), "a") as f:  # died without its line (a crash)
                f.write(json.dumps({"section": name, "ok": False, "error": f"exit code {rc}"}) + "\n")
        r = _earlier(out_dir, name)
        status[name] = "ok" if r.get("ok") else "cut (budget)" if rc == "timeout" and by_budget else "FAIL"
        print(f"== {name}: {status[name]} in {r.get('s', '?')} s" + (f" ({r['error']})" if "error" in r else ""),
              flush=True)
    results = {n: _earlier(out_dir, n) for n in names}
    print()
    table([[n, status[n], results[n].get("s", "-")] for n in names], ["section", "result", "seconds"])
    # ok: every section that ran to its end passed (one the budget skipped or cut is listed, not failed)
    summary = {"bench": "gpu-check", "cpu_smoke": smoke, "ok": all(s != "FAIL" for s in status.values()),
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
