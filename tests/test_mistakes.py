"""Nothing a user types damages their data: the mistakes people make by accident, each through the real command.

The classes (tests/README.md says where each is tested):
  1. outputs: written whole or not at all, never over what the command did not write, never inside an input;
  2. torn files: what a crash can cut short is read tolerantly; damage no crash makes is one line naming the file;
  3. one error line: every option and config key checked before work, with the fix named;
  4. interruptions end clearly (here: a command's Ctrl-C; training's in test_preempt.py, a killed rank's in
     test_launch.py);
  5. advice that is right: make_synthetic writes only where nothing is; data that cannot train is refused once.
Each class has the cases the issue names and one more of the same kind."""
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr

import configurator
import train
from conftest import ROOT, job_env, run_train, small_args
from infra import checkpoint, lease, synthetic


def command(*args, env=None, timeout=300):
    """python -m scripts.NAME ... (or python train.py ...), as a user runs it."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env or job_env(), capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(r, *says, code=2):
    """The command failed with `code`, its last line is one `error:` line holding every string of `says`, and no
    traceback was shown. Returns that line."""
    lines = (r.stdout + r.stderr).strip().splitlines()
    last = lines[-1] if lines else ""
    assert r.returncode == code and last.startswith("error:"), (r.returncode, r.stderr[-3000:])
    assert all(s in last for s in says), (says, last)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return last


def snapshot(path):
    """{relative path: sha256} of every file under `path` (or of the file): to show that nothing changed."""
    if os.path.isfile(path):
        return {"": hashlib.sha256(open(path, "rb").read()).hexdigest()}
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            f = os.path.join(root, n)
            out[os.path.relpath(f, path)] = hashlib.sha256(open(f, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def models(small_store, tmp_path_factory):
    """Two small runs, A and B (other seeds: other weights), 4 steps each on one process: (out_dir A, out_dir B)."""
    root = tmp_path_factory.mktemp("models")
    out = []
    for name, seed in (("A", 0), ("B", 1)):
        d = root / name
        r = run_train(small_args(small_store, d, max_steps=4, seed=seed))
        assert r.returncode == 0, r.stderr[-3000:]
        out.append(d)
    return tuple(out)


# -----------------------------------------------------------------------------
# 1. outputs


@pytest.mark.slow
def test_export_writes_only_model_files_and_only_over_its_own(models, tmp_path):
    a, b = models
    log = a / "log.jsonl"
    before = snapshot(log)
    one_error_line(command("-m", "scripts.export", str(a), f"--out={log}"), "is a file that is not a model file")
    assert snapshot(log) == before  # the run's log is whole (it used to be replaced by a model file)
    m = tmp_path / "m.pt"
    assert command("-m", "scripts.export", str(a), f"--out={m}").returncode == 0
    assert command("-m", "scripts.export", str(a), f"--out={m}").returncode == 0  # the same checkpoint: again
    a_file = snapshot(m)
    one_error_line(command("-m", "scripts.export", str(b), f"--out={m}"), "made with other inputs or settings",
                   "--overwrite")
    assert snapshot(m) == a_file
    r = command("-m", "scripts.export", str(b), f"--out={m}", "--overwrite")
    assert r.returncode == 0 and r.stdout.strip() == str(m), r.stderr[-2000:]
    import torch
    assert torch.load(m, weights_only=True)["source"]["ckpt_dir"] == str(b / "ckpt")
    # --overwrite replaces its own kind of output only; inside the checkpoints, or in a folder that is not there
    one_error_line(command("-m", "scripts.export", str(b), f"--out={log}", "--overwrite"), "not a model file")
    one_error_line(command("-m", "scripts.export", str(a), f"--out={a / 'ckpt' / 'x.pt'}"), "inside the input")
    one_error_line(command("-m", "scripts.export", str(a), f"--out={tmp_path / 'nowhere' / 'm.pt'}"),
                   "does not exist", "mkdir -p")
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]  # no temporary left behind


def test_library_index_never_writes_over_a_file_that_is_not_its_manifest(small_store, tmp_path):
    stores = tmp_path / "lib"
    stores.mkdir()
    for n in ("a", "b"):
        shutil.copytree(small_store, stores / f"{n}.mdio")
    pattern = str(stores / "*.mdio")
    csv = tmp_path / "EXISTING.csv"
    for text in ("a,b,c\n", "a,b,c\n1,2,3\n4,5"):  # one line; a longer file whose last line has no newline
        csv.write_text(text)
        one_error_line(command("-m", "scripts.library", "index", pattern, f"--out={csv}"),
                       "is a file that is not a manifest")
        assert csv.read_text() == text  # byte for byte: no line lost, even the last
    one_error_line(command("-m", "scripts.library", "index", pattern, f"--out={tmp_path / 'no' / 'm.jsonl'}"),
                   "does not exist")
    # a manifest of other stores: refused; --add keeps its lines, --overwrite replaces them
    m = tmp_path / "m.jsonl"
    assert command("-m", "scripts.library", "index", str(stores / "a.mdio"), f"--out={m}").returncode == 0
    one_error_line(command("-m", "scripts.library", "index", str(stores / "b.mdio"), f"--out={m}"),
                   "is a manifest of 1 other store", "--add", "--overwrite")
    assert command("-m", "scripts.library", "index", str(stores / "b.mdio"), f"--out={m}", "--add").returncode == 0
    assert [json.loads(x)["url"] for x in m.read_text().splitlines()] == [str(stores / "a.mdio"), str(stores / "b.mdio")]
    assert command("-m", "scripts.library", "index", str(stores / "b.mdio"), f"--out={m}",
                   "--overwrite").returncode == 0
    assert [json.loads(x)["url"] for x in m.read_text().splitlines()] == [str(stores / "b.mdio")]
    # an interrupted index (its .partial: one whole line, one cut short) goes on: only the other store is opened
    full = command("-m", "scripts.library", "index", pattern, f"--out={tmp_path / 'full.jsonl'}")
    lines = (tmp_path / "full.jsonl").read_text().splitlines()
    assert full.returncode == 0 and len(lines) == 2
    p = tmp_path / "go_on.jsonl"
    (tmp_path / "go_on.jsonl.partial").write_text(lines[0] + "\n" + lines[1][:30])
    r = command("-m", "scripts.library", "index", pattern, f"--out={p}")
    assert r.returncode == 0 and r.stdout.count("indexed /") == 1 and "b.mdio" in r.stdout, r.stdout
    assert p.read_text().splitlines() == lines and not (tmp_path / "go_on.jsonl.partial").exists()
    # (one more of the kind) the manifest inside one of the stores it describes
    one_error_line(command("-m", "scripts.library", "index", pattern, f"--out={stores / 'a.mdio' / 'm.jsonl'}"),
                   "inside the input")


@pytest.mark.slow
def test_embed_keeps_one_models_features_per_store_and_never_writes_into_a_survey(models, small_store, tmp_path):
    a, b = models

    def embed(model, out, *extra):
        return command("-m", "scripts.embed", str(model), small_store, f"--out={out}", *extra)
    f = tmp_path / "f.zarr"
    assert embed(a, f).returncode == 0
    before = snapshot(f)
    one_error_line(embed(b, f), "holds a features store made with other inputs or settings", "--overwrite")
    assert snapshot(f) == before  # A's features, untouched (B's run used to report success and keep them)
    r = embed(a, f)  # the same model again: complete already, nothing to do
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1])["already_complete"] is True
    # A interrupted, then B: refused, naming A's checkpoint (it used to make a store 17 % A, 83 % B)
    g = tmp_path / "g.zarr"
    assert embed(a, g, "--stop_after=1").returncode == 75
    assert not g.exists() and (tmp_path / "g.zarr.partial").exists()  # OUT only when complete
    line = one_error_line(embed(b, g), "an interrupted features store made with other inputs", "--overwrite")
    assert str(a / "ckpt" / "step_0000004") in line, line
    assert embed(b, g, "--overwrite").returncode == 0
    h = tmp_path / "h.zarr"
    assert embed(b, h).returncode == 0
    fg, fh = (zarr.open_group(str(x), mode="r") for x in (g, h))
    assert np.array_equal(fg["features"][:], fh["features"][:])  # all B's, as a fresh B run makes them
    assert fg.attrs["embed"]["model"]["checkpoint"] == str(b / "ckpt" / "step_0000004")
    # into the survey itself, or inside it: refused, the survey unchanged (it used to gain a features array)
    survey = snapshot(small_store)
    one_error_line(embed(a, small_store), "is the input")
    one_error_line(embed(a, os.path.join(small_store, "features.zarr")), "inside the input")
    assert snapshot(small_store) == survey
    # (one more of the kind) the picture over a file embed did not write
    (tmp_path / "notes.png").write_text("my notes")
    one_error_line(embed(a, tmp_path / "k.zarr", f"--picture={tmp_path / 'notes.png'}"),
                   "not a figure of scripts.embed")
    assert (tmp_path / "notes.png").read_text() == "my notes" and not (tmp_path / "k.zarr.partial").exists()


@pytest.mark.slow
def test_reconstruct_and_label_efficiency_keep_to_their_own_outputs(models, small_store, tmp_path):
    a, _ = models
    log = a / "log.jsonl"
    before = snapshot(log)
    one_error_line(command("-m", "scripts.reconstruct", str(a), f"--out={log}"), "not a figure of scripts.reconstruct")
    assert snapshot(log) == before
    fig = tmp_path / "r.png"
    assert command("-m", "scripts.reconstruct", str(a), f"--out={fig}").returncode == 0
    one_error_line(command("-m", "scripts.reconstruct", str(a), f"--out={fig}", "--seed=3"),
                   "made with other inputs or settings", "seed 0, not 3")
    assert command("-m", "scripts.reconstruct", str(a), f"--out={fig}", "--seed=3", "--overwrite").returncode == 0
    one_error_line(command("-m", "scripts.reconstruct", str(a), f"--out={small_store}/x.png"), "inside the input")
    # label_efficiency's --out: a folder of the user's is never its workspace
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("chapter 1")
    one_error_line(command("-m", "experiments.label_efficiency", "--quick", f"--out={mine}"),
                   "a folder label_efficiency did not make")
    assert os.listdir(mine) == ["thesis.tex"]


def test_a_failed_store_write_leaves_nothing_behind(tmp_path):
    """write_mdio (make_synthetic's, label_efficiency's stores): a write that fails part-way leaves no temporary
    store, and an existing store is never written over."""
    with pytest.raises(Exception):
        synthetic.write_mdio(str(tmp_path / "x.mdio"), np.zeros((8, 8, 8), np.float32), chunks=(0, 0, 0))
    assert os.listdir(tmp_path) == []
    synthetic.write_mdio(str(tmp_path / "y.mdio"), np.ones((8, 8, 8), np.float32), chunks=(8, 8, 8))
    with pytest.raises(synthetic.DataError, match="nothing is written over it"):
        synthetic.write_mdio(str(tmp_path / "y.mdio"), np.ones((8, 8, 8), np.float32))


# -----------------------------------------------------------------------------
# 2. torn files (a torn log line and a torn COMPLETE relaunched under launch.sh: test_preempt.py)


def test_a_log_damaged_in_the_middle_is_refused_naming_the_line(models, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(models[0], d)
    lines = (d / "log.jsonl").read_text().splitlines()
    (d / "log.jsonl").write_text("\n".join(lines[:3] + ["{not json"] + lines[3:]) + "\n")
    before = snapshot(d)
    r = run_train(small_args("unused", d, max_steps=6) + [f"--data_paths=['{models[0]}']"])
    one_error_line(r, f"{d}/log.jsonl line 4 is not a JSON record", "repair or delete that line")
    assert snapshot(d) == before


def test_a_torn_complete_marker_is_skipped_by_the_dry_run_and_export(models, tmp_path, small_store):
    """The newest checkpoint's COMPLETE cut short: the dry run says the ranks will resume from the one before (and
    checks that one), export takes the one before with a warning; nothing moves until a run resumes."""
    d = tmp_path / "run"
    shutil.copytree(models[0], d)
    src = d / "ckpt" / "step_0000004"
    shutil.copytree(src, d / "ckpt" / "step_0000002")  # an older complete checkpoint beside it
    meta = json.loads((d / "ckpt" / "step_0000002" / "COMPLETE").read_text())
    (d / "ckpt" / "step_0000002" / "COMPLETE").write_text(json.dumps({**meta, "step": 2}))
    (src / "COMPLETE").write_text((src / "COMPLETE").read_text()[:40])
    assert [s for s, _ in checkpoint.complete_checkpoints(str(d / "ckpt"))] == [2]
    r = run_train(small_args(small_store, d, max_steps=6) + ["--dry_run=True", "--gpus_per_node=1"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step_0000004's COMPLETE marker does not parse" in r.stdout and "step_0000002 fits this run" in r.stdout
    e = command("-m", "scripts.export", str(d), f"--out={tmp_path / 'm.pt'}")
    assert e.returncode == 0 and "step_0000004's COMPLETE marker does not parse" in e.stderr, e.stderr[-2000:]
    import torch
    assert torch.load(tmp_path / "m.pt", weights_only=True)["source"]["tag"] == "step_0000002"
    assert src.exists()  # (only a resuming run moves it aside)


def test_a_torn_lease_is_taken_over_once_its_writer_cannot_be_writing_it(tmp_path, monkeypatch):
    cfg = {**configurator.defaults(), "out_dir": str(tmp_path)}
    (tmp_path / "LEASE").write_text('{"host": "other", "pi')  # a writer that died half-way through its JSON
    with pytest.raises(lease.LeaseHeld):  # just written: it may still be being written
        lease.acquire(cfg, print)
    old = time.time() - 2 * lease.TORN_S
    os.utime(tmp_path / "LEASE", (old, old))
    said = []
    held = lease.acquire(cfg, said.append)
    assert "does not parse" in said[0] and json.loads((tmp_path / "LEASE").read_text())["id"] == held.me["id"]


# -----------------------------------------------------------------------------
# 3. one error line


def test_config_files_that_do_not_parse_or_fail_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("max_steps = 10\ncrop = (16, 16\n")
    one_error_line(command("train.py", str(bad)), f"config file {bad}, line 2", "was never closed")
    bad.write_text("max_steps = 10\n\ncrop = unknown_name\n")
    one_error_line(command("train.py", str(bad)), f"config file {bad}, line 3", "NameError")
    # (one more) the same file through launch.sh's dry run: its last line too
    r = subprocess.run(["bash", "launch.sh", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=job_env(PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]))
    one_error_line(r, f"config file {bad}, line 3")


def test_out_dir_problems_are_one_line_each(small_store, tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    for out, says in ((f, "is a file, not a folder"), (f / "run", "lies under"), ("", "out_dir is empty"),
                      ("s3://bucket/run", "not to an object store"),
                      (os.path.join(small_store, "run"), "inside the input")):
        one_error_line(run_train(small_args(small_store, "x") + [f"--out_dir={out}"]), says)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(tmp_path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("a read-only file system needs root to mount")
    try:
        one_error_line(run_train(small_args(small_store, tmp_path / "run")), "is read-only here")
    finally:
        subprocess.run(["umount", "-l", str(tmp_path)], check=False)


def test_a_read_only_or_misplaced_ckpt_folder_is_refused_at_start(small_store, tmp_path):
    """out_dir/ckpt is where the run's checkpoints go: a read-only one (a real read-only file system mounted there: as
    root, chmod would not stop a write) or a file in its place is refused before any step, in one line naming
    ckpt/, rather than found at the first checkpoint with every step since the start lost."""
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(run / "ckpt")], capture_output=True)
    if r.returncode != 0:
        pytest.skip("a read-only file system needs root to mount")
    try:
        one_error_line(run_train(small_args(small_store, run)), f"out_dir/ckpt='{run / 'ckpt'}' is read-only here")
    finally:
        subprocess.run(["umount", "-l", str(run / "ckpt")], check=False)
    assert not (run / "log.jsonl").exists()  # refused before the first step
    other = tmp_path / "other"
    other.mkdir()
    (other / "ckpt").write_text("x")
    one_error_line(run_train(small_args(small_store, other)), f"out_dir/ckpt='{other / 'ckpt'}' is a file")


def test_synthetic_chunks_of_zero_is_one_line_and_leaves_no_store(tmp_path):
    r = command("train.py", "config/quickstart.py", f"--data_paths=['{tmp_path / 'q.mdio'}']",
                f"--out_dir={tmp_path / 'out'}", "--synthetic_chunks=(0,0,0)")
    one_error_line(r, "synthetic_chunks must be 3 positive ints")
    assert os.listdir(tmp_path) == []


# every key that is not a bool (configurator checks those by type), with a value that is wrong for it
BAD = {"out_dir": "", "data_paths": [], "sample_weighting": "often", "max_open_stores": 0, "synthetic_shape": (0, 1, 1),
       "freeze_encoder_steps": -1,
       "synthetic_chunks": (1, 1), "store_chunks": (128, 0, 128), "in_flight": 0, "read_threads": -1, "prefetch": 0,
       "min_live": 1.5,
       "read_retries": -1, "read_timeout_s": 0.0, "s3_endpoint": "localhost:9000", "crop": (16, 16), "patch": (0, 8, 8),
       "model_size": "enormous", "heads": 5, "dec_heads": -1, "mask_ratio": 1.0, "ckpt_blocks": -2, "task": "classify", "label_var": "",
       "classes": 1, "pos_weight": 0.0, "layer_decay": 1.5, "seg_head": "mlp", "seg_features": 0, "cp": 0,
       "cp_impl": "nccl", "mask_strata": -1,
       "max_steps": 0, "micro_batch": 0, "grad_accum": 0, "blr": 0.0, "min_lr": -1.0, "warmup_steps": -1,
       "weight_decay": -0.1, "beta1": 1.0, "beta2": -0.5, "grad_clip": -1.0, "dtype": "float8", "strategy": "zero4",
       "zero_bucket": 0, "zero3_max_live": 0, "val_paths": [""], "val_frac": 1.0, "eval_interval": 0,
       "eval_samples": 0, "log_interval": 0, "ckpt_interval": 0, "keep_ckpts": 0, "init_from": None,
       "ckpt_write_gbps": 0.0, "stop_step": -1, "lease_stale": 0.0, "lease_min_s": -1.0, "seed": -1,
       "gpu_peak_flops": 0.0, "nodes": 0, "gpus_per_node": -1, "stop_lead_s": -1}


def test_every_config_key_is_checked_before_any_work(tmp_path):
    """Each key (but the bools, whose type is checked) with a wrong value is a ConfigError naming the key. A key added
    to configurator.py without a check fails here until it has one (init_from is checked where it is read: the dry
    run and setup, tests/test_elastic.py)."""
    keys = {k for k in configurator.KEYS if not isinstance(configurator.defaults()[k], bool)}
    assert keys == set(BAD), sorted(keys ^ set(BAD))
    for key, value in BAD.items():
        if value is None:
            continue
        cfg = {**configurator.defaults(), "out_dir": str(tmp_path / "out"), key: value}
        if key == "label_var":
            cfg["task"] = "segment"
        with pytest.raises(configurator.ConfigError) as e:
            train.check(cfg)
        assert key in str(e.value) or key.split("_")[0] in str(e.value), (key, str(e.value))


# every option of every command with a wrong value, and the options that take anything (paths, flags, words)
OPTIONS = {
    "export": ([("--tag=latest", "not a checkpoint tag")], {"tag", "out", "encoder_only", "check", "overwrite"}),
    "library": ([("--in_flight=0", "--in_flight"), ("--weight=-1", "--weight"), ("--read_timeout_s=0", "read_timeout_s"),
                 ("--read_retries=-1", "read_retries"), ("--add --overwrite", "give one"),
                 ("--split=test", "invalid choice")],
                {"out", "s3_anon", "s3_endpoint", "add", "overwrite"}),
    "embed": ([("--cp=0", "--cp=0"), ("--batch=-1", "--batch"), ("--crop=16,16", "--crop"), ("--stride=a", "--stride"),
               ("--dtype=int8", "invalid choice"), ("--read_timeout_s=0", "read_timeout_s")],
              {"out", "picture", "s3_anon", "s3_endpoint", "read_retries", "overwrite"}),
    "reconstruct": ([("--seed=-1", "--seed"), ("--mask_ratio=0.999", "leaves no visible token"),
                     ("--mask_ratio=1.5", "mask_ratio must be in"), ("--crop=0,8,8", "--crop"),
                     ("--origin=-1,0,0", "--origin"), ("--patch=4,4,4", "patch"), ("--device=tpu", "invalid choice"),
                     ("--read_retries=-1", "read_retries")],
                    {"data", "tag", "out", "s3_anon", "s3_endpoint", "read_timeout_s", "overwrite", "device"}),
    "probe": ([("--steps=0", "--steps"), ("--n_faults=-1", "--n_faults"), ("--test=0", "--test"),
               ("--volumes=1", "--test"), ("--repeats=0", "--repeats"), ("--seed=-1", "--seed"),
               ("--shape=0,0,0", "--shape")], set()),
    "label_efficiency": ([("--labels=a", "--labels"), ("--labels=0", "--labels"), ("--test=0", "--test"),
                          ("--batch=0", "--batch"), ("--patch=0", "--patch"), ("--seeds=0", "--seeds"),
                          ("--seed=-1", "--seed"), ("--lr=0", "--lr"), ("--pos_weight=0", "--pos_weight"),
                          ("--model_size=enormous", "--model_size"), ("--warmup=-1", "--warmup"),
                          ("--shape=30", "--shape"), ("--crop=0", "--crop"), ("--unlabelled=0", "--unlabelled"),
                          ("--pretrain_steps=0", "--pretrain_steps"), ("--finetune_steps=0", "--finetune_steps"),
                          ("--pretrain_batch=0", "--pretrain_batch"), ("--pretrain_blr=0", "--pretrain_blr"),
                          ("--mask_ratio=1", "--mask_ratio"), ("--seg_head=mlp", "--seg_head"),
                          ("--seg_features=0", "--seg_features"), ("--device=tpu", "--device"),
                          ("--crop=16,16", "--crop"), ("--layer_decay=0", "--layer_decay"),
                          ("--overlap=1", "--overlap"), ("--weight_decay=-1", "--weight_decay"),
                          ("--freeze=-1", "--freeze"), ("--freeze_twin", "--freeze_twin"),
                          ("--snr_db=nan", "--snr_db")],
                         {"out", "overwrite", "quick", "gpu", "flip"}),
    "plan": ([("--gpu=TPU", "--gpu"), ("--mfu=0", "--mfu"), ("--max_steps=0", "max_steps")], {"key"}),  # (--key=value:
    #        the config keys, each checked: test_every_config_key_is_checked_before_any_work)
}


def test_every_command_option_is_checked_before_any_work(models, small_store, tmp_path):
    """Each command's options, read from its --help, are all either given a wrong value here (one line naming the
    option, exit 2, nothing written) or listed as taking anything: an option added without a check fails here."""
    from infra import cli
    a = str(models[0])
    where = {"export": [a], "library": ["index", small_store, f"--out={tmp_path / 'm.jsonl'}"],
             "embed": [a, small_store, f"--out={tmp_path / 'f.zarr'}"], "reconstruct": [a, f"--out={tmp_path / 'r.png'}"],
             "probe": [a], "label_efficiency": [], "plan": ["config/quickstart.py"]}
    for name, (bad, free) in OPTIONS.items():
        module = f"{'experiments' if name == 'label_efficiency' else 'scripts'}.{name}"  # (a research question's)
        mod = __import__(module, fromlist=["main"])
        helped = subprocess.run([sys.executable, "-m", module, *(["index"] if name == "library" else []),
                                 "--help"], cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120)
        if name == "library":
            helped = subprocess.run([sys.executable, "-m", "scripts.library", "index", "x", "--out=y", "--help"],
                                    cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120)
        options = set(re.findall(r"--(\w+)", helped.stdout)) - {"help"}
        tested = {b.split("=")[0].lstrip("-") for arg, _ in bad for b in arg.split()}
        assert options - free <= tested and free <= options, (name, sorted(options - free - tested), free - options)
        for arg, says in bad:
            before = sorted(os.listdir(tmp_path))
            argv = where[name] + arg.split()
            try:
                rc = cli.run(mod.main, argv)
            except SystemExit as e:  # argparse's own refusal (a choice, a type): its one line, code 2
                rc = e.code
            assert rc == 2, (name, arg, rc)
            assert sorted(os.listdir(tmp_path)) == before, (name, arg)
    # the benches' options (python -m bench NAME --key=value): their ranges too
    bench = __import__("bench.__main__", fromlist=["main"])
    for argv in (["nothing"], ["attention", "--n=0"], ["attention", "--only=fast"], ["attention", "--n=15"],
                 ["data", "--crops=0"], ["library", "--in_flight=-1"], ["plan", "config/quickstart.py", "--crop=(0,8,8)"],
                 ["step", "config/quickstart.py", "--max_steps=0"]):
        assert cli.run(bench.main, argv) == 2, argv


@pytest.mark.slow
def test_the_options_that_crashed_are_one_line_before_any_work(models, tmp_path):
    """The options found crashing, through the commands as a user types them: label_efficiency's --test=0 (it used to
    fail after 218 s of pretraining), --batch=0, --patch=0, --labels=a; probe's --steps=0 and --n_faults=-1; and
    reconstruct's --mask_ratio=0.999, which training refuses (every token masked)."""
    before = snapshot(models[0])
    for args, says in ((("-m", "experiments.label_efficiency", "--test=0", f"--out={tmp_path / 'le'}"), "--test=0"),
                       (("-m", "experiments.label_efficiency", "--batch=0"), "--batch=0"),
                       (("-m", "experiments.label_efficiency", "--patch=0"), "--patch=0"),
                       (("-m", "experiments.label_efficiency", "--labels=a"), "--labels='a'"),
                       (("-m", "scripts.probe", str(models[0]), "--steps=0"), "--steps=0"),
                       (("-m", "scripts.probe", str(models[0]), "--n_faults=-1"), "--n_faults=-1"),
                       (("-m", "scripts.reconstruct", str(models[0]), "--mask_ratio=0.999"), "leaves no visible token")):
        t0 = time.time()
        one_error_line(command(*args), says)
        assert time.time() - t0 < 30, args
    assert not (tmp_path / "le").exists() and snapshot(models[0]) == before  # (probe exports nothing first)


@pytest.mark.slow
def test_s3_globs_fail_as_clearly_as_plain_paths_naming_the_endpoint(small_store, tmp_path):
    """A glob over S3 with credentials the endpoint refuses, a dead port, an endpoint that never answers: one line
    naming the endpoint (and, for the silent one, the options that set the patience), after a warning per try."""
    from bench.s3_loopback import FaultProxy, MotoS3, SilentEndpoint
    from infra.distributed import free_port
    s3 = MotoS3()
    s3.upload_dir(small_store, "bkt", "lib/a.mdio")
    proxy, silent = FaultProxy(s3.port, forbid=True), SilentEndpoint()
    try:
        base = small_args("s3://bkt/lib/*.mdio", tmp_path / "run") + ["--read_retries=1", "--read_timeout_s=1"]
        for endpoint, says in ((proxy.endpoint, "access denied"), (f"http://127.0.0.1:{free_port()}", "did not answer"),
                               (silent.endpoint, "did not answer")):
            t0 = time.time()
            r = run_train(base + [f"--s3_endpoint={endpoint}"])
            line = one_error_line(r, says, endpoint, "s3://bkt/lib/*.mdio")
            if says == "did not answer":
                assert "read_timeout_s" in line and "read_retries" in line, line
                assert re.search(rf"WARNING: .*at {endpoint}: no answer .*try 1 of 2", r.stderr), r.stderr[-2000:]
            assert time.time() - t0 < 60
        # the same store through the glob trains when the endpoint answers
        assert run_train(base + [f"--s3_endpoint={s3.endpoint}", "--max_steps=1"]).returncode == 0
    finally:
        proxy.stop()
        silent.stop()
        s3.stop()


def test_launch_sh_knobs_are_one_line_each():
    env = job_env(PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    for knob, says in (("NPROC=abc", "NPROC='abc' must be a whole number"), ("NPROC=0", "NPROC='0'"),
                       ("THREADS=two", "THREADS='two'"), ("PORT=99999", "PORT='99999'"),
                       ("REQUEUE=yes", "REQUEUE='yes' must be 1 or 0"), ("HOSTFILE=/no/such/file", "HOSTFILE=")):
        k, v = knob.split("=", 1)
        r = subprocess.run(["bash", "launch.sh", "config/quickstart.py"], cwd=ROOT, env={**env, k: v},
                           capture_output=True, text=True, timeout=60)
        one_error_line(r, says)


# -----------------------------------------------------------------------------
# 4. interruptions (training's: test_preempt.py; a rank killed first: test_launch.py)


def test_ctrl_c_to_a_command_is_one_line_and_the_shells_code(small_store, tmp_path):
    """The library index waiting on an endpoint that never answers, stopped with Ctrl-C: one line, no traceback, it
    dies of SIGINT (the shell sees 130), and no manifest is left."""
    from bench.s3_loopback import SilentEndpoint
    silent = SilentEndpoint()
    try:
        p = subprocess.Popen([sys.executable, "-m", "scripts.library", "index", "s3://bkt/lib/*.mdio",
                              f"--out={tmp_path / 'm.jsonl'}", f"--s3_endpoint={silent.endpoint}"], cwd=ROOT,
                             env={**job_env(), "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # (any credentials: signed
        deadline = time.time() + 60  # requests reach the endpoint; without, run alone, none is sent)
        while time.time() < deadline and len(silent.conns) == 0:
            time.sleep(0.1)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:  # (not stopped by it: it must not go on retrying after the test)
            p.kill()
        silent.stop()
    assert p.returncode == -signal.SIGINT, (p.returncode, err[-2000:])
    assert err.strip().splitlines()[-1].startswith("interrupted (Ctrl-C)") and "Traceback" not in err, err[-2000:]
    assert os.listdir(tmp_path) == []


# -----------------------------------------------------------------------------
# 5. advice that is right


@pytest.mark.slow
def test_make_synthetic_uses_what_is_there_and_says_when_it_writes(tmp_path):
    """With the quickstart's make_synthetic=True: a real Zarr v2 store at the path is the data (it used to be told to
    remove it), untouched; a path where nothing is gets a synthetic volume and one line saying so."""
    v2 = tmp_path / "mine.zarr"
    arr = zarr.open_array(str(v2), mode="w", shape=(32, 32, 64), chunks=(16, 16, 64), dtype="float32", zarr_format=2)
    arr[:] = np.nan_to_num(synthetic.synthetic_volume((32, 32, 64), seed=5))
    before = snapshot(v2)
    args = ["config/quickstart.py", f"--out_dir={tmp_path / 'out'}", "--max_steps=2", "--micro_batch=2",
            "--figures=False", "--val_frac=0.5", "--eval_samples=2", "--val_floor=False"]  # (the floor: test_floor's)
    r = command("train.py", *args, f"--data_paths=['{v2}']")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "remove" not in r.stdout + r.stderr and "synthetic volume was written" not in r.stdout
    assert snapshot(v2) == before
    typo = tmp_path / "mine.zar"
    r = command("train.py", *args, f"--data_paths=['{typo}']", f"--out_dir={tmp_path / 'out2'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"make_synthetic=True: nothing was at {typo}, so a synthetic volume was written there" in r.stdout


def test_data_that_cannot_train_is_refused_once_with_a_fix_that_works(tmp_path):
    dead = tmp_path / "dead.mdio"
    synthetic.write_mdio(str(dead), np.full((16, 16, 32), np.nan, np.float32), chunks=(16, 16, 32))
    zeros, nans = tmp_path / "zeros.zarr", tmp_path / "nans.zarr"
    zarr.open_array(str(zeros), mode="w", shape=(16, 16, 32), chunks=(8, 8, 32), dtype="float32")[:] = 0
    zarr.open_array(str(nans), mode="w", shape=(16, 16, 32), chunks=(8, 8, 32), dtype="float32")[:] = np.nan
    for store, says in ((dead, "every one of its 256 traces is dead"), (zeros, "a constant volume"),
                        (nans, "no finite value in any of its 4 chunks")):
        t0 = time.time()
        r = run_train(small_args(str(store), tmp_path / "run"))
        line = one_error_line(r, says, "nothing to train on", "drop it from data_paths")
        assert "times" not in line and "ZeroDivisionError" not in line and time.time() - t0 < 30, line  # (no retries)
    # (one more) an array dead along its diagonal, where the statistics were first estimated, but live elsewhere: it
    # used to be refused with advice to add mean / std attributes; the estimate now reads further and it trains
    patchy = tmp_path / "patchy.zarr"
    a = zarr.open_array(str(patchy), mode="w", shape=(32, 32, 32), chunks=(16, 16, 32), dtype="float32")
    a[:] = np.nan
    a[:16, 16:] = np.random.default_rng(0).normal(size=(16, 16, 32)).astype(np.float32)
    r = run_train(small_args(str(patchy), tmp_path / "run2", val_frac=0.0, max_steps=2))
    assert r.returncode == 0, r.stderr[-3000:]
