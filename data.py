"""
Seismic volumes in, training samples out.

  1. synthetic_volume()      a seismic-like volume: layered reflectivity with dips, folds and a fault,
                             convolved with a Ricker wavelet, plus noise, with a patch of dead traces
  2. write_mdio()            writes a volume as a Zarr v3 store in the MDIO v1 layout, as the official
                             `multidimio` library does (group attrs, `amplitude` with dims
                             inline/crossline/time, `statsV1`, `trace_mask`, coordinate arrays)
  3. Volume                  one opened store: shape, per-volume statistics, read a normalised crop
  4. Sampler                 random crops from one or more stores. A sample is a pure function of
                             (seed, global sample index), and the global index a function of
                             (step, micro step, dp_rank, position in the micro batch): so a resumed run
                             reads exactly what an uninterrupted run would have read, and 1 rank with
                             batch 2b sees the same samples as 2 ranks with batch b.

Normalisation uses per-volume statistics from the store's metadata (not per sample): the amplitude
scale of a survey carries meaning, and inference must normalise the same way. Dead traces are stored
as NaN (MDIO's fill value) and become 0 after normalisation, i.e. the volume mean.
"""

import json
import math
import os

import numpy as np
import torch
import zarr


class DataError(ValueError):
    """Bad data input: the message names the problem and the fix."""


# -----------------------------------------------------------------------------
# 1. a synthetic seismic volume


def ricker(f_peak, dt, n=None):
    """Ricker wavelet (the classic zero-phase seismic pulse) with peak frequency f_peak Hz, step dt s."""
    n = n or int(2.0 / (f_peak * dt)) | 1  # about 2 periods long, odd length so it is centred
    t = (np.arange(n) - n // 2) * dt
    a = (np.pi * f_peak * t) ** 2
    return (1 - 2 * a) * np.exp(-a)


def synthetic_volume(shape, seed=0, dt=0.004, f_peak=25.0, snr=8.0, dead_frac=0.02):
    """A seismic-like float32 volume of `shape` = (inline, crossline, time).

    Geology first, then physics:
      * a 1D reflectivity series in "geologic time" tau: blocky impedance layers, reflectivity = the
        relative impedance change at each layer boundary;
      * structure maps every voxel (i, j, t) to the tau it images: a regional dip along both lateral
        axes, folds whose amplitude grows with depth, and one normal fault plane across which the deeper
        block is thrown down;
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
    # a normal fault: plane through the volume centre, dipping in time; the far side is thrown down
    a, b = rng.uniform(-1, 1, size=2)
    side = a * (i - ni / 2) + b * (j - nx / 2) + 0.5 * (t - nt / 2) * max(ni, nx) / nt > 0
    tau = tau - side * rng.uniform(4, 10)
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
    return vol


# -----------------------------------------------------------------------------
# 2. write a volume as an MDIO v1 store (Zarr v3)


def volume_stats(vol):
    """MDIO's statsV1 over live (non-NaN) samples: count, sum, sumSquares, min, max (+ empty histogram)."""
    live = vol[np.isfinite(vol)].astype(np.float64)
    return {"count": int(live.size), "sum": float(live.sum()), "sumSquares": float((live ** 2).sum()),
            "min": float(live.min()), "max": float(live.max()), "histogram": {"counts": [], "binCenters": []}}


def write_mdio(path, vol, chunks=(64, 64, 64), first_inline=1, first_crossline=1, dt_ms=4):
    """Write `vol` (inline, crossline, time), NaN = dead trace, as a local MDIO v1 store at `path`.
    Written to `path + '.tmp'` then renamed, so a crash never leaves a half-written store behind, and
    an existing store is never overwritten."""
    if os.path.exists(path):
        raise DataError(f"{path!r} already exists; remove it first or write elsewhere (stores are never overwritten)")
    ni, nx, nt = vol.shape
    tmp = path.rstrip("/") + f".tmp{os.getpid()}"
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
    for name, n, start, step in [("inline", ni, first_inline, 1), ("crossline", nx, first_crossline, 1),
                                 ("time", nt, 0, dt_ms)]:
        c = root.create_array(name, shape=(n,), chunks=(n,), dtype="int32", dimension_names=[name])
        c[:] = start + step * np.arange(n, dtype=np.int32)
    os.rename(tmp, path)
    return path


def ensure_synthetic(path, shape, seed=0, chunks=(64, 64, 64)):
    """Create the synthetic store at `path` unless it already exists (the quickstart calls this)."""
    if not os.path.exists(os.path.join(path, "zarr.json")):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_mdio(path, synthetic_volume(shape, seed=seed), chunks=chunks)
    return path


# -----------------------------------------------------------------------------
# 3. one opened volume


class Volume:
    """An MDIO v1 store (or a Zarr group with a 3D array) opened for reading crops."""

    def __init__(self, path):
        if not os.path.exists(path):
            raise DataError(f"data path {path!r} does not exist: set data_paths to existing MDIO/Zarr stores "
                            f"(the quickstart creates its synthetic store when data_paths points at data/)")
        self.path = path
        try:
            root = zarr.open_group(path, mode="r")
        except Exception as e:
            raise DataError(f"{path!r} is not a Zarr group ({e}); expected an MDIO v1 store") from e
        name = root.attrs.get("attributes", {}).get("defaultVariableName", "amplitude")
        if name not in root:
            raise DataError(f"{path!r} has no variable {name!r}: expected an MDIO store with a 3D '{name}' array")
        self.arr = root[name]
        if self.arr.ndim != 3:
            raise DataError(f"{path!r}:{name} has shape {self.arr.shape}; a 3D (inline, crossline, time) volume "
                            f"is needed")
        self.shape = tuple(self.arr.shape)
        stats = self.arr.attrs.get("statsV1")
        if stats is None:
            raise DataError(f"{path!r}:{name} has no statsV1 attribute: per-volume mean/std are needed to "
                            f"normalise; write them when creating the store")
        s = json.loads(stats) if isinstance(stats, str) else stats
        self.mean = s["sum"] / s["count"]
        self.std = math.sqrt(max(s["sumSquares"] / s["count"] - self.mean ** 2, 0.0)) or 1.0
        self.trace_mask = np.asarray(root["trace_mask"][:]) if "trace_mask" in root else None

    def read(self, origin, shape):
        """The crop [origin, origin + shape) as float32, normalised to zero mean and unit std with the
        volume's statistics; dead traces (NaN) become 0."""
        sl = tuple(slice(o, o + s) for o, s in zip(origin, shape))
        x = np.asarray(self.arr[sl], dtype=np.float32)
        x = (x - np.float32(self.mean)) / np.float32(self.std)
        # only NaN is a dead trace; an inf is bad data and is left to fail loudly (non-finite loss)
        return np.where(np.isnan(x), np.float32(0.0), x)


# -----------------------------------------------------------------------------
# 4. the sampler


class Sampler:
    """Random crops of shape `crop` from `paths`. Every rank constructs the same Sampler; batch() picks
    the samples that belong to (step, micro, dp_rank)."""

    def __init__(self, paths, crop, seed=0, micro_batch=1, dp_rank=0, dp_size=1, grad_accum=1, cp_rank=0, cp_size=1):
        if isinstance(paths, str):
            paths = [paths]
        self.volumes = [Volume(p) for p in paths]
        self.crop = tuple(crop)
        for v in self.volumes:
            if any(c > s for c, s in zip(self.crop, v.shape)):
                raise DataError(f"crop {self.crop} is larger than the volume {v.shape} of {v.path!r}: choose a "
                                f"crop no larger than every volume along each axis")
        self.seed, self.micro_batch, self.grad_accum = seed, micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        # context parallelism: the cp ranks of a group read the same samples, each only its slab of
        # crop[0] / cp inline planes (a 1536 x 1536 x 2048 float32 sample is 19 GB: no rank holds one)
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.slab = (self.crop[0] // cp_size,) + self.crop[1:]

    def global_index(self, step, micro, i):
        """Sample number in the whole run's stream: steps, then micro steps, then dp ranks, then batch rows."""
        return ((step * self.grad_accum + micro) * self.dp_size + self.dp_rank) * self.micro_batch + i

    def locate(self, g):
        """Which volume and which crop origin global sample g reads: a function of (seed, g) alone."""
        rng = np.random.default_rng([self.seed, g])
        v = int(rng.integers(len(self.volumes)))
        origin = tuple(int(rng.integers(0, s - c + 1)) for s, c in zip(self.volumes[v].shape, self.crop))
        return v, origin

    def sample(self, g):
        """This rank's slab of global sample g."""
        v, origin = self.locate(g)
        origin = (origin[0] + self.cp_rank * self.slab[0],) + origin[1:]
        return self.volumes[v].read(origin, self.slab)

    def batch(self, step, micro=0):
        """(micro_batch, 1, crop[0] / cp, crop[1], crop[2]) float32 tensor, and the global sample indices."""
        ids = [self.global_index(step, micro, i) for i in range(self.micro_batch)]
        x = np.stack([self.sample(g) for g in ids])[:, None]
        return torch.from_numpy(x), ids


def mask_noise(seed, ids, L, cp_rank=0, cp_size=1):
    """Masking noise for global sample indices `ids`, this rank's share: (len(ids), L / cp_size). Like the
    crops, a function of the sample alone: identical within a CP group, different between samples, and
    the same whatever the dp/cp layout or a resume (4 bytes per token: 4.7 MB at 1.2 M tokens)."""
    share = slice(cp_rank * L // cp_size, (cp_rank + 1) * L // cp_size)
    return torch.from_numpy(np.stack([np.random.default_rng([seed, g, 1]).random(L, dtype=np.float32)[share]
                                      for g in ids]))


class Prefetcher:
    """Iterator over the micro batches of steps [start, end), read `depth` micro batches ahead by a pool
    of threads so that reading and decompressing overlap the model's compute (zarr's codecs and numpy
    release the GIL). Yields what Sampler.batch returns, in order. close() cancels and joins the threads."""

    def __init__(self, sampler, start, end, depth=2):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor
        self.sampler = sampler
        self.todo = ((s, m) for s in range(start, end) for m in range(sampler.grad_accum))
        self.pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="prefetch")
        self.pending = deque()
        for _ in range(depth):
            self._submit()

    def _submit(self):
        nxt = next(self.todo, None)
        if nxt is not None:
            self.pending.append(self.pool.submit(self.sampler.batch, *nxt))

    def __iter__(self):
        return self

    def __next__(self):
        if not self.pending:
            raise StopIteration
        out = self.pending.popleft().result()  # re-raises a read error here, in the training loop
        self._submit()
        return out

    def close(self):
        for f in self.pending:
            f.cancel()
        self.pool.shutdown(wait=True)
