"""
Does pretraining pay? Fault segmentation with few labelled volumes, from a pretrained encoder against the same ViT
from scratch and against a small 3D U-Net from scratch (the field's standard since FaultSeg3D), side by side.

    python -m experiments.label_efficiency [--labels=1,2,4] [--seeds=3] [--seed=0] [--out=DIR]   the table, JSON last
    python -m experiments.label_efficiency --quick                                               a small table, for the tests
    python -m experiments.label_efficiency --gpu --freeze_twin --labels=1                        GPU scale (~8 min planned)

Every volume is FaultSeg3D's recipe (infra/synthetic.faultseg_volume: cut from the recipe's 128^3, so its faults are
as dense), written as an MDIO store with its `fault` labels. Once: train.py pretrains a ViT-MAE (task="mae") on
`unlabelled` volumes, their labels unused, with the configs' loss (norm_pix_loss) and its own batch, lr and steps;
its validation reports the masked loss beside the floor a predictor that learns nothing scores on the same patches
(infra/floor.py: kriging), and the table flags a pretraining that did not get below it. Then for each label count n
and each seed s (the seed draws the n labelled volumes, the crops and the inits), three fine-tunings (four with
--freeze_twin) on the same n volumes with the same steps, batch, loss (voxel BCE, pos_weight) and lr schedule:
  pretrained     train.py task="segment", init_from = the pretrained run (its encoder; the head, --seg_head, is new)
  scratch        the same ViT and head, from a fresh init
  scratch_whole  with --freeze_twin (which freezes `scratch`'s encoder as the pretrained one's): the twin trained whole
  unet           a 3D U-Net (two poolings) on the same crops (data.Sampler with label_var: the same stream)
Each is scored on `test` held-out volumes, whole: fault IoU and Dice at probability 0.5 and average precision over
every voxel; beside them, per model, the fraction of voxels it calls fault at 0.5 and its IoU at the one threshold
best on the test voxels (what its ranking alone is worth: a diagnostic of where 0.5 falls, scores). Differences are
paired (the models met the same volumes, crops and test set within a seed): diff = pretrained - the best of the
baselines (by its mean), se = the standard error of that difference over seeds; `won`: ahead of every baseline by
more than 2 standard errors. The JSON line's `by_labels` holds, per label count, the means over seeds, the paired
differences of the best-threshold IoU (best_diff_*, best_se_*) and each seed's IoU and best-threshold IoU (`seeds`:
tables of other --seed draws pool with it).
--seed shifts every seed (volumes, inits, crops) for a fresh draw of the whole table; --flip mirrors every fine-tuning's
crops at random along inline and crossline (train.py's flip_crops, the U-Net's sampler alike); --snr_db=X puts
every volume's noise at X dB instead of the recipe's draw (the same reflectors, faults and noise pattern, scaled);
--freeze=N trains the pretrained ViT's head alone for N steps before its encoder (LP-FT). The twin from scratch
trains whole from the first step; with --freeze_twin its random encoder is frozen for the same N steps (`scratch`)
and a second twin trains whole (`scratch_whole`): the control that tells what the pretrained features add to a head
that learns alone beside them, from what freezing does by itself, and the better of the two twins to beat. The ViTs'
test windows overlap by --overlap (0.5) and are blended as scripts.predict blends them; --overlap=0 tiles them, as
every table before the option did.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn

import configurator
import data
from infra import cli, modelfile, outputs, synthetic
from infra.plan import table
from infra.progress import Progress
from model import SIZES, configure_optimizers, seg_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stores(root, name, n, shape, seed, snr_db=None):
    """n FaultSeg3D-style volumes (seeds seed .. seed + n - 1; noise at snr_db, None: the recipe's draw of 3-8 dB)
    as MDIO stores with fault labels; their paths."""
    out = []
    for i in range(n):
        path = os.path.join(root, f"{name}_{seed + i}.mdio")
        if not os.path.exists(path):
            vol, fault, _ = synthetic.faultseg_volume(shape, seed=seed + i, snr_db=snr_db)
            synthetic.write_mdio(path, vol, chunks=tuple(min(32, s) for s in shape), fault=fault.astype(bool))
        out.append(path)
    return out


DEVICE = "cpu"  # main() sets it: "cuda" when a GPU is there and --device allows


def train_py(args, log):
    """One train.py run in a process of its own (a world of 1, every core; the GPU when DEVICE is cuda); its stdout's
    last lines on failure."""
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()), PYTHONPATH=ROOT)
    if DEVICE == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"train.py {' '.join(args)} failed:\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
    log(r.stdout.strip().splitlines()[-1])


class UNet3D(nn.Module):
    """A small 3D U-Net in FaultSeg3D's shape: two 3x3x3 convolutions per level, two max-poolings down, two
    upsamplings up with skip connections, one logit per voxel. Widths c, 2c, 4c."""

    def __init__(self, c=12):
        super().__init__()

        def block(i, o):
            return nn.Sequential(nn.Conv3d(i, o, 3, padding=1), nn.ReLU(inplace=True),
                                 nn.Conv3d(o, o, 3, padding=1), nn.ReLU(inplace=True))
        self.e1, self.e2, self.mid = block(1, c), block(c, 2 * c), block(2 * c, 4 * c)
        self.d2, self.d1 = block(6 * c, 2 * c), block(3 * c, c)
        self.head = nn.Conv3d(c, 1, 1)

    def forward(self, x):  # (B, 1, Z, Y, X), each a multiple of 4 -> (B, 1, Z, Y, X) logits
        pool, up = nn.functional.max_pool3d, nn.functional.interpolate
        e1 = self.e1(x)
        e2 = self.e2(pool(e1, 2))
        m = self.mid(pool(e2, 2))
        d2 = self.d2(torch.cat([up(m, scale_factor=2), e2], 1))
        return self.head(self.d1(torch.cat([up(d2, scale_factor=2), e1], 1)))


def train_unet(paths, a, seed):
    """The U-Net on the crops train.py's sampler would give a run of this seed, the same steps, batch, loss and lr
    schedule as the ViT runs (train.get_lr), AdamW with the same weight decay on its kernels."""
    import train
    torch.manual_seed(seed)
    net = UNet3D().to(DEVICE)
    opt = configure_optimizers(net, {**configurator.defaults(), "weight_decay": a.weight_decay}, a.lr)  # (as the ViTs')
    cfg = {"warmup_steps": a.warmup, "max_steps": a.finetune_steps, "min_lr": 0.0}
    sampler = data.Sampler(paths, a.crop, seed=seed, micro_batch=a.batch, label_var="fault", weighting="volume",
                           flip=a.flip)  # (train.py's default sample_weighting and its flip_crops: the same draws)
    try:
        for step in range(a.finetune_steps):
            for g in opt.param_groups:
                g["lr"] = train.get_lr(step, a.lr, cfg)
            x, _ = sampler.batch(step)  # (B, 2, *crop): amplitude, labels
            x = x.to(DEVICE)
            logits = net(x[:, :1])
            loss = seg_loss(logits.reshape(len(x), -1, 1, 1), x[:, 1].reshape(len(x), -1, 1), a.pos_weight)
            opt.zero_grad(set_to_none=True)
            (loss / x[:, 1].numel()).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
    finally:
        sampler.close()
    return net.eval()


@torch.no_grad()
def predict(kind, model, vol, crop, overlap=0.0):
    """Fault probability of every voxel of a whole normalised volume (numpy (I, X, T), each at least the crop): the
    U-Net in one pass; the ViT on windows of its crop, a batch at a time. With overlap 0 the windows tile the volume;
    with overlap > 0 they overlap by that fraction and are blended as scripts.predict blends them (infra/sliding.py:
    p = sum_k w_k p_k / sum_k w_k, the weight a product of three 1D weights, so the denominator is too)."""
    x = torch.from_numpy(vol)[None, None].to(DEVICE)
    if kind == "unet":
        return torch.sigmoid(model(x))[0, 0].cpu().numpy()
    from infra import sliding
    from model import unpatchify
    model = model.to(DEVICE)
    starts = [sliding.window_starts(S, c, max(1, round(c * (1 - overlap)))) for S, c in zip(vol.shape, crop)]
    w1 = [sliding.axis_weights(c) for c in crop]  # (c,) per axis: scripts.predict's default Gaussian
    w = torch.from_numpy(np.einsum("i,j,k->ijk", *w1)).float()  # (*crop): one window's weight
    norm = np.einsum("i,j,k->ijk", *(sliding.normaliser(S, o, wa) for S, o, wa in zip(vol.shape, starts, w1)))
    out = np.zeros(vol.shape, dtype=np.float64)  # sum_k w_k p_k, then / sum_k w_k
    corners = [(i, j, k) for i in starts[0] for j in starts[1] for k in starts[2]]
    for n in range(0, len(corners), 16):
        tiles = corners[n:n + 16]
        win = torch.cat([x[..., i:i + crop[0], j:j + crop[1], k:k + crop[2]] for i, j, k in tiles])  # (b, 1, *crop)
        logits = model.seg_logits(win)  # (b, L, P, 1)
        p = unpatchify(torch.sigmoid(logits[..., 0]), model.patch, model.grid).cpu()  # (b, 1, *crop)
        for (i, j, k), q in zip(tiles, (p[:, 0] * w).numpy()):
            out[i:i + crop[0], j:j + crop[1], k:k + crop[2]] += q
    return (out / norm).astype(np.float32)


def scores(prob, label):
    """Fault IoU and Dice at probability 0.5, and average precision (the area under precision against recall,
    voxels ranked by probability), over all voxels given; beside them two diagnostics of calibration: the fraction of
    voxels called fault at 0.5 (`called`, against the labels' fault fraction) and the IoU at the single threshold
    that is best on these voxels (`iou_best`: chosen on the test labels, so not a usable threshold, but what the
    ranking alone is worth: a model whose `iou` is far below it calls faults at 0.5 where it should not).

    The loss's pos_weight w moves where 0.5 falls: the weighted BCE is least at p / (1 - p) = w q / (1 - q) for a true
    fault probability q, so p > 0.5 calls a fault wherever q > 1 / (1 + w) (w = 10: q > 0.09)."""
    prob, y = prob.ravel(), label.ravel().astype(bool)
    pred = prob > 0.5
    tp, fp, fn = (pred & y).sum(), (pred & ~y).sum(), (~pred & y).sum()
    order = np.argsort(-prob, kind="stable")
    hits, ranked = y[order], prob[order]
    tp_k = np.cumsum(hits)  # faults among the k most probable voxels, k = 1..N
    k = np.arange(1, hits.size + 1)
    precision = tp_k / k
    ap = float(precision[hits].sum() / max(1, hits.sum()))
    cut = np.r_[ranked[1:] < ranked[:-1], True]  # a threshold separates k from k + 1 only where the probability drops
    iou_k = tp_k / (k + hits.sum() - tp_k)  # calling the top k: tp / (tp + fp + fn), fp = k - tp, fn = P - tp
    return {"iou": float(tp / max(1, tp + fp + fn)), "dice": float(2 * tp / max(1, 2 * tp + fp + fn)), "ap": ap,
            "iou_best": float(iou_k[cut].max()), "called": float(pred.mean())}


def check_options(a):
    """Every option checked before any work (one `error:` line naming it and the fix); returns the label counts."""
    try:
        counts = [int(n) for n in a.labels.split(",")]
    except ValueError:
        counts = []
    configurator.need(counts and min(counts) >= 1, f"--labels={a.labels!r}: labelled volumes per fine-tuning, positive "
                                          f"integers separated by commas, e.g. --labels=1,4")
    for name, least in (("seeds", 1), ("seed", 0), ("shape", 1), ("unlabelled", 1), ("test", 1),
                        ("pretrain_steps", 1), ("pretrain_batch", 1), ("finetune_steps", 1), ("batch", 1),
                        ("warmup", 0), ("seg_features", 1), ("freeze", 0)):
        configurator.need(getattr(a, name) >= least, f"--{name}={getattr(a, name)} must be >= {least}")
    configurator.need(math.isfinite(a.weight_decay) and a.weight_decay >= 0,
                      f"--weight_decay={a.weight_decay} must be >= 0")
    for name in ("lr", "pretrain_blr", "pos_weight"):
        configurator.need(math.isfinite(getattr(a, name)) and getattr(a, name) > 0, f"--{name}={getattr(a, name)} must be > 0")
    configurator.need(0 < a.mask_ratio < 1, f"--mask_ratio={a.mask_ratio} must be in (0, 1)")
    configurator.need(0 <= a.overlap < 1, f"--overlap={a.overlap}: the fraction of a window its neighbour overlaps, "
                      "in [0, 1)")
    configurator.need(a.snr_db is None or math.isfinite(a.snr_db), f"--snr_db={a.snr_db} must be a finite number "
                      "of dB (or left out: the recipe's draw)")
    configurator.need(not (a.quick and a.gpu), "--quick and --gpu are two presets of the same options: give one")
    configurator.need(a.freeze > 0 or not a.freeze_twin, "--freeze_twin freezes the twin's encoder for --freeze steps: "
                      "give --freeze=N too")
    configurator.need(0 < a.layer_decay <= 1, f"--layer_decay={a.layer_decay} must be in (0, 1] (1: off)")
    configurator.need(a.model_size in SIZES, f"--model_size={a.model_size!r}: one of {list(SIZES)}")
    configurator.need(a.seg_head in ("unetr", "linear"), f"--seg_head={a.seg_head!r}: unetr or linear")
    configurator.need(a.device in ("auto", "cpu", "cuda"), f"--device={a.device!r}: auto, cpu or cuda")
    a.crop, a.patch = (axes(a, name) for name in ("crop", "patch"))
    configurator.need(not any(a.shape % c or c % p or c % 4 for c, p in zip(a.crop, a.patch)),
             f"--shape={a.shape} must be a multiple of --crop={a.crop} along every axis, itself a multiple of "
             f"--patch={a.patch} and of 4 (the U-Net's two poolings)")
    configurator.need(a.seg_head != "unetr" or all(p & (p - 1) == 0 for p in a.patch),
             f"--seg_head=unetr needs every side of --patch={a.patch} a power of two")
    return counts


def axes(a, name):
    """--crop / --patch: one int (a cube) or three, inline,crossline,time -> a tuple of 3 positive ints."""
    v = getattr(a, name)
    try:
        t = tuple(int(x) for x in str(v).strip("()").split(","))
    except ValueError:
        t = ()
    configurator.need(len(t) in (1, 3) and min(t) >= 1, f"--{name}={v}: one positive int or three, e.g. 16,16,64")
    return t * 3 if len(t) == 1 else t


# what the stores and runs in --out depend on (--labels and --seeds only add runs: a folder with more or fewer is gone
# on from)
SETTINGS = ("shape", "crop", "patch", "model_size", "unlabelled", "test", "pretrain_steps", "pretrain_batch",
            "pretrain_blr", "mask_ratio", "finetune_steps", "batch", "lr", "warmup", "pos_weight", "seg_head",
            "seg_features", "layer_decay", "weight_decay", "freeze", "freeze_twin", "flip", "snr_db", "seed")


def claim_folder(a):
    """--out: a new folder, or an earlier table's with the same settings (its stores and finished runs are reused;
    train.py resumes a run that was interrupted), recorded in OUT/label_efficiency.json. Another table's is refused
    unless --overwrite (then emptied of what this command wrote there); any other non-empty folder, never."""
    import shutil
    outputs.check_dir(a.out, "--out")
    record = os.path.join(a.out, "label_efficiency.json")
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(a, k)) for k in SETTINGS)}
    found = None
    if os.path.isdir(a.out) and os.listdir(a.out):
        found = outputs.inspect_file(record, lambda p: json.load(open(p)), "a record of label_efficiency")
        found = found if isinstance(found, dict) else outputs.Foreign("a folder label_efficiency did not make")
        if isinstance(found, dict):
            found.setdefault("freeze_twin", False)  # (a folder from before the option: its twin trained whole)
            found.setdefault("snr_db", None)  # (before that one: the recipe's noise)
    if outputs.target(a.out, "label_efficiency's stores and runs", found, settings, a.overwrite) == "replace":
        shutil.rmtree(a.out)
    os.makedirs(a.out, exist_ok=True)
    with outputs.replacing(record) as tmp, open(tmp, "w") as f:
        json.dump(settings, f)
    return a.out


# The recipe that learns on this machine (experiments/LOG.md, 2026-12-02: a pretraining recipe that learns): patches thin in space and long
# in time, as traces are (2 x 2 x 16 in crops of 16 x 16 x 64: 256 tokens), the configs' norm_pix_loss, a batch of
# 16 at blr 4.8e-2 (lr 3e-3), 3,000 steps: about 8 minutes of the 2-core CPU's time.
QUICK = dict(labels="1", seeds=2, shape=32, crop="16,16,32", patch="2,2,16", unlabelled=2, test=1, pretrain_steps=20,
             pretrain_batch=4, finetune_steps=10, warmup=2, seg_features=4)
# GPU scale, planned for about 8 minutes of one H200 and not yet measured there (docs/after_training.md): the CPU
# recipe whose pretraining beats the ViT from scratch, not yet the U-Net (patches of more voxels than the model is
# wide, so that pretraining decides what a token keeps; 256 tokens a crop; the encoder frozen under its head) scaled
# up: a small ViT (384 wide) on patches of 8 x 8 x 16 = 1,024 voxels in crops of 64^3 cut from 64 volumes of
# FaultSeg3D's own 128^3; 6,000 pretraining steps of 64 crops at lr 3e-3, the CPU recipe's (its FLOPs a sample:
# infra/plan.py's count), then per label count and seed a U-Net and 2 ViT fine-tunings (3 with --freeze_twin) of 400
# steps of 8 crops, each ViT's train.py process start most of its time: `--labels=1` first where the budget is short,
# then the rest on the same --out
GPU = dict(model_size="small", shape=128, crop="64,64,64", patch="8,8,16", unlabelled=64, test=8, pretrain_steps=6000,
           pretrain_batch=64, pretrain_blr=1.2e-2, finetune_steps=400, warmup=40, batch=8, seg_features=16,
           freeze=400)


def pm(row, other, key=""):
    """A paired difference of a by_labels row as the table prints it: +0.012 ± 0.004 (no ± from one seed)."""
    d, se = row[f"{key}diff_{other}"], row[f"{key}se_{other}"]
    return f"{d:+.3f}" + ("" if se is None else f" ± {se:.3f}")


def pretraining_record(out):
    """The pretraining run's validation, from its log.jsonl: {step: val_loss}, and the floor (or None)."""
    from infra.evaluate import read_floor, read_losses
    log = os.path.join(out, "log.jsonl")
    return read_losses(log)[1], read_floor(log)


def options(argv):
    """The command line: --quick and --gpu are presets of the other options' defaults, so an option given beside one
    wins over it (`--gpu --pretrain_steps=100`); every option checked (check_options). Returns (options, counts)."""
    ap = argparse.ArgumentParser(prog="python -m experiments.label_efficiency", description=__doc__.split("\n")[1])
    ap.add_argument("--labels", default="1,2,4", help="labelled volumes per fine-tuning, e.g. 1,2,4,8")
    ap.add_argument("--seeds", type=int, default=3, help="draws per label count (paired across the models)")
    ap.add_argument("--seed", type=int, default=0, help="shifts every seed: a fresh draw of the whole table")
    ap.add_argument("--shape", type=int, default=64, help="voxels per volume along each axis")
    ap.add_argument("--crop", default="16,16,64", help="crop (and ViT window): one int or inline,crossline,time")
    ap.add_argument("--patch", default="2,2,16", help="one int or three")
    ap.add_argument("--model_size", default="tiny")
    ap.add_argument("--unlabelled", type=int, default=16, help="volumes pretraining sees (labels unused)")
    ap.add_argument("--test", type=int, default=4, help="held-out volumes every model is scored on")
    ap.add_argument("--pretrain_steps", type=int, default=3000)
    ap.add_argument("--pretrain_batch", type=int, default=16)
    ap.add_argument("--pretrain_blr", type=float, default=4.8e-2, help="pretraining lr = blr x batch / 256")
    ap.add_argument("--mask_ratio", type=float, default=0.75)
    ap.add_argument("--finetune_steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4, help="fine-tuning batch")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak lr of every fine-tuning")
    ap.add_argument("--warmup", type=int, default=20, help="fine-tuning warmup steps")
    ap.add_argument("--pos_weight", type=float, default=10.0, help="class-1 voxels' loss weight (train.py's default: "
                    "about the ratio of non-fault to fault voxels, ~9 at FaultSeg3D's density)")
    ap.add_argument("--seg_head", default="unetr", help="the ViTs' head: unetr (train.py's default) or linear")
    ap.add_argument("--seg_features", type=int, default=12, help="the UNETR head's channels at full resolution "
                    "(12: the U-Net's)")
    ap.add_argument("--layer_decay", type=float, default=1.0, help="the ViTs' fine-tuning layer decay (train.py's "
                    "layer_decay; MAE fine-tunes with 0.75)")
    ap.add_argument("--weight_decay", type=float, default=0.05, help="every fine-tuning's AdamW weight decay, on "
                    "weight matrices and kernels (MAE's fine-tuning: 0.05)")
    ap.add_argument("--freeze", type=int, default=0, help="the pretrained ViT's encoder frozen for the first steps, "
                    "its head alone learning (train.py's freeze_encoder_steps: LP-FT); the twin's too with --freeze_twin")
    ap.add_argument("--freeze_twin", action="store_true", help="the twin's random encoder frozen for the same --freeze "
                    "steps too (the control for what the pretrained features add), beside a twin trained whole")
    ap.add_argument("--flip", action="store_true", help="every fine-tuning's crops mirrored at random along inline "
                    "and crossline (train.py's flip_crops; the U-Net's too)")
    ap.add_argument("--snr_db", type=float, default=None, help="every volume's noise (unlabelled, labelled, test) at "
                    "this signal-to-noise ratio in dB; default: the recipe's, drawn in 3-8 dB per volume")
    ap.add_argument("--overlap", type=float, default=0.5, help="the ViTs' test windows: the fraction of a window its "
                    "neighbour overlaps, blended as scripts.predict blends them (0: tiles side by side)")
    ap.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu or cuda")
    ap.add_argument("--out", default="", help="keep the stores and runs here (default: a temporary folder); a folder "
                    "of an earlier table with the same settings is gone on from")
    ap.add_argument("--overwrite", action="store_true", help="--out holds a table of other settings: make it anew")
    ap.add_argument("--quick", action="store_true", help="a small table in a minute or two (the tests)")
    ap.add_argument("--gpu", action="store_true", help="the GPU-scale budget (a small ViT, patches of 8 x 8 x 16 in "
                    "crops of 64^3 of 128^3 volumes, 6,000 pretraining steps of 64, the pretrained encoder frozen)")
    given = ap.parse_args(argv)
    ap.set_defaults(**{**(QUICK if given.quick else {}), **(GPU if given.gpu else {})})
    a = ap.parse_args(argv)
    return a, check_options(a)


def main(argv):
    global DEVICE
    a, counts = options(argv)
    DEVICE = "cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu"
    configurator.need(DEVICE == "cpu" or torch.cuda.is_available(), "--device=cuda but torch sees no GPU")
    root = claim_folder(a) if a.out else tempfile.mkdtemp(prefix="label_efficiency_")
    shape, t0 = (a.shape,) * 3, time.time()
    base = 100_000 + 1000 * a.seed  # volume seeds: unlabelled, test and each draw's labelled ones never overlap
    unlabelled = stores(root, "unlabelled", a.unlabelled, shape, base, a.snr_db)
    test_vols = [synthetic.faultseg_volume(shape, seed=base + 500 + i, snr_db=a.snr_db) for i in range(a.test)]
    crop, patch = ",".join(map(str, a.crop)), ",".join(map(str, a.patch))
    common = [f"--crop=({crop})", f"--patch=({patch})", f"--model_size={a.model_size}", "--figures=False",
              f"--log_interval={10 ** 6}", f"--ckpt_interval={10 ** 6}", "--keep_ckpts=1", "--norm_pix_loss=True"]
    pre = os.path.join(root, "pretrained")
    # validation on the last quarter of the unlabelled volumes' inlines: the MAE's masked loss and its floor
    val_frac = max(0.25, a.crop[0] / a.shape)
    print(f"pretraining a {a.model_size} MAE on {a.unlabelled} unlabelled volumes of {shape} ({a.pretrain_steps} "
          f"steps of {a.pretrain_batch} crops of {a.crop} in patches of {a.patch}, mask {a.mask_ratio}) on {DEVICE}",
          flush=True)
    train_py([*common, f"--data_paths={unlabelled}", f"--out_dir={pre}", f"--max_steps={a.pretrain_steps}",
              f"--micro_batch={a.pretrain_batch}", f"--blr={a.pretrain_blr}", f"--mask_ratio={a.mask_ratio}",
              f"--warmup_steps={max(1, a.pretrain_steps // 30)}", f"--val_frac={val_frac}", "--eval_samples=32",
              f"--eval_interval={max(1, a.pretrain_steps // 6)}", f"--seed={a.seed}",
              # a checkpoint at each evaluation: a table stopped during its pretraining (the longest part) goes on
              # from the last one when run again on the same --out
              f"--ckpt_interval={max(1, a.pretrain_steps // 6)}"], print)
    curve, floor = pretraining_record(pre)
    mae_val = curve[max(curve)]
    print(f"pretraining: validation masked loss {mae_val:.4f}, floor {floor:.4f} (kriging on the same patches): "
          + ("below it by %.4f" % (floor - mae_val) if mae_val < floor else "ABOVE IT: the MAE learnt less than "
             "linear interpolation; its encoder is not worth fine-tuning"), flush=True)
    pre_file = modelfile.export(pre)  # once: every pretrained fine-tuning starts from this file
    peak = a.lr * 256 / a.batch  # blr of train.py's rule lr = blr x batch / 256
    # the ViT runs: (kind, init, steps its encoder is frozen); with --freeze_twin the twin is fine-tuned twice, its
    # random encoder frozen as the pretrained one is (scratch: the control for freezing) and trained whole from the
    # first step (scratch_whole), so that the pretrained encoder is measured against the better of the two
    vits = [("pretrained", pre_file, a.freeze), ("scratch", "", a.freeze if a.freeze_twin else 0)]
    vits += [("scratch_whole", "", 0)] if a.freeze_twin else []
    kinds = [k for k, _, _ in vits] + ["unet"]
    results = {n: {k: [] for k in kinds} for n in counts}
    # progress on stderr (infra/progress.py): the table's fine-tuning runs done, of label counts x seeds x the
    # models, and when the last will be (each run is minutes; the table, hours)
    with Progress(total=len(counts) * a.seeds * len(kinds), desc="fine-tuning runs", unit="run") as bar:
        for n in counts:
            for s in range(a.seeds):
                seed = a.seed * 1000 + 17 * s + n
                labelled = stores(root, f"labelled_s{s}", max(counts), shape, base + 2000 + 100 * s,
                                  a.snr_db)[:n]
                for kind, init, frozen in vits:
                    out = os.path.join(root, f"{kind}_n{n}_s{s}")
                    train_py([*common, "--task=segment", f"--data_paths={labelled}", f"--out_dir={out}",
                              f"--micro_batch={a.batch}", "--val_frac=0.0", f"--max_steps={a.finetune_steps}",
                              f"--blr={peak}", f"--warmup_steps={a.warmup}", f"--pos_weight={a.pos_weight}",
                              f"--seed={seed}", f"--init_from={init}", f"--weight_decay={a.weight_decay}",
                              f"--seg_head={a.seg_head}", f"--seg_features={a.seg_features}",
                              f"--layer_decay={a.layer_decay}", f"--flip_crops={a.flip}",
                              f"--freeze_encoder_steps={frozen}"],
                             lambda line: None)
                    model, _ = modelfile.load(modelfile.export(out))
                    prob = np.stack([predict("vit", model, v, a.crop, a.overlap) for v, _, _ in test_vols])
                    results[n][kind].append(scores(prob, np.stack([f for _, f, _ in test_vols])))
                    bar.update()
                net = train_unet(labelled, argparse.Namespace(**{**vars(a), "lr": a.lr}), seed)
                prob = np.stack([predict("unet", net, v, a.crop) for v, _, _ in test_vols])
                results[n]["unet"].append(scores(prob, np.stack([f for _, f, _ in test_vols])))
                bar.update()
                bar.write(f"labels {n} seed {s}: " + ", ".join(f"{k} IoU {v[-1]['iou']:.3f}"
                                                                for k, v in results[n].items()))
    by_labels, rows, baselines = {}, [], kinds[1:]
    for n in counts:
        r = results[n]
        mean = {k: {m: float(np.mean([x[m] for x in v])) for m in ("iou", "dice", "ap", "iou_best", "called")}
                for k, v in r.items()}
        row = {k: round(mean[k]["iou"], 4) for k in kinds}
        for other in baselines:  # paired by seed: the same volumes, crops and test set
            for m, key in (("iou", ""), ("iou_best", "best_")):
                d = np.array([p[m] - b[m] for p, b in zip(r["pretrained"], r[other])])
                row[f"{key}diff_{other}"] = round(float(d.mean()), 4)
                row[f"{key}se_{other}"] = round(float(d.std(ddof=1) / math.sqrt(len(d))), 4) if len(d) > 1 else None
        better = max(baselines, key=lambda k: mean[k]["iou"])
        row.update(diff=row[f"diff_{better}"], se=row[f"se_{better}"], better_scratch=better,
                   dice={k: round(v["dice"], 4) for k, v in mean.items()},
                   ap={k: round(v["ap"], 4) for k, v in mean.items()},
                   iou_best={k: round(v["iou_best"], 4) for k, v in mean.items()},
                   called={k: round(v["called"], 4) for k, v in mean.items()},
                   seeds={k: {m: [round(x[m], 4) for x in v] for m in ("iou", "iou_best")} for k, v in r.items()},
                   won=all(row[f"se_{o}"] is not None and row[f"diff_{o}"] > 2 * row[f"se_{o}"] for o in baselines))
        by_labels[n] = row
        rows.append([n, *(f"{mean[k]['iou']:.3f} / {mean[k]['dice']:.3f} / {mean[k]['ap']:.3f}" for k in kinds),
                     *(pm(row, o) for o in baselines)])
    print(f"\nfault segmentation on {a.test} held-out volumes of {shape}; IoU / Dice / AP, means over {a.seeds} "
          f"seed(s); {a.finetune_steps} fine-tuning steps of {a.batch} crops of {a.crop}, ViT head {a.seg_head}"
          + (f"; the pretrained encoder frozen {a.freeze} steps" if a.freeze else "")
          + (", a twin's random one too, another twin trained whole" if a.freeze_twin else "")
          + ("" if a.snr_db is None else f"; every volume's noise at {a.snr_db:g} dB"))
    print(f"pretraining: {a.pretrain_steps} steps, validation masked loss {mae_val:.4f} against the floor {floor:.4f}"
          + ("" if mae_val < floor else "  ** ABOVE THE FLOOR: the pretrained encoder has learnt less than linear "
                                        "interpolation **"))
    names = {"pretrained": "pretrained ViT", "scratch": "ViT from scratch" + (", frozen" if a.freeze_twin else ""),
             "scratch_whole": "ViT from scratch, trained whole", "unet": "3D U-Net from scratch"}
    short = {"scratch": "ViT scratch" + (" frozen" if a.freeze_twin else ""), "scratch_whole": "ViT scratch whole",
             "unet": "U-Net"}
    table(rows, ["labelled volumes", *(names[k] for k in kinds), *(f"IoU pretrained - {short[o]}" for o in baselines)])
    faults = float(np.mean([f.mean() for _, f, _ in test_vols]))  # the test voxels' fault fraction
    for n, row in by_labels.items():  # calibration (scores): what the thresholded IoU owes to 0.5 rather than ranking
        print(f"labels {n}, each model's fraction of voxels called fault at 0.5 (the faults': {faults:.3f}) / "
              "IoU at the best single threshold: "
              + ", ".join(f"{short.get(k, k)} {row['called'][k]:.3f} / {row['iou_best'][k]:.3f}" for k in kinds)
              + "; best-threshold IoU pretrained - "
              + ", ".join(f"{short[o]} {pm(row, o, 'best_')}" for o in baselines))
    print(json.dumps({"bench": "label_efficiency", "by_labels": by_labels, "seeds": a.seeds, "seed": a.seed,
                      "pretraining": {"val_loss": round(mae_val, 4), "val_floor": round(floor, 4),
                                      "below_floor": mae_val < floor,
                                      "curve": {int(k): round(v, 4) for k, v in sorted(curve.items())}},
                      "shape": list(shape), "crop": list(a.crop), "patch": list(a.patch), "model_size": a.model_size,
                      "fault_fraction": round(faults, 4), "unlabelled": a.unlabelled, "test": a.test,
                      "pretrain_steps": a.pretrain_steps, "pretrain_batch": a.pretrain_batch,
                      "pretrain_blr": a.pretrain_blr, "mask_ratio": a.mask_ratio,
                      "finetune_steps": a.finetune_steps, "batch": a.batch, "lr": a.lr, "pos_weight": a.pos_weight,
                      "seg_head": a.seg_head, "seg_features": a.seg_features, "layer_decay": a.layer_decay,
                      "weight_decay": a.weight_decay, "freeze": a.freeze, "freeze_twin": a.freeze_twin, "flip": a.flip,
                      "snr_db": a.snr_db, "overlap": a.overlap, "device": DEVICE,
                      "seconds": round(time.time() - t0, 1), "out": root}))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))
