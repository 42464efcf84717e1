"""
Do fewer, wider heads cost accuracy? The same widths split two ways, trained side by side on this machine.

    python -m bench heads [--sizes=tiny,small] [--seeds=3] [--seed=0] [--max_steps=500] [--key=value ...]

The production configs split ViT-L's and ViT-G's widths into heads of 128 (model.SIZES' own heads of 64, 104 and
the decoders' 32 run the GPU's fused attention slower: python -m scripts.plan CONFIG). Heads change no parameter,
so with the same seed both layouts start from the same weights, read the same crops and are validated on the same
masked patches: the paired difference of their validation losses over seeds is the cost of the split alone. Per
size, the size's own heads against the widest that divide its widths by 128 (else 64, else one head per stack):

    tiny   96 / 4 heads of 24, decoder 64 / 4 of 16      against  1 of 96, 1 of 64
    small  384 / 6 of 64, decoder 256 / 8 of 32           against  3 of 128, 2 of 128

on config/quickstart.py's data, crops, patches, loss and recipe (norm_pix_loss; --key=value changes any of it).
Each run is one train.py process, world 1, every core. Prints a table, then one JSON line.
"""
import math
import os
import subprocess
import sys
import tempfile
import time

from infra.evaluate import read_floor, read_losses
from infra.plan import table
from model import SIZES, aligned_heads

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wide_heads(size):
    """The fewest heads of 128 (else 64, else 1) that divide each of the size's two widths: (heads, dec_heads)."""
    dim, _, _, dec_dim, _, _ = SIZES[size]
    return aligned_heads(dim) or 1, aligned_heads(dec_dim) or 1


def run(args, out):
    """One train.py run (config/quickstart.py and args) into out: (its last validation loss, its floor, s/step)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()), DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    t0 = time.time()
    r = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), os.path.join(HERE, "config/quickstart.py"),
                        *args, f"--out_dir={out}", "--figures=False", "--ckpt_interval=1000000"], cwd=HERE, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"train.py {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    train, val = read_losses(os.path.join(out, "log.jsonl"))
    return val[max(val)], read_floor(os.path.join(out, "log.jsonl")), (time.time() - t0) / max(train)


def mean_se(xs):
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else float("nan"))


def bench_heads(argv):
    opts = {"sizes": "tiny,small", "seeds": "3", "seed": "0", "max_steps": "500"}
    rest = []
    for a in argv:
        k, _, v = a.lstrip("-").partition("=")
        (opts.__setitem__(k, v) if k in opts and a.startswith("--") else rest.append(a))
    sizes = opts["sizes"].split(",")
    bad = [s for s in sizes if s not in SIZES]
    if bad or int(opts["seeds"]) < 2:
        raise SystemExit(f"--sizes: names of model.SIZES ({list(SIZES)}), got {bad}; --seeds >= 2 (a standard error)")
    seeds = [int(opts["seed"]) * 1000 + s for s in range(int(opts["seeds"]))]
    root = tempfile.mkdtemp(prefix="bench_heads_")
    rows, out = [], {}
    for size in sizes:
        h, dh = wide_heads(size)
        _, _, h0, _, _, dh0 = SIZES[size]
        res = {"own": [], "wide": []}
        for s in seeds:
            for layout, heads in (("own", (h0, dh0)), ("wide", (h, dh))):
                val, floor, spp = run([f"--model_size={size}", f"--heads={heads[0]}", f"--dec_heads={heads[1]}",
                                       f"--seed={s}", f"--max_steps={opts['max_steps']}", *rest],
                                      os.path.join(root, f"{size}_{layout}_{s}"))
                res[layout].append({"seed": s, "val_loss": val, "floor": floor, "s_per_step": spp})
                print(f"{size} {layout} ({heads[0]} / {heads[1]} heads) seed {s}: validation {val:.4f} "
                      f"(floor {floor:.4f}), {1000 * spp:.0f} ms/step", file=sys.stderr, flush=True)
        d, se = mean_se([w["val_loss"] - o["val_loss"] for o, w in zip(res["own"], res["wide"])])
        dim, _, _, dec_dim, _, _ = SIZES[size]
        for layout, heads in (("own", (h0, dh0)), ("wide", (h, dh))):
            m, sem = mean_se([x["val_loss"] for x in res[layout]])
            rows.append([size, layout, f"{heads[0]} x {dim // heads[0]}", f"{heads[1]} x {dec_dim // heads[1]}",
                         f"{m:.4f} ± {sem:.4f}", f"{sum(x['floor'] for x in res[layout]) / len(seeds):.4f}",
                         f"{1000 * sum(x['s_per_step'] for x in res[layout]) / len(seeds):.0f}",
                         f"{d:+.4f} ± {se:.4f}" if layout == "wide" else ""])
        out[size] = {**res, "wide_minus_own": d, "se": se, "heads": {"own": [h0, dh0], "wide": [h, dh]}}
    print(f"the same widths, two head layouts, {len(seeds)} seeds each (paired: the same init, crops and masks), "
          f"{opts['max_steps']} steps of config/quickstart.py{' ' + ' '.join(rest) if rest else ''}:")
    table(rows, ["size", "layout", "encoder heads", "decoder heads", "val loss (mean ± se)", "floor (mean)", "ms/step (whole run / steps)",
                 "wide − own (paired)"])
    return {"bench": "heads", "seeds": seeds, "max_steps": int(opts["max_steps"]), "overrides": rest, **out}
