"""
Will it fit, and how fast? The planner's answer for a config on a cluster, as a table and a JSON line last.

    python -m scripts.plan config/big_context.py [--nodes=16 --gpu=H100 --mfu=0.35 ...]

Config files and --key=value overrides as train.py takes them; --gpu (a name in infra/plan.py's GPUS) and
--mfu (the efficiency assumed outside attention) choose the hardware. The model behind the numbers, and how
`python -m bench plan` checks it against measurement: infra/plan.py.
"""
import argparse
import json
import sys

import configurator
from infra import cli
from infra.plan import ACT_MARGIN, GPUS, plan, table


def report(p, name):
    """Print plan p (plan()'s dict) as a table; name: where the config came from."""
    print(f"{name} on {p['world'] // p['gpus_per_node']} x {p['gpus_per_node']} {p['gpu']} = {p['world']} GPUs "
          f"(dp {p['dp']} x cp {p['cp']}), {p['strategy']}, {p['ckpt_blocks']} of {p['blocks']} blocks checkpointed")
    rows = [["params", f"{p['params'] / 1e6:.1f} M"], ["tokens / visible", f"{p['tokens']:,} / {p['visible']:,}"],
            ["encoder / decoder tokens per rank", f"{p['enc_tokens_per_rank']:,.0f} / {p['dec_tokens_per_rank']:,.0f}"],
            ["FLOPs per sample (fwd+bwd)", f"{p['flops_per_sample'] / 1e12:.1f} TFLOP"]]
    for k in ("zero2", "zero3", "fsdp2"):
        rows.append([f"memory per GPU, {k}", f"{p['mem_by_strategy_gb'][k]:.1f} GB (states {p['states_gb'][k]:.1f})"])
    first = {"enc": "encoder", "dec": "decoder"}[p["ckpt_order"][0]]
    fit = (f"{p['ckpt_blocks_fit']} -> {p['samples_per_s_ckpt_fit']:.2f} samples/s" if p["ckpt_blocks_fit"] is not None
           else "none fits")
    rows += [["activations per GPU", f"{p['activations_gb']:.1f} GB (every block checkpointed: "
                                     f"{p['activations_full_ckpt_gb']:.1f} GB, none: {p['activations_no_ckpt_gb']:.1f} GB)"],
             ["checkpointed blocks", f"{p['ckpt_blocks']} of {p['blocks']} ({first} blocks first: most bytes per "
                                     f"recomputed FLOP)"],
             [f"least that fits (activations x {ACT_MARGIN})", f"{fit}; every block: "
                                                             f"{p['samples_per_s_full_ckpt']:.2f} samples/s"],
             ["ring traffic per step per rank", f"{p['ring_gb_per_step_per_rank']:.1f} GB, "
                                               f"{'hidden' if p['ring_hidden_by_compute'] else 'NOT hidden'} by compute"],
             ["step time (per rank)", f"{p['step_s']:.1f} s = max({p['flop_bound_s_per_step']:.1f} s FLOP-bound, "
                                      f"{p['attention_s_per_step']:.1f} s attention + "
                                      f"{p['other_s_per_step']:.1f} s rest)"],
             ["predicted samples/s", f"{p['samples_per_s']:.2f} (recompute: "
                                     f"{p['recompute_flops_per_sample'] / 1e12:.1f} TFLOP per sample)"],
             ["stop lead (SLURM's warning)", f"{p['stop_lead_s']} s: 60 + 1.5 x (2 steps + an evaluation of "
                                             f"{p['eval_s']:.1f} s + the checkpoint write of {p['ckpt_s']:.1f} s)"],
             ["S3 read per node at that rate", f"{p['s3_gb_per_s_per_node']:.2f} GB/s (float32, uncompressed)"],
             ["fits", f"{'yes' if p['fits'] else 'NO'}: {p['mem_per_gpu_gb']:.1f} GB of {p['limit_gb']} GB usable"]]
    table(rows, ["quantity", "value"])
    print("\nshapes per rank (tokens: this rank's x the sequence attended to; attention rate: ATTN_TFLOPS, plan.py):")
    table(p["shapes"], ["stack", "op", "shape", "tokens", "attention rate"])
    for f in p["shape_flags"]:
        print(f"  flag: {f}")
    print(f"  attention, fwd + bwd, at those rates: {p['attention_gpu_s_per_sample']:.1f} GPU-s per sample "
          f"({p['attention_gpu_s_per_sample_at_128']:.1f} if every head dim ran at 128's rate)")


def config_plan(argv):
    """(the config of argv: config files and --key=value over the defaults; its plan)."""
    ap = argparse.ArgumentParser(prog="python -m scripts.plan", description=__doc__.split("\n")[1])
    ap.add_argument("configs", nargs="*", help="config files (config/*.py), then --key=value overrides, as train.py")
    ap.add_argument("--gpu", default="H200", help=f"one of {sorted(GPUS)}")
    ap.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilisation outside attention (0.4)")
    a, overrides = ap.parse_known_args(argv)
    if a.gpu not in GPUS:
        raise configurator.ConfigError(f"--gpu={a.gpu!r} is not one of {sorted(GPUS)}")
    cfg = configurator.defaults()
    configurator.apply(cfg, a.configs + overrides)
    gpn = cfg["gpus_per_node"] or 8
    return cfg, plan(cfg, cfg["nodes"] * gpn, a.gpu, a.mfu, gpn)


def main(argv):
    cfg, p = config_plan(argv)
    report(p, " ".join(a for a in argv if not a.startswith("--")) or "defaults")
    print(json.dumps(p))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))
