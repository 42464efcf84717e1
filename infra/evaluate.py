"""
Held-out validation: the masked loss on fixed validation samples, on every rank, and the slices of validation
sample 0 that the reconstruction figure shows.

    val_loss, per_sample, slices = evaluate.run(forward, model, sampler, seed, n, ...)   any caller, all ranks
    val_loss, scores, slices = evaluate.run_segment(forward, model, sampler, n, ...)     fine-tuning's
    record, figure = evaluate.validate(job, step, log_file)     train.py's: {step, val_loss (, val_iou, val_dice)}

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

import numpy as np
import torch
import torch.distributed as dist

import model as M
from infra import outputs


def assignment(n, dp_rank, dp_size, micro_batch):
    """This data-parallel group's batches: lists of (sample index, weight), ceil(n / dp_size) entries in all."""
    mine = list(range(dp_rank, n, dp_size))
    per = math.ceil(n / dp_size)
    items = [(i, 1.0) for i in mine] + [((mine or [0])[0], 0.0)] * (per - len(mine))
    return [items[k:k + micro_batch] for k in range(0, per, micro_batch)]


def reduce_and_gather(tensors, parts, cp, want_slices):
    """Sum each of `tensors` over the world, in place, and bring the centre-slice pieces of dp group 0's cp ranks
    (global ranks 0..cp-1) to rank 0: only the slices travel. Returns the joined slices there (want_slices), else
    None."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return join_parts([parts]) if want_slices else None
    for t in tensors:
        dist.all_reduce(t)
    if not want_slices:
        return None
    got = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(parts, got, dst=0)
    return join_parts(got[:cp]) if dist.get_rank() == 0 else None


@torch.no_grad()
def run(forward, model, sampler, seed, n, device, dtype, micro_batch, cp_rank=0, cp=1, dp_rank=0, dp_size=1,
        want_slices=False):
    """The validation loss over samples 0..n-1 (every rank gets it), the per-sample losses, and on global rank 0
    with want_slices the centre slices of sample 0 ({name: (3, a, b)}, centre_parts), else None.
    forward(x, ids_keep=...) -> (loss, pred, mask): the training engine (in eval mode) or a plain model.MAE.
    Every rank of the job must call this (it ends in collectives)."""
    masked_count = model.L - model.n_keep()  # per sample, over all its cp ranks
    sums = torch.zeros(n, dtype=torch.float64, device=device)
    parts = None
    for batch in assignment(n, dp_rank, dp_size, micro_batch):
        ids = [i for i, _ in batch]
        x = sampler.read(ids)  # (B, 1, Z / cp, Y, X) fp32, this rank's slabs
        noise = M.mask_noise(seed, ids, model.L, cp_rank, cp, stream="val")  # (B, L / cp)
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
            views, Z_loc = voxel_views(model, x, pred, mask), x.shape[2]
            parts = centre_parts(*views, cp_rank * Z_loc, cp * Z_loc)
            del views
    slices = reduce_and_gather([sums], parts, cp, want_slices)
    per_sample = sums.tolist()
    return sum(per_sample) / n, per_sample, slices


@torch.no_grad()
def run_segment(forward, model, sampler, n, device, dtype, micro_batch, cp_rank=0, cp=1, dp_rank=0, dp_size=1,
                want_slices=False):
    """Fine-tuning's validation over samples 0..n-1 (sampler with label_var: (B, 2, ...) batches), on every rank:
    (the mean voxel loss, {"iou": [per class], "dice": [per class]}, slices of sample 0 as run() gives them, with
    (amplitude, predicted class, label) for (original, reconstruction, mask)). IoU and Dice pool the voxels of all
    n samples: class c's true positives, false positives and false negatives are counted per sample on each rank,
    one all-reduce sums them over the world, so the scores do not depend on the dp / cp layout. Binary
    (classes 2): class 1 is the positive (a fault)."""
    C = model.seg_classes
    sums = torch.zeros(n, dtype=torch.float64, device=device)
    counts = torch.zeros(n, C, 3, dtype=torch.float64, device=device)  # per sample and class: tp, fp, fn
    parts = None
    for batch in assignment(n, dp_rank, dp_size, micro_batch):
        ids = [i for i, _ in batch]
        x = sampler.read(ids).to(device=device, dtype=dtype)  # (B, 2, Z / cp, Y, X): amplitude, labels
        _, logits = forward(x)  # (B, L / cp, P, seg_out)
        y = M.patchify(x[:, 1:].float(), model.patch).long()  # (B, L / cp, P)
        pred = (logits[..., 0] > 0).long() if logits.shape[-1] == 1 else logits.argmax(-1)  # (binary: logit > 0)
        for b, (i, w) in enumerate(batch):
            if w:
                sums[i] += M.seg_loss(logits[b:b + 1], y[b:b + 1], model.seg_pos_weight).double() / (model.L * model.P)
                for c in range(C):
                    p, t = pred[b] == c, y[b] == c
                    counts[i, c] += torch.stack([(p & t).sum(), (p & ~t).sum(), (~p & t).sum()]).double()
        if want_slices and dp_rank == 0 and parts is None and ids[0] == 0:
            g = [s // q for s, q in zip(x.shape[2:], model.patch)]
            vox = M.unpatchify(pred[:1, :, :, None].float(), model.patch, g)[0, 0]  # (Z_loc, Y, X) classes
            parts = centre_parts(x[0, 0], vox, x[0, 1], cp_rank * x.shape[2], cp * x.shape[2])
    slices = reduce_and_gather([sums, counts], parts, cp, want_slices)
    tp, fp, fn = counts.sum(0).unbind(-1)  # (C,) each
    scores = {"iou": (tp / (tp + fp + fn).clamp(min=1)).tolist(),
              "dice": (2 * tp / (2 * tp + fp + fn).clamp(min=1)).tolist()}
    return float(sums.mean()), scores, slices


@torch.no_grad()
def floor_of(job):
    """The validation floor of a train.py job (infra/floor.py), on rank 0 (None elsewhere, for fine-tuning and
    without validation): {"val_floor": the mean over validation samples 0..eval_samples-1 of the floor's masked loss
    on exactly their masks, "floor_alpha"}. The covariance table and alpha are fitted on the training
    stream's first floor.FIT_CROPS crops and their masks. Samples are read whole (under cp a rank holds a slab, and a
    masked patch at its border reads its neighbour's voxels); the masks are the ones the cp ranks' shares make up.
    Data the floor cannot be computed on (floor.Unsolvable: training crops with no signal, non-finite values) end no
    run: a WARNING says why and it returns None, so the records carry no val_floor (floor_words and read_floor take
    its absence)."""
    from infra import floor
    cfg, model = job.cfg, job.model
    if job.rank != 0 or cfg["task"] != "mae" or job.val_sampler is None:
        return None
    t0, patch, dev = time.time(), model.patch, job.device
    if math.prod(cfg["crop"]) > floor.WHOLE_MAX:
        job.log(f"floor: not computed: a whole sample of crop {tuple(cfg['crop'])} is more than rank 0 reads for it "
                f"({floor.WHOLE_MAX:,} voxels); a run of the same data and patch at a smaller crop shows it")
        return None

    def masks(ids, stream):  # the whole samples' masks: the strata decide them, not the ranks
        return model.keep_ids(M.mask_noise(cfg["seed"], ids, model.L, 0, 1, stream=stream), 0, 1).to(dev)
    train, val = job.sampler.whole(), job.val_sampler.whole()
    try:  # (data the floor cannot be computed on end no run: a WARNING, and no val_floor in the log)
        fit = list(range(max(1, min(floor.FIT_CROPS, floor.FIT_VOXELS // math.prod(cfg["crop"])))))
        crops = train.read(fit).to(dev)
        table = floor.covariance(crops, patch)
        few = fit[:floor.FIT_ALPHA]
        alpha = floor.fit_scale(crops[:len(few)], masks(few, "train"), patch, table) if model.norm_pix_loss else 1.0
        total, n = 0.0, cfg["eval_samples"]
        for s in range(0, n, cfg["micro_batch"]):
            ids = list(range(s, min(n, s + cfg["micro_batch"])))
            x, keep = val.read(ids).to(dev), masks(ids, "val")
            pred = floor.floor_pred(x, keep, patch, table, model.norm_pix_loss, alpha)
            total += float(floor.loss_per_sample(pred, x, keep, model).sum())
        if not math.isfinite(total):
            raise floor.Unsolvable(f"its loss is not finite ({total})")
    except (floor.Unsolvable, torch.linalg.LinAlgError) as e:
        job.log(f"WARNING: floor: not computed, skipped: {e}; the log's records have no val_floor (the validation loss "
                f"is logged without it). Check the training data: crops with no signal, or values that are not "
                f"seismic, give no floor")
        return None
    finally:
        train.close()
        val.close()
    job.log(f"floor: kriging on the same masked patches of the {n} validation samples, {time.time() - t0:.1f} s "
            f"(once per run)")
    return {"val_floor": total / n, "floor_alpha": round(alpha, 4)}


def validate(job, step, log_file):
    """train.py's evaluation: the validation loss of the job's model as it is now, after `step` optimizer
    steps. Every rank computes its share (run), rank 0 logs it (log_file: log.jsonl, or None) and draws the
    figures. Returns (the record log.jsonl gets: step, val_loss, and for fine-tuning val_iou and val_dice per class;
    the Figure on rank 0 when figures are on, else None)."""
    cfg, t0 = job.cfg, time.time()
    segment = cfg["task"] == "segment"
    layout = (job.device, job.dtype, cfg["micro_batch"], job.cp_rank, job.cp, job.dp_rank, job.dp_size)
    job.engine.eval()
    try:
        if segment:
            val, scores, slices = run_segment(job.engine, job.model, job.val_sampler, cfg["eval_samples"], *layout,
                                              want_slices=cfg["figures"])
        else:
            val, per, slices = run(job.engine, job.model, job.val_sampler, cfg["seed"], cfg["eval_samples"], *layout,
                                   want_slices=cfg["figures"])
    finally:
        job.engine.train()
    if not math.isfinite(val):
        raise FloatingPointError(f"non-finite validation loss ({val}) at step {step}: stopping. Lower blr or raise "
                                 f"warmup_steps, and check the validation data for NaN/inf outside dead traces.")
    record = {"step": step, "val_loss": val}
    if segment:
        record.update(val_iou=scores["iou"], val_dice=scores["dice"])
    elif cfg["val_floor"]:
        if job.floor is None:  # the same number at every evaluation (it learns nothing): computed once
            job.floor = floor_of(job) or {}
        record.update(job.floor)
    below = floor_words(val, record.get("val_floor"))
    if log_file:  # (eval_s: the forward passes; the figures come after)
        log_file.write(json.dumps({**record, "eval_s": round(time.time() - t0, 3)}) + "\n")
        log_file.flush()
    fig = None
    if job.rank == 0 and cfg["figures"]:
        fig_dir = os.path.join(cfg["out_dir"], "figures")
        v, origin = job.val_sampler.locate(0)
        store = os.path.basename(job.val_sampler.records[v]["url"].rstrip("/"))
        what = f"validation sample 0: {store}, crop {tuple(cfg['crop'])} at {origin}"
        if segment:
            fig = seg_figure(os.path.join(fig_dir, f"segment_step_{step:07d}.png"), slices, origin,
                             f"{what} | step {step} | IoU per class {[round(s, 3) for s in scores['iou']]}")
        else:
            title = figure_title(what, step, per[0], 1 - job.model.n_keep() / job.model.L, cfg["norm_pix_loss"])
            if below:
                title = title.replace("\n", f" | validation {val:.4f}, {below}\n", 1) if "\n" in title else \
                    f"{title}\nvalidation {val:.4f}, {below}"
            fig = recon_figure(os.path.join(fig_dir, f"recon_step_{step:07d}.png"), slices, origin, title)
        if log_file:
            loss_figure(os.path.join(fig_dir, "loss.png"), log_file.name,
                        "voxel cross-entropy" if segment else "masked MSE")
    extra = (f" | IoU {scores['iou'][-1]:.4f}, Dice {scores['dice'][-1]:.4f} (class {len(scores['iou']) - 1})"
             if segment else "")
    job.log(f"step {step:5d} | val loss {val:.4f}{extra} over {cfg['eval_samples']} held-out samples | "
            f"{time.time() - t0:.2f} s" + (f" | {below}" if below else ""))
    return record, fig


# -----------------------------------------------------------------------------
# the slices through a crop's centre (under context parallelism each rank holds a slab of inline planes)

ROWS = (("inline", "crossline", "time sample"),  # the inline slice: crossline across, time down
        ("crossline", "inline", "time sample"),  # the crossline slice: inline across, time down
        ("time", "inline", "crossline"))  # the time slice (map view): inline across, crossline down


def centre_parts(x, recon, masked, z0, Z):
    """This rank's pieces of the three centre slices. x, recon (Z_loc, Y, X) float, masked (Z_loc, Y, X) bool,
    tensors on any device (voxel_views) or numpy: the rank's slab of inline planes [z0, z0 + Z_loc) of a crop Z
    planes deep. Returns {name: (3, a, b) numpy array of original, reconstruction, mask} with the inline slice
    only on the rank that holds plane Z // 2, and the crossline and time slices cut to this slab's planes. A few
    MB per rank, never the slab: the slices are cut where the slab is (a GPU) and only they come to the host,
    and under cp only they travel to rank 0."""
    zc, yc, xc = Z // 2, x.shape[1] // 2, x.shape[2] // 2

    def host(a):  # one cut slice -> float32 numpy (the same values whether it was cut from a tensor or an array)
        return a.float().cpu().numpy() if torch.is_tensor(a) else np.asarray(a, dtype=np.float32)
    stack = lambda sel: np.stack([host(a[sel]) for a in (x, recon, masked)])  # noqa: E731
    out = {"crossline": stack(np.s_[:, yc, :]), "time": stack(np.s_[:, :, xc])}
    if z0 <= zc < z0 + x.shape[0]:
        out["inline"] = stack(np.s_[zc - z0])
    return out


def join_parts(parts):
    """The pieces of every cp rank, in rank order -> {name: (3, a, b)}: the crossline and time slices joined
    along inline, the inline slice from the rank that holds it."""
    out = {"crossline": np.concatenate([p["crossline"] for p in parts], axis=1),
           "time": np.concatenate([p["time"] for p in parts], axis=1)}
    out["inline"] = next(p["inline"] for p in parts if "inline" in p)
    return out


def pred_to_voxels(pred, patches, norm_pix_loss=False):
    """The prediction (B, L, P) on the scale of the input voxels, fp32. With norm_pix_loss the decoder learnt
    each target patch normalised by that patch's own mean and std (model.mae_loss), so its output is not voxels:
    shown as if it were, every patch would look flat and dim. It is de-normalised with the target patch's
    mean and std (the same + 1e-6), the inverse of what the loss did to the target:
        voxels = pred * sqrt(var + 1e-6) + mean          (per patch, over its P voxels)"""
    if not norm_pix_loss:
        return pred.float()
    t = patches.float()
    return pred.float() * (t.var(dim=-1, keepdim=True) + 1e-6) ** 0.5 + t.mean(dim=-1, keepdim=True)


def voxel_views(model, x, pred, mask):
    """Sample 0 of a batch as voxels: (x in its own dtype, reconstruction float, masked bool) each (Z_loc, Y, X),
    tensors on the device of the inputs (no host copy: a slab is GBs at long context; centre_parts cuts the
    slices there). x (B, 1, Z_loc, Y, X) the model's input slab, pred (B, L_loc, P), mask (B, L_loc) with
    1 = masked (the model's outputs)."""
    import model as M
    gz, gy, gx = x.shape[2] // model.patch[0], x.shape[3] // model.patch[1], x.shape[4] // model.patch[2]
    patches = M.patchify(x[:1].float(), model.patch)
    recon = M.unpatchify(pred_to_voxels(pred[:1], patches, model.norm_pix_loss), model.patch, (gz, gy, gx))
    m = M.unpatchify(mask[:1, :, None].expand(-1, -1, model.P).float(), model.patch, (gz, gy, gx)) > 0.5
    return x[0, 0], recon[0, 0], m[0, 0]


# -----------------------------------------------------------------------------
# figures (matplotlib is imported here only, with the Agg backend: no display, no pyplot state)


def recon_figure(path, slices, origin, title, record=None):
    """Write the 3 x 4 panel figure to `path` (PNG, whole or not at all, `record` in a text chunk: infra/outputs.py)
    and return the matplotlib Figure (tensorboard takes it).
    slices: {inline|crossline|time: (3, a, b) original, reconstruction, mask}, in crop coordinates; origin:
    the crop's origin in the volume, so that the axes read in volume indices."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    # a fixed grid (constrained layout would double the drawing time: it is spent at every evaluation)
    fig = Figure(figsize=(13, 9.5), dpi=64)
    axes = fig.subplots(3, 4, gridspec_kw=dict(left=0.05, right=0.99, bottom=0.05, top=0.88, wspace=0.12,
                                               hspace=0.42))
    cmap = matplotlib.colormaps["gray"].with_extremes(bad="#e9d8a6")  # masked patches: a colour no amplitude has
    # the axis of the volume behind each slice's two image axes (0 inline, 1 crossline, 2 time)
    axis_of = {"inline": (1, 2), "crossline": (0, 2), "time": (0, 1)}
    for row, (name, across, down) in zip(axes, ROWS):
        orig, recon, mask = slices[name]
        mask = mask > 0.5
        clip = float(np.percentile(np.abs(orig), 99)) or 1.0  # one symmetric clip for the row
        a, b = axis_of[name]
        extent = (origin[a] - 0.5, origin[a] + orig.shape[0] - 0.5, origin[b] + orig.shape[1] - 0.5, origin[b] - 0.5)
        panels = (("original", orig), ("masked input", np.where(mask, np.nan, orig)),
                  ("reconstruction", recon), ("reconstruction + visible", np.where(mask, recon, orig)))
        for ax, (label, img) in zip(row, panels):
            # (a, b) -> imshow wants rows = the downward axis: transpose
            ax.imshow(img.T, cmap=cmap, vmin=-clip, vmax=clip, extent=extent, aspect="auto", interpolation="nearest")
            ax.set_title(f"{name} slice: {label}", fontsize=9)
            ax.set_xlabel(across, fontsize=8)
            ax.tick_params(labelsize=7)
            if ax is row[0]:
                ax.set_ylabel(down, fontsize=8)
            else:  # the row shares its axes: numbers once, on the left
                ax.tick_params(labelleft=False)
    fig.suptitle(title, fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    outputs.save_figure(fig, path, record)
    return fig


def seg_figure(path, slices, origin, title, record=None):
    """Fine-tuning's figure: for the inline, crossline and time slices through validation sample 0's centre, the
    amplitude, the label over it and the prediction over it (slices: run_segment's, (amplitude, predicted class,
    label) per slice). Written to `path` (PNG); returns the Figure."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 9.5), dpi=64)
    axes = fig.subplots(3, 3, gridspec_kw=dict(left=0.06, right=0.99, bottom=0.05, top=0.9, wspace=0.12, hspace=0.42))
    axis_of = {"inline": (1, 2), "crossline": (0, 2), "time": (0, 1)}
    for row, (name, across, down) in zip(axes, ROWS):
        amp, pred, label = slices[name]
        clip = float(np.percentile(np.abs(amp), 99)) or 1.0
        a, b = axis_of[name]
        extent = (origin[a] - 0.5, origin[a] + amp.shape[0] - 0.5, origin[b] + amp.shape[1] - 0.5, origin[b] - 0.5)
        for ax, (what, classes) in zip(row, (("amplitude", None), ("label", label), ("prediction", pred))):
            ax.imshow(amp.T, cmap="gray", vmin=-clip, vmax=clip, extent=extent, aspect="auto", interpolation="nearest")
            if classes is not None:  # class 0 transparent, the others coloured over the amplitude
                ax.imshow(np.ma.masked_equal(classes.T, 0), cmap="autumn", alpha=0.6, extent=extent, aspect="auto",
                          interpolation="nearest")
            ax.set_title(f"{name} slice: {what}", fontsize=9)
            ax.set_xlabel(across, fontsize=8)
            ax.tick_params(labelsize=7)
            if ax is row[0]:
                ax.set_ylabel(down, fontsize=8)
            else:
                ax.tick_params(labelleft=False)
    fig.suptitle(title, fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    outputs.save_figure(fig, path, record)
    return fig


def read_losses(log_path):
    """(train, val) from a run's log.jsonl: {step: loss}, the last record of each step winning (a resumed run
    re-runs the steps after its checkpoint and logs them again)."""
    train, val = {}, {}
    with open(log_path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:  # (a last line cut short by a crash: train.py drops it when it goes on)
                continue
            if "loss" in r:
                train[r["step"]] = r["loss"]
            if "val_loss" in r:
                val[r["step"]] = r["val_loss"]
    return train, val


def read_floor(log_path):
    """The last val_floor log.jsonl holds (evaluate.floor_of's), or None."""
    floor = None
    with open(log_path) as f:
        for line in f:
            if '"val_floor"' in line:
                try:
                    floor = json.loads(line)["val_floor"]
                except ValueError:
                    continue
    return floor


def loss_figure(path, log_path, ylabel="masked MSE", record=None):
    """Train and validation loss against step, log scale, from log.jsonl."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    train, val = read_losses(log_path)
    fig = Figure(figsize=(7, 4), dpi=64, layout="tight")
    ax = fig.subplots()
    if train:
        ax.plot(sorted(train), [train[s] for s in sorted(train)], lw=1, label="train (per step)")
    if val:
        ax.plot(sorted(val), [val[s] for s in sorted(val)], "o-", ms=4, label="validation (held out)")
    floor = read_floor(log_path)
    if floor is not None:  # the loss a predictor that learns nothing gets on the same patches (infra/floor.py)
        ax.axhline(floor, color="k", ls="--", lw=1, label=f"floor: kriging, {floor:.3f}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    outputs.save_figure(fig, path, record)
    return fig


def floor_words(loss, floor):
    """How far below (or above) the floor a validation loss is, in words for the log line and the figure."""
    if floor is None:
        return ""
    if loss < floor:
        return f"floor {floor:.4f} (kriging): {floor - loss:.4f} below it"
    return f"floor {floor:.4f} (kriging): {loss - floor:.4f} ABOVE it, not yet better than interpolation"


def figure_title(what, step, mse, mask_ratio, norm_pix):
    t = f"{what} | step {step} | mask ratio {mask_ratio:.2f} | masked MSE {mse:.4f}"
    if norm_pix:
        t += ("\nnorm_pix_loss: the prediction is shown de-normalised with each target patch's own mean and std "
              "(the MSE is in normalised-patch units)")
    return t
