"""Held-out validation and its pictures (infra/evaluate.py): the held-out inlines are never trained on,
the validation loss is a function of the weights alone (not of cp, the strategy or a resume: those equalities are
in test_cp_train, test_strategies and test_train), eval_only repeats the logged value, and the figure shows
what it says it shows."""
import json
import os
import sys

import numpy as np
import pytest
import torch

import configurator
import data
import model as M
from infra import evaluate
from infra import synthetic
from conftest import read_log, read_val, run_train, small_args
from dist_util import run_ranks


# ---- the held-out split


def test_training_and_validation_crops_never_overlap(small_store, tmp_path):
    """Over many draws, with and without chunk alignment, from two volumes of different sizes: every training crop
    lies in the first inlines, every validation crop in the held-out last val_frac, and each stream is a function
    of (seed, index) alone."""
    other = str(tmp_path / "other.mdio")
    synthetic.write_mdio(other, synthetic.synthetic_volume((40, 24, 48), seed=1), chunks=(12, 12, 16))
    crop = (8, 8, 16)
    for align in (False, True):
        kw = dict(crop=crop, seed=4, align=align)
        tr = data.Sampler([small_store, other], part=("train", 0.3), **kw)
        va = data.Sampler([small_store, other], part=("val", 0.3), stream="val", **kw)
        bound = {0: 48 - round(48 * 0.3), 1: 40 - round(40 * 0.3)}  # 34 and 28
        seen_t, seen_v = set(), set()
        for g in range(1500):
            v, o = tr.locate(g)
            assert 0 <= o[0] and o[0] + crop[0] <= bound[v], (align, v, o)
            seen_t.add((v, o[0]))
            v, o = va.locate(g)
            assert bound[v] <= o[0] and o[0] + crop[0] <= tr.records[v]["shape"][0], (align, v, o)
            seen_v.add((v, o[0]))
        # the draws cover their ranges (a sampler stuck at one origin would pass the checks above)
        assert {v for v, _ in seen_t} == {v for v, _ in seen_v} == {0, 1}
        assert len(seen_t) >= (6 if align else 20) and len(seen_v) >= (2 if align else 6), (seen_t, seen_v)
        again = data.Sampler([small_store, other], part=("val", 0.3), stream="val", **kw)
        assert [again.locate(g) for g in range(20)] == [va.locate(g) for g in range(20)]
        for s in (tr, va, again):
            s.close()
    # the validation stream is not the training stream, and the held-out masks are not the training masks
    whole_t = data.Sampler([small_store], crop, seed=4)
    whole_v = data.Sampler([small_store], crop, seed=4, stream="val")
    assert [whole_t.locate(g) for g in range(10)] != [whole_v.locate(g) for g in range(10)]
    assert not torch.equal(M.mask_noise(4, [0, 1], 16), M.mask_noise(4, [0, 1], 16, stream="val"))


def test_a_held_out_part_too_small_for_a_crop_is_a_clear_error(small_store, tmp_path):
    with pytest.raises(data.DataError, match=r"48 inlines; val_frac=0.1 leaves inlines \[43, 48\) = 5 for validation, "
                                             r"fewer than a crop's 16: raise val_frac to at least 0.333"):
        data.Sampler([small_store], (16, 16, 32), part=("val", 0.1))
    with pytest.raises(data.DataError, match="for training, fewer than a crop's 16: lower val_frac"):
        data.Sampler([small_store], (16, 16, 32), part=("train", 0.9))
    # as a job: one line, before any work
    r = run_train(small_args(small_store, tmp_path, val_frac=0.1), nproc=1)
    assert r.returncode == 2 and "small.mdio' has 48 inlines; val_frac=0.1" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "log.jsonl").exists()


def test_bad_validation_settings_are_errors_before_work(monkeypatch):
    cfg = configurator.defaults()
    for kw, msg in (({"eval_samples": 0}, "eval_samples must be >= 1"), ({"val_frac": 1.0}, "val_frac must be in"),
                    ({"eval_interval": 0}, "eval_interval must be >= 1"),
                    ({"eval_only": True, "val_frac": 0.0}, "eval_only=True needs a validation set")):
        with pytest.raises(configurator.ConfigError, match=msg):
            configurator.check_config({**cfg, **kw})
    # tensorboard=True where the package is missing (an entry of None in sys.modules is how Python spells "not
    # installed" to the import system)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(configurator.ConfigError, match="pip install tensorboard"):
        configurator.check_config({**cfg, "tensorboard": True})


def test_assignment_covers_every_sample_once_with_equal_forwards():
    for n in (1, 3, 7, 16):
        for dp in (1, 2, 3, 4):
            for mb in (1, 2, 5):
                plans = [evaluate.assignment(n, r, dp, mb) for r in range(dp)]
                real = sorted(i for p in plans for b in p for i, w in b if w)
                assert real == list(range(n)), (n, dp, mb)
                assert len({len(p) for p in plans}) == 1  # the same number of forwards on every rank


# ---- a run with validation, figures and tensorboard; eval_only on its checkpoint


@pytest.fixture(scope="module")
def run(small_store, tmp_path_factory):
    d = tmp_path_factory.mktemp("val_run")
    r = run_train(small_args(small_store, d, max_steps=6, figures=True, tensorboard=True, norm_pix_loss=True), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, r


@pytest.mark.slow
def test_run_logs_val_loss_and_draws_figures(run):
    d, r = run
    val = read_val(d)
    assert [s for s, _ in val] == [0, 3, 6]
    assert "step     3 | val loss" in r.stdout and "evaluation took" in r.stdout
    figs = sorted(os.listdir(d / "figures"))
    assert figs == ["loss.png", "recon_step_0000000.png", "recon_step_0000003.png", "recon_step_0000006.png"]
    for f in figs:
        with open(d / "figures" / f, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    train_losses, val_losses = evaluate.read_losses(d / "log.jsonl")
    assert sorted(train_losses) == list(range(6)) and sorted(val_losses) == [0, 3, 6]
    # the floor (infra/floor.py): computed once, in every validation record, said on the log line and drawn
    floors = [r["val_floor"] for r in map(json.loads, open(d / "log.jsonl")) if "val_loss" in r]
    assert len(floors) == 3 and len(set(floors)) == 1 and 0 < floors[0] < 1.5
    assert r.stdout.count("floor: kriging on the same masked patches") == 1 and "(kriging): " in r.stdout
    assert evaluate.read_floor(d / "log.jsonl") == floors[0]
    # tensorboard: the event file holds the train and val scalars and the figure
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(d / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss/val")] == [0, 3, 6]
    assert [e.value for e in acc.Scalars("loss/val")] == pytest.approx([v for _, v in val], rel=1e-6)
    assert len(acc.Scalars("loss/train")) == 6 and len(acc.Images("reconstruction")) == 3


@pytest.mark.slow
def test_eval_only_prints_the_value_the_run_logged(run, small_store):
    d, _ = run
    r = run_train(small_args(small_store, d, max_steps=6, figures=False, norm_pix_loss=True, eval_only=True), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["step"] == 6 and last["val_loss"] == read_val(d)[-1][1], (last, read_val(d))
    assert len(read_log(d)) == 6 and len(read_val(d)) == 3  # nothing trained, nothing appended
    # no checkpoint to evaluate: a clear error
    r = run_train(small_args(small_store, d / "empty", eval_only=True), nproc=1)
    assert r.returncode == 2 and "holds no complete checkpoint to evaluate" in r.stderr, r.stderr[-2000:]


def test_val_paths_hold_out_whole_stores(small_store, tmp_path):
    """With val_paths, validation reads those stores, whole, and training all of data_paths: val_frac is then not
    applied (here 0.9 would leave training 5 of the small store's 48 inlines, fewer than a crop: an error if it
    were), and the validation crops come from the other store."""
    other = str(tmp_path / "held_out.mdio")
    synthetic.write_mdio(other, synthetic.synthetic_volume((16, 16, 32), seed=9), chunks=(16, 16, 16))
    r = run_train(small_args(small_store, tmp_path / "out", max_steps=3, val_paths=[other], val_frac=0.9), nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s for s, _ in read_val(tmp_path / "out")] == [0, 3]
    va = data.Sampler([other], (16, 16, 32), stream="val")
    assert {va.locate(g)[1] for g in range(5)} == {(0, 0, 0)}  # the whole (crop-sized) held-out store


# ---- the figure from known inputs


def test_pasted_panel_is_the_original_on_visible_patches_and_norm_pix_is_undone(tmp_path):
    torch.manual_seed(0)
    patch, grid = (2, 2, 4), (4, 3, 2)
    m = M.MAE(grid=grid, patch=patch, dim=12, depth=1, heads=2, dec_dim=8, dec_depth=1, dec_heads=2,
              norm_pix_loss=True)
    x = torch.randn(1, 1, 8, 6, 8)
    patches = M.patchify(x, patch)
    ids_keep = m.keep_ids(torch.rand(1, m.L))
    mask, _, _ = M.mask_from_keep(ids_keep, m.L)
    # a "prediction" that is exactly the norm-pix target: de-normalised, it must give back the voxels
    t = patches.float()
    pred = (t - t.mean(-1, keepdim=True)) / (t.var(-1, keepdim=True) + 1e-6) ** 0.5
    xs, rs, ms = evaluate.voxel_views(m, x, pred, mask)
    assert np.allclose(rs, xs, atol=1e-5)
    vox = M.unpatchify(mask[:, :, None].expand(-1, -1, m.P), patch, grid)[0, 0].numpy() > 0.5
    assert np.array_equal(ms, vox) and 0 < ms.float().mean() < 1  # (tensors: voxel_views leaves them on the device)
    # now a wrong prediction, so that the panels differ: the pasted panel must be the original where visible and
    # the reconstruction where masked, in every drawn row; the masked input blank (NaN) exactly where masked
    rs = rs + 5.0
    sl = evaluate.join_parts([evaluate.centre_parts(xs, rs, ms, 0, 8)])
    title = evaluate.figure_title("known inputs", 7, 0.5, 0.75, norm_pix=True)
    fig = evaluate.recon_figure(str(tmp_path / "f.png"), sl, (10, 20, 30), title)
    assert os.path.getsize(tmp_path / "f.png") > 1000
    assert "de-normalised with each target patch's own mean and std" in fig._suptitle.get_text()
    for row, name in enumerate(("inline", "crossline", "time")):
        orig, recon, msk = sl[name]
        ims = [fig.axes[4 * row + k].images[0].get_array() for k in range(4)]  # what imshow holds, transposed
        vis = ~(msk.T > 0.5)
        assert np.array_equal(np.asarray(ims[0]), orig.T)
        assert np.array_equal(np.isnan(np.asarray(ims[1].filled(np.nan))), ~vis)
        pasted = np.asarray(ims[3])
        assert np.array_equal(pasted[vis], orig.T[vis]) and np.array_equal(pasted[~vis], recon.T[~vis])
        assert vis.any() and (~vis).any()
    # the axes are the volume's indices: the inline slice spans crosslines 20..25, times 30..37
    assert fig.axes[0].get_xlim() == (19.5, 25.5) and fig.axes[0].get_ylim() == (37.5, 29.5)


def _slices_worker(rank, world, store, out):
    """Validation on `world` ranks as cp ranks of one sample (tiny model, same init everywhere); rank 0 saves
    the val loss and the figure's slices."""
    torch.manual_seed(0)
    group = torch.distributed.new_group(list(range(world)))
    m = M.mae("tiny", grid=(2, 2, 4), patch=(8, 8, 8), mask_strata=2)
    m.set_context_parallel(group if world > 1 else None)
    m.eval()
    s = data.Sampler([store], (16, 16, 32), seed=1, cp_rank=rank, cp_size=world, part=("val", 1 / 3), stream="val")
    val, per, sl = evaluate.run(m, m, s, 1, 3, torch.device("cpu"), torch.float32, 2, rank, world, 0, 1,
                                want_slices=True)
    if rank == 0:
        np.savez(out, val=val, per=per, **sl)


def test_cp2_validation_and_slices_equal_one_rank(small_store, tmp_path):
    run_ranks(1, _slices_worker, small_store, str(tmp_path / "one.npz"))
    run_ranks(2, _slices_worker, small_store, str(tmp_path / "two.npz"))
    a, b = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert abs(float(a["val"]) - float(b["val"])) <= 1e-5 * abs(float(a["val"]))
    for k in ("inline", "crossline", "time"):
        assert a[k].shape == b[k].shape and np.allclose(a[k], b[k], atol=1e-5), k
    assert a["crossline"].shape == (3, 16, 32) and a["inline"].shape == (3, 16, 32) and a["time"].shape == (3, 16, 16)
