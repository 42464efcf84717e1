"""The planner (plan.py; `bench.py plan` is it with these checks) against measurements on this machine: its FLOPs
and activation bytes on small models, and its weight/gradient/optimizer memory per strategy against what DeepSpeed
ZeRO-2, ZeRO-3 and FSDP2 really allocate on 2 CPU ranks (every CPU tensor allocation counted, see
bench._memory_worker). And the import graph that keeps the planner out of a circle."""
import bench


def test_flops_and_activations_within_25_percent():
    rows, worst = bench.calibrate()
    assert len(rows) == 15  # 3 configs x (FLOPs without and with half the blocks checkpointed, activations with
    #                               none, half and every block checkpointed)
    assert worst <= 0.25, rows


def test_state_memory_per_strategy_within_25_percent():
    # fp32 on 2 ranks, the `small` model (24.6 M parameters): the three strategies hold very different state
    # (ZeRO-2 replicates the weights, ZeRO-3 and FSDP2 shard them); then bf16 with 16e6-element buckets, where
    # DeepSpeed's buckets (fp32 for ZeRO-3, the compute dtype for ZeRO-2) are the largest terms
    cases = [c for c in bench.MEMORY_CASES if c[0] in ("fp32", "bf16, zero_bucket 16e6")]
    rows, worst = bench.memory_check(cases)
    assert len(rows) == (3 + 2) * 4
    got = {(r["case"], r["strategy"], r["term"]): r for r in rows}
    between = {s: got[("fp32", s, "state between steps")]["measured"] for s in ("zero2", "zero3", "fsdp2")}
    assert between["zero2"] > 1.5 * between["fsdp2"]  # the measurement tells the strategies apart
    assert worst <= 0.25, "\n".join(f"{r['case']} | {r['strategy']} | {r['term']} | {r['planner'] / 2 ** 20:.1f} | "
                                    f"{r['measured'] / 2 ** 20:.1f} MiB | {100 * r['error']:+.1f}%" for r in rows)


def test_the_import_graph_has_no_circle():
    """Every import between the project's files, at the top or inside a function: the graph is acyclic (train.py
    imports plan.py for the dry run; bench.py imports both; plan.py imports neither)."""
    import ast
    import glob
    import os

    from conftest import ROOT
    files = {os.path.basename(p)[:-3]: p for p in glob.glob(os.path.join(ROOT, "*.py"))}
    graph = {}
    for mod, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module.split(".")[0])
        graph[mod] = {d for d in deps if d in files and d != mod}
    assert "plan" in graph["train"] and "plan" in graph["bench"]
    assert not graph["plan"] & {"train", "bench"}, graph["plan"]
    state = {}  # depth-first search: 1 on the current path, 2 done

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import circle: " + " -> ".join(path + [m, d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_plan_py_reads_train_defaults_and_prints_the_dry_runs_plan():
    """configurator.defaults() (train.py's config block read from its source) equals train.py's own globals, and
    `python plan.py CONFIG` prints, JSON last, the plan that train.py's dry run computes."""
    import json
    import subprocess
    import sys

    import configurator
    import plan
    import train
    from conftest import ROOT
    assert configurator.defaults() == {k: getattr(train, k) for k in train.CONFIG_KEYS}
    r = subprocess.run([sys.executable, "plan.py", "config/big_context.py", "--nodes=4"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    printed = json.loads(r.stdout.strip().splitlines()[-1])
    cfg = configurator.defaults()
    configurator.apply(cfg, [f"{ROOT}/config/big_context.py", "--nodes=4"])
    assert printed == json.loads(json.dumps(plan.plan(cfg, 32, "H200", gpus_per_node=8)))
    assert printed["world"] == 32 and {"fits", "mem_per_gpu_gb", "samples_per_s"} <= set(printed)


def test_shapes_flag_head_dims_and_the_aligned_sizes_clear_them():
    """The planner flags ViT-G's heads of 104 and the decoder's heads of 32 (fused attention runs best at 64 and
    128); the aligned sizes beside them (model.py) have the same parameters and no flag, and their attention
    time at plan.py's kernel rates is what every head dim at 128 would give. The smoke test of gpu-check's
    timing by head dim runs on CPU."""
    import torch

    import bench_gpu
    import configurator
    import plan
    assert plan.attention_tflops(128) == 370 and plan.attention_tflops(64) == 324
    assert plan.attention_tflops(104) == 370 * 104 / 128 and plan.attention_tflops(32) == 162
    cfg = configurator.defaults()
    configurator.apply(cfg, [f"{__import__('conftest').ROOT}/config/big_context.py"])
    g = plan.plan(cfg, 128)
    a = plan.plan({**cfg, "model_size": "G_h128"}, 128)
    assert g["head_dims"] == {"enc": 104, "dec": 32} and a["head_dims"] == {"enc": 128, "dec": 128}
    assert any("encoder head dim 104" in f for f in g["shape_flags"])
    assert any("decoder head dim 32" in f for f in g["shape_flags"]) and a["shape_flags"] == []
    assert a["params"] == g["params"]
    assert a["attention_gpu_s_per_sample"] == g["attention_gpu_s_per_sample_at_128"] < g["attention_gpu_s_per_sample"]
    large, aligned = (plan.plan({**cfg, "model_size": m, "cp": 1, "crop": (640, 640, 1024)}, 128)
                      for m in ("large", "large_h64"))
    assert large["head_dims"] == {"enc": 64, "dec": 32} and aligned["head_dims"] == {"enc": 64, "dec": 64}
    rates = bench_gpu.attention_rates(torch.device("cpu"), N=256, dtype=torch.float32, reps=1)
    assert sorted(rates) == [32, 64, 104, 128] and all(f > 0 and fb > 0 for f, fb in rates.values())
