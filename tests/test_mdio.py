"""MDIO compatibility, proven against the official library: SEG-Y -> MDIO v1 by `multidimio`'s segy_to_mdio,
uploaded to a loopback S3, read through data.py, compared with segyio's reading of the same SEG-Y. Also
MDIO v0 layout and plain Zarr arrays."""
import os
import subprocess
import sys

import numpy as np
import pytest
import zarr

import data
from infra import reader
from conftest import ROOT
from bench.s3_loopback import MotoS3

segyio = pytest.importorskip("segyio")
F3 = os.path.join(ROOT, "..", "shared", "data", "f3.sgy")


@pytest.fixture(scope="module")
def s3():
    m = MotoS3()
    yield m
    m.stop()


def ingest(src, dst):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "mdio_ingest.py"), src, dst], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return dst


def check_against_segyio(vol, cube, live):
    """vol: our Volume; cube: (il, xl, t) float values from segyio, NaN where no trace; live: (il, xl) bool."""
    assert vol.shape == cube.shape
    raw = vol.read((0, 0, 0), vol.shape, normalize=False)
    assert np.array_equal(raw[live], cube[live].astype(np.float32))  # live traces: exactly segyio's values
    assert np.isnan(raw[~live]).all()  # dead traces: MDIO's fill value
    assert np.array_equal(vol.trace_mask, live)
    vals = cube[live].astype(np.float64)
    vals = vals[vals != 0]  # MDIO's statsV1 convention: over live, non-zero samples (zeros are padding)
    assert vol.mean == pytest.approx(vals.mean(), rel=1e-9, abs=1e-9)
    assert vol.std == pytest.approx(vals.std(), rel=1e-9)
    norm = vol.read((0, 0, 0), vol.shape)
    assert (norm[~live] == 0).all() and np.isfinite(norm).all()
    assert np.allclose(norm[live], (cube[live] - vals.mean()) / vals.std(), atol=1e-5)


@pytest.mark.skipif(not os.path.exists(F3), reason="shared/data/f3.sgy not present")
def test_f3_field_data_through_mdio_and_s3(s3, tmp_path):
    store = ingest(F3, str(tmp_path / "f3.mdio"))
    url = s3.upload_dir(store, "mdio", "f3.mdio")
    with segyio.open(F3, iline=189, xline=193) as f:
        cube = segyio.tools.cube(f)  # (23 inlines, 18 crosslines, 75 samples)
    assert cube.shape == (23, 18, 75)
    vol = reader.Volume(url, reader.ReadOptions(in_flight=4, endpoint_url=s3.endpoint))
    check_against_segyio(vol, cube, np.ones(cube.shape[:2], bool))
    # and a crop through the sampler: the same values, normalised
    s = data.Sampler([url], (16, 16, 64), seed=5, opts=vol.opts)
    _, origin = s.locate(0)
    x = s.batch(0)[0][0, 0].numpy()
    sl = tuple(slice(o, o + c) for o, c in zip(origin, (16, 16, 64)))
    assert np.allclose(x, (cube[sl] - vol.mean) / vol.std, atol=1e-5)
    s.close()


def write_segy_with_gaps(path, n_il=7, n_xl=6, n_t=50, seed=0):
    """A synthetic post-stack SEG-Y (IEEE float) whose survey grid has missing traces: acquisition gaps."""
    rng = np.random.default_rng(seed)
    live = np.ones((n_il, n_xl), bool)
    live[0, :2] = live[4, 3] = live[n_il - 1, n_xl - 1] = False
    cube = np.full((n_il, n_xl, n_t), np.nan)
    spec = segyio.spec()
    spec.format, spec.samples, spec.tracecount = 5, list(range(0, 4 * n_t, 4)), int(live.sum())
    with segyio.create(path, spec) as f:
        f.bin.update({segyio.BinField.Interval: 4000, segyio.BinField.Samples: n_t})
        t = 0
        for i in range(n_il):
            for j in range(n_xl):
                if not live[i, j]:
                    continue
                trace = (rng.normal(size=n_t) * 100 + 3).astype(np.float32)
                f.header[t] = {segyio.TraceField.INLINE_3D: 100 + i, segyio.TraceField.CROSSLINE_3D: 20 + j,
                               segyio.TraceField.TRACE_SAMPLE_COUNT: n_t, segyio.TraceField.TRACE_SAMPLE_INTERVAL: 4000,
                               segyio.TraceField.CDP_X: 1000 * i, segyio.TraceField.CDP_Y: 1000 * j,
                               segyio.TraceField.SourceGroupScalar: 1}
                f.trace[t] = trace
                cube[i, j] = trace
                t += 1
    return cube, live


def test_synthetic_segy_with_dead_traces_through_mdio_and_s3(s3, tmp_path):
    sgy = str(tmp_path / "gaps.sgy")
    cube, live = write_segy_with_gaps(sgy)
    with segyio.open(sgy, ignore_geometry=True) as f:  # segyio reads back what it wrote
        assert np.array_equal(np.stack([f.trace[t] for t in range(f.tracecount)]), cube[live].astype(np.float32))
    url = s3.upload_dir(ingest(sgy, str(tmp_path / "gaps.mdio")), "mdio", "gaps.mdio")
    check_against_segyio(reader.Volume(url, reader.ReadOptions(endpoint_url=s3.endpoint)), cube, live)


def test_mdio_v0_layout_and_plain_zarr_array(s3, tmp_path):
    rng = np.random.default_rng(0)
    vol = rng.normal(5, 2, size=(20, 12, 40)).astype(np.float32)
    live = np.ones((20, 12), bool)
    live[3, 4] = False
    vol[3, 4] = np.nan
    # MDIO v0: Zarr v2, consolidated; data/chunked_012, metadata/live_mask, root mean/std
    v0 = str(tmp_path / "v0.mdio")
    root = zarr.open_group(v0, mode="w", zarr_format=2)
    root.attrs.update({"mean": float(np.nanmean(vol)), "std": float(np.nanstd(vol)), "rms": 1.0, "min": 0.0,
                       "max": 1.0})
    root.create_group("data").create_array("chunked_012", data=vol, chunks=(8, 8, 16), fill_value=float("nan"))
    root.create_group("metadata").create_array("live_mask", data=live, chunks=(20, 12))
    zarr.consolidate_metadata(v0)
    # a plain 3D Zarr v3 array, no statistics: estimated from chunks
    plain = str(tmp_path / "plain.zarr")
    zarr.create_array(plain, data=np.nan_to_num(vol), chunks=(10, 12, 20))
    for name, path in (("v0.mdio", v0), ("plain.zarr", plain)):
        url = s3.upload_dir(path, "fmt", name)
        v = reader.Volume(url, reader.ReadOptions(endpoint_url=s3.endpoint))
        raw = v.read((2, 1, 3), (10, 9, 30), normalize=False)
        ref = vol[2:12, 1:10, 3:33] if name == "v0.mdio" else np.nan_to_num(vol)[2:12, 1:10, 3:33]
        assert np.array_equal(raw, ref, equal_nan=True)
        if name == "v0.mdio":
            assert np.array_equal(v.trace_mask, live)
            assert (v.mean, v.std) == (root.attrs["mean"], root.attrs["std"])
            assert v.chunk_key((1, 0, 2)) == "data/chunked_012/1.0.2"
        else:
            assert v.trace_mask is None and abs(v.mean - 5) < 0.2 and abs(v.std - 2) < 0.3
            assert v.chunk_key((1, 0, 1)) == "c/1/0/1"


LAYOUTS = {  # name: (zarr_format, dtype, compressors or compressor, extra create_array arguments)
    "v3 blosc (MDIO v1)": (3, "<f4", zarr.codecs.BloscCodec(cname="zstd", clevel=5, shuffle="shuffle"), {}),
    "v3 zstd with checksum": (3, "<f4", zarr.codecs.ZstdCodec(level=3, checksum=True), {}),
    "v3 uncompressed": (3, "<f4", None, {}),
    "v3 big-endian": (3, ">f4", zarr.codecs.BloscCodec(), {"serializer": zarr.codecs.BytesCodec(endian="big")}),
    "v3 int16": (3, "<i2", zarr.codecs.ZstdCodec(), {}),
    "v3 gzip (zarr's pipeline)": (3, "<f4", zarr.codecs.GzipCodec(), {}),
    "v3 sharded (zarr's pipeline)": (3, "<f4", zarr.codecs.BloscCodec(), {"shards": (16, 16, 32)}),
    "v2 blosc (MDIO v0)": (2, "<f4", "blosc", {}),
    "v2 zstd big-endian": (2, ">f4", "zstd", {}),
    "v2 uncompressed": (2, "<f4", None, {}),
    "v2 without a fill value": (2, "<f4", "zstd", {"fill_value": None}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_reads_what_zarr_reads(layout, tmp_path):
    """data.py decodes the chunks of the usual layouts itself (numcodecs, in its pool) and leaves the rest to zarr's
    pipeline: either way a crop is exactly zarr's own reading of it. A volume whose shape is no multiple of its
    chunks (edge chunks), with one chunk never written (the fill value: NaN, or 0 for integers), crops across
    chunk borders and at the edges, read one by one and side by side (read_crops)."""
    import numcodecs
    fmt, dtype, comp, extra = LAYOUTS[layout]
    rng = np.random.default_rng(1)
    vals = rng.normal(0, 100, size=(37, 30, 70)).astype(dtype)
    path = str(tmp_path / "v.zarr")
    fill = 0 if np.dtype(dtype).kind == "i" else float("nan")
    if fmt == 3:
        arr = zarr.create_array(path, shape=vals.shape, chunks=(8, 8, 16), dtype=dtype, fill_value=fill,
                                compressors=comp, **extra)
    else:
        compressor = {"blosc": numcodecs.Blosc(cname="lz4"), "zstd": numcodecs.Zstd(level=1), None: None}[comp]
        fill = extra.get("fill_value", fill)
        arr = zarr.create_array(path, shape=vals.shape, chunks=(8, 8, 16), dtype=dtype, fill_value=fill,
                                zarr_format=2, compressors=compressor)
    arr[:] = vals
    arr.attrs.update({"mean": 1.0, "std": 2.0})  # (a plain array: no statistics to estimate)
    if "sharded" not in layout:  # a chunk never written
        os.remove(os.path.join(path, arr.metadata.encode_chunk_key((1, 1, 1))))
    ref = zarr.open_array(path, mode="r")
    v = reader.Volume(path)
    assert (v.decode is None) == ("zarr's pipeline" in layout), layout
    crops = [((0, 0, 0), (37, 30, 70)), ((5, 3, 10), (12, 20, 40)), ((29, 22, 54), (8, 8, 16)), ((8, 8, 16), (8, 8, 16))]
    for origin, shape in crops:
        want = np.asarray(ref[tuple(slice(o, o + n) for o, n in zip(origin, shape))]).astype(np.float32)
        got = v.read(origin, shape, normalize=False)
        assert got.dtype == np.float32 and np.array_equal(got, want, equal_nan=True), (layout, origin)
        norm = v.read(origin, shape)
        assert np.array_equal(norm, np.nan_to_num((want - np.float32(1.0)) / np.float32(2.0), nan=0.0)), layout
    together = reader.read_crops([(v, o, s) for o, s in crops], normalize=False)
    for (origin, shape), got in zip(crops, together):
        assert np.array_equal(got, v.read(origin, shape, normalize=False), equal_nan=True)
    if "sharded" not in layout:  # the chunk never written: all fill value
        missing = v.read((8, 8, 16), (8, 8, 16), normalize=False)
        assert (missing == 0).all() if fill in (0, None) else np.isnan(missing).all()


def test_synthetic_fault_labels_sit_on_the_throw_and_are_written_beside_the_amplitude(tmp_path):
    """synthetic_volume(labels=True): the fault mask is every voxel within FAULT_HALF_WIDTH of a fault plane and
    no other, the data break across it (with no noise, the amplitude changes from one crossline to the next far
    more at the labelled voxels than away from them), and write_mdio stores it as a second variable that plain
    zarr opens with its dimension names. One fault (the default) gives the same volume as before faults could be
    several: the quickstart's data did not change."""
    import hashlib

    from infra import synthetic
    for shape, seed, digest in (((48, 32, 64), 3, "f6eee2ff1a75d6fb"), ((128, 128, 256), 0, "58d1aa87bac32005")):
        v = synthetic.synthetic_volume(shape, seed=seed)
        assert hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()[:16] == digest
    shape = (48, 40, 96)
    vol, mask, planes = synthetic.synthetic_volume(shape, seed=7, n_faults=3, labels=True, snr=1e9, dead_frac=0)
    assert len(planes) == 3 and mask.shape == shape and 0.02 < mask.mean() < 0.3
    i, j, t = np.meshgrid(*(np.arange(n) for n in shape), indexing="ij")
    dist = np.min([np.abs(f["normal"][0] * i + f["normal"][1] * j + f["normal"][2] * t - f["offset"])
                   / np.linalg.norm(f["normal"]) for f in planes], axis=0)
    assert np.array_equal(mask, dist <= synthetic.FAULT_HALF_WIDTH)
    step = np.abs(np.diff(vol, axis=1))  # crossline to crossline
    on, off = mask[:, 1:] | mask[:, :-1], dist[:, 1:] > 4
    assert step[on].mean() > 2 * step[off].mean(), (step[on].mean(), step[off].mean())
    path = synthetic.write_mdio(str(tmp_path / "faults.mdio"), vol, chunks=(16, 16, 32), fault=mask)
    g = zarr.open_group(path, mode="r")
    assert g["fault"].metadata.dimension_names == ("inline", "crossline", "time")
    assert np.array_equal(np.asarray(g["fault"][:]).astype(bool), mask)
    v = reader.Volume(path)  # the amplitude is still what a run reads
    assert np.array_equal(v.read((0, 0, 0), shape, normalize=False), vol)
