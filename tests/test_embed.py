"""scripts/embed.py: encoder features of a whole survey. The same features on 1 rank, on 2 dp ranks and on a cp 2 group
(ring attention), one window per forward or several, and after a stop and restart (fp32 features, to 1e-4); the windows' owned boxes tile the token
grid exactly once; the store opens with plain zarr, with named dimensions and the survey's coordinates at the
token centres. The model: the zero2 run of conftest.strategy_runs, given as its out_dir (scripts/embed.py exports its
newest checkpoint once)."""
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import zarr

from infra import features
from conftest import ROOT, job_env

pytestmark = pytest.mark.slow  # (tests/README.md: the editing loop's subset leaves it out)


def run_embed(args, nproc=1, env=None):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1
           else [sys.executable]) + ["-m", "scripts.embed", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env or job_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("grid,w,stride", [((6, 4, 8), (2, 2, 4), (1, 1, 2)), ((7, 5, 9), (3, 2, 4), (2, 2, 3)),
                                           ((4, 4, 4), (4, 4, 4), (2, 2, 2)), ((10, 3, 6), (4, 3, 2), (3, 1, 1))])
def test_owned_boxes_tile_the_grid_once_and_sit_inside_their_windows(grid, w, stride):
    count = np.zeros(grid, dtype=int)
    for _, org, box in features.plan_windows(grid, w, stride):
        for (lo, hi), o, n in zip(box, org, w):
            assert o <= lo < hi <= o + n  # a window owns only tokens it encodes
        count[tuple(slice(lo, hi) for lo, hi in box)] += 1
    assert (count == 1).all()


def test_features_are_the_same_on_any_layout_and_after_a_restart(small_store, strategy_runs, tmp_path):
    model = str(strategy_runs["zero2"][0])
    out = {name: str(tmp_path / f"{name}.zarr") for name in ("one", "dp2", "cp2", "restart")}
    base = [model, small_store, "--dtype=float32"]
    assert run_embed(base + [f"--out={out['one']}", "--batch=1"]).returncode == 0  # one window per forward
    for name, extra, nproc in (("dp2", [], 2), ("cp2", ["--cp=2", "--batch=3"], 2)):  # dp2: all its windows at once
        r = run_embed(base + [f"--out={out[name]}"] + extra, nproc=nproc)
        assert r.returncode == 0, r.stderr[-3000:]
    r = run_embed(base + [f"--out={out['restart']}", "--stop_after=7", "--batch=5"])  # (built as OUT.partial)
    assert r.returncode == 75 and len(os.listdir(os.path.join(out["restart"] + ".partial", "embed_done"))) == 7, \
        r.stderr[-2000:]
    r = run_embed(base + [f"--out={out['restart']}"])
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    ref = np.asarray(zarr.open_group(out["one"], mode="r")["features"][:])
    assert ref.shape == (6, 4, 8, 96) and info["grid"] == [6, 4, 8] and info["windows"] == 45
    assert np.isfinite(ref).all() and (np.abs(ref).sum(-1) > 0).all()  # every token written
    for name in ("dp2", "cp2", "restart"):
        got = np.asarray(zarr.open_group(out[name], mode="r")["features"][:])
        assert np.abs(got - ref).max() <= 1e-4, (name, np.abs(got - ref).max())
    # plain zarr: named dimensions, the survey's coordinates at token centres (write_mdio: inline and crossline
    # numbers from 1, time in ms at 4 ms: token k of patch 8 is centred on voxel 8 k + 3.5)
    g = zarr.open_group(out["one"], mode="r")
    assert g["features"].metadata.dimension_names == ("inline", "crossline", "time", "feature")
    k = np.arange(6)
    assert np.allclose(g["inline"][:], 1 + 8 * k + 3.5) and np.allclose(g["time"][:], 4 * (8 * np.arange(8) + 3.5))
    assert g.attrs["stride"] == [8, 8, 16] and g.attrs["patch"] == [8, 8, 8]
    assert os.path.getsize(out["one"] + ".png") > 10_000  # the principal-component picture
    # a second run into a store of other features is refused, nothing written
    r = run_embed([model, small_store, f"--out={out['one']}", "--stride=(8,8,8)"])
    assert r.returncode == 2 and "holds a features store made with other inputs or settings" in r.stderr, \
        r.stderr[-2000:]


def test_every_window_owns_its_centre():
    """Where windows overlap, a token's feature comes from the window in which it is most central: the window
    whose centre is nearest along every axis."""
    grid, w, stride = (9, 7, 11), (4, 3, 5), (2, 2, 3)
    wins = features.plan_windows(grid, w, stride)
    for t in itertools.product(*(range(n) for n in grid)):
        (_, org, _), = [x for x in wins if all(lo <= c < hi for c, (lo, hi) in zip(t, x[2]))]
        others = [o for _, o, _ in wins]
        for ax in range(3):
            d = abs(t[ax] + 0.5 - (org[ax] + w[ax] / 2))
            assert all(d <= abs(t[ax] + 0.5 - (o[ax] + w[ax] / 2)) for o in others if all(
                o_ <= c < o_ + n for k, (c, o_, n) in enumerate(zip(t, o, w)) if k != ax) and o[ax] <= t[ax] < o[ax] + w[ax])


def test_probe_scores_a_pretrained_and_a_random_encoder_side_by_side(strategy_runs):
    """scripts/probe.py end to end on a small setting: labelled synthetic volumes, frozen features, a linear head, IoU on
    held-out volumes for the trained encoder and a random one of its shape, over two draws compared paired (the
    scores are reported, not thresholded: which encoder is better is a measurement, README)."""
    r = subprocess.run([sys.executable, "-m", "scripts.probe", str(strategy_runs["zero2"][0]), "--volumes=3",
                        "--test=1", "--shape=(32,32,64)", "--steps=30", "--repeats=2"], cwd=ROOT, env=job_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    p, q = out["iou_pretrained_each"], out["iou_random_each"]
    assert out["repeats"] == len(p) == len(q) == 2
    assert all(0.0 <= v <= 1.0 for v in p + q)
    assert p != q  # two different encoders were scored
    assert q[0] != q[1]  # each draw met its own volumes and its own random encoder
    d = [a - b for a, b in zip(p, q)]
    assert abs(out["iou_diff"] - sum(d) / 2) < 2e-4 and abs(out["iou_pretrained"] - sum(p) / 2) < 2e-4
    assert abs(out["iou_diff_se"] - abs(d[0] - d[1]) / 2) < 2e-4  # the std of two values / sqrt 2
    assert 0.0 < out["fault_voxel_fraction"] < 0.5
    for bad, what in (("--test=6", "--test=6"), ("--repeats=0", "--repeats=0")):
        r = subprocess.run([sys.executable, "-m", "scripts.probe", str(strategy_runs["zero2"][0]), bad],
                           cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and what in r.stderr, r.stderr[-2000:]


def test_embed_refuses_a_live_commands_output_a_runs_checkpoints_and_its_picture_at_out(small_store, strategy_runs,
                                                                                          tmp_path):
    """One embed per output: while another process holds OUT's lease (here this test's own, taken as embed takes it),
    embed is refused naming that pid, and writes nothing; once released, it runs. An --out inside the run's ckpt/
    and a --picture at --out are refused before any work (test_predict.py: a ckpt/ of a run that is not the model)."""
    from infra import lease
    model = str(strategy_runs["zero2"][0])
    out = str(tmp_path / "f.zarr")
    held = lease.for_output(out, f"--out={out}")
    try:
        r = run_embed([model, small_store, f"--out={out}"])
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and "being written by another command" in last and f"pid {os.getpid()}" in last, \
            r.stderr[-2000:]
        assert sorted(os.listdir(tmp_path)) == ["f.zarr.lease"]  # (nothing of embed's)
    finally:
        held.release()
    step = max(t for t in os.listdir(os.path.join(model, "ckpt")) if t.startswith("step_"))
    for args, says in (([f"--out={model}/ckpt/{step}/f.zarr"], "ckpt"),  # (the run is its model: also an input)
                       ([f"--out={out}", f"--picture={out}"], "the same path as --out")):
        r = run_embed([model, small_store, *args])
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and last.startswith("error:") and says in last, (args, r.stderr[-2000:])
    assert os.listdir(tmp_path) == [] and not os.path.exists(f"{model}/ckpt/{step}/f.zarr")
    r = run_embed([model, small_store, f"--out={out}", "--stop_after=1"])
    assert r.returncode == 75 and not os.path.exists(f"{out}.lease"), r.stderr[-2000:]  # (released at its end)
