"""
A fine-tuned segmenter over a whole survey: the probability of each class at every voxel, written as a Zarr store
beside the survey (or as a new variable of an MDIO store of yours), chunked as the survey is.

    python -m scripts.predict MODEL SURVEY --out=FAULTS.zarr                          one process
    python -m scripts.predict MODEL SURVEY --out=SURVEY.mdio --variable=fault_probability   into an MDIO store
    torchrun --nproc_per_node=8 -m scripts.predict MODEL s3://b/survey.mdio --out=s3://b/faults.zarr --cp=2
    NODES=16 bash launch.sh -m scripts.predict MODEL s3://b/survey.mdio --out=s3://b/faults.zarr --cp=2  on SLURM

MODEL: a fine-tuned model file (scripts/export.py) or a fine-tuning run's out_dir (task="segment"). SURVEY: any store
infra/reader.py opens (MDIO v1/v0 or a 3D Zarr array, local or s3://), normalised as training saw it.

How (infra/sliding.py has the math). Windows of the model's crop (--crop to change it) overlap by --overlap of a
window (default 1/2) on a grid of origins per axis, the last shifted to end at the survey's edge; each window's
class probabilities are weighted by --blend (gaussian, sigma --sigma of the window; cosine; constant) and the
weighted sums divided by the summed weights, so no seam shows where windows meet. Along an axis shorter than the
window, one window padded with zeros. The sums are kept per output tile (--tile voxels, whole output chunks; by
default as many windows per axis as fit TILE_VOXELS), not for the survey: memory is a tile and a batch of windows
per rank whatever the survey's size, and a window that overlaps two tiles is computed for each (the JSON line says
how many windows were computed per window of the survey).

Dead traces: a trace the store's trace mask calls dead, or whose amplitudes in a tile are all zero (or NaN), is
predicted as no class (every stored probability 0), and `dead_traces` marks the traces dead over the whole survey.

    probability   (inline, crossline, time) of class 1 (binary) or (class, inline, crossline, time), chunks of the
                  survey's chunk shape; uint8 (p = value / 255: the attribute scale_factor), float16 or float32
                  (--dtype)
    dead_traces   (inline, crossline) uint8, 1 where the trace is dead
    inline, crossline, time   the store's coordinates (voxel indices where it has none)
With --variable=NAME the arrays are NAME and NAME_dead_traces inside the MDIO v1 store at --out (the survey itself, or
another of the same grid), on the amplitude's dimensions; nothing else of the store is touched.

Ranks: world = dp x cp. Tile t goes to dp group t mod dp; with cp > 1 each window is split over the group's ranks
along inline and goes through the encoder with ring attention and the head with its halo exchange, as in training;
the group's sums are added (all-reduce) and its first rank writes the tile. Resume: a tile written is marked
(predict_done/I.J.K); the same command again skips the marked tiles. A stop signal (SIGTERM, SIGUSR1: SLURM's
time-limit warning) or a Ctrl-C stops the ranks after their current round of tiles, agreed as training agrees on a
step (infra/stop.py): the last line says how many tiles are written, and the exit code is 75 (130 after a Ctrl-C).
What it writes over (infra/outputs.py, all checked before any work): a local --out is built at OUT.partial and
renamed when complete; on s3:// and in an MDIO store it is written in place, the record (attribute `predict`: survey,
model, windows, blending, tile, dtype) saying `"complete": false` until then. Another model, survey or setting is
refused unless --overwrite; anything predict did not write (the amplitude, your labels, a folder) is never written
over: with --variable=NAME, each name it would create beside NAME (NAME_dead_traces, NAME_zero_traces,
NAME_predict_done/) must be free or its own (tagged predict_of), and clean-up removes only those. No output goes
inside a training run's ckpt/ (its rotation deletes what is there), nor --picture at --out. One predict per output:
rank 0 holds OUT.lease (OUT.NAME.lease with --variable; infra/lease.py) while it runs, so a second one is refused,
naming the first. A write the file system refuses (no space, read-only) is one line, exit code 4, the tiles
written so far kept. Rank 0 draws the amplitude with the prediction on the central inline, crossline and time slice (OUT.png, or
--picture).
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import configurator
from infra import cli, distributed, lease, modelfile, outputs, reader, sliding
from infra.features import BATCH_TOKENS, token_coords, window_model
from infra.progress import Progress
from infra.stop import INTERRUPTED, RESUMABLE, StopRequest, launched, write_stopped
from model import token_grid, unpatchify

TILE_VOXELS = 2 ** 27  # the default tile's bound (voxels): its sums are 4 bytes per voxel and class, on the device
BATCH_VOXELS = 2 ** 22  # and the default batch's: the UNETR head holds seg_features (16) channels per voxel, and more


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m scripts.predict", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a fine-tuned model file (scripts/export.py) or a fine-tuning run's out_dir")
    ap.add_argument("survey", help="MDIO v1/v0 store or 3D Zarr array, local or s3://")
    ap.add_argument("--out", required=True, help="the prediction's Zarr store (local or s3://), or with --variable "
                    "an MDIO v1 store of yours to add it to")
    ap.add_argument("--variable", default="", help="write into the MDIO store at --out as this new variable")
    ap.add_argument("--crop", default=None, help="window in voxels, e.g. (64,64,128) (default: the model's crop)")
    ap.add_argument("--overlap", type=float, default=0.5, help="fraction of a window its neighbour overlaps, [0, 1)")
    ap.add_argument("--blend", default="gaussian", choices=sliding.BLENDS, help="the windows' weights")
    ap.add_argument("--sigma", type=float, default=0.125, help="gaussian blending: sigma as a fraction of the window")
    ap.add_argument("--tile", default=None, help="output tile in voxels, whole output chunks (default: up to "
                    f"{TILE_VOXELS:,} voxels)")
    ap.add_argument("--dtype", default="uint8", choices=("uint8", "float16", "float32"),
                    help="of the stored probabilities (uint8: p = value / 255)")
    ap.add_argument("--bf16", action="store_true", help="the forward in bf16 autocast (on a GPU, as training runs); "
                    "the blending and the sums stay fp32")
    ap.add_argument("--cp", type=int, default=1, help="ranks per window (ring attention), as in training")
    ap.add_argument("--batch", type=int, default=0,
                    help=f"windows per forward pass (default: as many as hold {BATCH_TOKENS:,} tokens and "
                         f"{BATCH_VOXELS:,} voxels per rank, at least 1)")
    ap.add_argument("--picture", default="", help="the figure (default: OUT.png beside a local OUT, "
                    "OUT.VARIABLE.png with --variable; NAME.png in the current folder for an s3:// OUT)")
    ap.add_argument("--score", default="", help="a label variable of the survey (e.g. fault): the prediction's IoU and "
                    "Dice against it in the JSON line")
    ap.add_argument("--threshold", type=float, default=0.5, help="binary --score: a voxel is called a fault where "
                    "its probability exceeds this. A model trained with pos_weight w (train.py: 10) leans to faults: "
                    "its p > 0.5 where the true odds exceed 1/w, p > w/(1+w) where they exceed 1. Choose it on "
                    "labels fine-tuning held out (--score_inlines); the same command again re-scores a finished "
                    "prediction at another threshold without predicting again")
    ap.add_argument("--score_inlines", default="", help="LO:HI, the inline indices scored (default: all), e.g. the "
                    "inlines fine-tuning held out")
    cli.add_read_arguments(ap)
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a prediction this command made with another model, survey or settings")
    ap.add_argument("--stop_after", type=int, default=0, help=argparse.SUPPRESS)  # tests: stop after N tiles
    ap.add_argument("--slow_tile", type=float, default=0, help=argparse.SUPPRESS)  # tests: seconds more per tile
    return ap.parse_args(argv)


class Names:
    """Where the arrays live in the output group: a store of its own, or variables of an MDIO store (--variable).
    Every name predict creates is here: in a store of the user's each is checked before any work (claim)."""

    def __init__(self, variable):
        v = variable
        self.prob, self.dead = (v, f"{v}_dead_traces") if v else ("probability", "dead_traces")
        self.zero = f"{v}_zero_traces" if v else "zero_traces"  # per time tile: the traces all zero in it
        self.done = f"{v}_predict_done/" if v else "predict_done/"  # one small object per tile written
        self.variable = v

    def beside(self):
        """The names created beside the probability array (the arrays and the markers' prefix)."""
        return [self.dead, self.zero, self.done.rstrip("/")]


MINE = {"made_by": "scripts.predict"}  # the attribute "predict_of" of each array predict creates beside the variable


def main(argv, stop=None):
    """The command; `stop`: a StopRequest (a stop signal or a Ctrl-C ends the run after the ranks' current tiles,
    which are kept: RESUMABLE, or INTERRUPTED after a Ctrl-C; a second Ctrl-C stops at once). Rank 0 holds the
    output's lease (infra/lease.py) from before it looks at the output until the command ends, however it ends."""
    held = []  # rank 0's lease on the output, once claim() has taken it
    try:
        return predict(argv, stop, held)
    finally:
        for h in held:
            h.release()


def predict(argv, stop, held):
    a = parse(argv)
    rank, world, device = distributed.init()  # torchrun's ranks, or a world of 1
    cp = a.cp
    configurator.need(0 <= a.overlap < 1, f"--overlap={a.overlap}: the fraction of a window its neighbour overlaps, in [0, 1)")
    configurator.need(a.sigma > 0, f"--sigma={a.sigma}: the gaussian's width as a fraction of the window, > 0 (0.125: MONAI's)")
    configurator.need(a.batch >= 0, f"--batch={a.batch}: windows per forward pass, >= 1 (0: as many as fit {BATCH_TOKENS:,} "
                           f"tokens)")
    if cp < 1 or world % cp:
        raise configurator.ConfigError(f"--cp={cp} must divide the world size {world}")
    cp_rank, dp_rank, dp, cp_group = distributed.cp_groups(cp)
    # ---- what would be written, checked against what is there before any work
    cfg = modelfile.init_source(a.model, "MODEL")[0]  # (the model's config, cheaply: no weight is read)
    if cfg["task"] != "segment":
        raise configurator.ConfigError(f"{a.model} is a pretrained MAE (task={cfg['task']!r}), not a "
                                       f"segmenter: predict needs a fine-tuned model (train.py task='segment', "
                                       f"init_from=it), or its out_dir")
    patch = tuple(cfg["patch"])
    crop = cli.triple(a.crop, "crop") or tuple(cfg["crop"])
    if any(c % p for c, p in zip(crop, patch)):
        raise configurator.ConfigError(f"--crop {crop} must be a multiple of the model's patch {patch}")
    if token_grid(crop, patch)[0] % cp:
        raise configurator.ConfigError(f"the window's {crop[0] // patch[0]} inline tokens do not split over --cp={cp}")
    opts = cli.read_options(a)
    if not outputs.is_remote(a.survey) and not os.path.exists(outputs.local(a.survey)):
        raise configurator.ConfigError(f"SURVEY={a.survey!r} does not exist: give an MDIO or Zarr store (a local path "
                                       f"or an s3:// URL)")
    vol = reader.Volume(a.survey, opts)
    shape = vol.shape
    chunks = tuple(min(c, s) for c, s in zip(vol.chunks, shape))
    stride = tuple(max(1, round(c * (1 - a.overlap))) for c in crop)
    starts = [sliding.window_starts(S, c, s) for S, c, s in zip(shape, crop, stride)]
    tile = cli.triple(a.tile, "tile") or sliding.default_tile(shape, crop, chunks, TILE_VOXELS)
    if any(t % c for t, c in zip(tile, chunks)):
        raise configurator.ConfigError(f"--tile={a.tile}: each axis a multiple of the output's chunks {chunks} (the "
                                       f"survey's), so that no two tiles write one chunk")
    classes = int(cfg["classes"])
    labels = vol.variable(a.score, "--score") if a.score else None  # (a missing or unfit variable: its error, before any work)
    try:
        inl = tuple(int(x) for x in a.score_inlines.split(":")) if a.score_inlines else (0, shape[0])
        assert len(inl) == 2 and 0 <= inl[0] < inl[1] <= shape[0]
    except (ValueError, AssertionError):
        raise configurator.ConfigError(f"--score_inlines={a.score_inlines!r}: LO:HI with 0 <= LO < HI <= "
                                       f"{shape[0]} (the survey's inlines)") from None
    if not 0 <= a.threshold < 1:
        raise configurator.ConfigError(f"--threshold={a.threshold}: a probability in [0, 1), e.g. 0.5 (the default)")
    names = Names(a.variable)
    source = a.survey if outputs.is_remote(a.survey) else os.path.abspath(a.survey)
    settings = {"made_by": "scripts.predict", "source": source, "model": modelfile.identity(a.model),
                "crop": list(crop), "overlap": a.overlap, "stride": list(stride), "blend": a.blend,
                "sigma": a.sigma if a.blend == "gaussian" else None, "tile": list(tile), "shape": list(shape),
                "chunks": list(chunks), "classes": classes, "dtype": a.dtype, "bf16": a.bf16}
    so = reader.storage_options(a.out, opts) if outputs.is_remote(a.out) else None
    pic = a.picture or (os.path.basename(a.out.rstrip("/")) + ".png" if outputs.is_remote(a.out) else
                        a.out.rstrip("/") + (f".{a.variable}.png" if a.variable else ".png"))
    work = distributed.on_rank_0(lambda: claim(a, names, settings, pic, vol, so, opts, held))
    all_tiles = sliding.tiles(shape, tile)
    n_windows = math.prod(len(s) for s in starts)
    extra = round(sliding.recompute(shape, crop, starts, tile), 3)
    if work is None:  # its own prediction, complete, with these settings: nothing to do
        if rank == 0:
            print(f"{a.out} already holds this prediction, complete (the same survey, model and settings): nothing "
                  f"to do (--overwrite does not redo it; remove it to)", file=sys.stderr)
            scored = score(a.out, so, names.prob, labels, inl, classes, chunks, a.threshold) \
                if labels is not None else {}
            if outputs.figure_target(pic, settings, option="--picture", made_by="scripts.predict") == "new":
                draw(a, vol, names, classes, so, pic, settings)  # (its first run could not write it)
            print(json.dumps({**scored, "tiles": len(all_tiles), "windows": n_windows, "out": a.out, "picture": pic,
                              "already_complete": True}))
        dist.destroy_process_group()
        return 0
    # ---- the segmenter
    model = window_model(a.model, settings["model"]["checkpoint"], crop, cp, cp_group, device)
    import zarr
    root = zarr.open_group(work, mode="r+", storage_options=so)
    # the tiles written before (the ranks of a cp group list before any of them can mark one: that follows the
    # all-reduce of its sums)
    done = outputs.Markers(root.store, names.done)
    index = [tuple(lo // t for (lo, _), t in zip(box, tile)) for box in all_tiles]
    left = [k for k in range(len(all_tiles)) if index[k] not in done]
    todo = [k for k in left if k % dp == dp_rank]
    if a.stop_after:
        todo = todo[:a.stop_after]
    # every rank goes through as many rounds as the rank with the most tiles, so that they can agree on a stop after
    # each round (a rank with fewer tiles has nothing to compute in the last)
    rounds = torch.tensor([len(todo)], device=device)
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
    rounds, stopped, written = int(rounds.item()), "", 0
    slab = crop[0] // cp  # this rank's inline voxels of each window
    g_loc = (slab // patch[0],) + token_grid(crop, patch)[1:]
    batch = a.batch or max(1, min(BATCH_TOKENS // math.prod(g_loc), BATCH_VOXELS // (slab * crop[1] * crop[2])))
    w1 = [sliding.axis_weights(c, a.blend, a.sigma) for c in crop]
    norm = [sliding.normaliser(S, s, w) for S, s, w in zip(shape, starts, w1)]
    w3 = torch.from_numpy(np.einsum("i,j,k->ijk", w1[0][cp_rank * slab:(cp_rank + 1) * slab], w1[1], w1[2])).float()
    w3 = w3.to(device)  # (slab, Y, X): this rank's part of a window's weight
    out_arr, zero_arr = root[names.prob], root[names.zero]
    t0, voxels, computed = time.time(), 0, 0
    kept = (f"the tiles written before it are kept in {work}: free space (or make it writable) and run the same "
            f"command again to go on from them")
    with Progress(total=len(all_tiles), initial=len(all_tiles) - len(left), desc="predicting", unit="tile") as bar:
        counted = 0
        if stop:
            stop.armed = True  # from here a stop signal ends the run after the current tile (infra/stop.py)
        for n in range(rounds):
            if n > 0 and stop and stop.agree_now(device):  # (a stop signal reached a rank during the last round)
                stopped = stop.signals(world)
                break
            if n >= len(todo):
                continue
            k = todo[n]
            time.sleep(a.slow_tile)
            box = all_tiles[k]
            wins = [(i, j, m) for i in sliding.touching(starts[0], crop[0], *box[0])
                    for j in sliding.touching(starts[1], crop[1], *box[1])
                    for m in sliding.touching(starts[2], crop[2], *box[2])]
            acc = torch.zeros((model.seg_out,) + tuple(hi - lo for lo, hi in box), device=device)
            for b in range(0, len(wins), batch):
                part = wins[b:b + batch]
                orgs = [(o[0] + cp_rank * slab,) + o[1:] for o in part]  # this rank's slab of each window
                p = window_probabilities(model, vol, orgs, (slab,) + crop[1:], g_loc, device, a.bf16)  # (B, C', ..)
                for o, q in zip(orgs, p * w3):
                    lo = [max(x, l_) for x, (l_, _) in zip(o, box)]
                    hi = [min(x + c, h_) for x, c, (_, h_) in zip(o, (slab,) + crop[1:], box)]
                    if all(h > l_ for l_, h in zip(lo, hi)):
                        acc[(slice(None),) + tuple(slice(l_ - bl, h - bl) for l_, h, (bl, _) in zip(lo, hi, box))] += \
                            q[(slice(None),) + tuple(slice(l_ - x, h - x) for l_, h, x in zip(lo, hi, o))]
            computed += len(wins)
            if cp > 1:
                dist.all_reduce(acc, group=cp_group)  # every slab's share of the tile's sums
            if cp_rank == 0:
                with outputs.writes(f"tile {k} {box} of the prediction", kept):
                    write_tile(acc, box, norm, vol, out_arr, zero_arr, tile, a.dtype, classes)
                    done.mark(index[k])
                voxels += math.prod(hi - lo for lo, hi in box)
                written += 1
            now = round((n + 1) / len(todo) * len(left)) if todo else 0
            bar.update(now - counted)
            counted = now
            if held and n:  # rank 0's lease: still ours (else LeaseLost, before the next tile is written)
                held[0].refresh()
            elif held:  # ... and, after the first tile, how often it is refreshed (for a command on another host)
                held[0].expect(time.time() - t0)
    if a.stop_after:
        print(f"rank {rank}: stopped after {len(todo)} tiles (--stop_after)", flush=True)
        dist.destroy_process_group()
        return RESUMABLE
    if stopped:
        return stopped_at(stop, stopped, written, (root.store, names.done), len(all_tiles), work, device)
    counts = torch.tensor([voxels, computed if cp_rank == 0 else 0], dtype=torch.float64, device=device)
    dist.all_reduce(counts)  # (NCCL: CUDA tensors only)
    dist.barrier()
    dt = time.time() - t0
    if rank == 0:
        with outputs.writes("the prediction's last pieces (dead_traces, its record)", f"every tile is written in "
                            f"{work}: free space (or make it writable) and run the same command again to finish"):
            finish(a, names, work, settings, so, vol)
        draw(a, vol, names, classes, so, pic, settings)
        scored = score(a.out, so, names.prob, labels, inl, classes, chunks, a.threshold) \
            if labels is not None else {}
        print(json.dumps({**scored, "tiles": len(all_tiles), "windows": n_windows, "windows_computed": int(counts[1]),
                          "recompute": extra, "tile": list(tile), "stride": list(stride), "batch": batch,
                          "voxels": int(counts[0]), "seconds": round(dt, 3),
                          "voxels_per_s": round(counts[0].item() / max(dt, 1e-9), 1), "out": a.out, "picture": pic}))
    dist.destroy_process_group()
    return 0


def draw(a, vol, names, classes, so, pic, settings):
    """Rank 0: the figure of the finished prediction at --picture."""
    from zarr import open_group
    fig = picture(vol, open_group(a.out, mode="r", storage_options=so), names, classes,
                  f"{a.survey}: {'class' if classes > 2 else 'fault'} probability, {os.path.basename(a.model)}")
    with outputs.writes(f"the picture {pic}", f"the prediction is complete at {a.out}: make room (or give --picture "
                        f"a writable path) and run the same command again to draw it"):
        outputs.save_figure(fig, pic, settings)


def stopped_at(stop, signals, written, marks, n_tiles, work, device):
    """The ranks agreed to stop after a round of tiles (`signals` reached them; this rank wrote `written`): how many
    tiles are now written in all (the markers, `marks` = (store, prefix), listed again), one line saying so (rank 0:
    stderr, and under launch.sh its MAE_STOPPED file, the line launch.sh repeats last), and the exit code, RESUMABLE
    or INTERRUPTED (a Ctrl-C's)."""
    done = torch.tensor([written], device=device)
    dist.all_reduce(done)  # (every tile is written before its marker, and markers before this)
    code = INTERRUPTED if "SIGINT" in signals else RESUMABLE
    n = len(outputs.Markers(*marks).done)  # this run's tiles and earlier runs'
    msg = (f"stopped by {signals} after {int(done.item())} tiles of this run: {n} of {n_tiles} tiles are written in "
           f"{work}; run the same command again to go on from them (exit code {code}: "
           f"{'interrupted by Ctrl-C' if code == INTERRUPTED else 'stopped'}, resumable)")
    if dist.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)
        if os.environ.get("MAE_STOPPED"):
            write_stopped(os.environ["MAE_STOPPED"], msg)
    dist.barrier()  # no rank (no node's launch.sh) ends before the line is written
    stop.finished()
    dist.destroy_process_group()
    return code


def window_probabilities(model, vol, origins, size, g_loc, device, bf16=False):
    """The class probabilities of windows (this rank's slab of each): origins [(i, x, t)] of `size` voxels, read from
    the survey where they lie inside it and zeros beyond (an axis shorter than the window) -> (B, C', *size) fp32,
    C' = 1 (binary: the probability of class 1) or the classes (softmax)."""
    crops = [(o, tuple(max(0, min(n, S - x)) for x, n, S in zip(o, size, vol.shape))) for o in origins]
    read = reader.read_crops([(vol, o, s) for o, s in crops if min(s) > 0])
    x = np.zeros((len(origins), 1) + tuple(size), dtype=np.float32)
    it = iter(read)
    for b, (_, s) in enumerate(crops):
        if min(s) > 0:
            x[b, 0, :s[0], :s[1], :s[2]] = next(it)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model.seg_logits(torch.from_numpy(x).to(device)).float()  # (B, L_loc, P, C')
        p = torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, -1)
        return torch.cat([unpatchify(p[..., c].float(), model.patch, g_loc) for c in range(p.shape[-1])], 1)


def write_tile(acc, box, norm, vol, out_arr, zero_arr, tile, dtype, classes):
    """The tile's blended probabilities (sums / the product of the three 1D weight sums), no class where its traces
    are dead, into the output (whole chunks: the tile is a box of them); its traces that are all zero (or NaN) in
    it into zero_arr's row of its time tile."""
    sl = tuple(slice(lo, hi) for lo, hi in box)
    p = acc.cpu().numpy()  # (C', I_t, X_t, T_t) fp32, divided in place by N0(i) N1(x) N2(t): no tile of weights
    for axis, (w, s) in enumerate(zip(norm, sl)):
        p /= w[s].astype(np.float32).reshape([-1 if k == axis + 1 else 1 for k in range(4)])
    raw = vol.read(tuple(lo for lo, _ in box), tuple(hi - lo for lo, hi in box), normalize=False)
    zero = np.all((raw == 0) | np.isnan(raw), axis=2)  # (I_t, X_t)
    dead = zero if vol.trace_mask is None else zero | ~vol.trace_mask[sl[0], sl[1]]
    p[:, dead] = 0
    q = np.round(p * 255).astype(np.uint8) if dtype == "uint8" else p.astype(dtype)
    out_arr[sl if classes == 2 else (slice(None),) + sl] = q[0] if classes == 2 else q
    zero_arr[box[2][0] // tile[2], sl[0], sl[1]] = zero.astype(np.uint8)


def score(out, so, name, labels, inl, classes, chunks, threshold=0.5):
    """IoU and Dice of the prediction stored at out/name (binary: probability > threshold; else the likeliest class)
    against the label variable over inlines [inl[0], inl[1]), read a chunk's inlines at a time: {"iou": .., "dice": ..}
    of class 1 (and the threshold), or per class for more classes. Dead traces count as predicted no class."""
    import zarr
    prob = zarr.open_group(out, mode="r", storage_options=so)[name]
    C = 2 if classes == 2 else classes
    tp, fp, fn = np.zeros(C), np.zeros(C), np.zeros(C)
    for lo in range(inl[0], inl[1], chunks[0]):
        hi = min(lo + chunks[0], inl[1])
        y = labels.read((lo, 0, 0), (hi - lo,) + labels.shape[1:], normalize=False).astype(np.int64)
        p = np.asarray(prob[lo:hi] if classes == 2 else prob[:, lo:hi], dtype=np.float32)
        p = p * (1 / 255 if prob.dtype == np.uint8 else 1.0)
        if classes == 2:
            pred = (p > threshold).astype(np.int64)
        else:
            pred = np.where(p.max(0) > 0, p.argmax(0), -1)  # (dead traces: no class)
        for c in range(C):
            tp[c] += ((pred == c) & (y == c)).sum()
            fp[c] += ((pred == c) & (y != c)).sum()
            fn[c] += ((pred != c) & (y == c)).sum()
    iou, dice = tp / np.maximum(1, tp + fp + fn), 2 * tp / np.maximum(1, 2 * tp + fp + fn)
    if classes == 2:
        return {"iou": round(float(iou[1]), 4), "dice": round(float(dice[1]), 4), "threshold": threshold,
                "scored_inlines": list(inl)}
    return {"iou": [round(float(v), 4) for v in iou], "dice": [round(float(v), 4) for v in dice],
            "scored_inlines": list(inl)}


def recorded(path, names, so):
    """What is at --out: None (nothing, or an empty folder), predict's record of it (its settings and whether it is
    complete), or outputs.Foreign. With --variable: what the variable holds (None when the store has no such
    variable); a store that is not MDIO v1 is an error of its own."""
    import zarr
    if outputs.nothing_at(path, so):
        return None
    try:
        root = zarr.open_group(path, mode="r", storage_options=so)
    except Exception:  # noqa: BLE001 - not a Zarr group: a file, a survey's array, anything
        root = None
    if not names.variable:
        rec = root.attrs.get("predict") if root is not None else None
        return dict(rec) if isinstance(rec, dict) else outputs.Foreign("not a prediction store of scripts.predict")
    if names.prob not in root:
        return None
    rec = root[names.prob].attrs.get("predict")
    return dict(rec) if isinstance(rec, dict) else outputs.Foreign(f"a store whose variable {names.prob!r} predict "
                                                                   f"did not write")


def check_mdio(a, vol, so):
    """--variable: --out must be an MDIO v1 store (a Zarr v3 group with a default variable) of the survey's grid."""
    import zarr
    try:
        root = zarr.open_group(a.out, mode="r", storage_options=so)
        amp = root.attrs.get("attributes", {}).get("defaultVariableName", "amplitude")
        grid = tuple(root[amp].shape)
    except Exception:  # noqa: BLE001 - whatever it is, it is not an MDIO v1 store
        raise configurator.ConfigError(f"--out={a.out!r} with --variable must be an MDIO v1 store (a Zarr v3 group "
                                       f"with its amplitude variable): give one, or drop --variable to write a store "
                                       f"of its own") from None
    if grid != vol.shape:
        raise configurator.ConfigError(f"--out={a.out!r} is on a grid of {grid}, the survey {vol.shape}: a variable "
                                       f"goes into a store of the same grid (the survey's own, usually)")
    if a.variable == amp or not a.variable.isidentifier():
        raise configurator.ConfigError(f"--variable={a.variable!r}: a new name (letters, digits, _), not the "
                                       f"amplitude's {amp!r}")
    return root


def claim(a, names, settings, pic, vol, so, opts, held):
    """Rank 0, before any work: the store to write in, or None when --out already holds this prediction complete.
    Local (no --variable): built at OUT.partial, renamed to OUT when complete. s3:// or --variable: in place, its
    record saying complete: false until then. Another model, survey or setting: refused unless --overwrite (then made
    anew); anything predict did not write is never written over. The output's lease is taken first (appended to
    `held`): a second predict into the same output is refused, naming the first."""
    inputs = [os.path.join(a.model, "ckpt") if os.path.isdir(a.model) else a.model]
    outputs.refuse_inside(a.out, inputs + ([] if a.variable else [a.survey]))  # (a variable may join the survey)
    outputs.refuse_inside(pic, inputs + [a.survey], "--picture")
    outputs.refuse_same(pic, a.out, "--picture", "--out")
    remote = outputs.is_remote(a.out)
    if not remote:
        outputs.check_folder(a.out)
        outputs.refuse_same(pic, a.out.rstrip("/") + ".partial", "--picture", "--out's store being built")
    outputs.check_folder(pic, "--picture")
    if a.variable:
        check_mdio(a, vol, so)
    what = f"--out={a.out}" + (f" --variable={a.variable}" if a.variable else "")
    held += [h for h in [lease.for_output(a.out.rstrip("/") + (f".{a.variable}" if a.variable else ""), what)] if h]
    found = recorded(a.out, names, so)
    if a.variable:
        check_names(a.out, names, so, found)
    how = outputs.target(a.out, f"the variable {names.prob!r}" if a.variable else "a prediction store", found,
                         settings, a.overwrite)
    outputs.figure_target(pic, settings, a.overwrite, "--picture", "scripts.predict")
    if how == "same" and found.get("complete", True):
        return None
    import shutil
    in_place = remote or bool(a.variable)
    work = a.out if in_place else a.out.rstrip("/") + ".partial"
    if in_place and how == "replace":
        remove(a.out, names, so, whole=not a.variable)  # (this command's own output, of other settings)
    if not in_place:
        part = recorded(work, names, so)
        if outputs.target(work, "an interrupted prediction store", part, settings, a.overwrite) == "replace":
            shutil.rmtree(work)
    create(work, names, settings, vol, so, opts)
    return work


def check_names(out, names, so, found):
    """--variable: every name predict would create beside the variable must be free, or predict's own: an array it
    tagged as made for this variable (attribute predict_of), or markers under NAME_predict_done/ while the variable
    is predict's (markers are written only after its record). Anything else of that name is the user's: refused,
    one line naming it, before any work. (found: what recorded() says the variable is.)"""
    import fsspec
    import zarr
    fs, p = fsspec.url_to_fs(out, **(so or {}))
    root = zarr.open_group(out, mode="r", storage_options=so)
    for n in names.beside():
        if not fs.exists(f"{p}/{n}") or ours(root, n, names) or (n == names.done.rstrip("/") and isinstance(found, dict)):
            continue
        raise configurator.ConfigError(f"--out={out!r} already holds {n!r}, which predict did not make: "
                                       f"--variable={names.variable} would write {', '.join(map(repr, names.beside()))} "
                                       f"beside it, and never writes over what is not its own; choose another "
                                       f"--variable")


def ours(root, name, names):
    """Whether root[name] is an array predict created beside the variable names.prob (its predict_of attribute)."""
    try:
        node = root[name]
    except KeyError:
        return False
    return dict(node.attrs.get("predict_of") or {}) == {**MINE, "variable": names.prob}


def remove(out, names, so, whole):
    """predict's own output at `out`: the whole store, or (--variable) its variable and what it made beside it
    (check_names has made sure those are its own)."""
    import fsspec
    fs, p = fsspec.url_to_fs(out, **(so or {}))
    for part in ([p] if whole else [f"{p}/{n}" for n in [names.prob] + names.beside()]):
        if fs.exists(part):
            fs.rm(part, recursive=True)


def create(work, names, settings, vol, so, opts):
    """The output's arrays at `work`, unless there (an interrupted run of the same settings). Those beside the
    variable are tagged as predict's (predict_of) and made before it; its record, last, says they are all there. A
    store of its own carries the record from its first write (its group's metadata), so that one killed while it was
    being made is predict's to go on from, not a store it must refuse."""
    import zarr
    first = {} if names.variable else {"attributes": {"predict": {**settings, "complete": False}}}
    root = zarr.open_group(work, mode="a", zarr_format=3, storage_options=so, **first)
    if names.prob in root and "predict" in root[names.prob].attrs:
        return
    tag = {"predict_of": {**MINE, "variable": names.prob}}
    shape, chunks, C = tuple(settings["shape"]), tuple(settings["chunks"]), settings["classes"]
    dims = list(getattr(vol.arr.metadata, "dimension_names", None) or ("inline", "crossline", "time"))
    n_tt = math.ceil(shape[2] / settings["tile"][2])
    q = settings["dtype"] == "uint8"
    attrs = {"long_name": "fault probability" if C == 2 else "class probability",
             **({"scale_factor": 1 / 255, "add_offset": 0.0} if q else {})}
    if not names.variable:
        coords = token_coords(vol, shape, (1, 1, 1), opts)
        root.attrs.update({"source": settings["source"], "model": settings["model"]["checkpoint"],
                           "description": "class probabilities of scripts/predict.py"})
        for n, d in zip(("inline", "crossline", "time"), dims):
            c = root.create_array(d, shape=(len(coords[n]),), chunks=(len(coords[n]),), dtype="float64",
                                  dimension_names=[d], overwrite=True)  # (a store of its own)
            c[:] = coords[n]
    # (overwrite: only ever predict's own of an interrupted create, which check_names found tagged)
    root.create_array(names.dead, shape=shape[:2], chunks=chunks[:2], dtype="uint8", fill_value=0,
                      dimension_names=dims[:2], attributes=tag, overwrite=True)
    root.create_array(names.zero, shape=(n_tt,) + shape[:2], chunks=(1,) + chunks[:2], dtype="uint8", fill_value=0,
                      attributes=tag, overwrite=True)
    arr = root.create_array(names.prob, shape=shape if C == 2 else (C,) + shape,
                            chunks=chunks if C == 2 else (1,) + chunks, dtype=settings["dtype"], fill_value=0,
                            dimension_names=dims if C == 2 else ["class"] + dims, overwrite=True,
                            attributes={**attrs, "predict": {**settings, "complete": False}})  # (last, its record
    if not names.variable:  # in the same metadata write: without it, nothing to go on from)
        root.attrs["predict"] = arr.attrs["predict"]


def finish(a, names, work, settings, so, vol):
    """Rank 0, every tile written: dead_traces (the trace mask's dead, and the traces zero in every time tile), the
    per-tile scratch and markers removed, the record marked complete, and (local) OUT.partial renamed to OUT, over
    the store of other settings that --overwrite replaces (outputs.move_into_place)."""
    import fsspec
    import zarr
    root = zarr.open_group(work, mode="r+", storage_options=so)
    dead = np.asarray(root[names.zero][:]).all(axis=0)
    if vol.trace_mask is not None:
        dead |= ~vol.trace_mask
    root[names.dead][:] = dead.astype(np.uint8)
    fs, p = fsspec.url_to_fs(work, **(so or {}))
    for part in (names.zero, names.done.rstrip("/")):
        if fs.exists(f"{p}/{part}"):
            fs.rm(f"{p}/{part}", recursive=True)
    root[names.prob].attrs["predict"] = {**settings, "complete": True, "dead_traces": int(dead.sum())}
    if not names.variable:
        root.attrs["predict"] = root[names.prob].attrs["predict"]
    elif root.metadata.consolidated_metadata is not None:  # a store whose readers trust its list of members
        zarr.consolidate_metadata(work, storage_options=so)  # (otherwise its zarr.json is left as it was)
    if work != a.out:
        outputs.move_into_place(work, a.out)


def picture(vol, root, names, classes, title):
    """The amplitude (grey, clipped at its 99th percentile) with the prediction over it (binary: the fault
    probability in red, opaque where it is 1; more classes: the likeliest, where it is likelier than 1/2) on the
    survey's central inline, crossline and time slice."""
    from matplotlib.figure import Figure
    I, X, T = vol.shape
    cuts = [((I // 2, 0, 0), (1, X, T)), ((0, X // 2, 0), (I, 1, T)), ((0, 0, T // 2), (I, X, 1))]
    prob = root[names.prob]
    scale = 1 / 255 if prob.dtype == np.uint8 else 1.0
    fig = Figure(figsize=(13, 4.5), dpi=90)
    for ax, (o, s), name, (xl, yl) in zip(fig.subplots(1, 3), cuts, (f"inline {I // 2}", f"crossline {X // 2}",
                                                                     f"time {T // 2}"),
                                          (("crossline", "time"), ("inline", "time"), ("inline", "crossline"))):
        amp = vol.read(o, s).squeeze()
        sl = tuple(slice(a, a + n) for a, n in zip(o, s))
        p = np.asarray(prob[sl] if classes == 2 else prob[(slice(None),) + sl], dtype=np.float32) * scale
        clip = float(np.percentile(np.abs(amp), 99)) or 1.0
        ax.imshow(amp.T, cmap="gray", vmin=-clip, vmax=clip, aspect="auto", interpolation="nearest")
        if classes == 2:
            rgba = np.zeros(amp.T.shape + (4,))
            rgba[..., 0], rgba[..., 3] = 1.0, np.clip(p.squeeze().T, 0, 1)
        else:
            p = p.reshape(classes, *amp.shape)
            top = p.argmax(0)
            import matplotlib
            rgba = matplotlib.colormaps["tab10"](top.T % 10)
            rgba[..., 3] = np.where(p.max(0).T > 0.5, 0.6, 0.0)
        ax.imshow(rgba, aspect="auto", interpolation="nearest")
        ax.set(title=name, xlabel=f"{xl} (voxels)", ylabel=f"{yl} (voxels)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    stop_request = StopRequest("after the current tile, which is kept")  # (unarmed until the tiles start: a
    # stop signal before then ends the command at once, with nothing written)
    sys.exit(launched(cli.run(lambda argv: main(argv, stop_request), sys.argv[1:],
                              interrupted="the tiles written so far are kept (OUT.partial locally): the same command "
                                          "goes on from them")))
