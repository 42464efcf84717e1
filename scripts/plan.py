"""
Will it fit, and how fast? The planner's answer for a config on a cluster, as a table and a JSON line last.

    python -m scripts.plan config/big_context.py [--nodes=16 --gpu=H100 --mfu=0.35 ...]

Config files and --key=value overrides as train.py takes them; --gpu (a name in infra/plan.py's GPUS) and
--mfu (the efficiency assumed outside attention) choose the hardware. The model behind the numbers, and how
`python -m bench plan` checks it against measurement: infra/plan.py. Below the plan, the same widths at the other
head layout (the model size's own heads where the config sets heads / dec_heads, else heads of 128 or 64): step time,
samples/s and MFU side by side, so that the choice of heads stays visible; the JSON's head_layouts holds them.
"""
import json
import sys

import configurator
from infra import cli
from infra.plan import config_plan, head_layouts, report, table


def main(argv):
    cfg, p = config_plan(argv, configurator.check_config)
    report(p, " ".join(a for a in argv if not a.startswith("--")) or "defaults")
    rows = head_layouts(cfg, p)  # the config's heads against the other split of the same widths
    if rows:
        print("\nthe same widths, two head layouts (heads = width / head dim; the planner's kernel rates by head dim):")
        table([[r["layout"], f"{r['heads']} x {r['head_dims']['enc']}", f"{r['dec_heads']} x {r['head_dims']['dec']}",
               f"{r['step_s']:.3g} s", f"{r['samples_per_s']:.3g}", f"{100 * r['mfu']:.1f} %"] for r in rows],
              ["layout", "encoder heads", "decoder heads", "step", "samples/s", "MFU"])
    print(json.dumps({**p, "head_layouts": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))
