"""
What does predicting a survey cost beyond the model's forward? scripts/predict.py's voxels/s against the forward
alone on the same windows, one process, side by side.

    python -m bench predict [--cases=quickstart,large] [--seed=0]

For each case a synthetic survey is written and a segmenter of the case's shape (random weights: speed does not
depend on training) is saved as a model file; then
  predict    python -m scripts.predict on the whole survey (its defaults: overlap 1/2, gaussian, uint8, default
             tile): reading, the forward, blending, dead traces, writing; its own clock (no start-up)
  forward    the same number of windows through model.seg_logits, batched as predict batches them, on inputs
             already in memory: what the model alone costs
overhead = predict's time / the forward's - 1. The cases:

  quickstart   config/quickstart.py's model and windows (tiny, 16 x 16 x 64 voxels in 2 x 2 x 16 patches) over its
               survey (128 x 128 x 256, chunks 32 x 32 x 128)
  large        windows of 128 x 128 x 256 voxels in 16^3 patches (512 tokens, 4 M voxels: every voxel through the
               UNETR head) over 256 x 256 x 512 (chunks 128^3), the tiny model: what a 2-core CPU can run
  production   base_102k's window (640 x 640 x 1024 in 16^3 patches, 102,400 tokens; ViT-L) over 960 x 960 x 1536:
               on a GPU only (a CPU would take hours)
Prints a table, then one JSON line.
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

import configurator
from infra import modelfile, synthetic
from infra.features import prepare
from infra.plan import table

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {  # name: (model size, crop, patch, survey, chunks)
    "quickstart": ("tiny", (16, 16, 64), (2, 2, 16), (128, 128, 256), (32, 32, 128)),
    "large": ("tiny", (128, 128, 256), (16, 16, 16), (256, 256, 512), (128, 128, 128)),
    "production": ("large", (640, 640, 1024), (16, 16, 16), (960, 960, 1536), (128, 128, 128)),
}


def segmenter_file(path, size, crop, patch, seed):
    """A model file of a UNETR segmenter of this shape, random weights (modelfile's format, as export writes it)."""
    from model import build_model
    cfg = {**configurator.defaults(), "task": "segment", "model_size": size, "crop": list(crop), "patch": list(patch),
           "seg_head": "unetr", "classes": 2, "label_var": "fault"}
    torch.manual_seed(seed)
    model = build_model(cfg)
    torch.save({"format": modelfile.FORMAT, "version": modelfile.VERSION,
                "model": {k: v.detach().contiguous() for k, v in model.state_dict().items()}, "config": cfg,
                "step": 0, "encoder_only": False, "source": {"tag": "bench"}}, path)
    return path


def forward_seconds(path, crop, windows, batch, device):
    """Seconds for `windows` windows through seg_logits, `batch` at a time, on random inputs in memory."""
    model, _ = modelfile.load(path)
    prepare(model, crop)
    model.to(device).eval()
    x = torch.randn((min(batch, windows), 1) + tuple(crop), device=device)
    with torch.no_grad():
        model.seg_logits(x[:1])  # (warm-up)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for n in range(0, windows, batch):
            torch.sigmoid(model.seg_logits(x[:min(batch, windows - n)]))
        if device.type == "cuda":
            torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_predict(argv):
    a = {"cases": "quickstart,large", "seed": 0}
    for arg in argv:
        k, _, v = arg.lstrip("-").partition("=")
        configurator.need(k in a and v, f"bench predict takes --cases=NAME,NAME ({', '.join(CASES)}) and --seed=N, not {arg!r}")
        a[k] = v if k == "cases" else int(v)
    cases = a["cases"].split(",")
    configurator.need(all(c in CASES for c in cases), f"--cases={a['cases']!r}: from {', '.join(CASES)}")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    configurator.need(device.type == "cuda" or "production" not in cases,
             "--cases=production needs a GPU (a 102,400-token window through ViT-L and every voxel of it through the "
             "UNETR head would take hours on a CPU): run it on one, or choose quickstart,large")
    env = dict(os.environ)
    if device.type == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    rows, out = [], {"bench": "predict", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "cases": {}}
    with tempfile.TemporaryDirectory() as d:
        for name in cases:
            size, crop, patch, shape, chunks = CASES[name]
            vol = synthetic.synthetic_volume(shape, seed=a["seed"] + 1)
            store = synthetic.write_mdio(f"{d}/{name}.mdio", vol, chunks=chunks)
            path = segmenter_file(f"{d}/{name}.pt", size, crop, patch, a["seed"])
            r = subprocess.run([sys.executable, "-m", "scripts.predict", path, store, f"--out={d}/{name}.zarr"],
                               cwd=HERE, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"scripts.predict failed (exit {r.returncode}): {r.stderr[-2000:]}")
            p = json.loads(r.stdout.strip().splitlines()[-1])
            f = forward_seconds(path, crop, p["windows_computed"], p["batch"], device)
            voxels = math.prod(shape)
            res = {"windows": p["windows"], "windows_computed": p["windows_computed"], "recompute": p["recompute"],
                   "tile": p["tile"], "batch": p["batch"], "predict_s": p["seconds"], "forward_s": round(f, 3),
                   "predict_voxels_per_s": p["voxels_per_s"], "forward_voxels_per_s": round(voxels / f, 1),
                   "overhead": round(p["seconds"] / f - 1, 3)}
            out["cases"][name] = res
            rows.append([name, f"{crop}", f"{shape}", p["windows"], f"{p['windows_computed']} ({p['recompute']}x)",
                         f"{p['seconds']:.2f}", f"{f:.2f}", f"{p['voxels_per_s']:,.0f}", f"{voxels / f:,.0f}",
                         f"{100 * res['overhead']:+.0f} %"])
    print(f"\nscripts.predict against the segmenter's forward alone on the same windows, one process ({out['device']})")
    table(rows, ["case", "window", "survey", "windows", "computed", "predict s", "forward s", "predict vox/s",
                 "forward vox/s", "overhead"])
    return out
