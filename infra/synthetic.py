"""
A synthetic seismic volume and its MDIO store: the quickstart's data, and the tests'.

  1. synthetic_volume()      a seismic-like volume: layered reflectivity with dips, folds and a fault,
                             convolved with a Ricker wavelet, plus noise, with a patch of dead traces
     faultseg_volume()       a fault-segmentation volume and its labels, by FaultSeg3D's published recipe
  2. write_mdio()            writes a volume as a Zarr v3 store in the MDIO v1 layout, as the official
                             `multidimio` library does (group attrs, `amplitude` with dims
                             inline/crossline/time, `statsV1`, `trace_mask`, coordinate arrays)
     ensure_synthetic()      the quickstart's store, written on first use (to a local path only)

infra/reader.py reads what this writes (and what multidimio writes: tests/test_mdio.py checks both).
"""

import json
import os
import shutil

import numpy as np
import zarr

from configurator import ConfigError
from infra.reader import DataError, ReadOptions, storage_options


# -----------------------------------------------------------------------------
# 1. a synthetic seismic volume


def ricker(f_peak, dt, n=None):
    """Ricker wavelet (the classic zero-phase seismic pulse) with peak frequency f_peak Hz, step dt s."""
    n = n or int(2.0 / (f_peak * dt)) | 1  # about 2 periods long, odd length so it is centred
    t = (np.arange(n) - n // 2) * dt
    a = (np.pi * f_peak * t) ** 2
    return (1 - 2 * a) * np.exp(-a)


def synthetic_volume(shape, seed=0, dt=0.004, f_peak=25.0, snr=8.0, dead_frac=0.02, n_faults=1, labels=False):
    """A seismic-like float32 volume of `shape` = (inline, crossline, time); with labels=True also its fault
    labels: (vol, fault mask (bool, the voxels within FAULT_HALF_WIDTH of a fault plane), the planes).

    Geology first, then physics:
      * a 1D reflectivity series in "geologic time" tau: blocky impedance layers, reflectivity = the
        relative impedance change at each layer boundary;
      * structure maps every voxel (i, j, t) to the tau it images: a regional dip along both lateral
        axes, folds whose amplitude grows with depth, and n_faults normal fault planes, each with a random
        strike, dip and throw, across which one block is thrown down (the first fault is the one the volume
        always had: n_faults=1 gives the same volume as before faults could be several);
      * the reflectivity sampled at tau(i, j, t), convolved along time with a Ricker wavelet;
      * Gaussian noise at signal-to-noise ratio `snr` (by RMS), and a rectangular patch of dead traces
        (NaN, as MDIO stores missing traces) covering about `dead_frac` of the lateral area."""
    ni, nx, nt = shape
    rng = np.random.default_rng(seed)
    # reflectivity on a fine tau grid (4 x oversampled) long enough for every shift below
    over, n_tau = 4, 3 * nt
    n_fine = n_tau * over
    thickness = rng.integers(2 * over, 12 * over, size=n_fine)  # layer thickness in fine samples
    bounds = np.cumsum(thickness)
    bounds = bounds[bounds < n_fine]
    log_imp = np.cumsum(rng.normal(0, 0.15, size=len(bounds)))  # impedance random walk, log scale
    refl_fine = np.zeros(n_fine)
    refl_fine[bounds[1:]] = np.diff(log_imp) / 2  # r = (Z2 - Z1) / (Z2 + Z1) ~ d(ln Z) / 2
    # structure: tau(i, j, t) in samples
    i = np.arange(ni)[:, None, None]
    j = np.arange(nx)[None, :, None]
    t = np.arange(nt)[None, None, :]
    dip_i, dip_j = rng.uniform(-0.15, 0.15, size=2)  # samples per trace
    lam_i, lam_j = rng.uniform(0.6, 1.5, size=2) * max(ni, nx)
    fold = rng.uniform(2, 6) * (t / nt) * np.sin(2 * np.pi * i / lam_i) * np.cos(2 * np.pi * j / lam_j)
    tau = nt + t + dip_i * i + dip_j * j + fold
    # normal faults: planes n . (i, j, t) = c; the side where n . x > c is thrown down. The first goes through
    # the volume centre and is drawn from the volume's own stream (as it always was); the others from a stream of
    # their own (seed, 1), anywhere in the middle half of the volume
    planes = []
    a, b = rng.uniform(-1, 1, size=2)  # strike and dip: the lateral components of the normal
    normal = np.array([a, b, 0.5 * max(ni, nx) / nt])
    planes.append({"normal": normal, "offset": float(normal @ [ni / 2, nx / 2, nt / 2]), "throw": rng.uniform(4, 10)})
    more = np.random.default_rng([seed, 1])
    for _ in range(n_faults - 1):
        a, b = more.uniform(-1, 1, size=2)
        normal = np.array([a, b, more.uniform(0.3, 0.8) * max(ni, nx) / nt])
        centre = [more.uniform(0.25, 0.75) * n for n in (ni, nx, nt)]
        planes.append({"normal": normal, "offset": float(normal @ centre), "throw": more.uniform(4, 10)})
    for f in planes:
        side = f["normal"][0] * i + f["normal"][1] * j + f["normal"][2] * t - f["offset"] > 0
        tau = tau - side * f["throw"]
    # convolve the reflectivity with the wavelet once, on the fine tau grid (the wavelet sampled at
    # dt / over), then read the band-limited trace at every voxel's tau. Interpolating a smooth trace
    # keeps reflectors continuous from trace to trace; interpolating the spikes would not.
    trace = np.convolve(refl_fine, ricker(f_peak, dt / over), mode="same")
    vol = np.interp(tau.ravel() * over, np.arange(n_fine), trace).reshape(ni, nx, nt)
    vol += rng.normal(0, vol.std() / snr, size=vol.shape)
    vol = (vol * 1000).astype(np.float32)  # field data come in arbitrary units; normalisation undoes it
    # dead traces: a rectangle near one corner
    if dead_frac > 0:
        di, dj = max(1, int(ni * dead_frac ** 0.5)), max(1, int(nx * dead_frac ** 0.5))
        vol[:di, nx - dj:, :] = np.nan
    if not labels:
        return vol
    return vol, fault_mask(shape, planes), planes


FAULT_HALF_WIDTH = 1.0  # voxels: a fault is labelled on the voxels within this distance of its plane (~2 thick)


def fault_mask(shape, planes, half_width=FAULT_HALF_WIDTH):
    """(inline, crossline, time) bool: the voxels whose centre lies within half_width of a fault plane (the
    distance of x to n . x = c is |n . x - c| / |n|), the labels of fault segmentation."""
    i, j, t = (np.arange(n, dtype=np.float64).reshape([-1 if k == a else 1 for k in range(3)])
               for a, n in enumerate(shape))
    mask = np.zeros(shape, dtype=bool)
    for f in planes:
        n = f["normal"]
        mask |= np.abs(n[0] * i + n[1] * j + n[2] * t - f["offset"]) <= half_width * np.linalg.norm(n)
    return mask


RECIPE_SIZE = 128  # FaultSeg3D's volumes are 128^3: its fault count, throws and fold widths are set for that size


def faultseg_volume(shape, seed=0, dt=0.004, half_width=FAULT_HALF_WIDTH, snr_db=None, recipe_size=RECIPE_SIZE):
    """A fault-segmentation training volume by FaultSeg3D's published recipe (Wu et al. 2019, Geophysics), with its
    labels: (vol float32 (inline, crossline, time), standardised; fault uint8 (1 on a fault); the faults as dicts).
    A shape smaller than recipe_size along an axis is cut from a volume drawn at recipe_size there (at an origin
    drawn from the seed), so that faults are as dense as the recipe makes them: 5-8 faults drawn into a 64^3
    volume put 17.5 % of its voxels on a fault, into 128^3 (the recipe's size) 8.5 %. The cut is standardised
    again, and the faults' centres are given in its coordinates.

      * a random 1D reflectivity series (values uniform in [-1, 1]) in reference time tau;
      * folding: a vertical shift s1 = a0 + 1.5 t / nt * sum of Gaussian bumps over (inline, crossline), growing
        with depth, plus planar shear s2 = e0 + f i + g j;
      * 5 to 8 faults, strike uniform in [0, 360) degrees, dip in [62, 82], through a random point of the middle of
        the volume; the hanging wall slides down the dip by the throw, 5 to 30 samples at the fault's centre and
        tapering as a Gaussian along the plane; later faults cut earlier ones;
      * the reflectivity imaged at every voxel, convolved along time with a Ricker wavelet of 20 to 35 Hz;
      * band-limited noise (white noise through the same wavelet) at a signal-to-noise ratio of 3 to 8 dB (or
        snr_db);
      * standardised (mean 0, std 1). The labels: the voxels within half_width of a fault plane (measured where that
        fault cut, before later faults moved it) wherever its throw is at least one sample.
    Every voxel is mapped back to the reference by undoing the faults newest first, then the folding."""
    full = tuple(max(int(n), recipe_size) for n in shape)
    if full != tuple(shape):  # cut `shape` out of the recipe's volume (a stream of its own draws the origin)
        vol, fault, faults = faultseg_volume(full, seed, dt, half_width, snr_db, recipe_size)
        o = [int(np.random.default_rng([seed, 26]).integers(0, f - n + 1)) for f, n in zip(full, shape)]
        cut = tuple(slice(a, a + n) for a, n in zip(o, shape))
        vol = vol[cut]
        for f in faults:
            f["centre"] = f["centre"] - np.array(o, dtype=np.float64)
        return ((vol - vol.mean()) / vol.std()).astype(np.float32), np.ascontiguousarray(fault[cut]), faults
    ni, nx, nt = shape
    rng = np.random.default_rng([seed, 25])  # a stream of its own: synthetic_volume's seeds draw other volumes
    x = [np.broadcast_to(np.arange(n, dtype=np.float64).reshape([-1 if k == a else 1 for k in range(3)]), shape)
         for a, n in enumerate(shape)]  # voxel coordinates (i, j, t), in samples
    x = [c.copy() for c in x]
    size = max(ni, nx)
    faults = []
    for _ in range(rng.integers(5, 9)):
        strike, dip = np.radians(rng.uniform(0, 360)), np.radians(rng.uniform(62, 82))
        along = np.array([np.cos(strike), np.sin(strike), 0.0])  # horizontal, in the plane
        down = np.array([-np.sin(strike) * np.cos(dip), np.cos(strike) * np.cos(dip), np.sin(dip)])  # down the dip
        normal = np.cross(along, down)  # unit: along and down are orthonormal
        centre = np.array([rng.uniform(0.2, 0.8) * n for n in shape])
        faults.append({"strike_deg": float(np.degrees(strike)), "dip_deg": float(np.degrees(dip)),
                       "normal": normal, "down": down, "along": along, "centre": centre,
                       "throw": float(rng.uniform(5, 30)), "spread": float(rng.uniform(0.5, 1.0) * size)})
    fault = np.zeros(shape, dtype=bool)
    for f in reversed(faults):  # undo the newest fault first: what lies at x now lay at x - throw x down before it
        rel = [c - o for c, o in zip(x, f["centre"])]
        side = sum(r * n for r, n in zip(rel, f["normal"]))  # signed distance to the plane
        u = sum(r * a for r, a in zip(rel, f["along"]))  # position in the plane
        v = sum(r * d for r, d in zip(rel, f["down"]))
        throw = f["throw"] * np.exp(-(u ** 2 + v ** 2) / (2 * f["spread"] ** 2))
        fault |= (np.abs(side) <= half_width) & (throw >= 1.0)
        hanging = side > 0
        for k in range(3):
            x[k] = x[k] - hanging * throw * f["down"][k]
    i, j, t = x
    bumps = 0  # the folds: Gaussian bumps over (inline, crossline), scaled with depth below
    for _ in range(rng.integers(4, 9)):
        height = rng.uniform(-1, 1) * rng.uniform(4, 12)
        ci, cj, width = rng.uniform(0, ni), rng.uniform(0, nx), rng.uniform(0.1, 0.3) * size
        bumps = bumps + height * np.exp(-((i - ci) ** 2 + (j - cj) ** 2) / (2 * width ** 2))
    s1 = rng.uniform(0, 5) + 1.5 * t / nt * bumps
    s2 = rng.uniform(0, 5) + rng.uniform(-0.15, 0.15) * i + rng.uniform(-0.15, 0.15) * j
    tau = t + s1 + s2 + 2 * nt  # reference time, kept inside the series below
    refl = rng.uniform(-1, 1, size=5 * nt)
    image = refl[np.clip(np.rint(tau).astype(np.int64), 0, len(refl) - 1)]
    w = ricker(rng.uniform(20, 35), dt)
    vol = np.apply_along_axis(lambda r: np.convolve(r, w, mode="same"), 2, image)
    noise = np.apply_along_axis(lambda r: np.convolve(r, w, mode="same"), 2, rng.normal(size=shape))
    snr_db = rng.uniform(3, 8) if snr_db is None else snr_db
    vol = vol + noise * np.sqrt(vol.var() / noise.var() / 10 ** (snr_db / 10))
    vol = ((vol - vol.mean()) / vol.std()).astype(np.float32)
    for f in faults:
        f["snr_db"] = float(snr_db)
    return vol, fault.astype(np.uint8), faults


# -----------------------------------------------------------------------------
# 2. write a volume as an MDIO v1 store (Zarr v3)


def volume_stats(vol):
    """MDIO's statsV1: count, sum, sumSquares, min, max (+ empty histogram), over live samples that are not
    exactly zero, as multidimio computes them (zeros are taken as padding; f3.sgy has 5,748 of 31,050)."""
    live = vol[np.isfinite(vol) & (vol != 0)].astype(np.float64)
    return {"count": int(live.size), "sum": float(live.sum()), "sumSquares": float((live ** 2).sum()),
            "min": float(live.min()) if live.size else 0.0, "max": float(live.max()) if live.size else 0.0,
            "histogram": {"counts": [], "binCenters": []}}


def write_mdio(path, vol, chunks=(64, 64, 64), first_inline=1, first_crossline=1, dt_ms=4, fault=None):
    """Write `vol` (inline, crossline, time), NaN = dead trace, as a local MDIO v1 store at `path`; with `fault`
    (a bool mask of the same shape: synthetic_volume's labels) also a second variable `fault` (uint8, 1 on a
    fault), chunked as the amplitude, on the same dimensions.
    Written to `path + '.tmpPID'` then renamed, so a crash never leaves a half-written store behind (a failed write
    removes it), and nothing already at `path` is ever overwritten (an empty folder is nothing)."""
    if os.path.exists(path) and not (os.path.isdir(path) and not os.listdir(path)):
        raise DataError(f"{path!r} already exists: nothing is written over it; write the volume elsewhere")
    tmp = path.rstrip("/") + f".tmp{os.getpid()}"
    try:
        _write_mdio(tmp, vol, chunks, first_inline, first_crossline, dt_ms, fault)
        os.rename(tmp, path)  # (over an empty folder too)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves nothing behind
        raise
    return path


def _write_mdio(tmp, vol, chunks, first_inline, first_crossline, dt_ms, fault):
    ni, nx, nt = vol.shape
    root = zarr.open_group(tmp, mode="w", zarr_format=3)
    root.attrs.update({"apiVersion": "1.1.3", "name": "PostStack3DTime",
                       "attributes": {"surveyType": "3D", "gatherType": "stacked",
                                      "defaultVariableName": "amplitude"}})
    blosc = zarr.codecs.BloscCodec(cname="zstd", clevel=5, shuffle="shuffle")
    amp = root.create_array("amplitude", shape=vol.shape, chunks=tuple(min(c, s) for c, s in zip(chunks, vol.shape)),
                            dtype="float32", fill_value=float("nan"), compressors=blosc,
                            dimension_names=["inline", "crossline", "time"])
    amp[:] = vol
    amp.attrs["statsV1"] = json.dumps(volume_stats(vol))
    live = np.isfinite(vol).any(axis=2)
    mask = root.create_array("trace_mask", shape=live.shape, chunks=live.shape, dtype="bool", fill_value=False,
                             dimension_names=["inline", "crossline"])
    mask[:] = live
    if fault is not None:
        if fault.shape != vol.shape:
            raise DataError(f"fault mask of shape {fault.shape} for a volume of shape {vol.shape}")
        lab = root.create_array("fault", shape=vol.shape, chunks=amp.chunks, dtype="uint8", fill_value=0,
                                compressors=blosc, dimension_names=["inline", "crossline", "time"])
        lab[:] = fault.astype(np.uint8)
        lab.attrs["description"] = "1 on the voxels within %g of a fault plane (infra/synthetic.py)" % FAULT_HALF_WIDTH
    for name, n, start, step in [("inline", ni, first_inline, 1), ("crossline", nx, first_crossline, 1),
                                 ("time", nt, 0, dt_ms)]:
        c = root.create_array(name, shape=(n,), chunks=(n,), dtype="int32", dimension_names=[name])
        c[:] = start + step * np.arange(n, dtype=np.int32)


def ensure_synthetic(path, shape, seed=0, chunks=(64, 64, 64), opts=None, log=print):
    """Create the synthetic store at `path` unless it already exists (make_synthetic: the quickstart calls this), with
    its fault labels beside the amplitude (so that fine-tuning, task="segment", runs on it as it is).

    Synthetic data is only ever written to a local path (or file://). At a remote one (s3://, gs://, any other URL)
    nothing is written: the store is looked for there through fsspec with the options the reader will use (`opts`,
    data.py's ReadOptions: endpoint, anonymous access, storage options); found, it is the data, as it is; missing,
    a ConfigError says so and how to fix it. (It used to test os.path.exists on the URL, always False, and to write
    its 16 MB of made-up volume there through AWS's default endpoint, whatever s3_endpoint said: on AWS, into the
    user's bucket.)

    Locally it writes only where nothing is (no file or folder, or an empty folder), and says so in one line: a
    mistyped data path must not quietly become a synthetic survey. Anything already there is the data, as it is
    (an MDIO v1 or v0 store, a Zarr array): the reader opens it, and names the problem if it is not a store; it is
    never written over, nor is its removal ever suggested."""
    local = path[len("file://"):] if path.startswith("file://") else path
    if "://" in local:
        if not _remote_store_exists(path, opts or ReadOptions()):
            raise ConfigError(f"data path {path!r} holds no store, and make_synthetic=True writes its synthetic "
                              f"volume only to a local path, never to a remote one: set data_paths to a local path "
                              f"(as config/quickstart.py has it), set make_synthetic=False, or upload the store to "
                              f"{path!r}")
        return path
    if os.path.exists(local) and not (os.path.isdir(local) and not os.listdir(local)):
        return path
    os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
    vol, fault, _ = synthetic_volume(shape, seed=seed, labels=True)
    write_mdio(local, vol, chunks=chunks, fault=fault)
    log(f"make_synthetic=True: nothing was at {path}, so a synthetic volume was written there "
        f"({' x '.join(map(str, shape))} voxels with fault labels, infra/synthetic.py); to train on your own data, set "
        f"data_paths to it")
    return path


def _remote_store_exists(url, opts):
    """Whether a Zarr store (an MDIO v1 or v0 store, or a plain array) is at `url`: its root metadata object, looked
    for with the reader's fsspec options. A failure to look (access denied, an endpoint that does not answer) counts
    as there: the reader then opens it and names the real problem, and nothing is written either way."""
    import fsspec
    try:
        fs, root = fsspec.url_to_fs(url, **storage_options(url, opts))
        return any(fs.exists(f"{root.rstrip('/')}/{name}") for name in ("zarr.json", ".zgroup", ".zarray"))
    except Exception:
        return True
