"""
Will it fit, and how fast? The planner's answer for a config on a cluster, as a table and a JSON line last.

    python -m scripts.plan config/big_context.py [--nodes=16 --gpu=H100 --mfu=0.35 ...]

Config files and --key=value overrides as train.py takes them; --gpu (a name in infra/plan.py's GPUS) and
--mfu (the efficiency assumed outside attention) choose the hardware. The model behind the numbers, and how
`python -m bench plan` checks it against measurement: infra/plan.py.
"""
import json
import sys

import train
from infra import cli
from infra.plan import config_plan, report


def main(argv):
    cfg, p = config_plan(argv, train.check_config)
    report(p, " ".join(a for a in argv if not a.startswith("--")) or "defaults")
    print(json.dumps(p))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))
