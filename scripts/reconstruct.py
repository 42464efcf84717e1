"""
What does the model reconstruct? Pictures of a masked crop and its reconstruction, and the loss curves.

    python reconstruct.py out/quickstart                       # newest checkpoint, exported on the fly
    python reconstruct.py out/quickstart/model_step_0000500.pt --origin=(96,40,100) --mask_ratio=0.9 --seed=3
    python reconstruct.py MODEL --data=s3://bucket/survey.mdio --crop=(64,64,256) --out=recon.png

It reads a crop of a store (the run's first store by default; local or s3://), masks it (mask_ratio, seed),
runs the model on one device (CPU, or one GPU with --device=cuda), prints the masked MSE and writes the
four-panel figure that training writes at each evaluation (train.py -> evaluate.py -> recon_figure):

    original | masked input (masked patches blank) | reconstruction | reconstruction + visible patches

for the inline, crossline and time slices through the crop's centre, in the seismic gray colormap with one
symmetric clip per row (the 99th percentile of |original|), axes in the volume's inline / crossline / time
sample indices. With norm_pix_loss the model predicts each patch normalised by its own mean and std: the
figure shows the prediction de-normalised with the target patch's mean and std (model.pred_to_voxels) and
says so in its title; shown raw, every patch would look flat.

Without --origin a crop is drawn from the seed: inside the held-out inlines when the store is one of the
run's training stores and the run held some out (val_frac), anywhere otherwise. The model's positions are
computed per token, so --crop may differ from the training crop (a multiple of the patch); the patch may not.
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

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


def voxel_views(model, x, pred, mask):
    """Sample 0 of a batch as voxels: (x in its own dtype, reconstruction float, masked bool) each (Z_loc, Y, X),
    tensors on the device of the inputs (no host copy: a slab is GBs at long context; centre_parts cuts the
    slices there). x (B, 1, Z_loc, Y, X) the model's input slab, pred (B, L_loc, P), mask (B, L_loc) with
    1 = masked (the model's outputs)."""
    import model as M
    gz, gy, gx = x.shape[2] // model.patch[0], x.shape[3] // model.patch[1], x.shape[4] // model.patch[2]
    patches = M.patchify(x[:1].float(), model.patch)
    recon = M.unpatchify(M.pred_to_voxels(pred[:1], patches, model.norm_pix_loss), model.patch, (gz, gy, gx))
    m = M.unpatchify(mask[:1, :, None].expand(-1, -1, model.P).float(), model.patch, (gz, gy, gx)) > 0.5
    return x[0, 0], recon[0, 0], m[0, 0]


# -----------------------------------------------------------------------------
# figures (matplotlib is imported here only, with the Agg backend: no display, no pyplot state)


def recon_figure(path, slices, origin, title):
    """Write the 3 x 4 panel figure to `path` (PNG) and return the matplotlib Figure (tensorboard takes it).
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
    fig.savefig(path)
    return fig


def read_losses(log_path):
    """(train, val) from a run's log.jsonl: {step: loss}, the last record of each step winning (a resumed run
    re-runs the steps after its checkpoint and logs them again)."""
    train, val = {}, {}
    with open(log_path) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                train[r["step"]] = r["loss"]
            if "val_loss" in r:
                val[r["step"]] = r["val_loss"]
    return train, val


def loss_figure(path, log_path):
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
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("masked MSE")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return fig


def figure_title(what, step, mse, mask_ratio, norm_pix):
    t = f"{what} | step {step} | mask ratio {mask_ratio:.2f} | masked MSE {mse:.4f}"
    if norm_pix:
        t += ("\nnorm_pix_loss: the prediction is shown de-normalised with each target patch's own mean and std "
              "(the MSE is in normalised-patch units)")
    return t


# -----------------------------------------------------------------------------
# the command line


def memory_needed(model_cfg):
    """Bytes one device needs to run the config's MAE forward (fp32, no gradients), by the planner
    (plan.activation_bytes with checkpointing: every block's input kept, one block's working set at a
    time; an upper bound for a forward without autograd) plus the fp32 weights and the input crop."""
    import plan
    m = plan.meta_model(model_cfg)
    act = sum(plan.activation_bytes(m, 1, 1, 4, True))
    return 4 * sum(p.numel() for p in m.parameters()) + act + 4 * math.prod(model_cfg["crop"]) * 3


def device_memory(device):
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1] * 0.92
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def main(argv):
    import configurator
    import data
    import reader
    import export
    import library
    import model as M
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model file (export.py) or a run's out_dir (its newest checkpoint)")
    ap.add_argument("--data", default="", help="store to read (default: the run's first store)")
    ap.add_argument("--origin", default="", help="crop origin (inline, crossline, time); default: drawn from --seed")
    ap.add_argument("--crop", default="", help="crop shape; default: the run's crop")
    ap.add_argument("--mask_ratio", type=float, default=None, help="default: the run's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--patch", default="", help="refused unless equal to the model's patch (a check)")
    ap.add_argument("--tag", default=None, help="with an out_dir: this checkpoint instead of the newest")
    ap.add_argument("--out", default="", help="figure path (PNG)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--s3_anon", action="store_true")
    ap.add_argument("--s3_endpoint", default="")
    a = ap.parse_args(argv)
    def triple(s, what):
        try:
            v = tuple(int(x) for x in s.strip("()[] ").split(",")) if s else None
        except ValueError:
            v = ()
        if v is not None and (len(v) != 3 or (what != "origin" and min(v) < 1)):
            raise configurator.ConfigError(f"--{what}={s!r}: give 3 {'non-negative' if what == 'origin' else 'positive'} "
                                           f"integers (inline, crossline, time), e.g. --{what}=16,16,64")
        return v

    # ---- the model: a file, or a run's checkpoint exported in memory
    if os.path.isdir(a.model):
        sd, meta = export.state_dict_from_checkpoint(a.model, a.tag)
        what = f"{a.model} ({meta['tag']})"
    else:
        sd, meta = export.read_model_file(a.model)
        what = os.path.basename(a.model)
    if meta.get("encoder_only"):
        raise configurator.ConfigError(f"{a.model} holds the encoder only: it cannot reconstruct. Export without "
                                       f"--encoder_only (python export.py OUT_DIR)")
    cfg = dict(meta["config"])
    cfg["patch"], cfg["crop"] = tuple(cfg["patch"]), tuple(cfg["crop"])
    patch = triple(a.patch, "patch")
    if patch and patch != cfg["patch"]:
        raise configurator.ConfigError(f"the model was trained with patch {cfg['patch']} and --patch is {patch}: a "
                                       f"model's patch size cannot change (its patch embedding is "
                                       f"{math.prod(cfg['patch'])} voxels wide); drop --patch")
    crop = triple(a.crop, "crop") or cfg["crop"]
    if len(crop) != 3 or any(c % p for c, p in zip(crop, cfg["patch"])):
        raise configurator.ConfigError(f"crop {crop} must be 3 multiples of the model's patch {cfg['patch']}")
    mask_ratio = cfg["mask_ratio"] if a.mask_ratio is None else a.mask_ratio
    if not 0 < mask_ratio < 1:
        raise configurator.ConfigError(f"mask_ratio must be in (0, 1), got {mask_ratio}")
    # one process: the run's mask strata are kept (cp = 1 draws the same masks as any cp, see model.py)
    strata = cfg.get("mask_strata") or cfg.get("cp", 1)
    grid = tuple(c // p for c, p in zip(crop, cfg["patch"]))
    if math.prod(grid) % strata:
        strata = 1
    mcfg = {**cfg, "crop": crop, "mask_ratio": mask_ratio, "cp": 1, "mask_strata": strata}
    if a.device == "cuda" and not torch.cuda.is_available():
        raise configurator.ConfigError("--device=cuda but torch sees no GPU here: use --device=cpu (or auto)")
    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    need, have = memory_needed(mcfg), device_memory(device)
    if need > have:
        raise configurator.ConfigError(
            f"crop {crop} needs about {need / 1e9:.1f} GB on one device by the planner and this {device.type} has "
            f"{have / 1e9:.1f} GB: choose a smaller --crop, or split it over GPUs with context parallelism: the "
            f"training job's own evaluation runs with the run's cp (bash launch.sh CONFIG --eval_only=True draws "
            f"validation sample 0 of the newest checkpoint, each rank holding crop[0] / cp inlines)")
    model = export.build_model(mcfg)
    model.load_state_dict(sd, strict=True)
    model.to(device).eval()

    # ---- the crop
    opts = reader.ReadOptions(anon=a.s3_anon or cfg.get("s3_anon", False),
                            endpoint_url=a.s3_endpoint or cfg.get("s3_endpoint") or None)
    first = library.expand(cfg["data_paths"][:1], opts)[0] if not a.data else None  # (a glob or a @manifest too)
    store = a.data or (first["url"] if isinstance(first, dict) else first)
    vol = reader.Volume(store, opts)
    origin = triple(a.origin, "origin")
    if origin is None:  # drawn: in the held-out inlines of a training store, if the run held some out
        same = lambda u: u if "://" in u else os.path.abspath(u)  # noqa: E731  (relative vs absolute paths)
        held_out = (same(store) in map(same, cfg["data_paths"]) and not cfg.get("val_paths")
                    and cfg.get("val_frac", 0) > 0)
        rng = np.random.default_rng([a.seed, 4])
        ranges = [data.split_inline(vol.describe(), ("val", cfg["val_frac"]), crop[0]) if held_out else
                  (0, vol.shape[0]),
                  (0, vol.shape[1]), (0, vol.shape[2])]
        if any(hi - lo < c for (lo, hi), c in zip(ranges, crop)):
            raise data.DataError(f"crop {crop} is larger than the volume {vol.shape} of {store!r}: choose a smaller --crop")
        origin = tuple(data._draw(rng, lo, hi, c, 1, False) for (lo, hi), c in zip(ranges, crop))
    if len(origin) != 3 or any(o < 0 or o + c > s for o, c, s in zip(origin, crop, vol.shape)):
        raise data.DataError(f"a crop {crop} at origin {origin} is outside the volume {vol.shape} of {store!r}: the "
                             f"origin must lie in [0, {tuple(s - c for s, c in zip(vol.shape, crop))}] per axis")
    x = torch.from_numpy(vol.read(origin, crop))[None, None].to(device)  # (1, 1, Z, Y, X), normalised

    # ---- mask, forward, error
    noise = data.mask_noise(a.seed, [0], model.L, stream="val").to(device)
    with torch.no_grad():
        ids_keep = model.keep_ids(noise)
        loss, pred, mask = model(x, ids_keep=ids_keep)
        recon_patches = M.pred_to_voxels(pred, M.patchify(x, model.patch), model.norm_pix_loss)
        masked = mask[0] > 0.5
        vox_mse = (recon_patches[0][masked] - M.patchify(x, model.patch)[0][masked]).pow(2).mean().item()
    mse = loss.item()
    xs, rs, ms = voxel_views(model, x, pred, mask)
    slices = join_parts([centre_parts(xs, rs, ms, 0, crop[0])])
    out = a.out or os.path.join(a.model if os.path.isdir(a.model) else os.path.dirname(os.path.abspath(a.model)),
                                "figures", f"reconstruct_{'_'.join(map(str, origin))}.png")
    title = figure_title(f"{what} on {os.path.basename(store.rstrip('/'))}, crop {crop} at {origin}", meta["step"],
                         mse, 1 - model.n_keep() / model.L, model.norm_pix_loss)
    recon_figure(out, slices, origin, title)
    extra = f" (in voxel units after de-normalising: {vox_mse:.4f})" if model.norm_pix_loss else ""
    print(f"masked MSE {mse:.6f}{extra} over {model.L - model.n_keep()} masked patches of {model.L}; crop {crop} at "
          f"{origin} of {store}; figure {out}")
    print(json.dumps({"masked_mse": mse, "voxel_mse": vox_mse, "origin": list(origin), "crop": list(crop),
                      "masked_patches": model.L - model.n_keep(), "tokens": model.L, "figure": out}))
    return 0


def cli(argv):
    import configurator
    import data
    try:
        return main(argv)
    except (configurator.ConfigError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
