"""
Export: one model file out of any complete checkpoint, whatever wrote it (ZeRO-2, ZeRO-3, FSDP2; any rank count).

    python -m scripts.export OUT_DIR                 # the newest complete checkpoint -> OUT_DIR/model_step_NNNNNNN.pt
    python -m scripts.export OUT_DIR --tag=step_500  # another one (step_0000500, step_500 and 500 all name it)
    python -m scripts.export OUT_DIR --encoder_only  # the encoder alone  -> OUT_DIR/model_step_NNNNNNN_encoder.pt
    python -m scripts.export OUT_DIR --out=PATH      # elsewhere (a directory: the default name inside it)
    python -m scripts.export --check=FILE            # load a model file as load() does (strict) and say what it is

An existing file at the output is replaced only when it is a model file exported from the same checkpoint (the same
weights again; with --overwrite, from another checkpoint too); anything else there is never written over, and a path
inside the run's checkpoints is refused (infra/outputs.py), all before the checkpoint is read.

It prints the file's path (and nothing else) on stdout, so `M=$(python -m scripts.export out/run)` works; what it
did goes to stderr. The file's format and the functions that read it: infra/modelfile.py.
"""
import argparse
import sys

import torch

from infra import cli
from infra.modelfile import FORMAT, export, load


def main(argv):
    ap = argparse.ArgumentParser(prog="python -m scripts.export", description=__doc__.split("\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", help="a run's out_dir (its checkpoints are in out_dir/ckpt)")
    ap.add_argument("--tag", default=None, help="a checkpoint: step_0000500, step_500 or 500 (default: the newest)")
    ap.add_argument("--out", default=None, help="the file (default: OUT_DIR/model_step_NNNNNNN[_encoder].pt)")
    ap.add_argument("--encoder_only", action="store_true", help="the encoder's weights only, no decoder")
    ap.add_argument("--check", default=None, metavar="FILE", help="load a model file (strict) and describe it")
    ap.add_argument("--overwrite", action="store_true", help="replace a model file exported from another checkpoint")
    a = ap.parse_args(argv)
    if bool(a.out_dir) == bool(a.check):
        ap.error("give a run's OUT_DIR, or --check=FILE")
    if a.check:
        model, meta = load(a.check)
        n = sum(p.numel() for p in model.parameters())
        src = meta.get("source") or {}
        print(f"{a.check}: {FORMAT} v{meta['version']}, MAE {meta['config']['model_size']} "
              f"({'encoder only, ' if model.encoder_only else ''}{n / 1e6:.2f} M params), patch "
              f"{tuple(meta['config']['patch'])}, step {meta['step']}, from {src.get('strategy')} on "
              f"{src.get('world')} ranks in {src.get('dtype')}: loads strictly")
        return 0
    path = export(a.out_dir, a.tag, a.out, a.encoder_only, a.overwrite)
    # what was written reads back as promised (memory-mapped: the weights are not read again)
    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    n = sum(t.numel() for t in obj["model"].values())
    print(f"exported {a.out_dir} {obj['source']['tag']} ({obj['source']['strategy']}, {obj['source']['world']} "
          f"ranks, {obj['source']['dtype']}): {len(obj['model'])} fp32 tensors, {n / 1e6:.2f} M params"
          f"{', encoder only' if a.encoder_only else ''}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))
