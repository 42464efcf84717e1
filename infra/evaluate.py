"""
Held-out validation: the masked loss on fixed validation samples, on every rank, and the slices of validation
sample 0 that the reconstruction figure shows.

    val_loss, per_sample, slices = evaluate.run(forward, model, sampler, seed, n, ...)   any caller, all ranks
    val_loss, figure = evaluate.on_job(job, step, log_file)                          train.py's evaluation

The validation set is samples 0 .. n-1 of the validation stream (data.Sampler(stream="val"), inside the
held-out inlines or the val_paths stores): sample i's crop and mask are functions of (seed, i) alone, so the
value does not depend on the dp / cp layout, the strategy, the dtype's rounding aside, or a resume.

Who computes what. Sample i belongs to data-parallel group i % dp_size; each group runs ceil(n / dp_size)
samples in batches of micro_batch, and a group with fewer repeats one of its own with weight 0: ZeRO-3 and
FSDP2 gather weights inside forward, a collective, so every rank must run the same number of forwards. The cp
ranks of a group each hold a slab of every sample, as in training, and the ring runs as in training.

The loss of a sample is its masked error summed over its masked patches, divided by its masked count (every
sample has the same count, L - n_keep); each cp rank adds its share into slot i of an n-vector, one all-reduce
sums the vector over the world, and the validation loss is its mean. That is the training loss's definition
(a micro batch's loss is the mean over its samples of exactly this), so the two curves compare, and the
slots are summed in one fixed order whatever the layout.
"""

import json
import math
import os
import time

import torch
import torch.distributed as dist

import data
import model as M
import reconstruct


def assignment(n, dp_rank, dp_size, micro_batch):
    """This data-parallel group's batches: lists of (sample index, weight), ceil(n / dp_size) entries in all."""
    mine = list(range(dp_rank, n, dp_size))
    per = math.ceil(n / dp_size)
    items = [(i, 1.0) for i in mine] + [((mine or [0])[0], 0.0)] * (per - len(mine))
    return [items[k:k + micro_batch] for k in range(0, per, micro_batch)]


@torch.no_grad()
def run(forward, model, sampler, seed, n, device, dtype, micro_batch, cp_rank=0, cp=1, dp_rank=0, dp_size=1,
        want_slices=False):
    """The validation loss over samples 0..n-1 (every rank gets it), the per-sample losses, and on global rank 0
    with want_slices the centre slices of sample 0 ({name: (3, a, b)}, reconstruct.centre_parts), else None.
    forward(x, ids_keep=...) -> (loss, pred, mask): the training engine (in eval mode) or a plain model.MAE.
    Every rank of the job must call this (it ends in collectives)."""
    masked_count = model.L - model.n_keep()  # per sample, over all its cp ranks
    sums = torch.zeros(n, dtype=torch.float64, device=device)
    parts = None
    for batch in assignment(n, dp_rank, dp_size, micro_batch):
        ids = [i for i, _ in batch]
        x = sampler.read(ids)  # (B, 1, Z / cp, Y, X) fp32, this rank's slabs
        noise = data.mask_noise(seed, ids, model.L, cp_rank, cp, stream="val")  # (B, L / cp)
        ids_keep = model.keep_ids(noise, cp_rank, cp).to(device)
        x = x.to(device=device, dtype=dtype)  # what training feeds the model: the compute dtype
        _, pred, mask = forward(x, ids_keep=ids_keep)  # pred (B, L / cp, P)
        patches = M.patchify(x, model.patch)
        _, _, ids_masked = M.mask_from_keep(ids_keep, patches.shape[1])
        for b, (i, w) in enumerate(batch):
            if w:
                s, _ = M.mae_loss(pred[b:b + 1], patches[b:b + 1], ids_masked[b:b + 1], model.norm_pix_loss)
                sums[i] += s.double() / masked_count
        if want_slices and dp_rank == 0 and parts is None and ids[0] == 0:  # sample 0 leads dp group 0's first batch
            # the slab's voxel views stay on the device and are dropped at once: only the slices are kept
            views, Z_loc = reconstruct.voxel_views(model, x, pred, mask), x.shape[2]
            parts = reconstruct.centre_parts(*views, cp_rank * Z_loc, cp * Z_loc)
            del views
    slices = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
        if want_slices:  # only the slices travel, from the cp ranks of dp group 0 (global ranks 0..cp-1)
            got = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(parts, got, dst=0)
            if dist.get_rank() == 0:
                slices = reconstruct.join_parts(got[:cp])
    elif want_slices:
        slices = reconstruct.join_parts([parts])
    per_sample = sums.tolist()
    return sum(per_sample) / n, per_sample, slices


def on_job(job, step, log_file):
    """train.py's evaluation: the validation loss of the job's model as it is now, after `step` optimizer
    steps. Every rank computes its share (run), rank 0 logs it (log_file: log.jsonl, or None) and draws the
    figures. Returns (val_loss, the reconstruction Figure on rank 0 when figures are on, else None)."""
    cfg, t0 = job.cfg, time.time()
    job.engine.eval()
    try:
        val, per, slices = run(job.engine, job.model, job.val_sampler, cfg["seed"], cfg["eval_samples"], job.device,
                               job.dtype, cfg["micro_batch"], job.cp_rank, job.cp, job.dp_rank, job.dp_size,
                               want_slices=cfg["figures"])
    finally:
        job.engine.train()
    if not math.isfinite(val):
        raise FloatingPointError(f"non-finite validation loss ({val}) at step {step}: stopping. Lower blr or raise "
                                 f"warmup_steps, and check the validation data for NaN/inf outside dead traces.")
    if log_file:  # (eval_s: the forward passes; the figures come after)
        log_file.write(json.dumps({"step": step, "val_loss": val, "eval_s": round(time.time() - t0, 3)}) + "\n")
        log_file.flush()
    fig = None
    if job.rank == 0 and cfg["figures"]:
        fig_dir = os.path.join(cfg["out_dir"], "figures")
        v, origin = job.val_sampler.locate(0)
        store = os.path.basename(job.val_sampler.records[v]["url"].rstrip("/"))
        title = reconstruct.figure_title(f"validation sample 0: {store}, crop {tuple(cfg['crop'])} at {origin}", step,
                                         per[0], 1 - job.model.n_keep() / job.model.L, cfg["norm_pix_loss"])
        fig = reconstruct.recon_figure(os.path.join(fig_dir, f"recon_step_{step:07d}.png"), slices, origin, title)
        if log_file:
            reconstruct.loss_figure(os.path.join(fig_dir, "loss.png"), log_file.name)
    job.log(f"step {step:5d} | val loss {val:.4f} over {cfg['eval_samples']} held-out samples | "
            f"{time.time() - t0:.2f} s")
    return val, fig

