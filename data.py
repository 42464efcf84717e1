"""
Seismic volumes in, training samples out.

  (synthetic.py writes the quickstart's synthetic volume as an MDIO store; library.py finds and indexes stores)
  1. Volume                  one opened store: shape, per-volume statistics, read a normalised crop
  2. Sampler                 random crops from one or more stores (URLs, or library.py's records: opened
                             when first needed, a bounded number kept open), each store drawn by its live
                             volume (or uniformly, or by a manifest's weights). A sample is a pure function of
                             (seed, global sample index), and the global index a function of
                             (step, micro step, dp_rank, position in the micro batch): so a resumed run
                             reads exactly what an uninterrupted run would have read, and 1 rank with
                             batch 2b sees the same samples as 2 ranks with batch b. A held-out part
                             (split_inline) keeps training crops off the last val_frac of each volume's
                             inline axis and puts validation crops inside it; validation samples are a
                             stream of their own (seed, validation index).

Normalisation uses per-volume statistics from the store's metadata (not per sample): the amplitude
scale of a survey carries meaning, and inference must normalise the same way. Dead traces are stored
as NaN (MDIO's fill value) and become 0 after normalisation, i.e. the volume mean.
"""

import asyncio
import itertools
import json
import math
import os
import random
import time

import numpy as np
import torch
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.buffer.cpu import NDBuffer  # a numpy array as zarr's output buffer
from zarr.core.sync import sync as zarr_sync  # runs a coroutine on zarr's event loop, where its stores live


class DataError(ValueError):
    """Bad data input: the message names the problem and the fix."""


# -----------------------------------------------------------------------------
# 1. one opened volume


class ReadOptions:
    """How stores are opened and read; train.py fills it from its config.
      in_flight        requests in flight, shared by every store opened with these options (RequestStore);
                       also sizes the HTTP connection pool
      retries          attempts after the first for a transient failure (5xx, SlowDown, reset, timeout)
      backoff_s        first backoff; doubles each retry, with full jitter
      timeout_s        a request that has not answered by then is abandoned and retried
      anon             anonymous S3 access (public buckets); otherwise the normal AWS credential chain
      endpoint_url     S3-compatible endpoint (MinIO, Ceph, a loopback test server); None = AWS
      storage_options  anything else for fsspec/s3fs (never logged: it may hold credentials)
      threads          decompression threads (0: the CPUs this process may use / the ranks on this node)"""

    def __init__(self, in_flight=16, retries=6, backoff_s=0.05, timeout_s=30.0, anon=False, endpoint_url=None,
                 storage_options=None, threads=0):
        self.in_flight, self.retries, self.backoff_s, self.timeout_s = in_flight, retries, backoff_s, timeout_s
        self.anon, self.endpoint_url, self.storage_options = anon, endpoint_url, dict(storage_options or {})
        # the places for requests in flight: an asyncio semaphore, used only on zarr's event loop (it binds to
        # that loop at its first wait)
        self.requests = asyncio.Semaphore(max(1, in_flight))
        # decompression, the copies into the crops and normalisation run in this pool, never on the event loop (whose
        # one thread must stay free to start the next requests the moment places come back). numcodecs and numpy
        # release the GIL there, so the threads decode side by side.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        self.threads = threads or max(1, cpus // max(1, local))
        self._pool = None

    def with_in_flight(self, n):
        """The same options with n request places (of their own)."""
        return ReadOptions(n, self.retries, self.backoff_s, self.timeout_s, self.anon, self.endpoint_url,
                           self.storage_options, self.threads)

    @property
    def pool(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="decode")
        return self._pool


def _deadline(seconds):
    """A timeout for the block inside (asyncio.timeout adds no task per request, as wait_for does)."""
    if hasattr(asyncio, "timeout"):  # Python >= 3.11
        return asyncio.timeout(seconds)
    import contextlib  # (3.10: no per-request deadline here; s3fs's read_timeout still bounds a request)
    return contextlib.nullcontext()


class RequestStore(zarr.storage.WrapperStore):
    """The store under every Volume: each GET (a chunk, or metadata) takes one of opts.in_flight places, must
    answer within timeout_s, and a transient failure (HTTP 5xx and SlowDown, connection reset, timeout, a
    truncated body) is retried with exponential backoff and full jitter, at most opts.retries times; then a
    DataError names the key and the store. Never zeros: a chunk that fails is an error (a chunk that does not
    exist is the fill value, by Zarr's rules: the store answers None).
    The place is given back as soon as the bytes are in, not when they are decoded: the chunk is decompressed in
    ReadOptions.pool while this place already serves the next request, so a reader with n places keeps n requests
    on the wire (with a thread per request, each thread held its place through the decompression and the
    copies: at 20 ms latency on 2 cores that lost a fifth of the link at 4 in flight). Access denied and not
    found are final: they are raised at once, with the key in the message."""

    def __init__(self, store, opts=None, url=""):
        super().__init__(store)
        self.opts, self.url = opts or ReadOptions(), url

    def _with_store(self, store):  # (zarr makes read-only copies of a store this way)
        return type(self)(store, self.opts, self.url)

    async def get(self, key, prototype, byte_range=None):
        opts = self.opts
        for attempt in range(opts.retries + 1):
            try:
                async with opts.requests, _deadline(opts.timeout_s):
                    return await self._store.get(key, prototype, byte_range)
            except (PermissionError, FileNotFoundError) as e:
                final = PermissionError if isinstance(e, PermissionError) else FileNotFoundError
                raise final(f"{key!r} of {self.url!r}: {e}") from e
            except Exception as e:
                if attempt == opts.retries:
                    what = "metadata" if key.rsplit("/", 1)[-1] in ("zarr.json", ".zarray", ".zgroup", ".zattrs") \
                        else "chunk"
                    raise DataError(f"{what} {key!r} of {self.url!r} failed {attempt + 1} times; last error: "
                                    f"{type(e).__name__}: {e}") from e
            await asyncio.sleep(random.uniform(0, opts.backoff_s * 2 ** attempt))  # (its place given back)


def storage_options(url, opts):
    """fsspec options for `url`. For s3:// the HTTP connection pool is sized to the requests in flight
    (botocore's default of 10 would silently cap concurrency) and the timeouts are bounded."""
    so = dict(opts.storage_options)
    if url.startswith("s3://"):
        so.setdefault("anon", opts.anon)

        if opts.endpoint_url:
            so.setdefault("endpoint_url", opts.endpoint_url)
        ck = dict(so.get("config_kwargs", {}))
        ck.setdefault("max_pool_connections", max(10, 2 * opts.in_flight))
        ck.setdefault("connect_timeout", opts.timeout_s)
        ck.setdefault("read_timeout", opts.timeout_s)
        ck.setdefault("retries", {"total_max_attempts": 1})
        so["config_kwargs"] = ck
    return so


def open_node(url, opts, store=None):
    """The Zarr group or array at a local path or any fsspec URL (s3://, gs://, file://, ...), read-only, or
    in `store` (a zarr Store object; url then only names it), every request through a RequestStore. Turns the
    usual failures into one DataError that names the store and the fix."""
    if store is None and "://" not in url:
        if not os.path.exists(url):
            raise DataError(f"data path {url!r} does not exist: set data_paths to existing MDIO/Zarr stores "
                            f"(local paths or s3:// URLs)")
        store = zarr.storage.LocalStore(url, read_only=True)
    elif store is None:
        import fsspec
        try:
            fs, path = fsspec.url_to_fs(url, asynchronous=True, **storage_options(url, opts))
            if url.startswith("s3://"):
                # one layer of retries, ours (bounded, with jitter, naming the chunk): s3fs's own loop and
                # botocore's would multiply with it, turning a dead endpoint into minutes of silent waiting
                fs.retries = 1
            store = zarr.storage.FsspecStore(fs, path=path, read_only=True)
        except ImportError as e:
            raise DataError(f"{url!r}: no fsspec filesystem for this URL scheme ({e}); install its package "
                            f"(s3fs for s3://)") from e
    try:
        return zarr.open(store=RequestStore(store, opts, url), mode="r")
    except PermissionError as e:
        raise DataError(f"access denied to {url!r} ({e}): check the AWS credentials (profile, env, instance role), "
                        f"the bucket policy, or set s3_anon=True for a public bucket") from e
    except FileNotFoundError as e:  # zarr's NodeNotFoundError is one too
        if url.startswith("s3://") and not _bucket_exists(url, opts):
            raise DataError(f"the bucket of {url!r} does not exist (or these credentials cannot see it): check the "
                            f"bucket name, region and s3_endpoint") from e
        raise DataError(f"no Zarr store at {url!r} ({type(e).__name__}: {e}): check the key (an MDIO store is a "
                        f"folder with zarr.json, or .zgroup for MDIO v0)") from e
    except Exception as e:
        txt = f"{type(e).__name__}: {e}"
        if "AccessDenied" in txt or "Forbidden" in txt:
            raise DataError(f"access denied to {url!r} ({txt}): check the AWS credentials, the bucket policy, "
                            f"or set s3_anon=True for a public bucket") from e
        raise  # anything else may be transient (5xx, reset, timeout): the caller retries it


def _bucket_exists(url, opts):
    import fsspec
    fs = fsspec.filesystem("s3", **storage_options(url, opts))
    try:
        return fs.exists(url[len("s3://"):].split("/")[0])
    except Exception:
        return True  # cannot tell: do not claim it is missing


def with_retries(fn, opts, what, permanent=(PermissionError, FileNotFoundError, DataError)):
    """fn(), retrying a transient failure (HTTP 5xx and SlowDown, connection reset, timeout, a truncated
    body) with exponential backoff and full jitter, at most opts.retries times; then a DataError that says
    `what` failed. Errors in `permanent` (access denied, not found, bad input) are not retried."""
    for attempt in range(opts.retries + 1):
        try:
            return fn()
        except permanent:
            raise
        except Exception as e:
            if attempt == opts.retries:
                raise DataError(f"{what} failed {attempt + 1} times; last error: {type(e).__name__}: {e}") from e
            time.sleep(random.uniform(0, opts.backoff_s * 2 ** attempt))


def _stats_from(mean, std, what):
    if not (np.isfinite(mean) and np.isfinite(std) and std > 0):
        raise DataError(f"{what}: mean {mean} / std {std} are not usable for normalisation")
    return float(mean), float(std)


class Volume:
    """One 3D seismic volume, opened for reading crops: an MDIO v1 store (Zarr v3 group, variable named by
    attributes.defaultVariableName, stats in statsV1, trace_mask), an MDIO v0 store (Zarr v2 group,
    data/chunked_012, root mean/std, metadata/live_mask), or a plain 3D Zarr array (stats from its
    attributes mean/std if present, else estimated from a few chunks)."""

    def __init__(self, url, opts=None, store=None, record=None):
        # record: the store's manifest line, when it was indexed: its statistics are used (a plain array's are not
        # estimated again), and a store that has changed since is an error
        self.url, self.opts, self.store, self.record = url, opts or ReadOptions(), store, record
        # zarr runs at most async.concurrency chunks of one read at a time (fetch, decode, copy; default 10): a
        # crop's chunks must be able to fill the requests in flight and still have some decoding behind them.
        # (zarr's config is process-wide: raised once here, never lowered)
        limit = zarr.config.get("async.concurrency")
        if limit is not None and limit < 4 * self.opts.in_flight:
            zarr.config.set({"async.concurrency": 4 * self.opts.in_flight})
        # metadata reads go over the network too: retried like chunks; not-found and denied are final
        with_retries(self._open, self.opts, f"opening {url!r}",
                     permanent=(PermissionError, FileNotFoundError, DataError, zarr.errors.BaseZarrError))
        self.shape, self.chunks = tuple(self.arr.shape), tuple(self.arr.chunks)
        self.decode = chunk_decoder(self.arr)  # None: a layout zarr's own pipeline reads
        if record is not None:  # the store must still be the one indexed
            now, then = self.describe(), record
            differ = [k for k in ("shape", "chunks", "format", "dtype") if now[k] != then[k]] + [
                k for k in ("mean", "std") if not math.isclose(now[k], then[k], rel_tol=1e-6)]
            if differ:
                raise DataError(f"{url!r} has {', '.join(f'{k} {now[k]}' for k in differ)}, but its manifest line says "
                                f"{', '.join(f'{k} {then[k]}' for k in differ)}: the store changed since it was "
                                f"indexed; index it again (python library.py index ... --out MANIFEST)")
        self.bytes_read = 0  # voxel bytes delivered (uncompressed), for the GB/s in the log

    def _open(self):
        url = self.url
        node = open_node(url, self.opts, self.store)
        self.trace_mask = None
        if isinstance(node, zarr.Array):  # a plain array
            self.arr, self.format = node, "zarr"
            self._check_3d(url)
            a = node.attrs
            self.mean, self.std = (_stats_from(a["mean"], a["std"], url) if "mean" in a and "std" in a else
                                   (self.record["mean"], self.record["std"]) if self.record else self._estimate_stats())
        elif "data" in node and "chunked_012" in node["data"]:  # MDIO v0
            self.arr, self.format = node["data"]["chunked_012"], "mdio_v0"
            self._check_3d(url)
            a = node.attrs
            if "mean" not in a or "std" not in a:
                raise DataError(f"{url!r} looks like MDIO v0 but has no root mean/std attributes")
            self.mean, self.std = _stats_from(a["mean"], a["std"], url)
            if "metadata" in node and "live_mask" in node["metadata"]:
                self.trace_mask = np.asarray(node["metadata"]["live_mask"][:], dtype=bool)
        else:  # MDIO v1
            name = node.attrs.get("attributes", {}).get("defaultVariableName", "amplitude")
            if name not in node:
                raise DataError(f"{url!r} has no variable {name!r}: expected an MDIO store with a 3D {name!r} "
                                f"array (or set data_paths to the array itself)")
            self.arr, self.format = node[name], "mdio_v1"
            self._check_3d(url)
            stats = self.arr.attrs.get("statsV1")
            if stats is None:
                self.mean, self.std = self._estimate_stats()
            else:
                st = json.loads(stats) if isinstance(stats, str) else stats
                mean = st["sum"] / st["count"]
                self.mean, self.std = _stats_from(mean, math.sqrt(max(st["sumSquares"] / st["count"] - mean ** 2, 0)),
                                                  url)
            if "trace_mask" in node:
                self.trace_mask = np.asarray(node["trace_mask"][:], dtype=bool)

    def describe(self):
        """This store's manifest line (library.py): what sampling needs, so that a run need not open it at start-up."""
        live = 1.0 if self.trace_mask is None else float(self.trace_mask.mean())
        return {"url": self.url, "format": self.format, "shape": list(self.shape), "chunks": list(self.chunks),
                "dtype": str(self.arr.dtype), "mean": self.mean, "std": self.std, "live_fraction": live,
                "bytes": int(math.prod(self.shape)) * self.arr.dtype.itemsize}

    def _check_3d(self, url):
        if self.arr.ndim != 3:
            raise DataError(f"{url!r} holds a {self.arr.ndim}D array of shape {self.arr.shape}; a 3D (inline, "
                            f"crossline, time) volume is needed (2D lines and prestack gathers are not supported)")

    def _estimate_stats(self):
        """Mean/std over up to 8 chunks spread through the volume (a plain array carries no statistics)."""
        grid = [math.ceil(s / c) for s, c in zip(self.arr.shape, self.arr.chunks)]
        picks = {tuple(int(g * f) for g in grid) for f in np.linspace(0, 0.999, 8)}
        vals = np.concatenate([self._read_chunk_region(p, tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in
                                                                zip(p, self.arr.chunks, self.arr.shape))).ravel()
                               for p in picks]).astype(np.float64)
        vals = vals[np.isfinite(vals)]
        if vals.size == 0:
            raise DataError(f"{self.url!r}: no finite values in the chunks sampled to estimate mean/std; add "
                            f"'mean' and 'std' attributes to the array")
        return _stats_from(vals.mean(), vals.std(), self.url)

    def chunk_key(self, coords):
        """The storage key of chunk `coords`, e.g. 'amplitude/c/0/1/2' (v3) or 'data/chunked_012/0.1.2' (v2)."""
        key = self.arr.metadata.encode_chunk_key(tuple(coords))
        return f"{self.arr.path}/{key}" if self.arr.path else key

    async def _achunk(self, coords, sel):
        """arr[sel] for a selection inside the single chunk `coords`, retried as a whole (the store retries its
        requests; this also retries a decode that failed); then a DataError naming the chunk key."""
        what = f"chunk {self.chunk_key(coords)!r} of {self.url!r}"
        for attempt in range(self.opts.retries + 1):
            try:
                return await self.arr.async_array.getitem(sel)
            except DataError:
                raise  # a request that kept failing: RequestStore named it
            except (PermissionError, FileNotFoundError) as e:  # not transient: retrying cannot help
                raise DataError(f"reading {what}: {e}") from e
            except Exception as e:
                if attempt == self.opts.retries:
                    raise DataError(f"{what} failed {attempt + 1} times; last error: {type(e).__name__}: {e}") from e
            await asyncio.sleep(random.uniform(0, self.opts.backoff_s * 2 ** attempt))

    def _read_chunk_region(self, coords, sel):
        return zarr_sync(self._achunk(coords, sel))

    async def aread(self, origin, shape, normalize=True):
        """The crop [origin, origin + shape) as float32, on zarr's event loop (read() and read_crops() run it).
        normalize: with the volume's mean/std, dead traces (NaN, MDIO's fill value) -> 0; else the raw values
        with NaN kept.
        zarr's own read of the selection starts all the crop's chunks at once (up to async.concurrency); each
        chunk's GET waits for a place among opts.in_flight (RequestStore: shared with every other crop being
        read), is decoded in the loop's thread pool and copied into the crop. No thread waits per request or per
        crop: many crops are read side by side by gathering them on the loop (read_crops). Measured behind 20 ms
        emulated latency on 2 cores (bench.py data): a thread per chunk request, and then a thread per crop, each
        cost a fifth to a third of the throughput at 64 requests in flight."""
        if any(o < 0 or o + n > s for o, n, s in zip(origin, shape, self.shape)):
            raise DataError(f"crop at {origin} of shape {shape} is outside the volume {self.shape} of {self.url!r}")
        loop = asyncio.get_running_loop()
        if self.decode is not None:
            out = np.empty(shape, dtype=self.arr.dtype)
            ranges = [range(o // c, (o + n - 1) // c + 1) for o, n, c in zip(origin, shape, self.chunks)]
            await asyncio.gather(*(self._chunk_into(out, origin, coords, loop) for coords in itertools.product(*ranges)))
            self.bytes_read += out.size * 4
            if not normalize and out.dtype == np.float32:
                return out
            return await loop.run_in_executor(self.opts.pool, self._normalize, out, normalize)
        # any other layout: zarr's own read. The crop's memory is first touched in the pool, not on the loop: a fresh buffer page-faults on first touch
        # (the kernel zeroes each page), which made zarr's copy of each decoded chunk into it, on the loop, cost as
        # much as the chunk's decompression (profiled: half the loop's time) and delayed every other request
        out = await loop.run_in_executor(self.opts.pool, _touched, shape, self.arr.dtype)
        try:
            await self.arr.async_array.get_orthogonal_selection(tuple(slice(o, o + n) for o, n in zip(origin, shape)),
                                                                out=NDBuffer.from_numpy_array(out))
        except DataError:
            raise  # a request that kept failing: RequestStore named it
        except (PermissionError, FileNotFoundError) as e:
            raise DataError(f"reading {self.url!r}: {e}") from e
        except Exception:
            # the bytes came but did not decode (a corrupt chunk, or a body cut short that looked whole): the crop
            # again, one chunk after another, each retried, which names the chunk that fails (or succeeds if the
            # failure was transient)
            ranges = [range(o // c, (o + n - 1) // c + 1) for o, n, c in zip(origin, shape, self.chunks)]
            for coords in itertools.product(*ranges):
                lo = [max(o, i * c) for o, i, c in zip(origin, coords, self.chunks)]
                hi = [min(o + n, (i + 1) * c) for o, n, i, c in zip(origin, shape, coords, self.chunks)]
                out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, origin))] = await self._achunk(
                    coords, tuple(slice(a, b) for a, b in zip(lo, hi)))
        self.bytes_read += out.size * 4
        if not normalize and out.dtype == np.float32:
            return out
        # off the loop: a big crop's arithmetic must not hold up the other crops' requests
        return await loop.run_in_executor(self.opts.pool, self._normalize, out, normalize)

    async def _chunk_into(self, out, origin, coords, loop):
        """Chunk `coords`'s part of the crop at `origin`, into out: the GET on the loop (RequestStore: a place among
        in_flight, timeout, retries), decompression and the copy in the pool. A chunk that arrives but does not
        decode is fetched again (a body damaged on the way) up to `retries` times, then a DataError names it."""
        lo = [max(o, i * c) for o, i, c in zip(origin, coords, self.chunks)]
        hi = [min(o + n, (i + 1) * c) for o, n, i, c in zip(origin, out.shape, coords, self.chunks)]
        dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, origin))  # in the crop
        src = tuple(slice(a - i * c, b - i * c) for a, b, i, c in zip(lo, hi, coords, self.chunks))  # in the chunk
        key = self.chunk_key(coords)
        for attempt in range(self.opts.retries + 1):
            raw = await self.arr.store_path.store.get(key, prototype=_BUFFERS)
            if raw is None:  # never written: the fill value, by Zarr's rules
                return await loop.run_in_executor(self.opts.pool, out[dst].fill, self.arr.fill_value)
            try:
                return await loop.run_in_executor(self.opts.pool, _place, self.decode, raw, out, dst, src)
            except Exception as e:
                if attempt == self.opts.retries:
                    raise DataError(f"chunk {key!r} of {self.url!r} does not decode ({type(e).__name__}: {e}), read "
                                    f"{attempt + 1} times: the stored chunk is damaged; write it again from the "
                                    f"source (SEG-Y) or drop the store from the library") from e
            await asyncio.sleep(random.uniform(0, self.opts.backoff_s * 2 ** attempt))

    def _normalize(self, out, normalize=True):
        """float32; with normalize, (x - mean) / std in place, dead traces (NaN) -> 0 (an inf is bad data and is left
        to fail loudly: a non-finite loss)."""
        out = out.astype(np.float32, copy=False)
        if normalize:
            np.subtract(out, np.float32(self.mean), out=out)
            np.divide(out, np.float32(self.std), out=out)
            np.copyto(out, np.float32(0.0), where=np.isnan(out))
        return out

    def read(self, origin, shape, normalize=True):
        """The crop [origin, origin + shape) as float32 (aread, from any thread)."""
        return zarr_sync(self.aread(origin, shape, normalize))

    def live_fraction(self, origin, shape):
        """Fraction of live traces under the crop's footprint (1.0 without a trace mask)."""
        if self.trace_mask is None:
            return 1.0
        return float(self.trace_mask[origin[0]:origin[0] + shape[0], origin[1]:origin[1] + shape[1]].mean())


def chunk_decoder(arr):
    """The stored bytes of one chunk of `arr` -> its values (the chunk's shape), by numcodecs directly, for the
    layouts surveys are stored in: Zarr v3 with the bytes codec and at most one compressor (Blosc, as MDIO v1
    writes, or Zstd) on a regular grid; Zarr v2 (MDIO v0) in C order with a compressor and no filters. Anything
    else (sharding, filters, transposes, other codecs): None, and zarr's own pipeline reads it.
    Why not zarr's pipeline everywhere: per chunk it runs indexers, buffer prototypes and task hops in Python on
    the one event-loop thread and copies each decoded chunk there; measured on 2 cores it reached a third of what
    numcodecs alone decodes, and its copies delayed the next requests."""
    import numcodecs
    m = arr.metadata
    if m.zarr_format == 2:
        if m.filters or m.order != "C":
            return None
        dtype, codec = np.dtype(m.dtype.to_native_dtype() if hasattr(m.dtype, "to_native_dtype") else m.dtype), \
            m.compressor
    else:
        from zarr.codecs import BloscCodec, BytesCodec, ZstdCodec
        from zarr.core.chunk_grids import RegularChunkGrid
        codecs = list(m.codecs)
        if not isinstance(m.chunk_grid, RegularChunkGrid) or not codecs or type(codecs[0]) is not BytesCodec or \
                len(codecs) > 2 or (len(codecs) == 2 and type(codecs[1]) not in (BloscCodec, ZstdCodec)):
            return None
        big = codecs[0].endian is not None and codecs[0].endian.value == "big"
        dtype = np.dtype(arr.dtype).newbyteorder(">" if big else "<")
        # (decoding needs no parameters: a Blosc or Zstd frame describes itself)
        codec = None if len(codecs) == 1 else numcodecs.Blosc() if type(codecs[1]) is BloscCodec else numcodecs.Zstd()
    shape = tuple(arr.chunks)

    def decode(raw):
        return np.frombuffer(raw if codec is None else codec.decode(raw), dtype=dtype).reshape(shape)
    return decode


def _place(decode, raw, out, dst, src):
    out[dst] = decode(raw.as_numpy_array())[src]


_BUFFERS = default_buffer_prototype()  # what zarr's stores return bytes in


def _touched(shape, dtype):
    out = np.empty(shape, dtype=dtype)
    out.fill(0)
    return out


def read_crops(crops, normalize=True):
    """[(volume, origin, shape), ...] -> their crops, read side by side: one task on zarr's event loop gathers
    them all, and their chunk requests share the places of their ReadOptions (the caller's thread waits once)."""
    async def gather():
        return await asyncio.gather(*(vol.aread(o, s, normalize) for vol, o, s in crops))
    return zarr_sync(gather())


# -----------------------------------------------------------------------------
# 2. the sampler


def store_weights(records, inline, how):
    """How often each store is drawn: "uniform" (equally), "volume" (in proportion to its live voxels in the part of
    it crops are drawn from: live fraction x inline range x crosslines x samples), "manifest" (each record's
    "weight")."""
    if how == "uniform":
        return [1.0] * len(records)
    if how == "volume":
        return [r["live_fraction"] * (hi - lo) * r["shape"][1] * r["shape"][2] for r, (lo, hi) in zip(records, inline)]
    if how == "manifest":
        bad = [r["url"] for r in records if not isinstance(r.get("weight"), (int, float)) or r["weight"] < 0]
        if bad:
            raise DataError(f"sample_weighting='manifest' but {len(bad)} store(s) have no usable weight (first: "
                            f"{bad[0]!r}): give every manifest line a \"weight\" >= 0, or sample_weighting='volume'")
        return [float(r["weight"]) for r in records]
    raise DataError(f"sample_weighting must be 'volume', 'uniform' or 'manifest', got {how!r}")


def split_inline(rec, part, crop_inline):
    """The inline range [lo, hi) of the store `rec` (its record) that crops of `part` lie in. part None: the whole axis. ("train", f)
    and ("val", f): the last round(n * f) inline planes are held out for validation, the rest is training's:
        n = 128, f = 0.25  ->  training crops in [0, 96), validation crops in [96, 128)
    A crop lies wholly inside its range, so no training crop ever touches a validation voxel. Either range too
    short for a crop is an error now, naming the volume and what to change."""
    n = rec["shape"][0]
    if part is None:
        return 0, n
    which, frac = part
    b = n - int(round(n * frac))
    lo, hi = (0, b) if which == "train" else (b, n)
    if hi - lo < crop_inline:
        if which == "val":
            fix = (f"raise val_frac to at least {crop_inline / n:.3g} (= crop[0] / inlines), lower crop[0], or give "
                   f"held-out stores in val_paths")
        else:
            fix = f"lower val_frac (at most {(n - crop_inline) / n:.3g} leaves room), lower crop[0], or use val_paths"
        raise DataError(f"{rec['url']!r} has {n} inlines; val_frac={frac} leaves inlines [{lo}, {hi}) = {hi - lo} for "
                        f"{'validation' if which == 'val' else 'training'}, fewer than a crop's {crop_inline}: {fix}")
    return lo, hi


def _draw(rng, lo, hi, c, ch, align):
    """A crop origin along one axis: the crop [o, o + c) inside [lo, hi), which holds it. align: on a chunk
    boundary where the crop is at least a chunk (ch), else inside one chunk; where the range has no such place
    (a held-out range that starts mid-chunk), anywhere in it. With lo = 0, hi = the axis length, the draws
    are those of the whole-volume sampler."""
    if align and c >= ch:
        k0, k1 = -(-lo // ch), (hi - c) // ch  # chunk boundaries k * ch with the crop inside [lo, hi)
        if k1 >= k0:
            return (k0 + int(rng.integers(0, k1 - k0 + 1))) * ch
    elif align:  # chunks whose part inside [lo, hi) holds a crop (the last chunk may be short)
        ks = [k for k in range(lo // ch, (hi - c) // ch + 1) if min((k + 1) * ch, hi) - max(k * ch, lo) >= c]
        if ks:
            k = ks[int(rng.integers(0, len(ks)))]
            a, b = max(k * ch, lo), min((k + 1) * ch, hi)
            return a + int(rng.integers(0, b - a - c + 1))
    return lo + int(rng.integers(0, hi - lo - c + 1))


class Sampler:
    """Random crops of shape `crop` from `stores`. Every rank constructs the same Sampler; batch() picks
    the samples that belong to (step, micro, dp_rank), and reads this rank's CP slab of each.
      stores        store URLs (opened now) and manifest records (expand()'s list; opened when a sample first
                    needs them). At most max_open stores are kept open (least recently used closed first), so
                    memory stays flat however many stores the library holds; shapes, chunks and statistics come
                    from the records.
      weighting     how often each store is drawn (store_weights: "uniform", "volume", "manifest")
      align         place crops so that they touch the fewest chunks: along an axis where the crop is at
                    least a chunk, the origin sits on a chunk boundary (640 x 640 x 1024 in 128^3 chunks:
                    200 chunks aligned, up to 324 not); where it is smaller, the crop lies inside one chunk
                    (one request per chunk-sized neighbourhood instead of up to 2 per axis)
      min_live      skip crops whose live-trace fraction (trace_mask under the crop) is below this
      opts          ReadOptions: requests in flight, retries, timeouts, S3 access"""

    def __init__(self, stores, crop, seed=0, micro_batch=1, dp_rank=0, dp_size=1, grad_accum=1, cp_rank=0,
                 cp_size=1, align=False, min_live=0.0, opts=None, part=None, stream="train", weighting="uniform",
                 max_open=64):
        import threading
        from collections import OrderedDict
        from concurrent.futures import ThreadPoolExecutor
        if isinstance(stores, str):
            stores = [stores]
        self.opts = opts or ReadOptions()
        # the open stores: index -> Future of a Volume (a store is opened once even when several threads want it)
        self._open, self._lock, self.max_open = OrderedDict(), threading.Lock(), max(1, max_open)
        self.records = []
        for x in stores:
            if isinstance(x, dict):
                self.records.append(x)
            else:  # a URL: open it now (as every run did before manifests), and keep it open while there is room
                vol = Volume(x, self.opts)
                self.records.append(vol.describe())
                self._keep(len(self.records) - 1, vol)
        self.crop = tuple(crop)
        for r in self.records:
            if any(c > s for c, s in zip(self.crop, r["shape"])):
                raise DataError(f"crop {self.crop} is larger than the volume {tuple(r['shape'])} of {r['url']!r}: "
                                f"choose a crop no larger than every volume along each axis")
        # part: None (whole volumes) or ("train" | "val", val_frac): the inline range [lo, hi) of each volume that
        # this sampler's crops lie in (split_inline). stream: "train" or "val", which random stream the crops and
        # masks come from, so that validation sample i is the same whatever the training run around it.
        self.part, self.stream = part, stream
        self.inline = [split_inline(r, part, self.crop[0]) for r in self.records]
        w = store_weights(self.records, self.inline, weighting) if len(self.records) > 1 else [1.0]
        if not sum(w) > 0:
            raise DataError(f"sample_weighting={weighting!r} gives every store weight 0 (no live traces?)")
        self.weighting, self.cum = weighting, np.cumsum(np.asarray(w, dtype=np.float64) / sum(w))
        self.cum[-1] = 1.0  # (rounding must not leave a gap above the last store)
        self.bytes = 0  # voxel bytes delivered by this sampler (uncompressed), for the GB/s in the log
        self.seed, self.micro_batch, self.grad_accum = seed, micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        # where step 0 would start in the stream: 0, unless a resumed run changed its global batch (train.py sets it
        # to samples seen - step x the new batch, so the next step reads the next unseen samples)
        self.offset = 0
        # context parallelism: the cp ranks of a group read the same samples, each only its slab of
        # crop[0] / cp inline planes (a 1536 x 1536 x 2048 float32 sample is 19 GB: no rank holds one)
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.slab = (self.crop[0] // cp_size,) + self.crop[1:]
        self.align, self.min_live = align, min_live
        # the samples of a micro batch are located side by side (locating may open a store: metadata requests), then
        # read together (read_crops); the chunk requests of all of them share opts.in_flight places (RequestStore)
        self.sample_pool = ThreadPoolExecutor(max_workers=micro_batch, thread_name_prefix="sample")

    def global_index(self, step, micro, i):
        """Sample number in the whole run's stream: steps, then micro steps, then dp ranks, then batch rows. Step s
        reads samples [s x global batch, (s + 1) x global batch) in any dp x cp layout, so a run resumed on other
        ranks with the same global batch reads what the uninterrupted run would have."""
        return self.offset + ((step * self.grad_accum + micro) * self.dp_size + self.dp_rank) * self.micro_batch + i

    def locate(self, g):
        """Which volume and which crop origin sample g of this sampler's stream reads: a function of (seed, g)
        alone (training: key [seed, g]; validation: [seed, g, 2], another stream). Crops below min_live are
        redrawn from the same random stream, so every rank and every resume agrees."""
        rng = np.random.default_rng([self.seed, g] + ([2] if self.stream == "val" else []))
        n = len(self.records)
        for _ in range(1000):
            if n == 1:  # (draws nothing: one store's stream is what it was before there were weights)
                v = 0
            elif self.weighting == "uniform":
                v = int(rng.integers(n))
            else:
                v = min(int(np.searchsorted(self.cum, rng.random(), side="right")), n - 1)
            r = self.records[v]
            ranges = [self.inline[v]] + [(0, s) for s in r["shape"][1:]]  # the held-out split is along inline
            origin = [_draw(rng, lo, hi, c, ch, self.align) for (lo, hi), c, ch in zip(ranges, self.crop, r["chunks"])]
            if self.min_live <= 0 or self.volume(v).live_fraction(origin, self.crop) >= self.min_live:
                return v, tuple(origin)
        raise DataError(f"no crop of {self.crop} with a live-trace fraction >= {self.min_live} found in 1000 draws: "
                        f"lower min_live or check the stores' trace masks")

    def volume(self, v):
        """Store v, opened (at most once, by whichever thread needs it first; kept among the max_open most recently
        used). A store that has gone since it was indexed fails here, at its first read, naming it: never skipped,
        never zeros."""
        from concurrent.futures import Future
        with self._lock:
            fut = self._open.get(v)
            mine = fut is None
            if mine:
                fut = self._open[v] = Future()
                while len(self._open) > self.max_open:
                    self._open.popitem(last=False)  # (a thread still reading it keeps its own reference)
            else:
                self._open.move_to_end(v)
        if not mine:
            return fut.result()
        try:
            fut.set_result(Volume(self.records[v]["url"], self.opts, record=self.records[v]))
        except BaseException as e:
            fut.set_exception(e)
            with self._lock:
                if self._open.get(v) is fut:
                    del self._open[v]  # the next sample that needs it tries again
        return fut.result()

    def _keep(self, v, vol):
        from concurrent.futures import Future
        fut = Future()
        fut.set_result(vol)
        with self._lock:
            self._open[v] = fut
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)

    def where(self, g):
        """(the opened store, origin of this rank's slab) of global sample g."""
        v, origin = self.locate(g)
        return self.volume(v), (origin[0] + self.cp_rank * self.slab[0],) + origin[1:]

    def read(self, ids):
        """(len(ids), 1, crop[0] / cp, crop[1], crop[2]) float32 tensor: this rank's slabs of samples `ids`. Their
        stores are located (and opened if need be) side by side in threads, then the slabs are read together."""
        xs = read_crops([(vol, o, self.slab) for vol, o in self.sample_pool.map(self.where, ids)])
        with self._lock:
            self.bytes += sum(x.nbytes for x in xs)
        return torch.from_numpy(np.stack(xs)[:, None])

    def batch(self, step, micro=0):
        """(micro_batch, 1, crop[0] / cp, crop[1], crop[2]) float32 tensor, and the global sample indices."""
        ids = [self.global_index(step, micro, i) for i in range(self.micro_batch)]
        return self.read(ids), ids

    def bytes_read(self):
        return self.bytes

    def close(self):
        self.sample_pool.shutdown(wait=True)


def mask_noise(seed, ids, L, cp_rank=0, cp_size=1, stream="train"):
    """Masking noise for sample indices `ids` of a stream, this rank's share: (len(ids), L / cp_size). Like the
    crops, a function of the sample alone (key [seed, g, 1]; validation [seed, g, 3]): identical within a CP
    group, different between samples, and the same whatever the dp/cp layout or a resume (4 bytes per token:
    4.7 MB at 1.2 M tokens)."""
    share = slice(cp_rank * L // cp_size, (cp_rank + 1) * L // cp_size)
    key = 3 if stream == "val" else 1
    return torch.from_numpy(np.stack([np.random.default_rng([seed, g, key]).random(L, dtype=np.float32)[share]
                                      for g in ids]))


class Prefetcher:
    """Iterator over the micro batches of steps [start, end), read `depth` micro batches ahead by a pool
    of threads so that reading and decompressing overlap the model's compute (zarr's codecs and numpy
    release the GIL). Yields prepare(*Sampler.batch(...)) in order (Sampler.batch's (x, ids) without
    prepare): train.py's prepare makes the mask and casts and pins the batch in these threads, so that the
    training thread only starts an asynchronous copy. close() cancels and joins the threads."""

    def __init__(self, sampler, start, end, depth=2, prepare=None):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor
        self.sampler, self.prepare = sampler, prepare
        self.todo = ((s, m) for s in range(start, end) for m in range(sampler.grad_accum))
        self.pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="prefetch")
        self.pending = deque()
        for _ in range(depth):
            self._submit()

    def _submit(self):
        nxt = next(self.todo, None)
        if nxt is not None:
            self.pending.append(self.pool.submit(self._read, *nxt))

    def _read(self, step, micro):
        x, ids = self.sampler.batch(step, micro)
        return self.prepare(x, ids) if self.prepare else (x, ids)

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
