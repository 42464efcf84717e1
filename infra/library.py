"""
A library of surveys: thousands of MDIO/Zarr stores, found by glob patterns and indexed once into a manifest, so that
a run opens none of them at start-up (data.Sampler opens a store when a sample first needs it, and keeps a bounded
number open).

    python -m scripts.library index 's3://bucket/library/*.mdio' --out s3://bucket/library/index.jsonl
    bash launch.sh CONFIG --data_paths="['@s3://bucket/library/index.jsonl']"

data_paths (and val_paths) entries are store URLs, glob patterns and @manifests (local or any fsspec URL). The
manifest holds one JSON line per store with what sampling needs:
    {"url": ..., "format": "mdio_v1" | "mdio_v0" | "zarr", "shape": [ni, nx, nt], "chunks": [...], "dtype": "float32",
     "mean": ..., "std": ..., "live_fraction": live traces / all traces, "bytes": voxel bytes uncompressed,
     optional "split": "train" | "val", optional "weight": a number (sample_weighting="manifest")}
Without a manifest, train.py has rank 0 index data_paths at start-up (index(): globs expanded, stores opened many at
once) and hands the records to every rank.
"""
import json

from infra.progress import Progress
from infra.reader import DataError, ReadOptions, Volume, storage_options


RECORD_KEYS = ("url", "format", "shape", "chunks", "dtype", "mean", "std", "live_fraction", "bytes")


def _fs(url, opts):
    import fsspec
    return fsspec.url_to_fs(url, **storage_options(url, opts))


def read_manifest(url, opts=None, cut_short_ok=False):
    """The store records of a manifest (local path or fsspec URL). A line that is not a record is a DataError naming
    the manifest, the line and the fix; so is a manifest that cannot be read. cut_short_ok: a last line that is not
    a record is dropped (an index that crashed mid-line; index() goes on from the rest)."""
    opts = opts or ReadOptions()
    try:
        fs, path = _fs(url, opts)
        with fs.open(path, "r") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read manifest {url!r} ({type(e).__name__}: {e}): write one with "
                        f"python -m scripts.library index PATTERN... --out MANIFEST") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            missing = [k for k in RECORD_KEYS if k not in r] if isinstance(r, dict) else list(RECORD_KEYS)
            if missing:
                raise ValueError(f"missing {missing}")
            if not all(isinstance(r[k], list) and len(r[k]) == 3 and all(isinstance(x, int) and x > 0 for x in r[k])
                       for k in ("shape", "chunks")):
                raise ValueError("shape and chunks need 3 positive integers each")
            if not all(isinstance(r[k], (int, float)) for k in ("mean", "std", "live_fraction", "bytes")):
                raise ValueError("mean, std, live_fraction and bytes must be numbers")
            if r.get("split", "train") not in ("train", "val") or not isinstance(r["url"], str):
                raise ValueError("url is a string, split is 'train' or 'val'")
        except ValueError as e:
            if cut_short_ok and n == len(lines):
                continue
            raise DataError(f"manifest {url!r} line {n} is not a store record ({e}): {line[:120]!r}; write manifests "
                            f"with python -m scripts.library index, or give each line the keys {list(RECORD_KEYS)}") from None
        out.append(r)
    if not out and not cut_short_ok:
        raise DataError(f"manifest {url!r} lists no store")
    return out


def expand(entries, opts=None):
    """data_paths as the sampler takes them: plain store URLs (str) as they are, glob patterns as the sorted stores
    they match (str), and @manifests as their records (dict). A pattern that matches nothing is a DataError."""
    opts = opts or ReadOptions()
    out = []
    for e in entries:
        if e.startswith("@"):
            out.extend(read_manifest(e[1:], opts))
        elif any(ch in e for ch in "*?[") and not _exists(e, opts):  # (a store may have [ ] in its name)
            fs, path = _fs(e, opts)
            proto = e.split("://", 1)[0] + "://" if "://" in e else ""
            found = sorted(proto + p if proto and not p.startswith(proto) else p for p in fs.glob(path.rstrip("/")))
            if not found:
                raise DataError(f"data path pattern {e!r} matches nothing: check the prefix and the pattern (a store "
                                f"is a folder: s3://bucket/library/*.mdio)")
            out.extend(found)
        else:
            out.append(e)
    return out


def index(entries, opts=None, out=None, in_flight=16, log=None, extra=None):
    """Records for `entries` (expand()'s: URLs are opened and described, records kept), opened `in_flight` at a time.
    Returns them in the order of `entries`. extra: keys to set on these stores' lines (split, weight).
    out: the manifest file to write. A local one gets each store's line appended (and flushed) as soon as it is
    done, so an index that crashed goes on where it stopped: stores already there are not opened again, and a last
    line cut short is dropped. At the end the manifest is rewritten whole, its lines sorted by url, under a
    temporary name and renamed: the same stores give the same file, and the same file the same samples (a list of
    the same URLs in that order gives them too). An object store cannot append: there it is written at the end."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor
    opts = opts or ReadOptions()
    items = expand(entries, opts)
    local = out is not None and ("://" not in out or out.startswith("file://"))
    if local and os.path.exists(out):  # a line cut short by a crash: gone before anything is appended after it
        with open(out, "rb+") as f:
            text = f.read()
            if text and not text.endswith(b"\n"):
                f.truncate(text.rfind(b"\n") + 1)
    done = {r["url"]: r for r in read_manifest(out, opts, cut_short_ok=True)} if out and _exists(out, opts) else {}
    todo = [u for u in dict.fromkeys(x for x in items if isinstance(x, str)) if u not in done]
    f = open(out, "a") if local and todo else None
    lock = threading.Lock()

    # opening a store sends zarr's probes side by side (zarr.json, .zarray, .zattrs at once: up to 4 requests), so
    # `in_flight` stores opened at once need 4 x in_flight request places, not in_flight
    opening = opts.with_in_flight(4 * max(1, in_flight))

    # thousands of stores take minutes: a count and an ETA on stderr (infra/progress.py; rank 0's, as train.py
    # indexes data_paths on rank 0), the per-store lines still going to `log` as they were
    bar = Progress(total=len(todo), desc="indexing", unit="store") if todo else None

    def one(url):
        r = {**Volume(url, opening).describe(), **(extra or {})}
        if f is not None:
            with lock:
                f.write(json.dumps(r) + "\n")
                f.flush()
        if log:
            bar.write(f"indexed {url}: {r['shape']} {r['format']}, live {r['live_fraction']:.2f}", log)
        bar.update()
        return r
    try:
        with ThreadPoolExecutor(max_workers=max(1, in_flight)) as pool:
            done.update(zip(todo, pool.map(one, todo)))
    finally:
        if f is not None:
            f.close()
        if bar is not None:
            bar.close()
    for u in (x for x in items if isinstance(x, str)):  # stores indexed before: this call's split / weight too
        done[u] = {**done[u], **(extra or {})}
    if out is not None:
        text = "".join(json.dumps(done[u]) + "\n" for u in sorted(done))
        fs, path = _fs(out, opts)
        tmp = f"{path}.tmp{os.getpid()}" if local else path
        with fs.open(tmp, "w") as g:
            g.write(text)
        if local:
            os.replace(tmp, path)
    return [x if isinstance(x, dict) else done[x] for x in items]


def _exists(url, opts):
    fs, path = _fs(url, opts)
    return fs.exists(path)
