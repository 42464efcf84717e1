"""Shared fixtures: a small synthetic MDIO store, a fine-tuned segmenter and its survey, and a helper that runs
train.py as a real job."""
import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from infra import synthetic  # noqa: E402

# The venv's tools first on PATH, for every process the tests start: DeepSpeed JIT-builds a small op with the first
# `ninja` on PATH, and two ninja versions (the venv's, from pip, and the system's) take each other's build log for a
# changed command, so every switch between them rebuilt the op (30 s on 2 cores). Jobs started through launch.sh
# (the venv on PATH, as the README has it) and jobs started directly alternated, and paid for it many times.
_VENV_BIN = os.path.dirname(sys.executable)
if not os.environ.get("PATH", "").startswith(_VENV_BIN + os.pathsep):
    os.environ["PATH"] = _VENV_BIN + os.pathsep + os.environ.get("PATH", "")


# A suite started with SIGINT ignored (in the background of a non-interactive shell, or under nohup) hands that on to
# every process it starts, and neither Python nor bash can then take a Ctrl-C: the tests that send one would fail
# for a reason of the suite's start, not of the code. Its children start with SIGINT at its default, as a terminal's
# commands do (a caught signal is reset to the default at exec; an ignored one would stay ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a launcher, cluster or many-run test (left out of the editing loop's "
                                       "`pytest -m 'not slow'`; tests/README.md)")


def job_env(**extra):
    # nothing of a SLURM job or a launcher setting that the tests happen to run under may leak into them
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("MODE", "HOSTFILE", "NPROC", "HEAD", "NODE_RANK", "DRY_RUN")}
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
                "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""})

    env.update(extra)
    return env


def run_train(args, nproc=1, timeout=600, env=None, script="train.py"):
    """Run train.py (or tests/train_hooks.py: train.py with test hooks) under torchrun (nproc > 1) or alone;
    returns the CompletedProcess."""
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               os.path.join(ROOT, script), *args]
    else:
        cmd = [sys.executable, os.path.join(ROOT, script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env or job_env(), capture_output=True, text=True, timeout=timeout)


def read_log(out_dir):
    """The training records of a run's log.jsonl (one per step), in order."""
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def read_val(out_dir):
    """The validation records of a run's log.jsonl: [(step, val_loss)], in order."""
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [(r["step"], r["val_loss"]) for r in map(json.loads, f) if "val_loss" in r]


@pytest.fixture(scope="session")
def small_store(tmp_path_factory):
    """A 48 x 32 x 64 synthetic volume with dead traces, as an MDIO v1 store in 16^3 chunks."""
    path = str(tmp_path_factory.mktemp("data") / "small.mdio")
    synthetic.write_mdio(path, synthetic.synthetic_volume((48, 32, 64), seed=3), chunks=(16, 16, 16))
    return path


@pytest.fixture(scope="module")
def s3(small_store):
    """A real S3 endpoint on loopback (bench/s3_loopback.py: moto) holding small_store as s3://bkt/small.mdio (.url);
    one per test module, so that what one module writes into its buckets no other module sees."""
    from bench.s3_loopback import MotoS3
    m = MotoS3()
    m.url = m.upload_dir(small_store, "bkt", "small.mdio")
    yield m
    m.stop()


def small_args(store, out_dir, **kw):
    """A fast config for CPU tests: 16 x 16 x 32 crops in 8^3 patches = 16 tokens, tiny model. Validation on:
    inlines 32..47 of the small store held out (val_frac 1/3), 3 samples (odd: 2 dp ranks get unequal shares),
    every 3 steps; no figures (drawing them costs more than these runs' steps: the tests that check them ask)."""
    cfg = {"data_paths": [store], "out_dir": str(out_dir), "crop": (16, 16, 32), "patch": (8, 8, 8),
           "model_size": "tiny", "micro_batch": 2, "max_steps": 6, "warmup_steps": 2, "blr": 0.05,
           "log_interval": 1, "ckpt_interval": 100, "val_frac": 1 / 3, "eval_samples": 3, "eval_interval": 3,
           "figures": False}
    cfg.update(kw)
    return [f"--{k}={v!r}" if not isinstance(v, str) else f"--{k}={v}" for k, v in cfg.items()]


STRATEGY_ARGS = dict(max_steps=8, grad_accum=2)


@pytest.fixture(scope="session")
def strategy_runs(small_store, tmp_path_factory):
    """Under zero2, zero3 and fsdp2, one 2-rank run of 8 steps (grad_accum 2) stopped after step 3 (a checkpoint,
    exit) and resumed to step 8: {strategy: (out_dir, first CompletedProcess, second)}. Complete checkpoints at
    steps 3 and 8, validation at 0, 3, 6 and 8. test_strategies checks the runs, test_export exports them,
    test_elastic continues their step 3 on other world sizes."""
    root, out = tmp_path_factory.mktemp("strategies"), {}
    for strategy in ("zero2", "zero3", "fsdp2"):
        d = root / strategy
        a = run_train(small_args(small_store, d, stop_step=3, strategy=strategy, **STRATEGY_ARGS), nproc=2)
        b = run_train(small_args(small_store, d, strategy=strategy, **STRATEGY_ARGS), nproc=2) if a.returncode == 0 else a
        out[strategy] = d, a, b
    return out


def launch_quickstart(*args, timeout=900, **extra_env):
    """bash launch.sh config/quickstart.py ARGS, as the README has it (the venv first on PATH; launch.sh splits the
    cores between the ranks itself); extra_env: more environment for it (DRY_RUN="1", credentials)."""
    env = job_env(PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **extra_env)
    env.pop("OMP_NUM_THREADS")
    return subprocess.run(["bash", "launch.sh", "config/quickstart.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory):
    """The main job, once for the whole session: bash launch.sh config/quickstart.py (2 CPU ranks, 500 steps, ~2 min)
    with its store and out_dir in a temporary folder. Returns (store, out_dir, CompletedProcess). test_quickstart
    checks it; test_elastic warm-starts from its model."""
    root = tmp_path_factory.mktemp("quickstart")
    store, out = str(root / "qs.mdio"), str(root / "out")
    return store, out, launch_quickstart(f"--data_paths=['{store}']", f"--out_dir={out}")


PREDICT_SHAPE = (48, 32, 64)  # 16^3 chunks; the model's crop 16 x 16 x 32 in 8^3 patches
PREDICT_DEAD = [(3, 7), (4, 7), (40, 30)]


@pytest.fixture(scope="session")
def predict_survey(tmp_path_factory):
    """A FaultSeg3D-style survey with its fault labels and three dead traces, MDIO v1 in 16^3 chunks; a segmenter
    fine-tuned on it for 2 steps (train.py task="segment", UNETR head; its out_dir), a model file of it with its output
    layer scaled so that its probabilities span 0..1 (a model 2 steps old predicts ~0.45 everywhere, which would hide
    seams), the folder, and the plain export: (store, out_dir, sharp, root, exported). test_predict and test_cluster's
    predict under SLURM use it."""
    import numpy as np
    import torch
    from infra import modelfile, reader
    from infra.features import prepare
    root = tmp_path_factory.mktemp("predict")
    vol, fault, _ = synthetic.faultseg_volume(PREDICT_SHAPE, seed=5)
    for i, x in PREDICT_DEAD:
        vol[i, x] = np.nan
    store = synthetic.write_mdio(str(root / "survey.mdio"), vol, chunks=(16, 16, 16), fault=fault.astype(bool))
    run = root / "seg"
    r = run_train(small_args(store, run, task="segment", max_steps=2, eval_interval=100))
    assert r.returncode == 0, r.stderr[-3000:]
    path = modelfile.export(str(run))
    model, _ = modelfile.load(path)
    prepare(model, PREDICT_SHAPE)
    with torch.no_grad():
        x = torch.from_numpy(reader.Volume(store).read((0, 0, 0), PREDICT_SHAPE))[None, None]
        logit = model.seg_logits(x)[..., 0]
    obj = torch.load(path, weights_only=True)
    k = 2.0 / logit.std().item()  # logits of std 2 about 0: probabilities across 0..1
    obj["model"]["head.out.weight"] *= k
    obj["model"]["head.out.bias"] = k * (obj["model"]["head.out.bias"] - logit.mean().item())
    sharp = str(root / "sharp.pt")
    torch.save(obj, sharp)
    return store, str(run), sharp, root, path


@contextlib.contextmanager
def tmpfs(path, options):
    """A real tmpfs mounted at `path` for the block (root only: skipped elsewhere)."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
