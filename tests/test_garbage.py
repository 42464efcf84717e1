"""Data that decodes but is not seismic is caught where it is read (infra/reader.py's value checks, data.dead_regions,
infra/floor.Unsolvable). A chunk of random bytes in an uncompressed Zarr store has no codec to fail: it decodes to
finite values up to ~1e38. Sampled for a store's statistics it is one DataError naming the chunk (it would otherwise
make the std enormous and every clean crop ~0); in a crop, likewise; a clean store of the same values is accepted with
the statistics it always had, and so are a synthetic survey and the F3 field crop. A training region with no signal is
a WARNING naming the store and the region, never an error; the floor on such data is skipped with a WARNING, never a
traceback. Each test fails without the checks: the garbage is accepted, nothing is said, the floor raises."""
import os
import shutil
import types

import numpy as np
import pytest
import torch
import zarr

import data
import model as M
from conftest import run_train, small_args
from infra import evaluate, floor, reader, synthetic

SHAPE, CHUNKS = (48, 32, 64), (16, 16, 16)  # a 3 x 2 x 4 grid of chunks


def uncompressed(path, vol, chunks=CHUNKS):
    """vol as a plain Zarr v3 array with no codec but the bytes: damaged bytes decode to whatever they say."""
    a = zarr.create_array(str(path), shape=vol.shape, chunks=chunks, dtype=vol.dtype, compressors=None)
    a[:] = vol
    return str(path)


def damage(store, coords, seed=0):
    """Chunk `coords` of the store overwritten on disk with random bytes of its size; returns its key ('c/1/1/2')."""
    key = "c/" + "/".join(map(str, coords))
    p = os.path.join(store, *key.split("/"))
    n = os.path.getsize(p)
    with open(p, "wb") as f:
        f.write(np.random.default_rng(seed).bytes(n))
    return key


def stats_as_before(store):
    """Mean and std as _estimate_stats has always computed them: the finite values of the 8 chunks along the grid's
    diagonal, in C order of their coordinates (the estimate a clean store must still get)."""
    a = zarr.open_array(store, mode="r")
    grid = [-(-s // c) for s, c in zip(a.shape, a.chunks)]
    picks = sorted({tuple(int(g * f) for g in grid) for f in np.linspace(0, 0.999, 8)})
    vals = np.concatenate([a[tuple(slice(i * c, (i + 1) * c) for i, c in zip(p, a.chunks))].ravel() for p in picks])
    vals = vals.astype(np.float64)
    vals = vals[np.isfinite(vals)]
    return vals.mean(), vals.std()


@pytest.fixture(scope="module")
def seismic():
    return synthetic.synthetic_volume(SHAPE, seed=3)  # float32, NaN on dead traces


def test_a_chunk_of_random_bytes_sampled_for_the_statistics_is_named(seismic, tmp_path):
    """Chunk (1, 1, 2) lies on the diagonal the statistics are estimated from: opening the damaged store is one
    DataError naming it (without the check its std was ~1e36 and every crop normalised to ~0); the clean store of the
    same values opens with the statistics it always had."""
    clean = uncompressed(tmp_path / "clean.zarr", seismic)
    v = reader.Volume(clean)
    assert (v.mean, v.std) == stats_as_before(clean)
    bad = shutil.copytree(clean, tmp_path / "bad.zarr")
    key = damage(bad, (1, 1, 2))
    with pytest.raises(reader.DataError) as e:
        reader.Volume(str(bad))
    msg = str(e.value)
    assert f"{str(bad)!r}: chunk {key!r}" in msg and "write the store again from its source" in msg, msg
    assert "data_paths" in msg and "\n" not in msg, msg


def test_a_chunk_of_random_bytes_in_a_crop_is_named(seismic, tmp_path):
    """Chunk (0, 1, 0) is not among those sampled: the store opens with the clean store's statistics, a crop that
    does not touch the chunk reads as the clean store's does, and one that does (alone, or among others read side by
    side) is a DataError naming the chunk, not a crop of values 1e30 std out."""
    clean = uncompressed(tmp_path / "clean.zarr", seismic)
    bad = str(shutil.copytree(clean, tmp_path / "bad.zarr"))
    key = damage(bad, (0, 1, 0))
    v, ok = reader.Volume(bad), reader.Volume(clean)
    assert (v.mean, v.std) == (ok.mean, ok.std)
    away = ((16, 0, 0), (16, 32, 64))
    assert np.array_equal(v.read(*away), ok.read(*away))
    for crop in [((0, 8, 8), (16, 16, 16)), ((0, 0, 0), SHAPE)]:
        for normalize in (True, False):
            with pytest.raises(reader.DataError, match=f"{bad!r}: chunk {key!r} holds .* std from the store's mean"):
                v.read(*crop, normalize=normalize)
    with pytest.raises(reader.DataError, match=f"chunk {key!r}"):
        reader.read_crops([(v, *away), (v, (0, 16, 0), (16, 16, 16))])


def test_real_data_passes_the_checks(seismic, tmp_path):
    """No false positive: a synthetic survey (MDIO v1, statsV1; and uncompressed with estimated statistics), a
    fault-model volume, an int16 store using its whole range (an integer store is not checked: it cannot hold a value
    beyond its type) and the F3 field crop through multidimio (its statistics estimated, every voxel read) all pass."""
    stores = [synthetic.write_mdio(str(tmp_path / "s.mdio"), seismic, chunks=CHUNKS),
              uncompressed(tmp_path / "s.zarr", seismic),
              uncompressed(tmp_path / "f.zarr", synthetic.faultseg_volume(SHAPE, seed=1)[0].astype(np.float32))]
    ints = np.zeros(SHAPE, np.int16)
    ints[5, 5, 5], ints[6, 6, 6], ints[7, 7, 7] = 32767, -32768, 1
    stores.append(uncompressed(tmp_path / "i.zarr", ints))
    from test_mdio import F3, ingest
    if os.path.exists(F3):
        f3 = ingest(F3, str(tmp_path / "f3.mdio"))
        stores += [f3, os.path.join(f3, "amplitude")]  # (the bare array: statistics estimated from its chunks)
    for s in stores:
        v = reader.Volume(s)
        x = v.read((0, 0, 0), v.shape)
        assert np.isfinite(x).all() and np.abs(x).max() > 0, s


def half_dead(path):
    """SHAPE with inlines 0..31 all zeros (the training region at val_frac 1/3) and a survey in 32..47."""
    vol = synthetic.synthetic_volume(SHAPE, seed=3)
    vol[:32] = 0
    return synthetic.write_mdio(str(path), vol, chunks=CHUNKS)


def test_a_dead_training_region_is_a_warning_naming_it(tmp_path):
    """Training crops in inlines [0, 32), all zeros: one WARNING naming the store and the region (and no error: a
    survey may have a dead corner); the live survey of the same shape gets none."""
    dead, live = half_dead(tmp_path / "dead.mdio"), synthetic.write_mdio(
        str(tmp_path / "live.mdio"), synthetic.synthetic_volume(SHAPE, seed=3), chunks=CHUNKS)
    said = []
    sampler = data.Sampler([live, dead], (16, 16, 32), part=("train", 1 / 3))
    assert data.dead_regions(sampler, said.append) == [(dead, (0, 32))]
    assert len(said) == 1 and said[0].startswith(f"WARNING: data: {dead!r}: its training region (inlines [0, 32) of "
                                                 f"48") and "every value 0" in said[0], said


def test_the_floor_on_data_it_cannot_use_is_a_warning_not_a_traceback(tmp_path):
    """floor_of on the half-dead store (every training crop the same value: a zero covariance table, a singular
    C_vv; it raised torch's LinAlgError) logs one WARNING saying why and returns None, so the record has no
    val_floor; a table that is not finite is refused by floor.predict with the reason."""
    store, crop, patch = half_dead(tmp_path / "dead.mdio"), (16, 16, 32), (8, 8, 8)
    m = M.mae("tiny", grid=M.token_grid(crop, patch), patch=patch, norm_pix_loss=True)
    said = []
    job = types.SimpleNamespace(
        cfg={"task": "mae", "seed": 0, "eval_samples": 2, "micro_batch": 2, "crop": crop}, model=m, rank=0,
        device=torch.device("cpu"), log=said.append,
        sampler=data.Sampler([store], crop, part=("train", 1 / 3), micro_batch=2),
        val_sampler=data.Sampler([store], crop, part=("val", 1 / 3), stream="val", micro_batch=2))
    assert evaluate.floor_of(job) is None
    assert len(said) == 1 and said[0].startswith("WARNING: floor: not computed, skipped: ") and "no val_floor" in said[0]
    x = torch.randn(1, 1, *crop)
    keep = m.keep_ids(M.mask_noise(0, [0], m.L, 0, 1), 0, 1)
    table = floor.covariance(x, patch)
    table[0, 0, 0] = float("nan")
    with pytest.raises(floor.Unsolvable, match="not finite"):
        floor.predict(x, keep, patch, table)


def test_train_py_on_a_damaged_store_ends_in_one_error_line(seismic, tmp_path):
    """End to end, as a user meets it: train.py on the store with a damaged diagonal chunk exits 2 with one
    `error:` line naming the store and the chunk, and no traceback."""
    bad = uncompressed(tmp_path / "bad.zarr", seismic)
    key = damage(bad, (1, 1, 2))
    r = run_train(small_args(bad, tmp_path / "run", max_steps=1), timeout=300)
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("error:") and key in last and bad in last, (r.returncode,
                                                                                            r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
