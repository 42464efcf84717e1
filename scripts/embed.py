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
from infra import cli, distributed, modelfile, reader
from infra.features import BATCH_TOKENS, encode, plan_windows, prepare, token_coords
from infra.progress import Progress
from model import token_grid


def pca_picture(features, path, title):
    """The three central slices of `features` (zarr array, (I, X, T, D)) coloured by the first three principal
    components of their pooled features (each component stretched over its 1st..99th percentile to 0..1)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    I, X, T, D = features.shape
    slices = [np.asarray(features[I // 2]), np.asarray(features[:, X // 2]), np.asarray(features[:, :, T // 2])]
    flat = np.concatenate([s.reshape(-1, D) for s in slices]).astype(np.float64)
    mean = flat.mean(0)
    _, _, vt = np.linalg.svd(flat - mean, full_matrices=False)
    comps = vt[:3]
    lo_hi = [np.percentile((flat - mean) @ c, [1, 99]) for c in comps]
    fig, axs = plt.subplots(1, 3, figsize=(13, 4.5))
    for ax, s, name, (xl, yl) in zip(axs, slices, (f"inline {I // 2}", f"crossline {X // 2}", f"time {T // 2}"),
                                     (("crossline", "time"), ("inline", "time"), ("inline", "crossline"))):
        proj = (s.reshape(-1, D).astype(np.float64) - mean) @ comps.T
        rgb = np.stack([np.clip((proj[:, k] - lo) / max(hi - lo, 1e-12), 0, 1) for k, (lo, hi) in enumerate(lo_hi)], 1)
        img = rgb.reshape(*s.shape[:2], 3)
        ax.imshow(np.swapaxes(img, 0, 1), aspect="auto", interpolation="nearest")  # time (or crossline) down
        ax.set(title=f"{name}", xlabel=f"{xl} (tokens)", ylabel=f"{yl} (tokens)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


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
    ap.add_argument("--s3_anon", action="store_true")
    ap.add_argument("--s3_endpoint", default="")
    ap.add_argument("--stop_after", type=int, default=0, help=argparse.SUPPRESS)  # tests: stop after N windows
    return ap.parse_args(argv)


def main(argv):
    a = parse(argv)
    rank, world, device = distributed.init()  # torchrun's ranks, or a world of 1
    cp = a.cp
    if cp < 1 or world % cp:
        raise configurator.ConfigError(f"--cp={cp} must divide the world size {world}")
    cp_rank, dp_rank, dp, cp_group = distributed.cp_groups(cp)
    # ---- the encoder
    path = a.model
    if os.path.isdir(path):  # a run's out_dir: its newest checkpoint as one model file, by rank 0
        path = distributed.on_rank_0(lambda: modelfile.export(a.model))
    model, meta = modelfile.load(path, map_location="cpu")
    cfg = meta["config"]
    patch = tuple(cfg["patch"])
    crop = cli.triple(a.crop, "crop") or tuple(cfg["crop"])
    stride = cli.triple(a.stride, "stride") or tuple(max(p, c // 2 // p * p) for c, p in zip(crop, patch))
    if any(c % p or s % p for c, s, p in zip(crop, stride, patch)):
        raise configurator.ConfigError(f"--crop {crop} and --stride {stride} must be multiples of the patch {patch}")
    w = token_grid(crop, patch)  # window in tokens
    if w[0] % cp:
        raise configurator.ConfigError(f"the window's {w[0]} inline tokens do not split over --cp={cp}")
    prepare(model, crop, cp)
    model.to(device).eval()
    model.set_context_parallel(cp_group, "ring")
    # ---- the survey and the plan
    opts = reader.ReadOptions(anon=a.s3_anon, endpoint_url=a.s3_endpoint or None)
    vol = reader.Volume(a.store, opts)
    grid = token_grid(vol.shape, patch)
    wins = plan_windows(grid, w, token_grid(stride, patch))
    D = model.dim
    so = reader.storage_options(a.out, opts) if "://" in a.out else None
    import zarr
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync
    if rank == 0:
        root = zarr.open_group(a.out, mode="a", zarr_format=3, storage_options=so)
        if "features" not in root:
            coords = token_coords(vol, grid, patch, opts)
            root.attrs.update({"source": a.store, "model": os.path.basename(str(path)), "step": meta.get("step"),
                               "patch": list(patch), "crop": list(crop), "stride": list(stride), "grid": list(grid),
                               "description": "MAE encoder features (every token visible, no cls), scripts/embed.py"})
            root.create_array("features", shape=grid + (D,), chunks=(1, min(grid[1], 32), min(grid[2], 32), D),
                              dtype=a.dtype, fill_value=0, dimension_names=["inline", "crossline", "time", "feature"])
            for n in ("inline", "crossline", "time"):
                c = root.create_array(n, shape=(len(coords[n]),), chunks=(len(coords[n]),), dtype="float64",
                                      dimension_names=[n])
                c[:] = coords[n]
            f = root.create_array("feature", shape=(D,), chunks=(D,), dtype="int32", dimension_names=["feature"])
            f[:] = np.arange(D, dtype=np.int32)
        elif tuple(root["features"].shape) != grid + (D,) or root.attrs.get("stride") != list(stride):
            raise configurator.ConfigError(f"{a.out} holds features of another survey, model or stride "
                                           f"({root['features'].shape}, stride {root.attrs.get('stride')}): use a new --out")
    dist.barrier()
    root = zarr.open_group(a.out, mode="r+", storage_options=so)
    feats, store = root["features"], root.store
    proto = default_buffer_prototype()

    def marker(idx):
        return "embed_done/" + ".".join(map(str, idx))

    # the windows of this rank's dp group that no earlier run finished: one listing of the markers (one LIST on S3,
    # not a request per window). The ranks of a cp group list before any of them can write a marker (a marker
    # follows a ring step that needs them all), so they agree on the list.
    async def listed():
        return {k async for k in store.list_prefix("embed_done/")}
    done = sync(listed())
    left = sum(marker(x[0]) not in done for x in wins)  # the survey's windows still to do, every group's
    todo = [x for x in wins if x[0][0] % dp == dp_rank and marker(x[0]) not in done]
    mine = len(todo)
    if a.stop_after:
        todo = todo[:a.stop_after]
    slab = w[0] // cp  # this rank's inline tokens of each window
    L_loc = slab * w[1] * w[2]
    batch = a.batch or max(1, BATCH_TOKENS // L_loc)
    # progress (infra/progress.py, rank 0 shows it) in the whole survey's windows, those of an earlier run counted
    # as done: rank 0 sees only its own group's, and stands for the others (the groups take rows in turn, so each
    # has about as many to do: rank 0's fraction of its own is the survey's), with no collective to wait on
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
                    feats[s + lo[0]:s + hi[0], box[1][0]:box[1][1], box[2][0]:box[2][1]] = \
                        zb[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].astype(a.dtype)
            n_tok += len(part) * L_loc
            if cp > 1:
                dist.barrier(group=cp_group)  # every slab of these windows written before they are marked
            if cp_rank == 0:
                for idx, _, _ in part:
                    sync(store.set(marker(idx), proto.buffer.from_bytes(b"1")))
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
        pic = a.picture or (a.out.rstrip("/") + ".png" if "://" not in a.out
                            else os.path.basename(a.out.rstrip("/")) + ".png")  # s3:// out: the picture stays here
        pca_picture(feats, pic, f"{a.store}: encoder features, first 3 principal components")
        print(json.dumps({"windows": len(wins), "grid": list(grid), "features": D, "out": a.out, "picture": pic,
                          "batch": batch, "tokens_per_s": round(rate.item(), 1)}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))
