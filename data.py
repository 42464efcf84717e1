"""
Seismic volumes in, training samples out.

  (infra/reader.py opens a store and reads crops from it; infra/synthetic.py writes the quickstart's synthetic
  volume as an MDIO store; infra/library.py finds and indexes stores)
  samplers(cfg, ...)         a run's training and held-out Samplers, from its config (train.py's setup)
  Sampler                    random crops from one or more stores (URLs, or infra/library.py's records: opened
                             when first needed, a bounded number kept open), each store drawn by its live
                             volume (or uniformly, or by a manifest's weights). A sample is a pure function of
                             (seed, global sample index), and the global index a function of
                             (step, micro step, dp_rank, position in the micro batch): so a resumed run
                             reads exactly what an uninterrupted run would have read, and 1 rank with
                             batch 2b sees the same samples as 2 ranks with batch b. A held-out part
                             (split_inline) keeps training crops off the last val_frac of each volume's
                             inline axis and puts validation crops inside it; validation samples are a
                             stream of their own (seed, validation index).
  dead_regions(sampler, log)  start-up's look at the training regions: a WARNING for one with no live signal
  Prefetcher                 micro batches read ahead of the model's compute
  PinnedBuffers              the page-locked host buffers those batches are copied to the GPU from, reused
"""

import numpy as np
import torch

from infra.reader import DataError, ReadOptions, Volume, read_crops


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
      opts          ReadOptions: requests in flight, retries, timeouts, S3 access
      label_var     fine-tuning: every store's class variable of that name (Volume.variable) is read at the same
                    crops, and a batch is (B, 2, ...): channel 0 the amplitude, channel 1 the labels (one tensor
                    through the prefetcher, the pinned copy and the copy to the device). Each store's variable is
                    checked (present, same grid, integer) when the sampler is made; classes: labels must lie in
                    [0, classes), checked at every read.
      flip          augmentation: each sample mirrored along inline and along crossline, each with probability 1/2
                    (flips(g): a function of (seed, g) alone, as the crop is), its labels with it. Mirroring along the
                    horizontal axes keeps a survey a survey (faults stay planes, dips change sign); time is never
                    reversed (a wavelet and the layering have a direction). Under cp, rank r of a sample mirrored
                    along inline reads slab cp - 1 - r and mirrors it: the slabs side by side are the mirrored
                    sample, as on one rank."""

    def __init__(self, stores, crop, seed=0, micro_batch=1, dp_rank=0, dp_size=1, grad_accum=1, cp_rank=0,
                 cp_size=1, align=False, min_live=0.0, opts=None, part=None, stream="train", weighting="uniform",
                 max_open=64, label_var=None, classes=2, flip=False):
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
        self.label_var, self.classes, self.flip = label_var, classes, flip
        if label_var:  # a store without usable labels fails now, before any work
            for v in range(len(self.records)):
                self.volume(v).variable(label_var)

    def whole(self):
        """The same stream as whole samples (no cp slab): what infra/evaluate.floor_of reads; close() it after."""
        return Sampler(self.records, self.crop, seed=self.seed, micro_batch=self.micro_batch, align=self.align,
                       min_live=self.min_live, opts=self.opts, part=self.part, stream=self.stream,
                       weighting=self.weighting, max_open=self.max_open, flip=self.flip)

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

    def flips(self, g):
        """(along inline, along crossline): whether sample g is mirrored along each, from a stream of its own (key
        [seed, g, 3]), so that turning flip on changes no crop. (False, False) when flip is off."""
        if not self.flip:
            return False, False
        a, b = np.random.default_rng([self.seed, g, 3]).random(2) < 0.5
        return bool(a), bool(b)

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
        """(the opened store, origin of this rank's slab) of global sample g: slab cp_rank of its crop, or slab
        cp - 1 - cp_rank when the sample is mirrored along inline (read() mirrors it)."""
        v, origin = self.locate(g)
        k = self.cp_size - 1 - self.cp_rank if self.flips(g)[0] else self.cp_rank
        return self.volume(v), (origin[0] + k * self.slab[0],) + origin[1:]

    def mirror(self, xs, ids):
        """Each sample's slab mirrored as flips() says: (Z / cp, Y, X) arrays, numpy axes 0 (inline), 1 (crossline)."""
        out = []
        for x, g in zip(xs, ids):
            axes = [a for a, f in enumerate(self.flips(g)) if f]
            out.append(np.ascontiguousarray(np.flip(x, axes)) if axes else x)
        return out

    def read(self, ids):
        """(len(ids), 1, crop[0] / cp, crop[1], crop[2]) float32 tensor: this rank's slabs of samples `ids`. Their
        stores are located (and opened if need be) side by side in threads, then the slabs are read together."""
        located = list(self.sample_pool.map(self.where, ids))
        xs = self.mirror(read_crops([(vol, o, self.slab) for vol, o in located]), ids)
        with self._lock:
            self.bytes += sum(x.nbytes for x in xs)
        if not self.label_var:
            return torch.from_numpy(np.stack(xs)[:, None])
        ys = read_crops([(vol.variable(self.label_var), o, self.slab) for vol, o in located], normalize=False)
        for y, (vol, o) in zip(ys, located):
            lo, hi = int(y.min()), int(y.max())
            if lo < 0 or hi >= self.classes:
                raise DataError(f"{vol.url!r}: label variable {self.label_var!r} holds class {lo if lo < 0 else hi} in "
                                f"the crop at {o}, outside [0, classes={self.classes}): set classes to the number of "
                                f"classes the labels use")
        ys = self.mirror(ys, ids)
        return torch.from_numpy(np.stack([np.stack(xs), np.stack(ys)], axis=1))  # (B, 2, Z / cp, Y, X)

    def batch(self, step, micro=0):
        """(micro_batch, 1, crop[0] / cp, crop[1], crop[2]) float32 tensor, and the global sample indices."""
        ids = [self.global_index(step, micro, i) for i in range(self.micro_batch)]
        return self.read(ids), ids

    def bytes_read(self):
        return self.bytes

    def close(self):
        self.sample_pool.shutdown(wait=True)


DEAD_CHECK_STORES = 8  # the training stores dead_regions looks at (the first ones: a look, not a scan of a library)
DEAD_CHECK_CHUNKS = 8  # chunks read from each one's training region, along its diagonal


def dead_regions(sampler, log, stores=DEAD_CHECK_STORES, chunks=DEAD_CHECK_CHUNKS):
    """A WARNING line (log) for each of the first `stores` training stores whose training region (its inline range,
    split_inline's) shows no live signal in the `chunks` chunks read from it along its diagonal: every value the same
    (all zeros, or a constant) or none finite. Crops of such a region all normalise to one number: the model learns
    to predict it, and the loss falls to a few hundredths without anything being learnt (a run on one trained to
    0.045, on clean data it is ~0.93). Not an error: a survey may have a dead corner, and a store is drawn among
    others. Returns the (url, (lo, hi)) warned about. The chunks are read raw, through the reader's checks (a chunk
    that is not seismic is its DataError here, at start-up)."""
    import math
    dead = []
    for v in range(min(stores, len(sampler.records))):
        r, (lo, hi) = sampler.records[v], sampler.inline[v]
        ch, shape = r["chunks"], r["shape"]
        ranges = [range(lo // ch[0], (hi - 1) // ch[0] + 1)] + [range(math.ceil(n / c)) for n, c in zip(shape[1:], ch[1:])]
        picks = sorted({tuple(rg[int(len(rg) * f)] for rg in ranges) for f in np.linspace(0, 0.999, chunks)})
        crops = []
        for p in picks:  # each chunk's part inside the region
            a = [max(i * c, b) for i, c, b in zip(p, ch, (lo, 0, 0))]
            z = [min((i + 1) * c, e) for i, c, e in zip(p, ch, (hi,) + tuple(shape[1:]))]
            crops.append((sampler.volume(v), tuple(a), tuple(e - b for b, e in zip(a, z))))
        values = [x[np.isfinite(x)] for x in read_crops(crops, normalize=False)]
        seen = np.concatenate(values) if values else np.zeros(0)
        if seen.size == 0 or seen.min() == seen.max():
            what = "no finite value (every trace dead)" if seen.size == 0 else f"every value {float(seen[0]):g}"
            log(f"WARNING: data: {r['url']!r}: its training region (inlines [{lo}, {hi}) of {shape[0]}, every crossline "
                f"and sample) has no live signal in the {len(picks)} chunks read from it ({what}: all zeros, or a "
                f"constant): its crops teach nothing, and make the loss fall without learning. A dead corner of a "
                f"survey is fine; a dead region is a store written wrong, or val_frac leaving the live part out")
            dead.append((r["url"], (lo, hi)))
    return dead


class Prefetcher:
    """Iterator over the micro batches of steps [start, end), read `depth` micro batches ahead by a pool
    of threads so that reading and decompressing overlap the model's compute (each thread waits while its
    micro batch's requests run on zarr's event loop and its chunks decode in infra/reader.py's pool). Yields
    prepare(*Sampler.batch(...)) in order (Sampler.batch's (x, ids) without prepare): train.py's prepare makes the mask and casts and pins the batch in these threads, so that the
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


class PinnedBuffers:
    """Page-locked host buffers for the micro batches' copies to the GPU, reused from batch to batch: train.py's
    prepare_batch takes one per tensor (take, in a prefetch thread) and its to_device gives it back with the CUDA
    event recorded after the buffer's copy to the device (give_back, on the training thread). Page-locking a
    GB-sized buffer (cudaHostAlloc) costs far more than filling it, so each is allocated once. A buffer is handed
    out again only once its event has completed: the copy is asynchronous, and the next batch written into a
    buffer the copy is still reading would reach the device half old, half new. That wait is the prefetch
    thread's, and in practice none (the copy was queued a micro step earlier). Buffers are kept per (shape,
    dtype); a Prefetcher of depth d holds d + 1 of each: d read ahead, and the one whose copy was queued last.
    pin=False: ordinary memory (tests on a CPU without CUDA)."""

    def __init__(self, pin=True):
        import threading
        from collections import defaultdict, deque
        self.pin, self.lock, self.free, self.allocated = pin, threading.Lock(), defaultdict(deque), 0

    def take(self, shape, dtype):
        """An unused buffer of this shape and dtype: the one given back first, once its copy is done, or a new one."""
        with self.lock:
            q = self.free[(tuple(shape), dtype)]
            buf, done = q.popleft() if q else (None, None)
            self.allocated += buf is None
        if buf is None:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        if done is not None:
            done.synchronize()
        return buf

    def give_back(self, buf, done=None):
        """buf may be taken again once `done` (a torch.cuda.Event recorded after the copy that reads it) has
        completed; None: at once."""
        with self.lock:
            self.free[(tuple(buf.shape), buf.dtype)].append((buf, done))


def samplers(cfg, cp_rank, dp_rank, dp_size, log):
    """A run's samplers, on every rank: (training Sampler, held-out Sampler or None, the stores' digest). Rank 0
    creates the quickstart's synthetic store (make_synthetic: at a local path only) and indexes data_paths and
    val_paths (globs expanded, manifests read, plain URLs opened and described: infra/library.py) while the others
    wait; every rank gets the records and opens a store only when a sample needs it. Held out: the val_paths stores
    and the manifests' split="val" ones, or else the last val_frac of every training volume's inline axis."""
    import hashlib
    import json
    import time

    from infra import distributed, library, synthetic
    opts = ReadOptions(in_flight=cfg["in_flight"], retries=cfg["read_retries"], timeout_s=cfg["read_timeout_s"],
                       anon=cfg["s3_anon"], endpoint_url=cfg["s3_endpoint"] or None, threads=cfg["read_threads"])
    if cfg["make_synthetic"]:
        # rank 0 writes the synthetic store while the others wait. Only to a local path: at a remote one it only
        # looks, with these options (the run's endpoint), and a missing store is a ConfigError on every rank
        distributed.on_rank_0(lambda: synthetic.ensure_synthetic(
            cfg["data_paths"][0], cfg["synthetic_shape"], seed=cfg["seed"], chunks=cfg["synthetic_chunks"], opts=opts,
            log=log))
    t0 = time.time()
    stores, val_stores = distributed.on_rank_0(
        lambda: (library.index(cfg["data_paths"], opts, in_flight=cfg["in_flight"]),
                 library.index(cfg["val_paths"], opts, in_flight=cfg["in_flight"]) if cfg["val_paths"] else []))
    val_stores += [r for r in stores if r.get("split") == "val"]
    stores = [r for r in stores if r.get("split") != "val"]
    if not stores:
        raise DataError(f"data_paths {cfg['data_paths']} hold only split='val' stores: nothing to train on")
    log(f"data: {len(stores)} training store(s), {len(val_stores)} held-out; indexed in {time.time() - t0:.1f} s")
    held_out = not val_stores and cfg["val_frac"] > 0
    sampling = dict(crop=cfg["crop"], seed=cfg["seed"], micro_batch=cfg["micro_batch"], cp_rank=cp_rank,
                    cp_size=cfg["cp"], align=cfg["align_crops"], min_live=cfg["min_live"], opts=opts,
                    weighting=cfg["sample_weighting"], max_open=cfg["max_open_stores"],
                    label_var=cfg["label_var"] if cfg["task"] == "segment" else None, classes=cfg["classes"])
    train = Sampler(stores, dp_rank=dp_rank, dp_size=dp_size, grad_accum=cfg["grad_accum"],
                    part=("train", cfg["val_frac"]) if held_out else None, flip=cfg["flip_crops"], **sampling)
    # what the training stream depends on besides the seed: which stores, in which order, drawn how (a glob
    # re-expanded at a relaunch may have found more; train.py warns when a resumed run's differs)
    drawn = [[r["url"] for r in stores], cfg["sample_weighting"]] + (["flip_crops"] if cfg["flip_crops"] else [])
    digest = hashlib.sha256(json.dumps(drawn).encode()).hexdigest()[:16]
    distributed.on_rank_0(lambda: bool(dead_regions(train, log)))  # (a WARNING per dead training region; rank 0's)
    val = None
    if val_stores or held_out:
        recs = val_stores or stores
        if cfg["sample_weighting"] == "manifest" and not all("weight" in r for r in recs):
            sampling["weighting"] = "volume"  # held-out stores without weights (val_paths, split "val"): by volume
        val = Sampler(recs, part=("val", cfg["val_frac"]) if held_out else None, stream="val", **sampling)
    return train, val, digest
