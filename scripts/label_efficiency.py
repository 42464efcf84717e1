"""
Does pretraining pay? Fault segmentation with few labelled volumes, from a pretrained encoder against the same ViT
from scratch and against a small 3D U-Net from scratch (the field's standard since FaultSeg3D), side by side.

    python -m scripts.label_efficiency [--labels=1,4] [--seeds=3] [--seed=0] [--out=DIR]     the table, JSON last
    python -m scripts.label_efficiency --quick                                               a small table, for the tests

Every volume is FaultSeg3D's recipe (infra/synthetic.faultseg_volume), written as an MDIO store with its `fault`
labels. Once: train.py pretrains a ViT-MAE (task="mae") on `unlabelled` volumes, their labels unused. Then for each
label count n and each seed s (the seed draws the n labelled volumes, the crops and the inits), three fine-tunings
on the same n volumes with the same steps, batch, loss (voxel BCE, pos_weight) and lr schedule (train.get_lr):
  pretrained   train.py task="segment", init_from = the pretrained run (its encoder and decoder blocks)
  scratch      the same, from a fresh init
  unet         a 3D U-Net (two poolings) on the same crops (data.Sampler with label_var: the same stream)
Each is scored on `test` held-out volumes, whole: fault IoU and Dice at probability 0.5 and average precision over
every voxel. Differences are paired (the three met the same volumes, crops and test set within a seed): diff =
pretrained - the better of the two scratch baselines (by its mean), se = the standard error of that difference
over seeds. The JSON line's `by_labels` holds, per label count, the means over seeds.
--seed shifts every seed (volumes, inits, crops) for a fresh draw of the whole table.
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

import data
from infra import cli, modelfile, outputs, synthetic
from infra.plan import table
from infra.progress import Progress
from model import MODELS, seg_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stores(root, name, n, shape, seed):
    """n FaultSeg3D-style volumes (seeds seed .. seed + n - 1) as MDIO stores with fault labels; their paths."""
    out = []
    for i in range(n):
        path = os.path.join(root, f"{name}_{seed + i}.mdio")
        if not os.path.exists(path):
            vol, fault, _ = synthetic.faultseg_volume(shape, seed=seed + i)
            synthetic.write_mdio(path, vol, chunks=tuple(min(32, s) for s in shape), fault=fault.astype(bool))
        out.append(path)
    return out


def train_py(args, log):
    """One train.py run in a process of its own (a world of 1, every core); its stdout's last lines on failure."""
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()), PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
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
    net = UNet3D()
    decay = [p for p in net.parameters() if p.ndim >= 2]
    rest = [p for p in net.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}],
                            betas=(0.9, 0.95))
    cfg = {"warmup_steps": a.warmup, "max_steps": a.finetune_steps, "min_lr": 0.0}
    sampler = data.Sampler(paths, (a.crop,) * 3, seed=seed, micro_batch=a.batch, label_var="fault",
                           weighting="volume")  # (train.py's default sample_weighting: the same draws)
    try:
        for step in range(a.finetune_steps):
            for g in opt.param_groups:
                g["lr"] = train.get_lr(step, a.lr, cfg)
            x, _ = sampler.batch(step)  # (B, 2, c, c, c): amplitude, labels
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
def predict(kind, model, vol, crop):
    """Fault probability of every voxel of a whole normalised volume (numpy (I, X, T), each a multiple of crop):
    the ViT window by window (its crop), the U-Net in one pass."""
    x = torch.from_numpy(vol)[None, None]
    if kind == "unet":
        return torch.sigmoid(model(x))[0, 0].numpy()
    out = np.zeros(vol.shape, dtype=np.float32)
    from model import unpatchify
    for i in range(0, vol.shape[0], crop):
        for j in range(0, vol.shape[1], crop):
            for k in range(0, vol.shape[2], crop):
                w = x[..., i:i + crop, j:j + crop, k:k + crop]
                logits = model.seg_logits(w)  # (1, L, P, 1)
                p = unpatchify(torch.sigmoid(logits[..., 0]), model.patch, model.grid)  # (1, 1, c, c, c)
                out[i:i + crop, j:j + crop, k:k + crop] = p[0, 0].numpy()
    return out


def scores(prob, label):
    """Fault IoU and Dice at probability 0.5, and average precision (the area under precision against recall,
    voxels ranked by probability), over all voxels given."""
    prob, y = prob.ravel(), label.ravel().astype(bool)
    pred = prob > 0.5
    tp, fp, fn = (pred & y).sum(), (pred & ~y).sum(), (~pred & y).sum()
    order = np.argsort(-prob, kind="stable")
    hits = y[order]
    precision = np.cumsum(hits) / np.arange(1, hits.size + 1)
    ap = float(precision[hits].sum() / max(1, hits.sum()))
    return {"iou": float(tp / max(1, tp + fp + fn)), "dice": float(2 * tp / max(1, 2 * tp + fp + fn)), "ap": ap}


def check_options(a):
    """Every option checked before any work (one `error:` line naming it and the fix); returns the label counts."""
    try:
        counts = [int(n) for n in a.labels.split(",")]
    except ValueError:
        counts = []
    cli.need(counts and min(counts) >= 1, f"--labels={a.labels!r}: labelled volumes per fine-tuning, positive "
                                          f"integers separated by commas, e.g. --labels=1,4")
    for name, least in (("seeds", 1), ("seed", 0), ("patch", 1), ("crop", 1), ("shape", 1), ("unlabelled", 1),
                        ("test", 1), ("pretrain_steps", 1), ("finetune_steps", 1), ("batch", 1), ("warmup", 0)):
        cli.need(getattr(a, name) >= least, f"--{name}={getattr(a, name)} must be >= {least}")
    for name in ("lr", "pos_weight"):
        cli.need(math.isfinite(getattr(a, name)) and getattr(a, name) > 0, f"--{name}={getattr(a, name)} must be > 0")
    cli.need(a.model_size in MODELS, f"--model_size={a.model_size!r}: one of {list(MODELS)}")
    cli.need(not (a.shape % a.crop or a.crop % a.patch or a.crop % 4),
             f"--shape={a.shape} must be a multiple of --crop={a.crop}, itself a multiple of --patch={a.patch} and of "
             f"4 (the U-Net's two poolings)")
    return counts


SETTINGS = ("shape", "crop", "patch", "model_size", "unlabelled", "test", "pretrain_steps", "finetune_steps", "batch",
            "lr", "warmup", "pos_weight", "seed")  # what the stores and runs in --out depend on (--labels and --seeds
#                                                   only add runs: a folder with more or fewer is gone on from)


def claim_folder(a):
    """--out: a new folder, or an earlier table's with the same settings (its stores and finished runs are reused;
    train.py resumes a run that was interrupted), recorded in OUT/label_efficiency.json. Another table's is refused
    unless --overwrite (then emptied of what this command wrote there); any other non-empty folder, never."""
    import shutil
    outputs.check_dir(a.out, "--out")
    record = os.path.join(a.out, "label_efficiency.json")
    settings = {k: getattr(a, k) for k in SETTINGS}
    found = None
    if os.path.isdir(a.out) and os.listdir(a.out):
        found = outputs.inspect_file(record, lambda p: json.load(open(p)), "a record of label_efficiency")
        found = found if isinstance(found, dict) else outputs.Foreign("a folder label_efficiency did not make")
    if outputs.target(a.out, "label_efficiency's stores and runs", found, settings, a.overwrite) == "replace":
        shutil.rmtree(a.out)
    os.makedirs(a.out, exist_ok=True)
    with outputs.replacing(record) as tmp, open(tmp, "w") as f:
        json.dump(settings, f)
    return a.out


def main(argv):
    ap = argparse.ArgumentParser(prog="python -m scripts.label_efficiency", description=__doc__.split("\n")[1])
    # 1 and 4 by default: the table in ~20 min on 2 CPU cores (docs/after_training.md); --labels=1,2,4,8 doubles it
    ap.add_argument("--labels", default="1,4", help="labelled volumes per fine-tuning, e.g. 1,2,4,8")
    ap.add_argument("--seeds", type=int, default=3, help="draws per label count (paired across the three)")
    ap.add_argument("--seed", type=int, default=0, help="shifts every seed: a fresh draw of the whole table")
    ap.add_argument("--shape", type=int, default=64, help="voxels per volume along each axis")
    ap.add_argument("--crop", type=int, default=32, help="crop (and ViT window) along each axis")
    ap.add_argument("--patch", type=int, default=8)
    ap.add_argument("--model_size", default="tiny")
    ap.add_argument("--unlabelled", type=int, default=16, help="volumes pretraining sees (labels unused)")
    ap.add_argument("--test", type=int, default=4, help="held-out volumes every model is scored on")
    ap.add_argument("--pretrain_steps", type=int, default=600)
    ap.add_argument("--finetune_steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3, help="peak lr of every fine-tuning (pretraining: 1.5e-3)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--pos_weight", type=float, default=3.0)
    ap.add_argument("--out", default="", help="keep the stores and runs here (default: a temporary folder); a folder "
                    "of an earlier table with the same settings is gone on from")
    ap.add_argument("--overwrite", action="store_true", help="--out holds a table of other settings: make it anew")
    ap.add_argument("--quick", action="store_true", help="a small table in a minute or two (the tests)")
    a = ap.parse_args(argv)
    if a.quick:
        a.labels, a.seeds, a.shape, a.crop, a.unlabelled, a.test = "1", 2, 32, 16, 2, 1
        a.pretrain_steps, a.finetune_steps, a.warmup = 20, 10, 2
    counts = check_options(a)
    root = claim_folder(a) if a.out else tempfile.mkdtemp(prefix="label_efficiency_")
    shape, t0 = (a.shape,) * 3, time.time()
    base = 100_000 + 1000 * a.seed  # volume seeds: unlabelled, test and each draw's labelled ones never overlap
    unlabelled = stores(root, "unlabelled", a.unlabelled, shape, base)
    test_vols = [synthetic.faultseg_volume(shape, seed=base + 500 + i) for i in range(a.test)]
    common = [f"--crop=({a.crop},{a.crop},{a.crop})", f"--patch=({a.patch},{a.patch},{a.patch})",
              f"--model_size={a.model_size}", f"--micro_batch={a.batch}", "--val_frac=0.0", "--figures=False",
              f"--log_interval={10 ** 6}", f"--ckpt_interval={10 ** 6}", "--keep_ckpts=1"]
    pre = os.path.join(root, "pretrained")
    print(f"pretraining a {a.model_size} MAE on {a.unlabelled} unlabelled volumes of {shape} ({a.pretrain_steps} "
          f"steps of {a.batch})", flush=True)
    train_py([*common, f"--data_paths={unlabelled}", f"--out_dir={pre}", f"--max_steps={a.pretrain_steps}",
              f"--blr={1.5e-3 * 256 / a.batch}", f"--warmup_steps={max(1, a.pretrain_steps // 20)}",
              f"--seed={a.seed}"], print)
    pre_file = modelfile.export(pre)  # once: every pretrained fine-tuning starts from this file
    peak = a.lr * 256 / a.batch  # blr of train.py's rule lr = blr x batch / 256
    results = {n: {k: [] for k in ("pretrained", "scratch", "unet")} for n in counts}
    # progress on stderr (infra/progress.py): the table's fine-tuning runs done, of label counts x seeds x the
    # three kinds, and when the last will be (each run is minutes; the table, hours)
    with Progress(total=len(counts) * a.seeds * 3, desc="fine-tuning runs", unit="run") as bar:
        for n in counts:
            for s in range(a.seeds):
                seed = a.seed * 1000 + 17 * s + n
                labelled = stores(root, f"labelled_s{s}", max(counts), shape, base + 2000 + 100 * s)[:n]
                for kind, init in (("pretrained", pre_file), ("scratch", "")):
                    out = os.path.join(root, f"{kind}_n{n}_s{s}")
                    train_py([*common, "--task=segment", f"--data_paths={labelled}", f"--out_dir={out}",
                              f"--max_steps={a.finetune_steps}", f"--blr={peak}", f"--warmup_steps={a.warmup}",
                              f"--pos_weight={a.pos_weight}", f"--seed={seed}", f"--init_from={init}",
                              "--weight_decay=0.05"], lambda line: None)
                    model, _ = modelfile.load(modelfile.export(out))
                    prob = np.stack([predict("vit", model, v, a.crop) for v, _, _ in test_vols])
                    results[n][kind].append(scores(prob, np.stack([f for _, f, _ in test_vols])))
                    bar.update()
                net = train_unet(labelled, argparse.Namespace(**{**vars(a), "lr": a.lr}), seed)
                prob = np.stack([predict("unet", net, v, a.crop) for v, _, _ in test_vols])
                results[n]["unet"].append(scores(prob, np.stack([f for _, f, _ in test_vols])))
                bar.update()
                bar.write(f"labels {n} seed {s}: " + ", ".join(f"{k} IoU {v[-1]['iou']:.3f}"
                                                                for k, v in results[n].items()))
    by_labels, rows = {}, []
    for n in counts:
        r = results[n]
        mean = {k: {m: float(np.mean([x[m] for x in v])) for m in ("iou", "dice", "ap")} for k, v in r.items()}
        better = max(("scratch", "unet"), key=lambda k: mean[k]["iou"])
        d = np.array([p["iou"] - b["iou"] for p, b in zip(r["pretrained"], r[better])])
        se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None
        by_labels[n] = {"pretrained": round(mean["pretrained"]["iou"], 4), "scratch": round(mean["scratch"]["iou"], 4),
                        "unet": round(mean["unet"]["iou"], 4), "diff": round(float(d.mean()), 4),
                        "se": None if se is None else round(se, 4), "better_scratch": better,
                        "dice": {k: round(v["dice"], 4) for k, v in mean.items()},
                        "ap": {k: round(v["ap"], 4) for k, v in mean.items()}}
        rows.append([n, *(f"{mean[k]['iou']:.3f} / {mean[k]['dice']:.3f} / {mean[k]['ap']:.3f}"
                          for k in ("pretrained", "scratch", "unet")),
                     f"{d.mean():+.3f}" + ("" if se is None else f" ± {se:.3f}") + f" (vs {better})"])
    print(f"\nfault segmentation on {a.test} held-out volumes of {shape}; IoU / Dice / AP, means over {a.seeds} "
          f"seed(s); {a.finetune_steps} fine-tuning steps of {a.batch} crops of {a.crop}^3")
    table(rows, ["labelled volumes", "pretrained ViT", "ViT from scratch", "3D U-Net from scratch",
                 "IoU diff (pretrained - better scratch)"])
    print(json.dumps({"bench": "label_efficiency", "by_labels": by_labels, "seeds": a.seeds, "seed": a.seed,
                      "shape": list(shape), "crop": a.crop, "patch": a.patch, "model_size": a.model_size,
                      "unlabelled": a.unlabelled, "test": a.test, "pretrain_steps": a.pretrain_steps,
                      "finetune_steps": a.finetune_steps, "batch": a.batch, "lr": a.lr, "pos_weight": a.pos_weight,
                      "seconds": round(time.time() - t0, 1), "out": root}))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))
