"""
Encoder features of a volume: the windows that tile a survey's token grid, which window owns which tokens, and
the encoder's forward on every token of a window (no mask). scripts/embed.py writes a whole survey with them;
scripts/probe.py and bench/step.py (embed) use them in memory.

    plan_windows(grid, w, stride)     -> [(index, origin, owned box)] in tokens: the boxes tile the grid
    prepare(model, crop, cp)          the MAE set up for windows of `crop` (every token visible)
    encode(model, x, offset)          (B, 1, Z, Y, X) voxels -> (B, tokens, D) features
    features_of(model, vol, crop, stride)   a whole in-memory volume -> (gz, gy, gx, D) features
    window_model(path, checkpoint, crop, cp, cp_group, device)   embed's and predict's model, set up on the ranks
"""
import itertools
import math

import numpy as np
import torch

import configurator
from infra import reader
from model import token_grid

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
    w = token_grid(crop, model.patch)
    model.grid, model.L = w, math.prod(w)  # positions are sin-cos of grid coordinates: any window size works
    return w


def window_model(path, checkpoint, crop, cp, cp_group, device):
    """The model of a command that runs windows on dp x cp ranks (embed, predict): a model file, or a run's out_dir
    whose `checkpoint` (the one the command checked: a run may write newer ones) rank 0 exports once; set up for
    windows of `crop` split over the cp group, on `device`, in eval mode."""
    import os

    from infra import distributed, modelfile
    if os.path.isdir(path):
        tag = os.path.basename(checkpoint)
        path = distributed.on_rank_0(lambda: modelfile.export(path, tag=tag))
    model, _ = modelfile.load(path, map_location="cpu")
    prepare(model, crop, cp)
    model.to(device).eval()
    model.set_context_parallel(cp_group)
    return model


def features_of(model, vol, crop, stride):
    """The features of a whole normalised volume (numpy, (I, X, T) voxels) in this one process: (I/pz, X/py, T/px,
    D), each token from the window in which it is most central (what scripts/embed.py writes, without a store)."""
    patch = model.patch
    w = prepare(model, crop)
    grid = token_grid(vol.shape, patch)
    out = None
    for _, org, box in plan_windows(grid, w, token_grid(stride, patch)):
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
