"""
The measured numbers. Each subcommand prints a table, then one JSON line as the last line of output.

    python -m bench step config/quickstart.py [--key=value ...]   training-step throughput vs matmul peak
    python -m bench attention [--n=16384] [--ranks=2] [--only=ring] full SDPA vs ring vs torch CP, per rank
    python -m bench strategies CONFIG [--key=value ...]            zero2 vs zero3 vs fsdp2 on 2 ranks here
    python -m bench bf16 [--key=value ...]                         bf16 against fp32, every strategy, 2 ranks
    python -m bench embed                                          scripts/embed.py's tokens/s beside training's
    python -m bench data [--latency_ms=20] [--crops=128]           our reader vs a plain zarr read; S3 training
    python -m bench library [--stores=(100,1000)]                  start-up and memory per rank vs library size
    python -m bench plan CONFIG [--key=value ...]                  the planner, checked against measurement here
    python -m bench heads [--sizes=tiny,small] [--seeds=3]         few wide heads vs many narrow: validation loss
    python -m bench predict [--cases=quickstart,large]             scripts/predict.py's voxels/s vs the forward alone
    python -m bench.gpu                                            every GPU check (bash bench/gpu_check.sh runs it)

Speed is shown here, side by side in one run, never asserted in tests: the machine is noisy, ratios
measured together are what carry over. Where each lives: step.py (the training path), data.py (the reader
and the library), plan.py (the planner's checks), heads.py (head layouts' accuracy), predict.py (survey prediction), gpu.py with gpu_attention.py and gpu_training.py (the
GPU check), s3_loopback.py (a real S3 endpoint on loopback, shared with the tests).
"""
import json
import sys

from bench.data import bench_data, bench_library
from bench.heads import bench_heads
from bench.plan import bench_plan
from bench.predict import bench_predict
from bench.step import bench_attention, bench_bf16, bench_embed, bench_step, bench_strategies
from configurator import ConfigError
from infra import cli

CMDS = {"step": bench_step, "attention": bench_attention, "strategies": bench_strategies, "bf16": bench_bf16,
        "embed": bench_embed, "data": bench_data, "library": bench_library, "plan": bench_plan,
        "heads": bench_heads, "predict": bench_predict}


def main(argv):
    if not argv or argv[0] not in CMDS:
        raise ConfigError(f"usage: python -m bench {{{'|'.join(CMDS)}}} [CONFIG] [--key=value ...]")
    print(json.dumps(CMDS[argv[0]](argv[1:])))
    return 0


if __name__ == "__main__":  # (through infra/cli.py: a bad config or option is one line, as for every command)
    sys.exit(cli.run(main, sys.argv[1:]))
