"""
Encoder features of a whole survey: every token of the volume through the pretrained encoder, written as a Zarr
v3 store on the token grid, with the survey's coordinates at the token centres.

    python embed.py MODEL STORE --out=FEATURES.zarr                       one process
    torchrun --nproc_per_node=8 embed.py MODEL STORE --out=s3://b/f.zarr --cp=2 --stride=(128,128,256)

MODEL: a model file (export.py) or a run's out_dir (its newest checkpoint, exported once by rank 0). STORE: an
MDIO v1/v0 store or a 3D Zarr array, local or s3:// (reader.py reads it, normalised with the store's statistics,
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
import itertools
import json
import math
import os
import sys
import time

import numpy as np
import torch

import checkpoint
import configurator
import export
import reader


BATCH_TOKENS = 16384  # tokens per rank per forward when --batch is not given: small windows batched, big ones alone


def window_origins(T, w, stride):
    """Window origins (in tokens) along an axis of T tokens for windows of w tokens: 0, stride, ..., and T - w last."""
    if w > T:
        raise configurator.ConfigError(f"a window of {w} tokens does not fit an axis of {T}: use a smaller --crop")
    o = list(range(0, T - w + 1, stride))
    return o if o[-1] == T - w else o + [T - w]


def owned(T, origins, w):
    """For each window along an axis, the token range [lo, hi) it owns: every token goes to the window whose centre
    is nearest to the token's centre (ties: the first window)."""
    centres = np.asarray(origins) + w / 2
    owner = np.argmin(np.abs((np.arange(T) + 0.5)[:, None] - centres[None, :]), axis=1)
    return [(int(np.argmax(owner == i)), int(T - np.argmax(owner[::-1] == i))) if (owner == i).any() else (0, 0)
            for i in range(len(origins))]


def plan_windows(grid, w, stride):
    """[(index (a, b, c), origin in tokens, owned box ((lo, hi) per axis))] over the token grid, owned boxes tiling
    it; windows that own nothing (a stride smaller than needed) are left out."""
    per_axis = [window_origins(T, w_, s) for T, w_, s in zip(grid, w, stride)]
    own = [owned(T, o, w_) for T, o, w_ in zip(grid, per_axis, w)]
    out = []
    for idx in itertools.product(*(range(len(o)) for o in per_axis)):
        box = tuple(own[k][i] for k, i in enumerate(idx))
        if all(hi > lo for lo, hi in box):
            out.append((idx, tuple(per_axis[k][i] for k, i in enumerate(idx)), box))
    return out


def encode(model, x, offset=0):
    """x (B, 1, Z, Y, X) normalised voxels (B windows, or under cp this rank's slab of each) -> (B, Z/pz, Y/py,
    X/px, D) fp32 features: every token visible, no cls token; offset: the slab's first token in its window (cp
    rank x tokens)."""
    from model import patchify
    with torch.no_grad():
        p = patchify(x, model.patch)  # (B, L_loc, P)
        ids = torch.arange(p.shape[1], device=x.device)[None].expand(p.shape[0], -1)
        z = model.forward_encoder(p, ids, offset=offset, has_cls=False)  # (B, L_loc, D)
    return z.float().cpu().numpy().reshape(x.shape[0], *(n // q for n, q in zip(x.shape[2:], model.patch)), -1)


def prepare(model, crop, cp=1):
    """The encoder for windows of `crop` voxels (its positions follow the window's token grid)."""
    w = tuple(c // p for c, p in zip(crop, model.patch))
    model.grid, model.L = w, math.prod(w)  # positions are sin-cos of grid coordinates: any window size works
    model.mask_strata = cp  # (nothing is masked here; set_context_parallel only asks that strata split over cp)
    return w


def features_of(model, vol, crop, stride):
    """The features of a whole normalised volume (numpy, (I, X, T) voxels) in this one process: (I/pz, X/py, T/px,
    D), each token from the window in which it is most central (what embed.py writes, without a store)."""
    patch = model.patch
    w = prepare(model, crop)
    grid = tuple(s // p for s, p in zip(vol.shape, patch))
    out = None
    for _, org, box in plan_windows(grid, w, tuple(s // p for s, p in zip(stride, patch))):
        v0 = tuple(o * p for o, p in zip(org, patch))
        x = torch.from_numpy(np.ascontiguousarray(vol[tuple(slice(a, a + c) for a, c in zip(v0, crop))]))[None, None]
        z = encode(model, x.float())[0]
        if out is None:
            out = np.zeros(grid + (z.shape[-1],), dtype=np.float32)
        out[tuple(slice(lo, hi) for lo, hi in box)] = z[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, org))]
    return out


def token_coords(vol, grid, patch, opts):
    """The store's coordinate arrays (MDIO: inline, crossline, time) at the token centres, linearly interpolated
    at voxel index k * patch + (patch - 1) / 2; voxel indices where the store has none."""
    names = ("inline", "crossline", "time")
    try:
        node = reader.open_node(vol.url, opts)
        axes = [np.asarray(node[n][:], dtype=np.float64) if hasattr(node, "__contains__") and n in node else None
                for n in names]
    except Exception:
        axes = [None] * 3
    out = {}
    for n, a, T, p, S in zip(names, axes, grid, patch, vol.shape):
        centre = np.arange(T) * p + (p - 1) / 2
        out[n] = np.interp(centre, np.arange(S), a) if a is not None and len(a) == S else centre
    return out


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
    ap = argparse.ArgumentParser(prog="embed.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model file (export.py) or a run's out_dir")
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


def triple(text, what):
    import ast
    v = tuple(ast.literal_eval(text)) if text else None
    if v is not None and (len(v) != 3 or not all(isinstance(x, int) and x > 0 for x in v)):
        raise configurator.ConfigError(f"--{what} must be three positive integers like (64,64,128), got {text!r}")
    return v


def main(argv):
    a = parse(argv)
    import torch.distributed as dist
    import train
    train.dist_env()
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    cp = a.cp
    if cp < 1 or world % cp:
        raise configurator.ConfigError(f"--cp={cp} must divide the world size {world}")
    dp, dp_rank, cp_rank = world // cp, rank // cp, rank % cp
    cp_group = None
    for i in range(dp):  # (every rank makes every group, in the same order)
        g = dist.new_group(list(range(i * cp, (i + 1) * cp))) if cp > 1 else None
        if i == dp_rank:
            cp_group = g
    # ---- the encoder
    path = a.model
    if os.path.isdir(path):  # a run's out_dir: its newest checkpoint as one model file, by rank 0
        path = checkpoint.on_rank_0(lambda: export.export(a.model))
    model, meta = export.load(path, map_location="cpu")
    cfg = meta["config"]
    patch = tuple(cfg["patch"])
    crop = triple(a.crop, "crop") or tuple(cfg["crop"])
    stride = triple(a.stride, "stride") or tuple(max(p, c // 2 // p * p) for c, p in zip(crop, patch))
    if any(c % p or s % p for c, s, p in zip(crop, stride, patch)):
        raise configurator.ConfigError(f"--crop {crop} and --stride {stride} must be multiples of the patch {patch}")
    w = tuple(c // p for c, p in zip(crop, patch))  # window in tokens
    if w[0] % cp:
        raise configurator.ConfigError(f"the window's {w[0]} inline tokens do not split over --cp={cp}")
    prepare(model, crop, cp)
    model.to(device).eval()
    model.set_context_parallel(cp_group, "ring")
    # ---- the survey and the plan
    opts = reader.ReadOptions(anon=a.s3_anon, endpoint_url=a.s3_endpoint or None)
    vol = reader.Volume(a.store, opts)
    grid = tuple(s // p for s, p in zip(vol.shape, patch))
    wins = plan_windows(grid, w, tuple(s // p for s, p in zip(stride, patch)))
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
                               "description": "MAE encoder features (every token visible, no cls), embed.py"})
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
    todo = [x for x in wins if x[0][0] % dp == dp_rank and marker(x[0]) not in done]
    if a.stop_after:
        todo = todo[:a.stop_after]
    slab = w[0] // cp  # this rank's inline tokens of each window
    L_loc = slab * w[1] * w[2]
    batch = a.batch or max(1, BATCH_TOKENS // L_loc)
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


def cli(argv):
    try:
        return main(argv)
    except (configurator.ConfigError, reader.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
