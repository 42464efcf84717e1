"""
The GPU check's whole-model sections (bench/gpu.py runs each in its own process, right after the correctness
sections): whole training steps of the production configs on one GPU, timed and measured beside the planner's
prediction (infra/plan.py, called here on the same config: the thresholds follow the planner as it is, never
numbers written down), and the batch's way to the device.

  base_step, base_step_aligned   train.setup on base_102k, one GPU, bf16, ZeRO-2, a synthetic store of one sample's
                                 size in 128^3 chunks, no validation: 2 warm-up steps, 5 timed
  rank_step, rank_step_aligned   one cp rank's exact share of a big_context step (model G, rank 0's slab, the ring
                                 a W = 8 self-ring, the config's checkpointed blocks): forward, loss, backward
  data_copy                      prepare_batch and the copy to the device, as train.py did it and as it does now

Each whole-model section runs at ViT's own head counts (heads of 64 / 32 for large, 104 / 32 for G: the "narrow"
layout) and, as *_aligned, at heads of 128 (what the configs set), so that one run shows the gain measured: the
two layouts are the config overrides in HEADS. Each sec_NAME(smoke, dev, out_dir) returns a dict with "ok" (its
pass/fail against the threshold its docstring states) and what it measured; --cpu-smoke runs the same code on a
tiny model and tiny shapes.
"""

import os
import shutil
import time
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch

from bench.gpu_attention import HERE, _init_world_1, _self_ring_vias, _sync
from infra.plan import table

# the two head layouts of each section, as config overrides; smoke: the tiny model's (widths 96 and 64), with head
# dims the ring's kernels take (multiples of 8)
HEADS = {"base_step": {"heads": 16, "dec_heads": 16}, "base_step_aligned": {"heads": 8, "dec_heads": 4},
         "rank_step": {"heads": 16, "dec_heads": 16}, "rank_step_aligned": {"heads": 13, "dec_heads": 4}}
SMOKE_HEADS = {"base_step": {"heads": 4, "dec_heads": 4}, "base_step_aligned": {"heads": 2, "dec_heads": 1},
               "rank_step": {"heads": 4, "dec_heads": 4}, "rank_step_aligned": {"heads": 2, "dec_heads": 2}}
SMOKE_MODEL = ["--model_size=tiny"]
SIZE_HEADS = ["--heads=0", "--dec_heads=0"]  # the size's own (the configs' heads of 128 do not divide tiny's widths)
TOLERANCE = 0.2  # measured within 20 % of the planner: time (both sections) and memory (base_step)


def _gpu_kind(dev):
    """The planner's GPU (infra/plan.py's GPUS) this device is: its peak FLOP/s for MFU."""
    from infra import plan as P
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else ""
    return next((k for k in P.GPUS if k in name), "H200")


def _config(name, args):
    import configurator
    cfg = configurator.defaults()
    configurator.apply(cfg, [os.path.join(HERE, "config", name), *args])
    return cfg


def _mem_stats(dev):
    if dev.type != "cuda":
        return {"max_allocated_gb": 0.0, "max_reserved_gb": 0.0, "alloc_retries": 0}
    s = torch.cuda.memory_stats()
    return {"max_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
            "max_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2),
            "alloc_retries": int(s.get("num_alloc_retries", 0))}


class BlockTimer:
    """Marks around each transformer block's forward and backward: CUDA events on the GPU (read after a sync), host
    time on CPU. Forward: module hooks before and after the block. Backward: tensor hooks on the block's input and
    output, since a block's backward runs from the gradient of its output to the gradient of its input (a
    checkpointed block's recompute falls inside it). The recompute calls the block's forward again, in backward:
    only a block's first call in a step is its forward (begin() starts a step)."""

    def __init__(self, model, dev):
        self.cuda, self.steps, self.handles = dev.type == "cuda", [], []
        self.stacks = {"encoder": len(model.blocks), "decoder": len(model.decoder_blocks)}
        for stack, blocks in (("encoder", model.blocks), ("decoder", model.decoder_blocks)):
            for i, blk in enumerate(blocks):
                self.handles += [blk.register_forward_pre_hook(partial(self._pre, stack, i)),
                                 blk.register_forward_hook(partial(self._post, stack, i))]

    def _mark(self, key):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
        else:
            e = time.perf_counter()
        self.steps[-1].setdefault(key, e)  # (the first mark of a key in a step)

    def _pre(self, stack, i, mod, args):
        if not self.steps or (stack, i, "f0") in self.steps[-1]:
            return  # outside a timed step, or the recompute in backward
        self._mark((stack, i, "f0"))
        if args[0].requires_grad:
            args[0].register_hook(lambda g: self._mark((stack, i, "b1")))

    def _post(self, stack, i, mod, args, out):
        if not self.steps or (stack, i, "f1") in self.steps[-1]:
            return
        self._mark((stack, i, "f1"))
        if out.requires_grad:
            out.register_hook(lambda g: self._mark((stack, i, "b0")))

    def begin(self):
        self.steps.append({})

    def _ms(self, a, b):
        return a.elapsed_time(b) if self.cuda else 1000 * (b - a)

    def read(self):
        """Per timed step's mean, ms: each block's forward and backward, and each stack's (its first block's start
        to its last block's end)."""
        _sync(torch.device("cuda" if self.cuda else "cpu"))
        out = {}
        for stack, n in self.stacks.items():
            if not n:
                continue
            per = {"fwd": [], "bwd": []}
            for i in range(n):
                per["fwd"].append(np.mean([self._ms(s[(stack, i, "f0")], s[(stack, i, "f1")]) for s in self.steps]))
                per["bwd"].append(np.mean([self._ms(s[(stack, i, "b0")], s[(stack, i, "b1")]) for s in self.steps]))
            out[stack] = {"fwd_ms": round(float(np.mean([self._ms(s[(stack, 0, "f0")], s[(stack, n - 1, "f1")])
                                                         for s in self.steps])), 2),
                          "bwd_ms": round(float(np.mean([self._ms(s[(stack, n - 1, "b0")], s[(stack, 0, "b1")])
                                                         for s in self.steps])), 2),
                          "block_fwd_ms": [round(float(x), 2) for x in per["fwd"]],
                          "block_bwd_ms": [round(float(x), 2) for x in per["bwd"]]}
        return out

    def close(self):
        for h in self.handles:
            h.remove()


def _verdict(ok, smoke):
    return "(on a GPU)" if smoke else "ok" if ok else "FAIL"


def _synthetic_store(path, shape, chunks):
    """A synthetic MDIO store of `shape` at `path` (reused when there: the two base sections share it): the
    synthetic volume of a quarter of each axis, tiled (writing the whole-size volume's geology would cost a
    minute of the check; what the step reads and decodes per sample is the same)."""
    from infra import synthetic
    if os.path.exists(path):
        return 0.0
    t = time.perf_counter()
    reps = [4 if s >= 256 else 1 for s in shape]
    vol = synthetic.synthetic_volume(tuple(s // r for s, r in zip(shape, reps)))
    vol = np.ascontiguousarray(np.tile(vol, reps)[tuple(slice(0, s) for s in shape)])
    synthetic.write_mdio(path, vol, chunks=chunks)
    return time.perf_counter() - t


def _base_step(smoke, dev, out_dir, name):
    """base_102k's step on this one GPU through train.py (setup, micro_batches, train_step) at the head layout
    HEADS[name]: step time (wall, with the data wait apart), MFU (attention counted, as flops_per_sample counts it),
    CUDA events around the encoder's and the decoder's blocks, max_memory_allocated and the allocator's retries,
    beside infra/plan.py's plan of the same config on 1 GPU. Pass (GPU): the step's time less the data wait, and
    max_memory_allocated, within 20 % of the planner's step_s and memory per GPU; every loss finite."""
    import configurator
    import train
    from infra import plan as P
    heads = (SMOKE_HEADS if smoke else HEADS)[name]
    store = os.path.join(out_dir, "base_102k.mdio")
    run = os.path.join(out_dir, name)
    shutil.rmtree(run, ignore_errors=True)
    cfg = _config("base_102k.py", [
        "--dtype=bfloat16", "--strategy=zero2", "--nodes=1", "--gpus_per_node=1", "--val_frac=0", "--val_paths=[]",
        "--eval_interval=1000000", "--ckpt_interval=1000000", "--make_synthetic=False", f"--out_dir={run}",
        f"--data_paths=['{store}']", *(f"--{k}={v}" for k, v in heads.items()),
        *([*SMOKE_MODEL, "--crop=(32,32,64)", "--patch=(8,8,16)"] if smoke else [])])
    configurator.check_config(cfg)
    store_s = _synthetic_store(store, tuple(cfg["crop"]), (16, 16, 32) if smoke else (128, 128, 128))
    warm, timed = (1, 2) if smoke else (2, 5)
    job = train.setup(cfg)
    m = job.model
    timer = BlockTimer(m, dev)
    batches = train.micro_batches(job, 0, warm + timed)
    losses, wait = [], 0.0
    try:
        for s in range(warm + timed):
            if s == warm:
                _sync(dev)
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
            if s >= warm:
                timer.begin()
            loss, _, w = train.train_step(job, s, batches)
            losses.append(loss)
            wait += w if s >= warm else 0.0
        _sync(dev)
        step_s = (time.perf_counter() - t0) / timed
    finally:
        batches.close()
        job.sampler.close()
    stacks = timer.read()
    timer.close()
    losses = [x.item() for x in losses]
    p = P.plan(cfg, 1, gpu=_gpu_kind(dev), gpus_per_node=1)
    peak = P.GPUS[p["gpu"]]["flops"]
    fps = P.flops_per_sample(m)
    compute_s = step_s - wait / timed
    mem = _mem_stats(dev)
    res = {"heads": [m.blocks[0].heads, m.decoder_blocks[0].heads],
           "head_dims": [m.dim // m.blocks[0].heads, m.dec_dim // m.decoder_blocks[0].heads],
           "store_write_s": round(store_s, 1), "step_s": round(step_s, 3), "data_wait_s": round(wait / timed, 3),
           "compute_s": round(compute_s, 3), "mfu": round(fps / compute_s / peak, 4),
           **mem, "plan_step_s": round(p["step_s"], 3), "plan_mfu": round(fps * p["samples_per_s"] / peak, 4),
           "plan_mem_gb": p["mem_per_gpu_gb"], "losses": [round(x, 5) for x in losses], "stacks": stacks}
    ok_time = abs(compute_s / p["step_s"] - 1) <= TOLERANCE
    ok_mem = abs(mem["max_allocated_gb"] / p["mem_per_gpu_gb"] - 1) <= TOLERANCE
    res["ok"] = bool(all(np.isfinite(losses)) and res["heads"] == [heads["heads"], heads["dec_heads"]]
                     and (smoke or (ok_time and ok_mem)))
    print(f"{name}: base_102k, 1 {dev.type} rank, bf16 zero2, heads {res['heads']} (of {res['head_dims']}); "
          f"{timed} steps after {warm}")
    table([["step s (less data wait)", f"{compute_s:.3f}", f"{p['step_s']:.3f}", _verdict(ok_time, smoke)],
           ["data wait s per step", f"{wait / timed:.3f}", "-", ""],
           ["MFU (attention counted)", f"{res['mfu']:.3f}", f"{res['plan_mfu']:.3f}", ""],
           ["max_memory_allocated GB", mem["max_allocated_gb"], p["mem_per_gpu_gb"], _verdict(ok_mem, smoke)],
           ["max_memory_reserved GB", mem["max_reserved_gb"], "-", ""],
           ["allocator retries", mem["alloc_retries"], "-", ""],
           *[[f"{k} fwd / bwd ms", f"{v['fwd_ms']:.1f} / {v['bwd_ms']:.1f}", "-", ""] for k, v in stacks.items()]],
          ["quantity", "measured", "infra/plan.py", "within 20 %"])
    return res


def sec_base_step(smoke, dev, out_dir):
    return _base_step(smoke, dev, out_dir, "base_step")


def sec_base_step_aligned(smoke, dev, out_dir):
    return _base_step(smoke, dev, out_dir, "base_step_aligned")


def _rank_step(smoke, dev, out_dir, name):
    """One cp rank's exact share of a big_context step on this GPU: model G at the head layout HEADS[name], bf16,
    the config's checkpointed blocks, rank 0's slab (crop[0] / cp inline planes, its cls token, its masked tokens),
    the ring a self-ring of W = cp ranks (bench/ring_sim.py's SelfRing: every K/V block comes back, so each attention
    call does rank 0's full share, W blocks of keys), the loss over the whole sample's masked count; forward, loss
    and backward of the plain model (no optimizer: a world-of-1 ZeRO-2 would hold the optimizer state of 128 ranks).
    A warm-up of one encoder and one decoder block at these shapes (the kernels' plans), then one timed step: its
    time, per-block CUDA events, the ring's communication wait, max_memory_allocated and the allocator's retries,
    beside the planner's per-rank step time and memory per GPU for big_context on its cluster. Pass (GPU): the
    peak under this GPU's memory, the step within 20 % of the planner's step_s, the loss finite."""
    import model as M
    import ring_attention as RA
    import configurator
    from bench.ring_sim import SelfRing
    from infra import plan as P
    heads = (SMOKE_HEADS if smoke else HEADS)[name]
    cfg = _config("big_context.py", [*(f"--{k}={v}" for k, v in heads.items()),
                                     *([*SMOKE_MODEL, "--crop=(64,32,64)", "--patch=(8,8,16)", "--ckpt_blocks=3"]
                                       if smoke else [])])
    configurator.check_config(cfg)
    world, W = cfg["nodes"] * cfg["gpus_per_node"], cfg["cp"]
    p = P.plan(cfg, world, gpu=_gpu_kind(dev), gpus_per_node=cfg["gpus_per_node"])
    dist = _init_world_1()
    via = _self_ring_vias(dev, out_dir)[0]
    dtype = torch.bfloat16
    torch.manual_seed(cfg["seed"])
    m = M.build_model(cfg, device=dev).to(dtype).train()
    m.set_grad_ckpt(P.checkpointed(m, cfg))  # the run's checkpointed blocks
    m.ring = (SelfRing(W, via), RA.ring_attention)  # (set_context_parallel asks a process group its size: this is none)
    crop = cfg["crop"]
    x = torch.randn(1, 1, crop[0] // W, crop[1], crop[2], device=dev, dtype=dtype)  # rank 0's slab
    ids_keep = m.keep_ids(M.mask_noise(cfg["seed"], [0], m.L, 0, W), 0, W).to(dev)
    n_enc, n_dec = ids_keep.shape[1] + 1, m.L // W

    def step():  # model.MAE.forward's steps on cp rank 0, the count's all-reduce replaced by the sample's count
        patches = M.patchify(x, m.patch)
        _, ids_restore, ids_masked = M.mask_from_keep(ids_keep, patches.shape[1])
        latent = m.forward_encoder(patches, ids_keep, offset=0, has_cls=True)
        pred = m.forward_decoder(latent, ids_restore, offset=0, has_cls=True)
        loss_sum, _ = M.mae_loss(pred, patches, ids_masked, m.norm_pix_loss)
        loss = loss_sum / (m.L - m.n_keep())  # every rank's masked tokens: what forward's all-reduce sums
        (loss * W).backward()  # as train_step: x cp
        return loss.detach()

    for blk, n, C in ((m.blocks[0], n_enc, m.dim), (m.decoder_blocks[0], n_dec, m.dec_dim)):  # the warm-up
        xi = torch.randn(1, n, C, device=dev, dtype=dtype, requires_grad=True)
        blk(xi, m.ring).sum().backward()
        del xi
    m.zero_grad(set_to_none=True)
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    timer = BlockTimer(m, dev)
    RA.comm_wait_s(reset=True)
    timer.begin()
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    t0 = time.perf_counter()
    loss = step()
    if dev.type == "cuda":
        b.record()
        torch.cuda.synchronize()
        step_s = a.elapsed_time(b) / 1000
    else:
        step_s = time.perf_counter() - t0
    comm = RA.comm_wait_s()
    stacks = timer.read()
    timer.close()
    mem = _mem_stats(dev)
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if dev.type == "cuda" else float("inf")
    peak = P.GPUS[p["gpu"]]["flops"]
    fps = P.flops_per_sample(m) / W  # this rank's share of the sample's FLOPs
    ckpt = sorted(i for st, i in m.ckpt if st == "enc"), sorted(i for st, i in m.ckpt if st == "dec")
    ok_time = abs(step_s / p["step_s"] - 1) <= TOLERANCE
    ok_mem = mem["max_allocated_gb"] < total_gb
    res = {"heads": [m.blocks[0].heads, m.decoder_blocks[0].heads],
           "head_dims": [m.dim // m.blocks[0].heads, m.dec_dim // m.decoder_blocks[0].heads], "W": W, "via": via,
           "tokens_per_rank": [n_enc, n_dec], "ckpt_blocks": {"encoder": ckpt[0], "decoder": ckpt[1]},
           "loss": loss.item(), "step_s": round(step_s, 3), "comm_wait_s": round(comm, 3),
           "mfu": round(fps / step_s / peak, 4), **mem, "gpu_mem_gb": round(total_gb, 1),
           "plan_step_s": round(p["step_s"], 3), "plan_mfu": round(P.flops_per_sample(m) * p["samples_per_s"]
                                                                    / (world * peak), 4),
           "plan_mem_gb": p["mem_per_gpu_gb"], "plan_activations_gb": p["activations_gb"], "stacks": stacks}
    res["ok"] = bool(np.isfinite(res["loss"]) and res["heads"] == [heads["heads"], heads["dec_heads"]]
                     and ok_mem and (smoke or ok_time))
    enc = stacks["encoder"]
    k = len(ckpt[0])
    print(f"{name}: big_context's cp rank 0 on 1 {dev.type}, heads {res['heads']} (of {res['head_dims']}), "
          f"self-ring W={W} ({via}), tokens per rank {n_enc:,} / {n_dec:,}, {len(m.ckpt)} blocks checkpointed")
    table([["step s", f"{step_s:.3f}", f"{p['step_s']:.3f}", _verdict(ok_time, smoke)],
           ["ring's communication wait s", f"{comm:.3f}", "-", ""],
           ["MFU (attention counted)", f"{res['mfu']:.3f}", f"{res['plan_mfu']:.3f}", ""],
           ["max_memory_allocated GB", mem["max_allocated_gb"], f"{p['mem_per_gpu_gb']} (ZeRO-2 on {world})",
            _verdict(ok_mem, smoke)],
           ["allocator retries", mem["alloc_retries"], "-", ""],
           ["encoder block fwd / bwd ms, checkpointed",
            f"{np.mean(enc['block_fwd_ms'][:k] or [0]):.1f} / {np.mean(enc['block_bwd_ms'][:k] or [0]):.1f}", "-", ""],
           ["encoder block fwd / bwd ms, not",
            f"{np.mean(enc['block_fwd_ms'][k:] or [0]):.1f} / {np.mean(enc['block_bwd_ms'][k:] or [0]):.1f}", "-", ""],
           *[[f"{s} fwd / bwd s", f"{v['fwd_ms'] / 1000:.2f} / {v['bwd_ms'] / 1000:.2f}", "-", ""]
             for s, v in stacks.items()]],
          ["quantity", "measured", "infra/plan.py", "pass"])
    dist.destroy_process_group()
    return res


def sec_rank_step(smoke, dev, out_dir):
    return _rank_step(smoke, dev, out_dir, "rank_step")


def sec_rank_step_aligned(smoke, dev, out_dir):
    return _rank_step(smoke, dev, out_dir, "rank_step_aligned")


def _ids_keep(job, ids):
    import model as M
    return job.model.keep_ids(M.mask_noise(job.cfg["seed"], ids, job.model.L, job.cp_rank, job.cp), job.cp_rank,
                              job.cp)


def _old_prepare(job, x, ids):
    """train.prepare_batch as it was: a new page-locked buffer per batch (and per ids_keep)."""
    ids_keep = _ids_keep(job, ids)
    if job.on_gpu:
        return torch.empty(x.shape, dtype=job.dtype, pin_memory=True).copy_(x), ids_keep.pin_memory()
    return x.to(job.dtype), ids_keep


def _old_to_device(job, x, ids_keep):
    """train_step's copy as it was: on the compute stream, queued behind whatever the stream holds before it."""
    return x.to(job.device, non_blocking=True), ids_keep.to(job.device, non_blocking=True)


def sec_data_copy(smoke, dev, out_dir):
    """The batch's way to the device at quickstart's, base_102k's and a big_context cp rank's sample shapes, as
    train.py did it (a new pinned buffer per batch, the copy on the compute stream) and as it does now (pinned
    buffers reused, data.PinnedBuffers; the copy on a side stream that the compute stream waits for,
    train.to_device), and a pageable fp32 cast on the way, for scale. Per path: prepare_batch's time (the prefetch
    thread's; the first call apart: it page-locks), the training thread's time for the copy call, and the copy's
    exposed time on the GPU: each step's compute is a fixed GPU spin (torch.cuda._sleep, twice the copy's own
    time) queued before the copy, then a read of the batch; exposed = step time - spin. Every batch's values
    arrive (a marker per batch). Pass (GPU): the new path's exposed time at most a quarter of the old one's +
    0.5 ms, its steady prepare_batch time at most 1.2 x the old one's + 1 ms; every marker right."""
    import data
    import model as M
    import train
    gpu = dev.type == "cuda"
    reps = 2 if smoke else 3
    cases = (("quickstart", "quickstart.py", []),
             ("base_102k", "base_102k.py", [*SMOKE_MODEL, *SIZE_HEADS, "--crop=(64,64,64)"] if smoke else []),
             ("big_context rank", "big_context.py", [*SMOKE_MODEL, *SIZE_HEADS, "--crop=(128,64,64)"] if smoke else []))
    if gpu:  # the spin's rate: GPU cycles per ms
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(10 ** 7)
        b.record()
        torch.cuda.synchronize()
        cycles_per_ms = 10 ** 7 / a.elapsed_time(b)
    rows, res, ok = [], {}, True
    for case, config, args in cases:
        cfg = _config(config, args)
        dtype = {"auto": torch.bfloat16 if gpu else torch.float32, "float32": torch.float32,
                 "bfloat16": torch.bfloat16}[cfg["dtype"]]
        job = SimpleNamespace(cfg=cfg, model=M.build_model(cfg, device="meta"), cp_rank=0, cp=cfg["cp"], on_gpu=gpu,
                              dtype=dtype, device=dev, pinned=data.PinnedBuffers() if gpu else None,
                              copy_stream=torch.cuda.Stream() if gpu else None)
        shape = (cfg["micro_batch"], 1, cfg["crop"][0] // cfg["cp"], *cfg["crop"][1:])
        srcs = [torch.zeros(shape) for _ in range(reps)]  # samples as Sampler.batch yields them: float32, each new
        ids = list(range(cfg["micro_batch"]))
        paths = {"old": (_old_prepare, _old_to_device), "new": (train.prepare_batch, train.to_device),
                 "pageable": (lambda j, x_, i: (x_, _ids_keep(j, i)),
                              lambda j, x_, i: (x_.to(dev, dtype), i.to(dev)))}
        copy_ms, out = None, {}
        for path, (prep, to_dev) in paths.items():
            # prepare_batch's time, each batch copied and read before the next (the new path's buffers come back)
            prep_ms = []
            for r in range(reps + 1):
                srcs[r % reps].view(-1)[0] = r
                t = time.perf_counter()
                xb, ib = prep(job, srcs[r % reps], ids)
                prep_ms.append(1000 * (time.perf_counter() - t))
                xd, _ = to_dev(job, xb, ib)
                ok = ok and xd.view(-1)[0].item() == r
                del xb, ib, xd
            # the copy within a step: the batches prepared first (the prefetch threads' work), then per step the
            # spin, the copy, the first read of the batch
            batches = []
            for r in range(reps):
                srcs[r].view(-1)[0] = r
                batches.append(prep(job, srcs[r], ids))
            if gpu and copy_ms is None:  # the copy's own time, once per shape: the spin is twice it
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                batches[0][0].to(dev, non_blocking=True)
                b.record()
                torch.cuda.synchronize()
                copy_ms = a.elapsed_time(b)
            spin_ms = 2 * copy_ms + 1 if gpu else 0.0
            _sync(dev)
            steps, host, seen = [], [], []
            while batches:
                xb, ib = batches.pop(0)
                if gpu:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    torch.cuda._sleep(int(spin_ms * cycles_per_ms))
                t = time.perf_counter()
                xd, _ = to_dev(job, xb, ib)
                host.append(1000 * (time.perf_counter() - t))
                seen.append(xd.view(-1)[:1].float())  # the forward's first read of the batch
                if gpu:
                    b.record()
                    steps.append((a, b))
                del xb, ib, xd
            _sync(dev)
            exposed = [a.elapsed_time(b) - spin_ms for a, b in steps] if gpu else [0.0]
            right = torch.cat(seen).tolist() == list(range(reps))
            ok = ok and right
            out[path] = {"prepare_first_ms": round(prep_ms[0], 3),
                         "prepare_ms": round(float(np.median(prep_ms[1:])), 3),
                         "host_copy_ms": round(float(np.median(host)), 3),
                         "exposed_ms": round(float(np.median(exposed)), 3), "values_right": bool(right)}
            rows.append([case, path, out[path]["prepare_first_ms"], out[path]["prepare_ms"],
                         out[path]["host_copy_ms"], out[path]["exposed_ms"], "ok" if right else "WRONG"])
        o, n = out["old"], out["new"]
        good = n["exposed_ms"] <= 0.25 * o["exposed_ms"] + 0.5 and n["prepare_ms"] <= 1.2 * o["prepare_ms"] + 1
        ok = ok and (good or not gpu)
        res[case] = {"shape": list(shape), "dtype": str(dtype)[6:], "copy_ms": copy_ms, **out, "ok": bool(good)}
        del srcs
    print("a micro batch to the device: old (a new pinned buffer per batch, copied on the compute stream), new "
          "(train.py: pinned buffers reused, the copy on a side stream), pageable (fp32, cast on the way)")
    table(rows, ["sample", "path", "prepare ms (first)", "prepare ms", "training thread ms", "exposed ms on GPU",
                 "values"])
    return {**res, "ok": bool(ok)}
