"""The layout's rules, read from the files themselves (README: "the shape of the code"):
  * the top level's Python files are the card's files a researcher reads and edits (unetr.py: the fine-tuning head);
  * dependencies run one way: scripts/ and bench/ -> the top level -> infra/ -> model.py, unetr.py, ring_attention.py,
    configurator.py (data.py may use infra/'s reader and library); infra/ never imports train.py, nothing outside
    scripts/ and bench/ imports them, and no import (at the top of a file or inside a function) closes a circle.
The checker is shown to catch a planted violation of each rule."""
import ast
import os
import shutil

from conftest import ROOT

TOP = {"train", "model", "unetr", "data", "ring_attention", "configurator"}
FOLDERS = ("infra", "scripts", "bench")
BOTTOM = {"model", "unetr", "ring_attention", "configurator"}  # what infra/ builds on: they import none of the folders


def modules(root):
    """{module name: path} of the project's Python files: top level and the three folders (tests/ aside)."""
    out = {f[:-3]: os.path.join(root, f) for f in os.listdir(root) if f.endswith(".py")}
    for d in FOLDERS:
        for f in os.listdir(os.path.join(root, d)):
            if f.endswith(".py") and f != "__init__.py":
                out[f"{d}.{f[:-3]}"] = os.path.join(root, d, f)
    return out


def imports(path, mods):
    """The project modules a file imports, anywhere in it."""
    deps = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        deps |= {n for n in names if n in mods}
    return deps


def violations(root):
    mods = modules(root)
    graph = {m: imports(p, mods) - {m} for m, p in mods.items()}
    found = []
    top = {m for m in mods if "." not in m}
    if top != TOP:
        found.append(f"top-level Python files {sorted(top)}, expected {sorted(TOP)}")
    for m, deps in graph.items():
        where = m.split(".")[0] if "." in m else "top"
        for d in deps:
            d_where = d.split(".")[0] if "." in d else "top"
            if d_where in ("scripts", "bench") and where != d_where:
                found.append(f"{m} imports {d}: nothing outside scripts/ and bench/ may import them")
            if where == "infra" and d == "train":
                found.append(f"{m} imports train: infra/ never imports train.py")
            if m in BOTTOM and d_where == "infra":
                found.append(f"{m} imports {d}: {m}.py is below infra/")
    state = {}  # depth-first search for a circle: 1 on the current path, 2 done

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                found.append("import circle: " + " -> ".join(path + [m, d]))
            elif d not in state:
                visit(d, path + [m])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return found


def test_the_layout_holds():
    assert violations(ROOT) == []


def test_the_checker_catches_each_planted_violation(tmp_path):
    root = tmp_path / "tree"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns(".venv", ".git", "tests", "out", "data", "docs",
                                                               "wheels", ".gpu_site", "__pycache__"))

    def plant(rel, line):
        p = root / rel
        p.write_text(p.read_text() + f"\n{line}\n")

    plant("infra/evaluate.py", "import train")  # the machinery importing the loop (also a circle)
    plant("infra/dryrun.py", "from scripts import plan")  # the core importing a command
    plant("model.py", "from infra import stop")  # the model importing the machinery
    (root / "helpers.py").write_text("x = 1\n")  # a sixth file at the top
    found = "\n".join(violations(str(root)))
    for want in ("infra.evaluate imports train", "infra.dryrun imports scripts.plan", "model imports infra.stop",
                 "helpers", "import circle: "):
        assert want in found, (want, found)
