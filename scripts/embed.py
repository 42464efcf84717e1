"""
Encoder features of a whole survey: every token of the volume through the pretrained encoder, written as a Zarr
v3 store on the token grid, with the survey's coordinates at the token centres.

    python -m scripts.embed MODEL STORE --out=FEATURES.zarr                       one process
    torchrun --nproc_per_node=8 scripts/embed.py MODEL STORE --out=s3://b/f.zarr --cp=2 --stride=(128,128,256)

MODEL: a model file (scripts/export.py) or a run's out_dir (its newest checkpoint, exported once by rank 0). STORE: an
MDIO v1/v0 store or a 3D Zarr array, local or s3:// (infra/reader.py reads it, normalised with the store's statistics,
dead traces -> 0, as training saw it).

How. The volume is tiled into windows of the model's crop (--crop to change it), `stride` voxels apart
(default: half the crop; the last window of each axis ends at the volume's last whole token). Each window goes
through the encoder with every token visible (no mask; the cls token is left out: under cp every rank must hold
as many tokens as the others, and the token features do not need it). Where windows overlap, a token keeps the
feature from the window in which it is most central: along each axis the window whose centre is nearest (ties:
the first), so each window owns a box of tokens and the boxes tile the grid. The volume's edge (fewer voxels
than a patch) has no token.

    features   (inline, crossline, time, feature) float16 (--dtype), chunks (1, <=32, <=32, D): one inline token plane per
               chunk row, so no two windows that different ranks embed ever write the same chunk
    inline, crossline, time    the store's coordinates (or voxel indices) at the token centres
    embed_done/I.J.K           one small object per window written (resume: those windows are skipped)

Ranks: world = dp x cp. dp groups take different rows of windows along inline (row i goes to group i mod dp);
with cp > 1 a window is split over the cp ranks of a group along inline and encoded with ring attention, as in
training; each rank writes its own inline planes. Small windows go through the encoder `--batch` at a time (by
default as many as hold BATCH_TOKENS tokens per rank), their crops read side by side. Rank 0 draws the central
inline, crossline and time slices of the features, mapped to RGB by their first three principal components, to
OUT.png (a local OUT) or NAME.png in the current folder (an s3:// OUT), or --picture.

What it writes over (infra/outputs.py; all checked before any work): nothing but its own. A local OUT is built as
OUT.partial and renamed to OUT when every window is in, so OUT is whole or absent; on s3:// (no rename) OUT is
written in place and its root attribute `embed` says `"complete": false` until then. That attribute records what
made it (the survey, the model's checkpoint, step and config digest, patch, crop, stride, grid, dtype): a run with
the same goes on from an interrupted one (or finds it complete: nothing to do); one with another model, survey or
settings is refused unless --overwrite, which makes it anew. OUT inside the survey or the run's checkpoints, and
anything at OUT that embed did not write (a survey, a folder of yours), are refused, --overwrite or not; the
picture likewise (a PNG records its settings in a text chunk), and never at OUT itself. Nothing goes inside a
training run's ckpt/ (its rotation deletes what is there). One embed per output: rank 0 holds OUT.lease
(infra/lease.py) while it runs, so a second one is refused, naming the first. A write the file system refuses (no
space, read-only) is one line, exit code 4, the windows written so far kept.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import configurator
from infra import cli, distributed, lease, modelfile, outputs, reader
from infra.features import BATCH_TOKENS, encode, plan_windows, token_coords, window_model
from infra.progress import Progress
from model import build_model, token_grid


def pca_picture(features, title):
    """The figure of the three central slices of `features` (zarr array, (I, X, T, D)) coloured by the first three
    principal components of their pooled features (each component stretched over its 1st..99th percentile to 0..1)."""
    from matplotlib.figure import Figure
    I, X, T, D = features.shape
    slices = [np.asarray(features[I // 2]), np.asarray(features[:, X // 2]), np.asarray(features[:, :, T // 2])]
    flat = np.concatenate([s.reshape(-1, D) for s in slices]).astype(np.float64)
    mean = flat.mean(0)
    _, _, vt = np.linalg.svd(flat - mean, full_matrices=False)
    comps = vt[:3]
    lo_hi = [np.percentile((flat - mean) @ c, [1, 99]) for c in comps]
    fig = Figure(figsize=(13, 4.5), dpi=90)
    axs = fig.subplots(1, 3)
    for ax, s, name, (xl, yl) in zip(axs, slices, (f"inline {I // 2}", f"crossline {X // 2}", f"time {T // 2}"),
                                     (("crossline", "time"), ("inline", "time"), ("inline", "crossline"))):
        proj = (s.reshape(-1, D).astype(np.float64) - mean) @ comps.T
        rgb = np.stack([np.clip((proj[:, k] - lo) / max(hi - lo, 1e-12), 0, 1) for k, (lo, hi) in enumerate(lo_hi)], 1)
        img = rgb.reshape(*s.shape[:2], 3)
        ax.imshow(np.swapaxes(img, 0, 1), aspect="auto", interpolation="nearest")  # time (or crossline) down
        ax.set(title=f"{name}", xlabel=f"{xl} (tokens)", ylabel=f"{yl} (tokens)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m scripts.embed", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model file (scripts/export.py) or a run's out_dir")
    ap.add_argument("store", help="the survey: MDIO v1/v0 store or 3D Zarr array, local or s3://")
    ap.add_argument("--out", required=True, help="the features' Zarr v3 store (local or s3://)")
    ap.add_argument("--crop", default=None, help="window in voxels, e.g. (64,64,128) (default: the model's crop)")
    ap.add_argument("--stride", default=None, help="window stride in voxels (default: half the window)")
    ap.add_argument("--cp", type=int, default=1, help="ranks per window (ring attention), as in training")
    ap.add_argument("--batch", type=int, default=0,
                    help=f"windows per forward pass (default: as many as hold {BATCH_TOKENS:,} tokens per rank, at least 1)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"), help="of the stored features")
    ap.add_argument("--picture", default="", help="the principal-component picture (default: OUT.png beside a "
                    "local OUT; NAME.png in the current folder for an s3:// OUT)")
    cli.add_read_arguments(ap)
    ap.add_argument("--overwrite", action="store_true",
                    help="replace features this command made with another model, survey or settings")
    ap.add_argument("--stop_after", type=int, default=0, help=argparse.SUPPRESS)  # tests: stop after N windows
    return ap.parse_args(argv)


def main(argv):
    """The command. Rank 0 holds the output's lease (infra/lease.py) from before it looks at the output until the
    command ends, however it ends: a second embed into the same --out is refused, naming the first."""
    held = []  # rank 0's lease on the output, once claim() has taken it
    try:
        return embed(argv, held)
    finally:
        for h in held:
            h.release()


def embed(argv, held):
    a = parse(argv)
    rank, world, device = distributed.init()  # torchrun's ranks, or a world of 1
    cp = a.cp
    configurator.need(a.batch >= 0, f"--batch={a.batch}: windows per forward pass, >= 1 (0: as many as fit "
                           f"{BATCH_TOKENS:,} tokens)")
    if cp < 1 or world % cp:
        raise configurator.ConfigError(f"--cp={cp} must divide the world size {world}")
    cp_rank, dp_rank, dp, cp_group = distributed.cp_groups(cp)
    # ---- what would be written, checked against what is there before any work (rank 0 looks; every rank gets it)
    cfg = modelfile.init_source(a.model, "MODEL")[0]  # (the model's config, cheaply: no weight is read)
    patch = tuple(cfg["patch"])
    crop = cli.triple(a.crop, "crop") or tuple(cfg["crop"])
    stride = cli.triple(a.stride, "stride") or tuple(max(p, c // 2 // p * p) for c, p in zip(crop, patch))
    if any(c % p or s % p for c, s, p in zip(crop, stride, patch)):
        raise configurator.ConfigError(f"--crop {crop} and --stride {stride} must be multiples of the patch {patch}")
    w = token_grid(crop, patch)  # window in tokens
    if w[0] % cp:
        raise configurator.ConfigError(f"the window's {w[0]} inline tokens do not split over --cp={cp}")
    opts = cli.read_options(a)
    vol = reader.Volume(a.store, opts)
    grid = token_grid(vol.shape, patch)
    wins = plan_windows(grid, w, token_grid(stride, patch))
    D = build_model(cfg, device="meta").dim
    source = a.store if outputs.is_remote(a.store) else os.path.abspath(a.store)
    settings = {"made_by": "scripts.embed", "source": source, "model": modelfile.identity(a.model),
                "patch": list(patch), "crop": list(crop), "stride": list(stride), "grid": list(grid), "features": D,
                "dtype": a.dtype}
    so = reader.storage_options(a.out, opts) if outputs.is_remote(a.out) else None
    pic = a.picture or (a.out.rstrip("/") + ".png" if not outputs.is_remote(a.out)
                        else os.path.basename(a.out.rstrip("/")) + ".png")  # s3:// out: the picture stays here
    work = distributed.on_rank_0(lambda: claim(a, settings, pic, vol, grid, patch, so, opts, held))
    if work is None:  # its own output, complete, with these settings: nothing to do
        if rank == 0:
            print(f"{a.out} already holds these features, complete (the same survey, model and settings): nothing to "
                  f"do (--overwrite does not redo it; remove it to)", file=sys.stderr)
            if outputs.figure_target(pic, settings, option="--picture", made_by="scripts.embed") == "new":
                draw(a, so, pic, settings)  # (its first run could not write it)
            print(json.dumps({"windows": len(wins), "grid": list(grid), "features": D, "out": a.out, "picture": pic,
                              "already_complete": True}))
        dist.destroy_process_group()
        return 0
    # ---- the encoder
    model = window_model(a.model, settings["model"]["checkpoint"], crop, cp, cp_group, device)
    import zarr
    root = zarr.open_group(work, mode="r+", storage_options=so)
    feats = root["features"]
    # the windows of this rank's dp group that no earlier run finished (the ranks of a cp group list before any of
    # them can write a marker: a marker follows a ring step that needs them all)
    done = outputs.Markers(root.store, "embed_done/")
    left = sum(x[0] not in done for x in wins)  # the survey's windows still to do, every group's
    todo = [x for x in wins if x[0][0] % dp == dp_rank and x[0] not in done]
    mine = len(todo)
    if a.stop_after:
        todo = todo[:a.stop_after]
    slab = w[0] // cp  # this rank's inline tokens of each window
    L_loc = slab * w[1] * w[2]
    batch = a.batch or max(1, BATCH_TOKENS // L_loc)
    # progress (infra/progress.py, rank 0 shows it) in the whole survey's windows, those of an earlier run counted
    # as done: rank 0 sees only its own group's, and stands for the others (the groups take rows in turn, so each
    # has about as many to do: rank 0's fraction of its own is the survey's), with no collective to wait on
    kept = (f"the windows written before them are kept in {work}: free space (or make it writable) and run the same "
            f"command again to go on from them")
    with Progress(total=len(wins), initial=len(wins) - left, desc="embedding", unit="window") as bar:
        counted = 0
        t0, n_tok = time.time(), 0
        for k in range(0, len(todo), batch):
            part = todo[k:k + batch]
            # this rank's slab of each window: inline tokens [org0 + cp_rank * slab, + slab), read side by side
            s0 = [org[0] + cp_rank * slab for _, org, _ in part]
            xs = reader.read_crops([(vol, (s * patch[0], org[1] * patch[1], org[2] * patch[2]),
                                     (slab * patch[0],) + crop[1:]) for s, (_, org, _) in zip(s0, part)])
            x = torch.from_numpy(np.stack(xs))[:, None].to(device)  # (B, 1, slab * pz, Y, X), dead traces -> 0
            z = encode(model, x, offset=cp_rank * L_loc)  # (B, slab, w1, w2, D)
            for zb, s, (_, org, box) in zip(z, s0, part):
                # the owned box, in this slab's token coordinates
                lo = [max(box[0][0], s) - s, box[1][0] - org[1], box[2][0] - org[2]]
                hi = [min(box[0][1], s + slab) - s, box[1][1] - org[1], box[2][1] - org[2]]
                if hi[0] > lo[0]:
                    with outputs.writes(f"the features of window {org}", kept):
                        feats[s + lo[0]:s + hi[0], box[1][0]:box[1][1], box[2][0]:box[2][1]] = \
                            zb[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].astype(a.dtype)
            n_tok += len(part) * L_loc
            if cp > 1:
                dist.barrier(group=cp_group)  # every slab of these windows written before they are marked
            if cp_rank == 0:
                with outputs.writes("the windows' markers", kept):
                    for idx, _, _ in part:
                        done.mark(idx)
            if held and k:  # rank 0's lease: still ours (else LeaseLost, before the next windows are written)
                held[0].refresh()
            elif held:  # ... and, after the first batch, how often it is refreshed (for a command on another host)
                held[0].expect(time.time() - t0)
            now = round((k + len(part)) / mine * left)
            bar.update(now - counted)
            counted = now
    if a.stop_after:
        print(f"rank {rank}: stopped after {len(todo)} windows (--stop_after)", flush=True)
        dist.destroy_process_group()
        return 75
    dt = time.time() - t0
    rate = torch.tensor([n_tok / max(dt, 1e-9)], dtype=torch.float64, device=device)  # NCCL: CUDA tensors only
    dist.all_reduce(rate)
    dist.barrier()
    if rank == 0:
        with outputs.writes("the features store's record", f"every window is written in {work}: free space (or make "
                            f"it writable) and run the same command again to finish"):
            finish(a.out, work, settings, so)
        draw(a, so, pic, settings)
        print(json.dumps({"windows": len(wins), "grid": list(grid), "features": D, "out": a.out, "picture": pic,
                          "batch": batch, "tokens_per_s": round(rate.item(), 1)}))
    dist.destroy_process_group()
    return 0


def draw(a, so, pic, settings):
    """Rank 0: the figure of the finished features at --picture."""
    import zarr
    feats = zarr.open_group(a.out, mode="r", storage_options=so)["features"]
    fig = pca_picture(feats, f"{a.store}: encoder features, first 3 principal components")
    with outputs.writes(f"the picture {pic}", f"the features are complete at {a.out}: make room (or give --picture a "
                        f"writable path) and run the same command again to draw it"):
        outputs.save_figure(fig, pic, settings)


def recorded(path, so):
    """What is at the features store `path`: None (nothing, or an empty folder), embed's record of it (its settings and
    whether it is complete: the root's "embed" attribute), or outputs.Foreign."""
    import zarr
    if outputs.nothing_at(path, so):
        return None
    try:
        rec = zarr.open_group(path, mode="r", storage_options=so).attrs.get("embed")
    except Exception:  # noqa: BLE001 - not a Zarr group: a file, a survey's array, anything
        rec = None
    return dict(rec) if isinstance(rec, dict) else outputs.Foreign("not a features store of scripts.embed")


def claim(a, settings, pic, vol, grid, patch, so, opts, held):
    """Rank 0, before any work: where this run writes (the store to open), or None when --out already holds these
    features complete. Local: the store is built at OUT.partial and renamed to OUT when complete (finish), so OUT is
    whole or absent; an interrupted run's OUT.partial with the same settings is gone on from. On an object store
    (no rename) it is OUT itself, its "embed" attribute saying complete: false until the last window is in. A store
    made with another model, survey or settings is refused unless --overwrite (then made anew); anything else at
    OUT (a survey, a folder of the user's) is never written over, and OUT may not lie inside the survey or the run
    (infra/outputs.py). The picture's path is checked the same way. The output's lease is taken before the output is
    looked at (appended to `held`)."""
    inputs = [a.store, os.path.join(a.model, "ckpt") if os.path.isdir(a.model) else a.model]
    outputs.refuse_inside(a.out, inputs)
    outputs.refuse_inside(pic, inputs, "--picture")
    outputs.refuse_same(pic, a.out, "--picture", "--out")
    remote = outputs.is_remote(a.out)
    if not remote:
        outputs.check_folder(a.out)
        outputs.refuse_same(pic, a.out.rstrip("/") + ".partial", "--picture", "--out's store being built")
    outputs.check_folder(pic, "--picture")
    held += [h for h in [lease.for_output(a.out, f"--out={a.out}")] if h]
    found = recorded(a.out, so)
    how = outputs.target(a.out, "a features store", found, settings, a.overwrite)
    outputs.figure_target(pic, settings, a.overwrite, "--picture", "scripts.embed")
    if how == "same" and found.get("complete", True):
        return None
    import shutil
    work = a.out if remote else a.out.rstrip("/") + ".partial"
    if remote and how == "replace":
        import fsspec
        fs, p = fsspec.url_to_fs(a.out, **so)
        fs.rm(p, recursive=True)  # (this command's own store, of other settings: --overwrite)
    if not remote:
        part = recorded(work, so)
        if outputs.target(work, "an interrupted features store", part, settings, a.overwrite) == "replace":
            shutil.rmtree(work)
    create(work, settings, vol, grid, patch, so, opts)
    return work


def create(work, settings, vol, grid, patch, so, opts):
    """The features store at `work`, unless it is there (an interrupted run of the same settings)."""
    import zarr
    root = zarr.open_group(work, mode="a", zarr_format=3, storage_options=so)
    if "features" in root:
        return
    D = settings["features"]
    coords = token_coords(vol, grid, patch, opts)
    root.attrs.update({"source": settings["source"], "model": settings["model"]["checkpoint"],
                       "step": settings["model"]["step"], "patch": list(patch), "crop": settings["crop"],
                       "stride": settings["stride"], "grid": list(grid),
                       "description": "MAE encoder features (every token visible, no cls), scripts/embed.py"})
    root.create_array("features", shape=grid + (D,), chunks=(1, min(grid[1], 32), min(grid[2], 32), D),
                      dtype=settings["dtype"], fill_value=0, dimension_names=["inline", "crossline", "time", "feature"])
    for n in ("inline", "crossline", "time"):
        c = root.create_array(n, shape=(len(coords[n]),), chunks=(len(coords[n]),), dtype="float64",
                              dimension_names=[n])
        c[:] = coords[n]
    f = root.create_array("feature", shape=(D,), chunks=(D,), dtype="int32", dimension_names=["feature"])
    f[:] = np.arange(D, dtype=np.int32)
    root.attrs["embed"] = {**settings, "complete": False}  # last: a store without it is not one to go on from


def finish(out, work, settings, so):
    """Rank 0, every window written: the store marked complete, and (local) OUT.partial renamed to OUT, over the
    store of other settings that --overwrite replaces (outputs.move_into_place)."""
    import zarr
    zarr.open_group(work, mode="r+", storage_options=so).attrs["embed"] = {**settings, "complete": True}
    if work != out:
        outputs.move_into_place(work, out)


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:], interrupted="the windows written so far are kept (OUT.partial locally): the "
                                                     "same command goes on from them"))
