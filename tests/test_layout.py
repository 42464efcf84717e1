"""The layout's rules, read from the files themselves (README: "the shape of the code"):
  * the top level's Python files are the card's files a researcher reads and edits (unetr.py: the fine-tuning head);
  * dependencies run one way: experiments/ -> scripts/ and bench/ -> train.py, data.py -> infra/ -> model.py, unetr.py,
    ring_attention.py, configurator.py, which import only each other. experiments/ (research questions the code
    answers) may import everything, and nothing imports it. infra/ never imports train.py or data.py;
    nothing outside scripts/ and bench/ imports them, neither imports the other, and no import (at the top of a file
    or inside a function) closes a circle. An exception (EXCEPTIONS: none) would be named here and in the README, and
    stays in the rule only while its import is there.
The checker is shown to catch a planted violation of each rule."""
import ast
import os
import shutil

from conftest import ROOT

TOP = {"train", "model", "unetr", "data", "ring_attention", "configurator"}
FOLDERS = ("infra", "scripts", "bench", "experiments")
BOTTOM = {"model", "unetr", "ring_attention", "configurator"}  # what infra/ builds on: they import only each other
EXCEPTIONS = set()  # (importer, imported) against the one way, each one named in the README: none


def modules(root):
    """{module name: path} of the project's Python files: top level and the folders (tests/ aside)."""
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


def layer(m):
    """How high a module stands: 4 the research questions (experiments/), 3 the commands (scripts/, bench/), 2 train.py
    and data.py, 1 infra/, 0 the bottom. A module imports its own layer and the ones below it."""
    if m.startswith("experiments."):
        return 4
    if m.split(".")[0] in ("scripts", "bench"):
        return 3
    if m.startswith("infra."):
        return 1
    return 0 if m in BOTTOM else 2


def why(m, d):
    """The rule an import m -> d against the one way breaks, in words."""
    folder, d_folder = m.split(".")[0], d.split(".")[0]
    if d_folder == "experiments":
        return "nothing imports experiments/: research questions sit on top of the product, never under it"
    if d_folder in ("scripts", "bench"):
        return ("scripts/ and bench/ never import each other" if folder in ("scripts", "bench")
                else "nothing outside scripts/ and bench/ may import them")
    if m in BOTTOM:
        return f"{m}.py is below infra/: it imports only {', '.join(sorted(BOTTOM - {m}))}"
    if d == "train":
        return "infra/ never imports train.py"
    if d == "data":
        return "infra/ never imports data.py"
    return "dependencies run one way"


def violations(root, exceptions=EXCEPTIONS):
    """Every way the tree under `root` breaks the layout's rules, in words (none: [])."""
    mods = modules(root)
    graph = {m: imports(p, mods) - {m} for m, p in mods.items()}
    found = []
    top = {m for m in mods if "." not in m}
    if top != TOP:
        found.append(f"top-level Python files {sorted(top)}, expected {sorted(TOP)}")
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            across = m.split(".")[0] != d.split(".")[0] and layer(m) == layer(d) == 3
            if (layer(d) > layer(m) or across) and (m, d) not in exceptions:
                found.append(f"{m} imports {d}: {why(m, d)}")
    for m, d in sorted(exceptions):
        if d not in graph.get(m, ()):
            found.append(f"the exception {m} -> {d} is gone: the rule (here and in the README) no longer needs it")
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


def copy_tree(tmp_path):
    """The project's Python files copied under tmp_path, to plant violations in."""
    root = tmp_path / "tree"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns(".venv", ".git", "tests", "out", "data", "docs",
                                                               "wheels", ".gpu_site", "__pycache__"))
    return root


def test_the_layout_holds():
    assert violations(ROOT) == []


def test_the_checker_catches_each_planted_violation(tmp_path):
    root = copy_tree(tmp_path)

    def plant(rel, line):
        p = root / rel
        p.write_text(p.read_text() + f"\n{line}\n")

    plant("infra/evaluate.py", "import train")  # the machinery importing the loop (also a circle)
    plant("infra/dryrun.py", "from scripts import plan")  # the core importing a command
    plant("model.py", "from infra import stop")  # the model importing the machinery
    plant("configurator.py", "import data")  # the bottom importing the layer above infra/
    plant("infra/plan.py", "def _f():\n    import data")  # infra/ importing data.py, in a function
    plant("scripts/plan.py", "from bench import plan")  # one command folder importing the other
    plant("bench/plan.py", "from experiments import label_efficiency")  # the product leaning on a research question
    (root / "helpers.py").write_text("x = 1\n")  # a seventh file at the top
    found = "\n".join(violations(str(root)))
    for want in ("infra.evaluate imports train: infra/ never imports train.py",
                 "infra.dryrun imports scripts.plan: nothing outside", "model imports infra.stop: model.py is below",
                 "configurator imports data: configurator.py is below",
                 "infra.plan imports data: infra/ never imports data.py",
                 "scripts.plan imports bench.plan: scripts/ and bench/ never import each other",
                 "bench.plan imports experiments.label_efficiency: nothing imports experiments/",
                 "helpers", "import circle: "):
        assert want in found, (want, found)


def test_the_checker_catches_a_stale_exception():
    """An exception is exact: one whose import is not there is flagged, so that none outlives its need."""
    assert violations(ROOT, {("infra.evaluate", "data")}) == ["the exception infra.evaluate -> data is gone: the "
                                                              "rule (here and in the README) no longer needs it"]
