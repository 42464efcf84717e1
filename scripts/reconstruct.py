"""
What does the model reconstruct? Pictures of a masked crop and its reconstruction, and the loss curves.

    python -m scripts.reconstruct out/quickstart                       # newest checkpoint, exported on the fly
    python -m scripts.reconstruct out/quickstart/model_step_0000500.pt --origin=(96,40,100) --mask_ratio=0.9 --seed=3
    python -m scripts.reconstruct MODEL --data=s3://bucket/survey.mdio --crop=(64,64,256) --out=recon.png

It reads a crop of a store (the run's first store by default; local or s3://), masks it (mask_ratio, seed),
runs the model on one device (CPU, or one GPU with --device=cuda), prints the masked MSE and writes the
four-panel figure that training writes at each evaluation (train.py -> infra/evaluate.py -> recon_figure):

    original | masked input (masked patches blank) | reconstruction | reconstruction + visible patches

for the inline, crossline and time slices through the crop's centre, in the seismic gray colormap with one
symmetric clip per row (the 99th percentile of |original|), axes in the volume's inline / crossline / time
sample indices. With norm_pix_loss the model predicts each patch normalised by its own mean and std: the
figure shows the prediction de-normalised with the target patch's mean and std (evaluate.pred_to_voxels) and
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

import configurator
import data
import model as M
from infra import cli, library, modelfile, outputs, reader
from infra.evaluate import centre_parts, figure_title, join_parts, pred_to_voxels, recon_figure, voxel_views
from infra.plan import activation_bytes
from model import build_model, token_grid


def memory_needed(model_cfg):
    """Bytes one device needs to run the config's MAE forward (fp32, no gradients), by the planner
    (plan.activation_bytes with checkpointing: every block's input kept, one block's working set at a
    time; an upper bound for a forward without autograd) plus the fp32 weights and the input crop."""
    m = build_model(model_cfg, device="meta")
    act = sum(activation_bytes(m, 1, 1, 4, True))
    return 4 * sum(p.numel() for p in m.parameters()) + act + 4 * math.prod(model_cfg["crop"]) * 3


def device_memory(device):
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1] * 0.92
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model file (scripts/export.py) or a run's out_dir (its newest checkpoint)")
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
    ap.add_argument("--read_timeout_s", type=float, default=30.0, help="a request not answered by then is retried")
    ap.add_argument("--read_retries", type=int, default=6, help="retries of a failing request, then an error")
    ap.add_argument("--overwrite", action="store_true", help="replace a figure of reconstruct made otherwise")
    a = ap.parse_args(argv)
    configurator.need(a.seed >= 0, f"--seed={a.seed}: seeds are >= 0")
    configurator.need(a.read_timeout_s > 0 and a.read_retries >= 0, "--read_timeout_s must be > 0 and --read_retries >= 0")
    # ---- the model: a file, or a run's checkpoint exported in memory
    if os.path.isdir(a.model):
        sd, meta = modelfile.state_dict_from_checkpoint(a.model, a.tag)
        what = f"{a.model} ({meta['tag']})"
    else:
        sd, meta = modelfile.read_model_file(a.model)
        what = os.path.basename(a.model)
    if meta.get("encoder_only"):
        raise configurator.ConfigError(f"{a.model} holds the encoder only: it cannot reconstruct. Export without "
                                       f"--encoder_only (python -m scripts.export OUT_DIR)")
    if meta["config"]["task"] != "mae":
        raise configurator.ConfigError(f"{a.model} is a fine-tuned segmenter (task={meta['config']['task']!r}): it "
                                       f"predicts classes, not voxels; its figures are the run's own "
                                       f"(figures/segment_step_N.png). Reconstruct with the pretrained model")
    cfg = dict(meta["config"])
    cfg["patch"], cfg["crop"] = tuple(cfg["patch"]), tuple(cfg["crop"])
    patch = cli.triple(a.patch, "patch")
    if patch and patch != cfg["patch"]:
        raise configurator.ConfigError(f"the model was trained with patch {cfg['patch']} and --patch is {patch}: a "
                                       f"model's patch size cannot change (its patch embedding is "
                                       f"{math.prod(cfg['patch'])} voxels wide); drop --patch")
    crop = cli.triple(a.crop, "crop") or cfg["crop"]
    if len(crop) != 3 or any(c % p for c, p in zip(crop, cfg["patch"])):
        raise configurator.ConfigError(f"crop {crop} must be 3 multiples of the model's patch {cfg['patch']}")
    mask_ratio = cfg["mask_ratio"] if a.mask_ratio is None else a.mask_ratio
    configurator.check_masking({"mask_ratio": mask_ratio, "crop": crop, "patch": cfg["patch"]})  # (what training refuses)
    # one process: the run's mask strata are kept (cp = 1 draws the same masks as any cp, see model.py)
    strata = cfg["mask_strata"] or cfg["cp"]
    grid = token_grid(crop, cfg["patch"])
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
    model = build_model(mcfg)
    model.load_state_dict(sd, strict=True)
    model.to(device).eval()

    # ---- the crop
    opts = reader.ReadOptions(anon=a.s3_anon or cfg.get("s3_anon", False),
                              endpoint_url=a.s3_endpoint or cfg.get("s3_endpoint") or None, retries=a.read_retries,
                              timeout_s=a.read_timeout_s)
    first = library.expand(cfg["data_paths"][:1], opts)[0] if not a.data else None  # (a glob or a @manifest too)
    store = a.data or (first["url"] if isinstance(first, dict) else first)
    vol = reader.Volume(store, opts)
    origin = cli.triple(a.origin, "origin", least=0)
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
    # ---- the figure's path, checked before any work: a figure of reconstruct made otherwise is replaced only with
    # --overwrite, anything else there never; the default is the run's figures/ folder (or the model file's folder)
    default = not a.out
    out = a.out or os.path.join(a.model if os.path.isdir(a.model) else os.path.dirname(os.path.abspath(a.model)),
                                "figures", f"reconstruct_step_{meta['step']}_{'_'.join(map(str, origin))}.png")
    record = {"made_by": "scripts.reconstruct", "model": modelfile.identity(a.model, a.tag),
              "data": store if outputs.is_remote(store) else os.path.abspath(store), "origin": list(origin),
              "crop": list(crop), "mask_ratio": mask_ratio, "seed": a.seed}
    outputs.refuse_inside(out, [store, os.path.join(a.model, "ckpt") if os.path.isdir(a.model) else a.model])
    if default:
        os.makedirs(os.path.dirname(out), exist_ok=True)  # (its own folder: the run's figures/)
    outputs.check_folder(out)
    outputs.figure_target(out, record, a.overwrite, made_by="scripts.reconstruct")
    x = torch.from_numpy(vol.read(origin, crop))[None, None].to(device)  # (1, 1, Z, Y, X), normalised

    # ---- mask, forward, error
    noise = M.mask_noise(a.seed, [0], model.L, stream="val").to(device)
    with torch.no_grad():
        ids_keep = model.keep_ids(noise)
        loss, pred, mask = model(x, ids_keep=ids_keep)
        recon_patches = pred_to_voxels(pred, M.patchify(x, model.patch), model.norm_pix_loss)
        masked = mask[0] > 0.5
        vox_mse = (recon_patches[0][masked] - M.patchify(x, model.patch)[0][masked]).pow(2).mean().item()
    mse = loss.item()
    xs, rs, ms = voxel_views(model, x, pred, mask)
    slices = join_parts([centre_parts(xs, rs, ms, 0, crop[0])])
    title = figure_title(f"{what} on {os.path.basename(store.rstrip('/'))}, crop {crop} at {origin}", meta["step"],
                         mse, 1 - model.n_keep() / model.L, model.norm_pix_loss)
    recon_figure(out, slices, origin, title, record)
    extra = f" (in voxel units after de-normalising: {vox_mse:.4f})" if model.norm_pix_loss else ""
    print(f"masked MSE {mse:.6f}{extra} over {model.L - model.n_keep()} masked patches of {model.L}; crop {crop} at "
          f"{origin} of {store}; figure {out}")
    print(json.dumps({"masked_mse": mse, "voxel_mse": vox_mse, "origin": list(origin), "crop": list(crop),
                      "masked_patches": model.L - model.n_keep(), "tokens": model.L, "figure": out}))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))
