"""scripts/predict.py: a fine-tuned segmenter over a whole survey. Blended windows where one window covers the survey
are the model's own forward (and stay so cut into tiles); blended windows show no seam against that one-window
answer, where plain tiling does; every voxel is written; dp 2 x cp 2, 2 dp ranks on tiles, a run stopped and
restarted and a model given as its out_dir all write the same prediction; dead traces are no fault and marked; a
variable added to an MDIO store leaves the store's own variables as they were, and multidimio opens it; bad model,
survey and output settings are one error line each. And infra/sliding.py's arithmetic against brute force.

The model and survey: conftest's predict_survey."""
import hashlib
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr

from conftest import PREDICT_DEAD as DEAD, PREDICT_SHAPE as SHAPE, ROOT, job_env, run_train, small_args
from infra import sliding


@pytest.mark.parametrize("S,c,overlap,blend", [(48, 16, 0.5, "gaussian"), (50, 16, 0.25, "cosine"),
                                               (10, 16, 0.5, "constant"), (64, 32, 0.0, "gaussian")])
def test_windows_cover_the_axis_and_the_weight_sum_is_a_product(S, c, overlap, blend):
    stride = max(1, round(c * (1 - overlap)))
    starts = sliding.window_starts(S, c, stride)
    covered = np.zeros(S, int)
    for o in starts:
        covered[o:o + c] += 1
        assert o >= 0 and (o + c <= S or starts == [0])  # inside the survey, or the one padded window
    assert covered.min() >= 1  # every voxel in a window
    w = sliding.axis_weights(c, blend)
    assert w.min() > 0 and (blend == "constant" or w.argmax() in (c // 2 - 1, c // 2))
    # the 3D sum of separable weights over a Cartesian grid of windows is the product of the 1D sums
    shape, crop = (S, 12, 20), (c, 8, 8)
    st3 = [starts, sliding.window_starts(12, 8, 4), sliding.window_starts(20, 8, 8)]
    ws = [w, sliding.axis_weights(8, blend), sliding.axis_weights(8, blend)]
    brute = np.zeros(shape)
    for o in itertools.product(*st3):
        box = tuple(slice(a, min(a + n, s)) for a, n, s in zip(o, crop, shape))
        full = np.einsum("i,j,k->ijk", *ws)
        brute[box] += full[tuple(slice(0, b.stop - b.start) for b in box)]
    n = [sliding.normaliser(s, o, w_) for s, o, w_ in zip(shape, st3, ws)]
    assert np.allclose(brute, np.einsum("i,j,k->ijk", *n), rtol=1e-12)


def test_tiles_tile_the_survey_once_and_the_recompute_counts_the_windows_of_each():
    shape, crop, tile = (50, 33, 70), (16, 16, 32), (32, 16, 64)
    starts = [sliding.window_starts(S, c, c // 2) for S, c in zip(shape, crop)]
    count, computed = np.zeros(shape, int), 0
    for box in sliding.tiles(shape, tile):
        count[tuple(slice(lo, hi) for lo, hi in box)] += 1
        wins = list(itertools.product(*(sliding.touching(s, c, *b) for s, c, b in zip(starts, crop, box))))
        for o in itertools.product(*starts):  # touching() misses no window that overlaps the tile
            overlaps = all(a < hi and a + c > lo for a, c, (lo, hi) in zip(o, crop, box))
            assert overlaps == (o in wins)
        computed += len(wins)
    assert (count == 1).all()
    assert computed / np.prod([len(s) for s in starts]) == pytest.approx(sliding.recompute(shape, crop, starts, tile))


# ----------------------------------------------------------------------------- the command, for real

def run_predict(args, nproc=1):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1
           else [sys.executable]) + ["-m", "scripts.predict", *args]
    return subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=600)


def ok(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def prob(path, name="probability"):
    return np.asarray(zarr.open_group(path, mode="r")[name][:], dtype=np.float32)


slow = pytest.mark.slow  # (tests/README.md: the editing loop's subset leaves the command's runs out)


@slow
def test_one_window_is_the_model_itself_and_blended_windows_leave_no_seam(predict_survey):
    store, _, sharp, root, _ = predict_survey
    base = [sharp, store, "--dtype=float32"]
    one = ok(run_predict(base + [f"--out={root / 'one.zarr'}", f"--crop={SHAPE}"]))
    tiled = ok(run_predict(base + [f"--out={root / 'one_tiled.zarr'}", f"--crop={SHAPE}", "--tile=16,16,32"]))
    assert one["windows"] == 1 and tiled["tiles"] == 12 and tiled["windows_computed"] == 12
    # the one window's blended answer is the model's forward on the whole survey (weights divide out), in tiles too
    from infra import modelfile, reader
    from infra.features import prepare
    model, _ = modelfile.load(sharp)
    prepare(model, SHAPE)
    vol = reader.Volume(store)
    with torch.no_grad():
        p = torch.sigmoid(model.seg_logits(torch.from_numpy(vol.read((0, 0, 0), SHAPE))[None, None])[..., 0])
    from model import unpatchify
    ref = unpatchify(p, model.patch, model.grid)[0, 0].numpy()
    for i, x in DEAD:
        ref[i, x] = 0  # dead traces: no fault
    ref_one = prob(root / "one.zarr")
    assert np.abs(ref_one - ref).max() <= 1e-5 and np.abs(prob(root / "one_tiled.zarr") - ref).max() <= 1e-5
    assert ref.std() > 0.2  # (a prediction with structure: seams would show)
    # the forward in bf16 (one window: bf16 on a CPU without it is emulated, ~80x slower): close to fp32
    ok(run_predict(base + [f"--out={root / 'bf16.zarr'}", f"--crop={SHAPE}", "--bf16"]))
    d = np.abs(prob(root / "bf16.zarr") - ref_one)
    assert d.mean() <= 0.01 and d.max() <= 0.1, (d.mean(), d.max())
    # a window longer than the survey's inline axis: zeros beyond it, every voxel still predicted
    padded = ok(run_predict(base + [f"--out={root / 'padded.zarr'}", "--crop=64,32,64"]))
    live = ~np.isin(np.arange(SHAPE[0] * SHAPE[1]), [i * SHAPE[1] + x for i, x in DEAD]).reshape(SHAPE[:2])
    assert padded["windows"] == 1 and (prob(root / "padded.zarr")[live] > 0).all()
    # windows of the model's crop (16 x 16 x 32), half overlapping, gaussian: no seam. Against the one-window answer,
    # the voxels next to a window's edge differ no more than the voxels inside windows; plain tiling (no overlap,
    # constant weights) differs ten times more at its edges: the seams blending removes

    def border_and_inside(p, stride):
        m = []
        for S, c, s in zip(SHAPE, (16, 16, 32), stride):
            edge = np.zeros(S, bool)
            for o in sliding.window_starts(S, c, s):
                for b in (o, o + c):
                    if 0 < b < S:
                        edge[b - 1:b + 1] = True
            m.append(edge)
        border = m[0][:, None, None] | m[1][None, :, None] | m[2][None, None, :]
        d = np.abs(p - ref_one)
        return d[border].mean(), d[~border].mean()
    blended = ok(run_predict(base + [f"--out={root / 'blend.zarr'}"]))
    assert blended["windows"] == 45 and blended["stride"] == [8, 8, 16]
    b, i = border_and_inside(prob(root / "blend.zarr"), (8, 8, 16))
    assert b <= 1.2 * i, (b, i)
    ok(run_predict(base + [f"--out={root / 'tiling.zarr'}", "--overlap=0", "--blend=constant"]))
    b, i = border_and_inside(prob(root / "tiling.zarr"), (16, 16, 32))
    assert b > 3 * i, (b, i)


@slow
def test_every_layout_and_a_restart_write_the_same_prediction(predict_survey):
    store, run, sharp, root, exported = predict_survey
    base = [sharp, store, "--dtype=float32", "--tile=16,16,32"]  # 12 tiles, each window computed for every tile
    ref_info = ok(run_predict(base + [f"--out={root / 'ref.zarr'}", "--batch=3"]))
    ref = prob(root / "ref.zarr")
    assert ref_info["recompute"] > 1 and ref_info["voxels"] == np.prod(SHAPE)
    dead = np.asarray(zarr.open_group(root / "ref.zarr", mode="r")["dead_traces"][:])
    assert sorted(map(tuple, np.argwhere(dead).tolist())) == DEAD and (ref[dead.astype(bool)] == 0).all()
    assert (ref[~dead.astype(bool)] > 0).all() and np.isfinite(ref).all()  # every live voxel written
    # the finished prediction scored at two thresholds: nothing predicted again; IoU and Dice of p > t against the
    # labels, as counted here (a dead trace, probability 0, is no fault)
    from infra import reader
    y = reader.Volume(store).variable("fault").read((0, 0, 0), SHAPE, normalize=False).astype(bool)
    ious = []
    for t in (0.5, 0.3):
        again = ok(run_predict(base + [f"--out={root / 'ref.zarr'}", "--score=fault", f"--threshold={t}"]))
        hit = ref > t
        tp, union = (hit & y).sum(), (hit | y).sum()
        assert again["already_complete"] and again["threshold"] == t
        assert again["iou"] == pytest.approx(tp / union, abs=1e-4), (t, again)
        assert again["dice"] == pytest.approx(2 * tp / (hit.sum() + y.sum()), abs=1e-4), (t, again)
        ious.append(again["iou"])
    assert ious[0] != ious[1]  # (the threshold reached the count)
    ok(run_predict(base + [f"--out={root / 'dp2cp2.zarr'}", "--cp=2"], nproc=4))
    ok(run_predict(base + [f"--out={root / 'dp2.zarr'}"], nproc=2))
    r = run_predict(base + [f"--out={root / 'restart.zarr'}", "--stop_after=5"])
    assert r.returncode == 75, r.stderr[-2000:]
    part = root / "restart.zarr.partial"
    marks = sorted(os.listdir(part / "predict_done"))
    assert len(marks) == 5
    os.remove(part / "predict_done" / marks[-1])  # killed after writing a tile, before marking it: it is redone
    again = ok(run_predict(base + [f"--out={root / 'restart.zarr'}"]))
    assert again["voxels"] == np.prod(SHAPE) - 4 * 16 * 16 * 32  # the 4 tiles marked were skipped
    for name in ("dp2cp2", "dp2", "restart"):
        assert np.abs(prob(root / f"{name}.zarr") - ref).max() <= 1e-5, name

    assert not os.path.exists(part) and not os.path.exists(root / "restart.zarr" / "predict_done")
    again = ok(run_predict(base + [f"--out={root / 'restart.zarr'}"]))
    assert again["already_complete"]
    # the same model given as its run's out_dir: the same prediction as its model file (uint8, the default)
    ok(run_predict([run, store, f"--out={root / 'run.zarr'}", "--score=fault"]))
    info = ok(run_predict([exported, store, f"--out={root / 'file.zarr'}", "--score=fault"]))
    a, b = (np.asarray(zarr.open_group(root / f"{n}.zarr", mode="r")["probability"][:]) for n in ("run", "file"))
    assert a.dtype == np.uint8 and (a == b).all() and 0 <= info["iou"] <= 1
    assert zarr.open_group(root / "file.zarr", mode="r")["probability"].attrs["scale_factor"] == pytest.approx(1 / 255)


@slow
def test_a_variable_joins_an_mdio_store_and_leaves_its_own_as_they_were(predict_survey, tmp_path):
    _, _, sharp, _, _ = predict_survey
    # a store the official multidimio wrote from real SEG-Y (the F3 crop: 23 x 18 x 75, one chunk)
    mine = str(tmp_path / "f3.mdio")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "mdio_ingest.py"),
                        os.path.join(ROOT, "..", "shared", "data", "f3.sgy"), mine], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]

    def digest(path, skip):
        h = hashlib.sha256()
        for d, _, files in sorted(os.walk(path)):
            if os.path.relpath(d, path).split(os.sep)[0].startswith(skip):
                continue
            for f in sorted(files):
                h.update(os.path.join(os.path.relpath(d, path), f).encode() + open(os.path.join(d, f), "rb").read())
        return h.hexdigest()
    before = digest(mine, "fault_probability")
    info = ok(run_predict([sharp, mine, f"--out={mine}", "--variable=fault_probability", "--dtype=float32"]))
    assert info["windows"] == 2 * 2 * 4  # 23 x 18 x 75 in windows of 16 x 16 x 32 (origins 0, 7 | 0, 2 | 0, 16, 32, 43)
    ok(run_predict([sharp, mine, f"--out={tmp_path / 'own.zarr'}", "--dtype=float32"]))
    assert digest(mine, "fault_probability") == before  # every byte of the store but the new variables as it was
    g = zarr.open_group(mine, mode="r")
    assert np.abs(np.asarray(g["fault_probability"][:]) - prob(tmp_path / "own.zarr")).max() <= 1e-6
    assert "fault_probability_predict_done" not in os.listdir(mine)
    import mdio
    ds = mdio.open_mdio(mine)
    assert ds["fault_probability"].dims == ds["amplitude"].dims and ds["fault_probability"].shape == (23, 18, 75)
    for name, says in (("amplitude", "not the amplitude's"), ("headers", "predict did not write")):
        r = run_predict([sharp, mine, f"--out={mine}", f"--variable={name}"])
        assert r.returncode == 2 and says in r.stderr.strip().splitlines()[-1], r.stderr[-1000:]


@slow
def test_bad_model_survey_and_output_are_one_error_line_each(predict_survey, tmp_path):
    store, run, sharp, root, exported = predict_survey
    mae_run = tmp_path / "mae"
    assert run_train(small_args(store, mae_run, max_steps=1, eval_interval=100)).returncode == 0
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a model")
    os.makedirs(tmp_path / "folder" / "x")
    ok(run_predict([sharp, store, f"--out={tmp_path / 'p.zarr'}"]))
    cases = [([str(mae_run), store, f"--out={tmp_path / 'a.zarr'}"], "pretrained MAE"),
             ([str(junk), store, f"--out={tmp_path / 'b.zarr'}"], "not a seismic-mae model file"),
             ([sharp, str(tmp_path / "nothing.mdio"), f"--out={tmp_path / 'c.zarr'}"], "nothing.mdio"),
             ([sharp, store, f"--out={tmp_path / 'p.zarr'}", "--overlap=0.25"], "--overwrite"),
             ([sharp, store, f"--out={tmp_path / 'folder'}"], "never writes over"),
             ([sharp, store, f"--out={tmp_path / 'd.zarr'}", "--tile=10,16,16"], "multiple of the output's chunks"),
             ([sharp, store, f"--out={tmp_path / 'e.zarr'}", "--score=horizon"], "no label variable"),
             ([sharp, store, f"--out={tmp_path / 'f.zarr'}", "--overlap=1"], "--overlap=1"),
             ([sharp, store, f"--out={tmp_path / 'h.zarr'}", "--score=fault", "--threshold=1"], "--threshold=1"),
             ([sharp, store, f"--out={tmp_path / 'g.zarr'}", "--crop=12,16,32"], "multiple of the model's patch"),
             ([str(tmp_path / "no.pt"), store, f"--out={tmp_path / 'i.zarr'}"], "MODEL="),
             ([sharp, store, f"--out={tmp_path / 'j.zarr'}", "--score=horizon"], "set --score to one")]
    for args, says in cases:
        r = run_predict(args)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode != 0 and last.startswith("error:") and says in last, (args, r.stderr[-1500:])
        assert not any(w in last for w in ("init_from='", "set data_paths", "set label_var")), last  # (its own words)
    assert zarr.open_group(tmp_path / "p.zarr", mode="r")["probability"].attrs["predict"]["overlap"] == 0.5


# ----------------------------------------------------------------------------- nothing it did not make is touched

def tree_digest(path):
    """sha256 of every file under `path` (names and bytes): equal before and after = not a byte changed."""
    h = hashlib.sha256()
    for d, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            h.update(os.path.join(os.path.relpath(d, path), f).encode() + open(os.path.join(d, f), "rb").read())
    return h.hexdigest()


@slow
def test_a_variable_never_writes_over_the_users_arrays_of_its_derived_names(predict_survey, tmp_path):
    """--variable=fp into a store of the user's that holds an array or group of a name predict would create beside fp
    (fp_dead_traces, fp_zero_traces, fp_predict_done): refused before any work, one line naming it, and every byte of
    the store as it was. Into a store with none of them, stopped and resumed: predict's own arrays (tagged) are gone
    on from, and the user's other arrays stay byte-identical."""
    import shutil
    store, _, sharp, _, _ = predict_survey
    for name, kind in (("fp_dead_traces", "array"), ("fp_zero_traces", "array"), ("fp_predict_done", "group")):
        mine = tmp_path / f"{name}.mdio"
        shutil.copytree(store, mine)
        g = zarr.open_group(mine, mode="r+")
        if kind == "array":
            g.create_array(name, shape=(4, 4), dtype="float32")[:] = np.arange(16, dtype=np.float32).reshape(4, 4)
        else:
            g.create_group(name).create_array("notes", shape=(3,), dtype="int32")[:] = [1, 2, 3]
        before = tree_digest(mine)
        r = run_predict([sharp, str(mine), f"--out={mine}", "--variable=fp"])
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and last.startswith("error:") and f"already holds {name!r}" in last, r.stderr[-2000:]
        assert tree_digest(mine) == before
    mine = tmp_path / "clean.mdio"
    shutil.copytree(store, mine)
    g = zarr.open_group(mine, mode="r+")
    g.create_array("fp_notes", shape=(2,), dtype="int32")[:] = [7, 8]  # (a name predict does not use: untouched)
    before = {n: tree_digest(mine / n) for n in os.listdir(mine) if n != "zarr.json"}
    args = [sharp, str(mine), f"--out={mine}", "--variable=fp", "--tile=16,16,32", "--dtype=float32"]
    r = run_predict(args + ["--stop_after=2"])
    assert r.returncode == 75 and "fp_zero_traces" in os.listdir(mine), r.stderr[-2000:]
    ok(run_predict(args))  # its own tagged arrays and markers: gone on from
    ok(run_predict([sharp, store, f"--out={tmp_path / 'ref.zarr'}", "--tile=16,16,32", "--dtype=float32"]))
    assert np.abs(prob(mine, "fp") - prob(tmp_path / "ref.zarr")).max() <= 1e-6
    assert {n: tree_digest(mine / n) for n in before} == before
    assert sorted(set(os.listdir(mine)) - set(before)) == ["fp", "fp_dead_traces", "zarr.json"]


@slow
def test_no_output_inside_a_runs_checkpoints_and_no_picture_at_the_output(predict_survey, tmp_path):
    """A prediction (or its picture) inside a run's ckpt/ is refused however the model is given (its exported file,
    whose path names no run): the run's next relaunch rotates step_N/ away with whatever is in it. --picture at
    --out is refused before any work, not after the whole run."""
    _, run, _, _, exported = predict_survey
    from infra import checkpoint
    ckpt = os.path.join(run, "ckpt")
    step = os.path.join(ckpt, checkpoint.complete_checkpoints(ckpt)[-1][1])
    before = tree_digest(ckpt)
    for args, says in (([f"--out={step}/pred.zarr"], "inside the checkpoint folder"),
                       ([f"--out={tmp_path / 'p.zarr'}", f"--picture={ckpt}/p.png"], "inside the checkpoint folder"),
                       ([f"--out={tmp_path / 'p.zarr'}", f"--picture={tmp_path / 'p.zarr'}"], "the same path as --out"),
                       ([f"--out={tmp_path / 'p.zarr'}", f"--picture={tmp_path / 'p.zarr.partial'}"], "store being built"),
                       (["--out=" + os.path.join(run, "..", os.path.basename(run), "ckpt", "x.zarr")], "checkpoint")):
        r = run_predict([exported, predict_survey[0], *args])
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and last.startswith("error:") and says in last, (args, r.stderr[-1500:])
    assert tree_digest(ckpt) == before and not os.path.exists(tmp_path / "p.zarr.partial")


@slow
def test_one_predict_per_output_the_second_is_refused_and_a_dead_ones_lease_is_taken_over(predict_survey, tmp_path):
    """Two predicts into one --out: the second is refused at once, naming the first (its pid), and the first
    finishes undisturbed; its lease goes with it. A predict killed with kill -9 leaves its lease behind: the same
    command takes it over (its process is gone) and finishes from the tiles written."""
    import signal
    import time
    store, _, sharp, _, _ = predict_survey
    base = [sharp, store, "--dtype=float32", "--tile=16,16,32"]  # 12 tiles
    out = tmp_path / "p.zarr"
    # (2 s a tile: the second predict's start-up must find the first still running, on a busy machine too)
    first = subprocess.Popen([sys.executable, "-m", "scripts.predict", *base, f"--out={out}", "--slow_tile=2"],
                             cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not os.path.exists(f"{out}.partial/predict_done"):
            assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.05)
        r = run_predict([*base, f"--out={out}"])
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and "being written by another command" in last and f"pid {first.pid}" in last, \
            r.stderr[-2000:]
        o, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]
    ref = prob(out)
    assert not os.path.exists(f"{out}.lease") and not os.path.exists(f"{out}.partial")
    again = tmp_path / "q.zarr"
    p = subprocess.Popen([sys.executable, "-m", "scripts.predict", *base, f"--out={again}", "--slow_tile=0.5"],
                         cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while marked(again) < 2:
            assert p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        p.kill()
    assert os.path.exists(f"{again}.lease")  # (left by the killed one)
    r = run_predict([*base, f"--out={again}"])
    assert r.returncode == 0 and "took over the stale lease" in r.stderr and "is gone" in r.stderr, r.stderr[-2000:]
    assert np.abs(prob(again) - ref).max() <= 1e-6 and not os.path.exists(f"{again}.lease")


@slow
def test_a_store_killed_while_it_was_being_made_is_gone_on_from(predict_survey, tmp_path):
    """A predict killed after its store's first write (the group, which carries its record) but before its arrays:
    the same command goes on from it (not "not a prediction store", which even --overwrite could not clear)."""
    store, _, sharp, _, _ = predict_survey
    base = [sharp, store, "--dtype=float32", "--tile=16,16,32"]
    ok(run_predict([*base, f"--out={tmp_path / 'ref.zarr'}"]))
    rec = dict(zarr.open_group(tmp_path / "ref.zarr", mode="r").attrs["predict"])
    rec = {k: v for k, v in rec.items() if k not in ("complete", "dead_traces")}
    half = zarr.open_group(tmp_path / "p.zarr.partial", mode="w", attributes={"predict": {**rec, "complete": False}})
    half.create_array("inline", shape=(3,), dtype="float64")  # (and one coordinate array, half written)
    ok(run_predict([*base, f"--out={tmp_path / 'p.zarr'}"]))
    assert np.abs(prob(tmp_path / "p.zarr") - prob(tmp_path / "ref.zarr")).max() <= 1e-6


@slow
def test_a_full_disk_is_one_line_the_tiles_are_kept_and_the_same_command_finishes(predict_survey, tmp_path):
    """--out on a real tmpfs too small for the prediction: one line (exit code 4) naming the write, the cause and what
    is kept; with room made, the same command finishes from the tiles written and equals a prediction on a disk
    with room."""
    from conftest import tmpfs
    store, _, sharp, _, _ = predict_survey
    base = [sharp, store, "--dtype=float32", "--tile=16,16,32"]  # 12 tiles of 16 x 16 x 32 x 4 B = 32 KiB each
    ok(run_predict([*base, f"--out={tmp_path / 'ref.zarr'}"]))
    with tmpfs(tmp_path / "disk", "size=160k") as disk:
        out = disk / "p.zarr"
        r = run_predict([*base, f"--out={out}", f"--picture={tmp_path / 'p.png'}"])
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 4 and lines[-1].startswith("error: writing tile ") and "No space left" in lines[-1] \
            and f"kept in {out}.partial" in lines[-1] and "Traceback" not in r.stderr, r.stderr[-3000:]
        n = marked(out)
        assert 0 < n < 12
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        info = ok(run_predict([*base, f"--out={out}", f"--picture={tmp_path / 'p.png'}"]))
        assert info["voxels"] == np.prod(SHAPE) - n * 16 * 16 * 32  # the tiles kept were not redone
        assert np.abs(prob(out) - prob(tmp_path / "ref.zarr")).max() <= 1e-6


@slow
def test_a_survey_on_s3_predicted_into_s3_and_resumed_there(predict_survey, s3, small_store, tmp_path):
    """s3:// in and out (a real S3 endpoint on loopback), 2 dp ranks, stopped after 2 tiles each and restarted (the
    markers are S3 objects, listed once; the record says complete: false until the end): the local prediction."""
    _, _, sharp, _, _ = predict_survey
    base = [sharp, "--dtype=float32", "--tile=16,16,32"]
    ok(run_predict([base[0], small_store, f"--out={tmp_path / 'local.zarr'}", *base[1:]]))
    remote, so = "s3://bkt/faults.zarr", {"client_kwargs": {"endpoint_url": s3.endpoint}}
    args = [base[0], s3.url, f"--out={remote}", *base[1:], f"--s3_endpoint={s3.endpoint}",
            f"--picture={tmp_path / 'faults.png'}"]
    r = run_predict(args + ["--stop_after=2"], nproc=2)
    assert r.returncode != 0 and r.stdout.count("stopped after 2 tiles") == 2, r.stderr[-3000:]  # (torchrun: 75 -> 1)
    keys = s3.client().list_objects_v2(Bucket="bkt", Prefix="faults.zarr/predict_done/")["Contents"]
    assert len(keys) == 4 and not zarr.open_group(remote, mode="r", storage_options=so).attrs["predict"]["complete"]
    info = ok(run_predict(args, nproc=2))
    assert info["voxels"] == np.prod(SHAPE) - 4 * 16 * 16 * 32
    g = zarr.open_group(remote, mode="r", storage_options=so)
    assert g.attrs["predict"]["complete"] and "Contents" not in s3.client().list_objects_v2(
        Bucket="bkt", Prefix="faults.zarr/predict_done/")  # (the markers go when the prediction is complete)
    assert np.abs(np.asarray(g["probability"][:]) - prob(tmp_path / "local.zarr")).max() <= 1e-5
    assert (tmp_path / "faults.png").stat().st_size > 10_000


@slow
def test_traces_of_zeros_in_a_plain_array_are_dead_and_no_fault(predict_survey, tmp_path):
    """A plain Zarr array has no trace mask: a trace whose amplitudes are all zero is dead, predicted as no fault
    and marked."""
    store, _, sharp, _, _ = predict_survey
    from infra import reader
    vol = reader.Volume(store).read((0, 0, 0), SHAPE, normalize=False)
    vol = np.nan_to_num(vol)  # the dead traces' NaN -> 0
    vol[10, 20] = 0.0
    arr = zarr.create_array(str(tmp_path / "plain.zarr"), shape=SHAPE, chunks=(16, 16, 16), dtype="float32")
    arr[:] = vol
    ok(run_predict([sharp, str(tmp_path / "plain.zarr"), f"--out={tmp_path / 'p.zarr'}", "--dtype=float32"]))
    dead = np.asarray(zarr.open_group(tmp_path / "p.zarr", mode="r")["dead_traces"][:]).astype(bool)
    p = prob(tmp_path / "p.zarr")
    assert sorted(map(tuple, np.argwhere(dead).tolist())) == sorted(DEAD + [(10, 20)])
    assert (p[dead] == 0).all() and (p[~dead] > 0).all()


# ----------------------------------------------------------------------------- under launch.sh

def launch_predict(args, **env):
    """bash launch.sh -m scripts.predict ARGS, as a user starts it (the venv first on PATH), in the background."""
    e = job_env(PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **env)
    e.pop("OMP_NUM_THREADS")  # (launch.sh splits the cores between the ranks itself)
    return subprocess.Popen(["bash", "launch.sh", "-m", "scripts.predict", *args], cwd=ROOT, env=e, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def marked(out):
    d = f"{out}.partial/predict_done"
    return len(os.listdir(d)) if os.path.isdir(d) else 0


@slow
def test_under_launch_sh_a_stop_keeps_the_tiles_and_the_same_command_finishes_them(predict_survey, tmp_path):
    """launch.sh -m scripts.predict, 2 local ranks: a SIGTERM to launch.sh stops the ranks after their current tiles
    (kept, marked), the last line says so and the exit code is 75; the same command finishes the prediction, equal to
    one process's. Two nodes from a hostfile (each a host of this machine, 1 rank) write it too."""
    import time
    store, _, sharp, _, _ = predict_survey
    base = [sharp, store, "--dtype=float32", "--tile=16,16,32"]  # 12 tiles
    ref = ok(run_predict(base + [f"--out={tmp_path / 'ref.zarr'}"]))
    out = tmp_path / "launched.zarr"
    logs = tmp_path / "logs"
    env = dict(NPROC="2", LOG_DIR=str(logs))
    p = launch_predict(base + [f"--out={out}", "--slow_tile=1"], **env)  # (a tile takes a second more: a stop lands
    try:                                                                 # in the middle of the run)
        deadline = time.time() + 120
        while marked(out) < 2:
            assert p.poll() is None and time.time() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.05)
        p.send_signal(15)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    last = err.strip().splitlines()[-1]
    n = marked(out)
    assert p.returncode == 75, err[-3000:]
    assert 2 <= n < 12 and last.startswith("launch.sh: stopped by SIGTERM after ") and \
        f"{n} of 12 tiles are written in {out}.partial; run the same command again" in last, last
    assert not list(logs.glob("STOPPED_*"))  # (said, and gone)
    p = launch_predict(base + [f"--out={out}"], **env)
    o, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    again = json.loads(o.strip().splitlines()[-1])
    assert again["voxels"] == ref["voxels"] - n * 16 * 16 * 32  # the tiles written before were not redone
    assert np.abs(prob(out) - prob(tmp_path / "ref.zarr")).max() <= 1e-5
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n127.0.0.1\n")
    p = launch_predict(base + [f"--out={tmp_path / 'two_nodes.zarr'}"], HOSTFILE=str(hosts), NODES="2", NPROC="1",
                       LOG_DIR=str(logs), PORT="29617")
    o, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:] + "".join(f.read_text()[-2000:] for f in logs.glob("node_*.log"))
    assert json.loads(o.strip().splitlines()[-1])["voxels"] == ref["voxels"]  # (its JSON line, repeated from the log)
    assert np.abs(prob(tmp_path / "two_nodes.zarr") - prob(tmp_path / "ref.zarr")).max() <= 1e-5


def test_launch_sh_dry_run_of_a_command_and_its_bad_knobs(tmp_path):
    """DRY_RUN=1 prints what every node runs for a command (NODES of them); an unknown module and a bad NODES are
    one error line each."""
    def launch(args, **env):
        return subprocess.run(["bash", "launch.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env=job_env(LOG_DIR=str(tmp_path / "logs"), **env))
    r = launch(["-m", "scripts.predict", "M", "S", "--out=O"], DRY_RUN="1", NODES="3", NPROC="4")
    assert r.returncode == 0, r.stderr
    assert "3 node(s) x 4 rank(s) = world 12" in r.stdout and "--signal=USR1@300" in r.stdout
    assert r.stdout.count("--nnodes=3 --nproc_per_node=4") == 3 and "-m scripts.predict M S --out=O" in r.stdout
    for args, env, says in ((["-m", "scripts.embed", "M"], {}, "not '-m scripts.embed'"),
                            (["-m", "scripts.predict", "M", "S"], {"NODES": "0"}, "NODES='0' must be a whole number"),
                            (["-m", "scripts.predict", "M", "S"], {"STOP_LEAD": "x"}, "STOP_LEAD='x'")):
        r = launch(args, **env)
        assert r.returncode == 2 and says in r.stderr.strip().splitlines()[-1], r.stderr
