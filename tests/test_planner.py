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
