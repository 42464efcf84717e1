"""
Did pretraining help? A frozen encoder's features scored on a labelled task: fault segmentation of synthetic
volumes whose faults the generator knows (infra/synthetic.py, labels=True).

    python -m scripts.probe MODEL [--volumes=6 --test=2 --repeats=3 --shape=(64,64,128) --n_faults=3 --steps=300 --seed=0]

MODEL: a model file (scripts/export.py) or a run's out_dir. For each of `volumes` synthetic volumes (`n_faults` faults of
random strike, dip and throw, no dead traces), every token's features come from the frozen encoder
(features_of: windows of the model's crop at half-window strides, every token visible). A linear head per
token, features -> the patch's voxels (P logits), is trained on the first volumes' tokens (binary cross-entropy,
the positives weighted by the negatives / positives ratio: faults are a few % of the voxels) and scored on the
last `test` volumes: IoU of the fault voxels, the threshold chosen on the training volumes. The same for an
encoder of the same shape with random weights (the MAE's own init), side by side.

One draw of volumes is a noisy judge: between draws the IoU moves by more than the two encoders differ (on the
quickstart's model, random encoders scored 0.122 to 0.172 over five draws). So the comparison is repeated
`repeats` times, each on its own volumes (seeds seed + 1000 + r * volumes + i) and its own random encoder
(seed + r), and reported paired: the mean of each encoder's IoU, and the mean difference pretrained - random
with its standard error over the repeats. The last line is JSON with iou_pretrained and iou_random (the means),
iou_diff and iou_diff_se.

The head is deliberately weak (linear, per token, frozen features): the score says what the features hold, not
what a fine-tuned network could learn. A head that calls every voxel a fault scores the fault voxel fraction
(printed): the floor to read the scores against.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

import configurator
from infra import cli, modelfile, synthetic
from infra.features import features_of
from infra.plan import table
from infra.progress import Progress
from model import build_model, patchify


def labelled_volumes(n, shape, n_faults, seed):
    """[(normalised volume, fault mask)] for seeds seed + 1000 + i, i < n (none of them a quickstart volume)."""
    out = []
    for i in range(n):
        vol, mask, _ = synthetic.synthetic_volume(shape, seed=seed + 1000 + i, n_faults=n_faults, labels=True,
                                                  dead_frac=0.0)
        out.append(((vol - vol.mean()) / vol.std(), mask))
    return out


def tokens_and_targets(model, vols, crop, tick=lambda: None):
    """(features (N, D), targets (N, P)): every token of every volume, its fault voxels in patch order. tick():
    called after each volume (the progress)."""
    stride = tuple(max(p, c // 2 // p * p) for c, p in zip(crop, model.patch))
    xs, ys = [], []
    for vol, mask in vols:
        f = features_of(model, vol, crop, stride)  # (I, X, T, D)
        grid = f.shape[:3]
        m = torch.from_numpy(mask[tuple(slice(0, g * p) for g, p in zip(grid, model.patch))].astype(np.float32))
        ys.append(patchify(m[None, None], model.patch)[0])  # (L, P), tokens in (inline, crossline, time) order
        xs.append(torch.from_numpy(f.reshape(-1, f.shape[-1])))
        tick()
    return torch.cat(xs), torch.cat(ys)


def iou(pred, true):
    inter, union = (pred & true).sum().item(), (pred | true).sum().item()
    return inter / union if union else 1.0


def fit_and_score(xtr, ytr, xte, yte, steps, seed, tick=lambda: None):
    """Train the linear head on (xtr, ytr), pick the threshold that maximises IoU there, return (test IoU,
    train IoU, threshold). tick(): called after each step (the progress)."""
    torch.manual_seed(seed)
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-6  # standardise the features (the head's scale-free)
    xtr, xte = (xtr - mu) / sd, (xte - mu) / sd
    head = torch.nn.Linear(xtr.shape[1], ytr.shape[1])
    pos = ytr.mean().clamp(min=1e-6)
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=(1 - pos) / pos)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(head(xtr), ytr).backward()
        opt.step()
        tick()
    with torch.no_grad():
        ptr, pte = torch.sigmoid(head(xtr)), torch.sigmoid(head(xte))
    best = max((iou(ptr > t, ytr > 0.5), t) for t in np.linspace(0.05, 0.95, 19))
    return iou(pte > best[1], yte > 0.5), best[0], float(best[1])


def main(argv):
    ap = argparse.ArgumentParser(prog="python -m scripts.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model file (scripts/export.py) or a run's out_dir")
    ap.add_argument("--volumes", type=int, default=6)
    ap.add_argument("--test", type=int, default=2, help="of the volumes, the last ones scored (the rest train)")
    ap.add_argument("--shape", default="(64,64,128)", help="voxels per synthetic volume")
    ap.add_argument("--n_faults", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300, help="full-batch Adam steps of the head")
    ap.add_argument("--repeats", type=int, default=3, help="draws of volumes and random encoder, compared paired")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    shape = cli.triple(a.shape, "shape")
    configurator.need(1 <= a.test < a.volumes, f"--test={a.test} must be >= 1 and leave training volumes out of "
                                      f"--volumes={a.volumes}")
    configurator.need(a.repeats >= 1, f"--repeats={a.repeats}: at least one draw is needed")
    configurator.need(a.steps >= 1, f"--steps={a.steps}: the head needs at least one step")
    configurator.need(a.n_faults >= 1, f"--n_faults={a.n_faults}: the volumes need at least one fault to segment")
    configurator.need(a.seed >= 0, f"--seed={a.seed}: seeds are >= 0")
    crop = tuple(modelfile.init_source(a.model)[0]["crop"])  # (its config alone: nothing is read or written yet)
    configurator.need(all(s >= c for s, c in zip(shape, crop)), f"--shape {shape} is smaller than the model's crop {crop}")
    path = a.model
    if os.path.isdir(path):
        path = modelfile.export(a.model)  # its newest checkpoint as one model file, beside it
    trained, meta = modelfile.load(path)
    cfg = meta["config"]
    scores = {"pretrained": [], "random": []}  # per repeat: (test IoU, train IoU, threshold)
    fraction = []
    # progress on stderr (infra/progress.py): each volume through an encoder and each step of a head count one,
    # over every draw and both encoders. A draw is the same work each time, so the average rate of whole draws
    # gives a true ETA, however a volume's cost compares with a step's
    with Progress(total=a.repeats * 2 * (a.volumes + a.steps), desc="probe", unit="step") as bar:
        for r in range(a.repeats):
            torch.manual_seed(a.seed + r)
            random = build_model(cfg).eval()  # the same shape, the MAE's init, a new one each draw
            vols = labelled_volumes(a.volumes, shape, a.n_faults, a.seed + r * a.volumes)
            train, test = vols[:-a.test], vols[-a.test:]
            fraction.append(float(np.mean([m.mean() for _, m in test])))
            for name, model in (("pretrained", trained), ("random", random)):
                xtr, ytr = tokens_and_targets(model, train, crop, bar.update)
                xte, yte = tokens_and_targets(model, test, crop, bar.update)
                scores[name].append(fit_and_score(xtr, ytr, xte, yte, a.steps, a.seed + r, bar.update))
    # paired: both encoders met the same volumes in each draw, so the draw-to-draw spread cancels in the difference
    te = {k: np.array([v[0] for v in vs]) for k, vs in scores.items()}
    diff = te["pretrained"] - te["random"]
    se = float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else None  # one draw: no spread to measure
    out = {"bench": "probe", "model": str(path), "step": meta.get("step"), "volumes": a.volumes, "test": a.test,
           "repeats": a.repeats, "shape": list(shape), "n_faults": a.n_faults,
           "iou_pretrained": round(float(te["pretrained"].mean()), 4), "iou_random": round(float(te["random"].mean()), 4),
           "iou_diff": round(float(diff.mean()), 4), "iou_diff_se": None if se is None else round(se, 4),
           "iou_pretrained_each": [round(float(v), 4) for v in te["pretrained"]],
           "iou_random_each": [round(float(v), 4) for v in te["random"]],
           "iou_train_pretrained": round(float(np.mean([v[1] for v in scores["pretrained"]])), 4),
           "iou_train_random": round(float(np.mean([v[1] for v in scores["random"]])), 4),
           "fault_voxel_fraction": round(float(np.mean(fraction)), 4)}
    print(f"fault segmentation by a linear head on frozen features, {a.repeats} draw(s) of {a.volumes - a.test} training "
          f"and {a.test} test volumes of {shape}, {a.n_faults} faults each ({100 * out['fault_voxel_fraction']:.1f} % of "
          f"the voxels: the IoU of a head that calls every voxel a fault)")
    rows = [[r, f"{scores['pretrained'][r][0]:.3f}", f"{scores['random'][r][0]:.3f}", f"{diff[r]:+.3f}",
             f"{scores['pretrained'][r][1]:.3f} / {scores['random'][r][1]:.3f}"] for r in range(a.repeats)]
    rows.append(["mean", f"{out['iou_pretrained']:.3f}", f"{out['iou_random']:.3f}",
                 f"{diff.mean():+.3f}" + ("" if se is None else f" ± {se:.3f}"),
                 f"{out['iou_train_pretrained']:.3f} / {out['iou_train_random']:.3f}"])
    table(rows, ["draw", "IoU pretrained", "IoU random", "difference", "train IoU (p / r)"])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))
