"""
Index a library of surveys into a manifest: thousands of MDIO/Zarr stores found by glob patterns, opened many at
once, one JSON line per store (the format: infra/library.py), so that a run opens none of them at start-up.

    python -m scripts.library index 's3://bucket/library/*.mdio' --out s3://bucket/library/index.jsonl
    bash launch.sh CONFIG --data_paths="['@s3://bucket/library/index.jsonl']"
"""
import argparse
import math
import sys
import time

import configurator
from infra import cli
from infra.library import index
from infra.reader import ReadOptions


def main(argv):
    """python -m scripts.library index PATTERN... --out MANIFEST: one manifest line per store (infra/library.py), many
    stores opened at once, each line appended to MANIFEST.partial as it is done: run it again after a crash and it
    goes on (a local manifest; one on s3:// is written at the end only). The manifest itself is written whole at the
    end. An existing MANIFEST of these stores is gone on from; one of other stores (or with another --split or
    --weight) is refused unless --add or --overwrite; anything else there is never written over. Prints one line per
    store and the manifest's path last."""
    ap = argparse.ArgumentParser(prog="python -m scripts.library", description="index a library of MDIO/Zarr stores into a manifest")
    ap.add_argument("command", choices=["index"])
    ap.add_argument("patterns", nargs="+", help="stores, glob patterns (s3://bucket/library/*.mdio), @manifests")
    ap.add_argument("--out", required=True, help="the manifest (local path or s3://...), JSON lines")
    ap.add_argument("--in_flight", type=int, default=32, help="stores opened at once (default 32)")
    ap.add_argument("--split", choices=["train", "val"], default=None, help="mark these stores (default: none)")
    ap.add_argument("--weight", type=float, default=None, help="each store's weight (sample_weighting='manifest')")
    ap.add_argument("--s3_anon", action="store_true", help="anonymous S3 (public buckets)")
    ap.add_argument("--s3_endpoint", default=None, help="S3-compatible endpoint URL")
    ap.add_argument("--read_timeout_s", type=float, default=30.0, help="a request not answered by then is retried")
    ap.add_argument("--read_retries", type=int, default=6, help="retries of a failing request, then an error")
    ap.add_argument("--add", action="store_true", help="add these stores' lines to a manifest of other stores")
    ap.add_argument("--overwrite", action="store_true", help="replace a manifest of other stores with these alone")
    a = ap.parse_args(argv)
    configurator.need(a.in_flight >= 1, f"--in_flight={a.in_flight}: open at least 1 store at a time")
    configurator.need(a.weight is None or (math.isfinite(a.weight) and a.weight >= 0),
             f"--weight={a.weight}: a store's weight is a number >= 0 (sample_weighting='manifest')")
    configurator.need(a.read_timeout_s > 0 and a.read_retries >= 0, "--read_timeout_s must be > 0 and --read_retries >= 0")
    configurator.need(not (a.add and a.overwrite), "--add keeps the manifest's other lines and --overwrite drops them: give one")
    extra = {k: v for k, v in (("split", a.split), ("weight", a.weight)) if v is not None}
    opts = ReadOptions(in_flight=a.in_flight, anon=a.s3_anon, endpoint_url=a.s3_endpoint, retries=a.read_retries,
                       timeout_s=a.read_timeout_s)
    t0 = time.time()
    records = index(a.patterns, opts, out=a.out, in_flight=a.in_flight, log=print, extra=extra,
                    overwrite=a.overwrite, add=a.add)
    print(f"{len(records)} stores, {sum(r['bytes'] for r in records) / 1e9:.2f} GB of voxels, indexed in "
          f"{time.time() - t0:.1f} s")
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:], interrupted="the stores indexed so far are kept (MANIFEST.partial locally): "
                                                     "the same command goes on from them"))
