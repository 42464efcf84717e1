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

from configurator import ConfigError
from infra import outputs
from infra.progress import Progress
from infra.reader import DataError, ReadOptions, Volume, bucket_exists, endpoint, remote_call, storage_options


RECORD_KEYS = ("url", "format", "shape", "chunks", "dtype", "mean", "std", "live_fraction", "bytes")


def _fs(url, opts):
    import fsspec
    fs, path = fsspec.url_to_fs(url, **storage_options(url, opts))
    if url.startswith("s3://"):
        fs.retries = 1  # one layer of retries, ours (reader.remote_call: bounded, saying what it waits for)
    return fs, path


def read_manifest(url, opts=None, cut_short_ok=False):
    """The store records of a manifest (local path or fsspec URL). A line that is not a record is a DataError naming
    the manifest, the line and the fix; so is a manifest that cannot be read. cut_short_ok: a last line that is not
    a record is dropped (an index that crashed mid-line; index() goes on from the rest)."""
    opts = opts or ReadOptions()

    def read():
        fs, path = _fs(url, opts)
        with fs.open(path, "r") as f:
            return f.read().splitlines()
    try:
        lines = remote_call(read, url, opts, f"reading manifest {url!r}") if "://" in url else read()
    except DataError:
        raise
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read manifest {url!r} ({type(e).__name__}: {e}): write one with "
                        f"python -m scripts.library index PATTERN... --out MANIFEST") from None
    return parse_lines(url, lines, cut_short_ok)


def parse_lines(url, lines, cut_short_ok=False):
    """read_manifest()'s records of a manifest's lines (url names it in the errors)."""
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
            last = (" (its last line, cut short? an index that crashed: run the same index command again to finish "
                    "it)" if n == len(lines) else "")
            raise DataError(f"manifest {url!r} line {n} is not a store record ({e}): {line[:120]!r}{last}; write "
                            f"manifests with python -m scripts.library index, or give each line the keys "
                            f"{list(RECORD_KEYS)}") from None
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
            matched = remote_call(lambda: fs.glob(path.rstrip("/")), e, opts, f"listing data path pattern {e!r}") \
                if "://" in e else fs.glob(path.rstrip("/"))
            found = sorted(proto + p if proto and not p.startswith(proto) else p for p in matched)
            if not found:
                if e.startswith("s3://") and not bucket_exists(e, opts):
                    raise DataError(f"the bucket of data path pattern {e!r} does not exist (or these credentials "
                                    f"cannot see it) at {endpoint(opts)}: check the bucket name, region and "
                                    f"s3_endpoint")
                raise DataError(f"data path pattern {e!r} matches nothing: check the prefix and the pattern (a store "
                                f"is a folder: s3://bucket/library/*.mdio)")
            out.extend(found)
        else:
            out.append(e)
    return out


def index(entries, opts=None, out=None, in_flight=16, log=None, extra=None, overwrite=False, add=False):
    """Records for `entries` (expand()'s: URLs are opened and described, records kept), opened `in_flight` at a time.
    Returns them in the order of `entries`. extra: keys to set on these stores' lines (split, weight).
    out: the manifest file to write, whole, at the end: its lines sorted by url, under a temporary name and renamed
    (infra/outputs.py), so that the same stores give the same file, and the same file the same samples (a list of
    the same URLs in that order gives them too). While it runs, each store's line is appended (and flushed) to
    OUT.partial beside it as soon as it is done (local manifests), so an index that crashed goes on where it stopped:
    stores already there are not opened again, and a last line cut short is dropped. An object store cannot
    append: there the manifest is written at the end only. What is at `out` already (checked before any store is
    opened, see _kept):
      * a manifest of these stores (all of its lines among them, with this split and weight): it goes on from it;
      * a manifest of other stores, or with another split or weight: refused, unless add (its lines are kept, these
        stores' lines added, with this call's split / weight on them) or overwrite (these stores' lines alone);
      * anything else (a file that is not a manifest): refused."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor
    opts, extra = opts or ReadOptions(), extra or {}
    items = expand(entries, opts)
    urls = list(dict.fromkeys(x for x in items if isinstance(x, str)))
    done = {} if out is None else _kept(out, entries, urls, extra, opts, overwrite, add)
    todo = [u for u in urls if u not in done]
    partial = f"{outputs.local(out)}.partial" if out is not None and not outputs.is_remote(out) else None
    f = open(partial, "a") if partial and todo else None
    lock = threading.Lock()

    # opening a store sends zarr's probes side by side (zarr.json, .zarray, .zattrs at once: up to 4 requests), so
    # `in_flight` stores opened at once need 4 x in_flight request places, not in_flight
    opening = opts.with_in_flight(4 * max(1, in_flight))

    # thousands of stores take minutes: a count and an ETA on stderr (infra/progress.py; rank 0's, as train.py
    # indexes data_paths on rank 0), the per-store lines still going to `log` as they were
    bar = Progress(total=len(todo), desc="indexing", unit="store") if todo else None

    def one(url):
        r = {**Volume(url, opening).describe(), **extra}
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
    for u in urls:  # stores indexed before (add): this call's split / weight too
        done[u] = {**done[u], **extra}
    if out is not None:
        text = "".join(json.dumps(done[u]) + "\n" for u in sorted(done))
        if partial:
            with outputs.replacing(out) as tmp, open(tmp, "w") as g:
                g.write(text)
            if os.path.exists(partial):
                os.remove(partial)
        else:
            fs, path = _fs(out, opts)
            with fs.open(path, "w") as g:  # (one PUT: whole or not at all)
                g.write(text)
    return [x if isinstance(x, dict) else done[x] for x in items]


MARKS = ("split", "weight")  # what an index call sets on its stores' lines


def _kept(out, entries, urls, extra, opts, overwrite, add):
    """index(): the records already at `out` (and in OUT.partial, an interrupted index's) that this call keeps,
    {url: record}, or a ConfigError (one line) when out must not be written: inside one of the inputs, in a
    folder that does not exist, not a manifest, or a manifest of other stores or marks without add / overwrite."""
    inputs = urls + [e[1:] for e in entries if e.startswith("@")]
    outputs.refuse_inside(out, inputs)
    if outputs.is_remote(out):
        found = (_records(out, opts) or outputs.Foreign("an object that is not a manifest")) if _exists(out, opts) \
            else None
        kept = None if isinstance(found, outputs.Foreign) else found
    else:
        outputs.check_folder(out)
        found = outputs.inspect_file(out, lambda p: _records(p, opts), "a manifest")
        partial = outputs.inspect_file(f"{outputs.local(out)}.partial", _partial_records, "a manifest")
        if isinstance(partial, outputs.Foreign):
            raise ConfigError(f"{out}.partial is {partial}, where an interrupted index of --out={out!r} would be: "
                              f"move it away, or choose another --out")
        kept = None if isinstance(found, outputs.Foreign) else {**(found or {}), **(partial or {})}
    if isinstance(found, outputs.Foreign):
        outputs.target(out, "a manifest", found, {})  # (refuses, naming what it is)
    if not kept:
        return {}
    mine = set(urls)
    others = [u for u in kept if u not in mine]
    marked = [u for u in kept if u in mine and {k: kept[u].get(k) for k in MARKS} != {k: extra.get(k) for k in MARKS}]
    if not (others or marked) or add:
        return kept  # the same stores (an index that goes on), or add: every line kept
    if overwrite:
        return {}
    why = (f"{len(others)} other store(s) (first: {others[0]!r})" if others else
           f"{len(marked)} of these stores with another split or weight (first: {marked[0]!r}: "
           f"{ {k: kept[marked[0]].get(k) for k in MARKS} })")
    raise ConfigError(f"--out={out!r} is a manifest of {why}: add --add to add these stores' lines to it (with this "
                      f"--split / --weight on them), --overwrite to replace it with these stores' lines alone, or "
                      f"choose another --out")


def _records(url, opts):
    """{url: record} of the manifest at url (a last line cut short dropped), or None when it is not a manifest (a
    line that is not a store record before the last, or no record at all)."""
    try:
        return {r["url"]: r for r in read_manifest(url, opts, cut_short_ok=True)} or None
    except DataError:
        return None


def _partial_records(path):
    """{url: record} of an interrupted index's OUT.partial: its whole lines (what follows the last newline was being
    written when it stopped), {} when none is whole, None when one of them is not a store record."""
    with open(path) as f:
        lines = f.read().split("\n")[:-1]
    try:
        return {r["url"]: r for r in parse_lines(path, lines)} if any(x.strip() for x in lines) else {}
    except DataError:
        return None


def _exists(url, opts):
    fs, path = _fs(url, opts)
    if "://" not in url:
        return fs.exists(path)
    # (s3fs's exists() answers False for whatever fails: its info() says why, which remote_call reports)
    def look():
        try:
            fs.info(path)
            return True
        except FileNotFoundError:
            return False
    return remote_call(look, url, opts, f"looking for {url!r}")
