"""
The reader's and the survey library's benches (`python -m bench data` and `python -m bench library` run them and
print the JSON line):

    python -m bench data [--latency_ms=20] [--crops=128] [--levels=(1,4,16,64)]   our reader vs a plain zarr read
    python -m bench library [--stores=(100,1000)]                                  start-up and memory per rank

Speed is shown here, side by side in one run, never asserted in tests.
"""

import json
import math
import os
import sys
import time

import numpy as np

from infra.plan import table


# -----------------------------------------------------------------------------
# data: our reader (infra/reader.py: requests in flight on zarr's event loop, decompression in a pool, many crops at
# once) against a plain zarr slice read of the same crops one after another, (a) on a local store behind an
# emulated per-request latency, like S3's time to first byte, and (b) on a loopback S3 endpoint (moto); then a
# quickstart training run reading from that S3 endpoint, with its data-wait fraction.


def _latency_store(path, latency_s):
    import asyncio

    import zarr

    class LatencyStore(zarr.storage.WrapperStore):
        """A local store whose every get waits latency_s first (an S3 GET's time to first byte); zarr's LocalStore
        then reads the file in the event loop's default thread pool (which the reader leaves to it: decompression
        has a pool of its own, reader.ReadOptions.pool)."""

        async def get(self, key, prototype, byte_range=None):
            await asyncio.sleep(latency_s)
            return await self._store.get(key, prototype, byte_range)

    return LatencyStore(zarr.storage.LocalStore(path, read_only=True))


def _decode_ceiling(path, vol, seconds=1.0):
    """GB/s of decompressed float32 that numcodecs alone makes of the volume's stored chunks (read into memory
    first), decoded and copied into a crop by vol.opts.threads threads: the ceiling under any reader."""
    from concurrent.futures import ThreadPoolExecutor
    import zarr
    raws = [zarr.core.buffer.default_buffer_prototype().buffer.from_bytes(open(os.path.join(r, f), "rb").read())
            for r, _, fs in os.walk(os.path.join(path, vol.arr.path, "c")) for f in fs]
    whole = (slice(None),) * 3

    def work(_):
        from infra import reader
        crop = np.empty(vol.chunks, dtype=np.float32)
        for raw in raws:
            reader._place(vol.decode, raw, crop, whole, whole)
        return len(raws)

    with ThreadPoolExecutor(vol.opts.threads) as pool:
        list(pool.map(work, range(vol.opts.threads)))  # warm-up
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < seconds:
            n += sum(pool.map(work, range(vol.opts.threads)))
        dt = time.perf_counter() - t
    return n * math.prod(vol.chunks) * 4 / 1e9 / dt


def _time_reads(vol, crops, in_flight=None):
    """Seconds to read every crop. in_flight None: plain zarr, vol.arr[crop] one crop after another (zarr
    itself overlaps the chunk GETs inside one read). Otherwise our reader: every crop handed to
    reader.read_crops at once, their requests held to in_flight by vol's ReadOptions (as a micro batch is read)."""
    from infra import reader
    t = time.perf_counter()
    if in_flight is None:
        for o, c in crops:
            np.asarray(vol.arr[tuple(slice(a, a + n) for a, n in zip(o, c))])
    else:
        assert vol.opts.in_flight == in_flight
        reader.read_crops([(vol, o, c) for o, c in crops], normalize=False)
    return time.perf_counter() - t


def bench_data(argv):
    import subprocess
    import tempfile

    from infra import reader
    from infra import synthetic
    from bench.s3_loopback import MotoS3

    # rounds: each level reads at least rounds x in_flight chunks, so that the first round (all requests leave
    # together) and the last (decoding what came, nothing on the wire) are a small part of the time, as in a
    # run that reads for hours (128 crops at 64 in flight were 2 rounds: half the time was ramp and tail)
    opts = {"latency_ms": 20.0, "crops": 128, "shape": (128, 128, 512), "chunk": 64, "crop": 64, "steps": 60,
            "levels": (1, 4, 16, 64), "rounds": 16}
    import configurator
    from infra import cli
    configurator.apply(opts, argv)
    cli.positive(opts, zero_ok=("latency_ms",))
    lat = opts["latency_ms"] / 1000
    rows, out = [], {"bench": "data", "latency_ms": opts["latency_ms"], "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "vol.mdio")
        ch = opts["chunk"]
        synthetic.write_mdio(path, synthetic.synthetic_volume(opts["shape"], seed=1), chunks=(ch, ch, ch))
        chunk_bytes = ch ** 3 * 4
        c = opts["crop"]
        rng = np.random.default_rng(0)  # chunk-aligned crops: c^3 / ch^3 chunks each
        per_crop = math.prod(math.ceil(c / ch) for _ in range(3))
        n_most = max(opts["crops"], math.ceil(opts["rounds"] * max(opts["levels"]) / per_crop))
        all_crops = [(tuple(int(rng.integers(0, (s - c) // ch + 1)) * ch for s in opts["shape"]), (c, c, c))
                     for _ in range(n_most)]
        crops = all_crops[:opts["crops"]]

        def crops_for(n):  # at least `rounds` rounds of n requests
            return all_crops[:max(opts["crops"], math.ceil(opts["rounds"] * n / per_crop))]
        moto = MotoS3()
        try:
            url = moto.upload_dir(path, "bench", "vol.mdio")
            for where in ("local+latency", "loopback S3"):
                def vol(n):
                    o = reader.ReadOptions(in_flight=n, endpoint_url=moto.endpoint)
                    return (reader.Volume(path, o, store=_latency_store(path, lat)) if where == "local+latency"
                            else reader.Volume(url, o))
                _time_reads(vol(10), crops[:2])  # warm-up: event loop, connection pool
                t_zarr = _time_reads(vol(10), crops)
                gb = len(crops) * c ** 3 * 4 / 1e9
                rows.append([where, "plain zarr", "-", len(crops), f"{t_zarr:.3f}", f"{gb / t_zarr:.3f}", "-", "1.00x"])
                best = None
                for n in opts["levels"]:
                    cn = crops_for(n)
                    gb_n = len(cn) * c ** 3 * 4 / 1e9
                    v = vol(n)
                    _time_reads(v, cn[:2 * n], in_flight=n)  # (warm-up: this many connections)
                    t = min(_time_reads(v, cn, in_flight=n) for _ in range(2))  # the better of two (a noisy machine)
                    limit = n * chunk_bytes / lat / 1e9 if where == "local+latency" else None
                    frac = (gb_n / t) / limit if limit else None
                    rows.append([where, "ours", n, len(cn), f"{t:.3f}", f"{gb_n / t:.3f}",
                                 f"{limit:.3f} ({100 * frac:.0f}%)" if limit else "-", f"{(gb_n / t) / (gb / t_zarr):.2f}x"])
                    if best is None or gb_n / t > best[1]:
                        best = (n, gb_n / t, frac)
                    out[f"{'lat' if limit else 's3'}_ours_{n}_gbps"] = round(gb_n / t, 4)
                if where == "local+latency":
                    # the CPU's own ceiling: the same reads with no latency at all (decompression and copies),
                    # the best over the concurrency levels, each measured twice (this machine is noisy)
                    cpu_gbps, n_cpu = max((len(crops_for(n)) * c ** 3 * 4 / 1e9 / _time_reads(
                        reader.Volume(path, reader.ReadOptions(in_flight=n)), crops_for(n), in_flight=n), n)
                        for n in opts["levels"] for _ in range(2))
                    rows.append(["local, 0 ms", "ours", n_cpu, len(crops_for(n_cpu)), "-", f"{cpu_gbps:.3f}",
                                 "CPU ceiling", "-"])
                    out["cpu_ceiling_gbps"] = round(cpu_gbps, 4)
                    # and what numcodecs alone does with the same chunks' bytes in the reader's threads (decode
                    # and copy into a crop, no store, no event loop): how much the reader's machinery costs
                    dec = _decode_ceiling(path, vol(1))
                    rows.append(["memory", "numcodecs alone", "-", "-", "-", f"{dec:.3f}", "decode ceiling", "-"])
                    out["decode_ceiling_gbps"] = round(dec, 4)
                key = "lat" if where == "local+latency" else "s3"
                out[f"{key}_zarr_gbps"] = round(gb / t_zarr, 4)
                out[f"{key}_best_in_flight"] = best[0]
                if key == "lat":
                    out["speedup_vs_zarr"] = round(best[1] / (gb / t_zarr), 3)
                    out["frac_of_emulated_limit"] = round(best[2], 3)
                    # per concurrency level, of the emulated limit and of min(limit, CPU ceiling): on few cores
                    # decompression caps the top levels, and no reader can beat that
                    lim = {n: n * chunk_bytes / lat / 1e9 for n in opts["levels"]}
                    out["frac_of_emulated_limit_by_in_flight"] = {
                        str(n): round(out[f"lat_ours_{n}_gbps"] / lim[n], 3) for n in opts["levels"]}
                    out["frac_of_min_limit_cpu_by_in_flight"] = {
                        str(n): round(out[f"lat_ours_{n}_gbps"] / min(lim[n], cpu_gbps), 3) for n in opts["levels"]}
                else:
                    out["s3_speedup_vs_zarr"] = round(best[1] / (gb / t_zarr), 3)
            print(f"chunk-aligned crops of {c}^3 float32 ({per_crop} chunk(s) of {ch}^3 = {chunk_bytes / 2 ** 20:.0f} "
                  f"MiB each, Blosc zstd 5) from a {opts['shape']} volume; at least {opts['rounds']} rounds of requests "
                  f"per level; emulated latency {opts['latency_ms']:.0f} ms per request; limit = in flight x chunk "
                  f"bytes / latency; {reader.ReadOptions().threads} decode threads")
            table(rows, ["store", "reader", "in flight", "crops", "seconds", "GB/s", "emulated limit GB/s", "vs zarr"])
            # the quickstart, reading from the loopback S3 endpoint on 2 ranks
            qs = os.path.join(d, "qs.mdio")
            synthetic.write_mdio(qs, synthetic.synthetic_volume((128, 128, 256), seed=0), chunks=(32, 32, 128))  # as quickstart
            qs_url = moto.upload_dir(qs, "bench", "quickstart.mdio")
            run_dir = os.path.join(d, "run")
            env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
            here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                os.path.join(here, "train.py"), os.path.join(here, "config/quickstart.py"),
                                f"--data_paths=['{qs_url}']", f"--s3_endpoint={moto.endpoint}", f"--out_dir={run_dir}",
                                f"--max_steps={opts['steps']}", "--make_synthetic=False", "--log_interval=20"],
                               env=env, capture_output=True, text=True, cwd=here)
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                raise SystemExit("quickstart from S3 failed")
            with open(os.path.join(run_dir, "log.jsonl")) as f:  # the training records, after warm-up
                log = [x for x in map(json.loads, f) if "loss" in x][5:]
            wait = sum(x["wait_s"] for x in log) / sum(x["step_s"] for x in log)
            print(f"\nquickstart, 2 CPU ranks, data from the loopback S3 endpoint, steps 5..{opts['steps'] - 1}:")
            for line in r.stdout.splitlines():
                if line.startswith("step"):
                    print("  " + line)
            print(f"  data wait {100 * wait:.2f}% of step time")
            out["data_wait_frac"] = round(wait, 4)
        finally:
            moto.stop()
    print()
    out.update({k: v for k, v in bench_library([]).items() if k != "bench"})  # start-up and memory vs library size
    return out


def _library_worker(argv):
    """One rank's start-up over a library (bench_library), in a process of its own so that its memory is its own:
    argv = [manifest or url-list file, how ("manifest" | "list"), latency_s, in_flight]. Prints one JSON line."""
    from infra import library
    import data
    from infra import reader
    src, how, lat, in_flight = argv[0], argv[1], float(argv[2]), int(argv[3])
    real = reader.open_node

    def open_node(url, opts, store=None):  # every request of a local store waits `lat` first, as an S3 GET would
        return real(url, opts, store if store is not None or "://" in url else _latency_store(url, lat))
    reader.open_node = open_node
    rss = lambda: int(next(x for x in open("/proc/self/status") if x.startswith("VmRSS")).split()[1]) / 1024  # noqa
    base = rss()
    opts = reader.ReadOptions(in_flight=in_flight)
    t = time.perf_counter()
    if how == "manifest":
        time.sleep(lat)  # the manifest itself: one GET
        stores = library.expand(["@" + src], opts)
    elif how == "list-index":  # the list today: rank 0 indexes it, many stores opened at once
        stores = library.index(json.load(open(src)), opts, in_flight=in_flight)
    else:  # the list before manifests: every rank opened every store, one after another
        stores = json.load(open(src))
    sampler = data.Sampler(stores, (16, 16, 32), micro_batch=8, weighting="volume", opts=opts)
    startup = time.perf_counter() - t
    for step in range(16):  # 128 samples: up to 64 stores opened and kept (max_open_stores)
        sampler.batch(step)
    sampler.close()
    print(json.dumps({"startup_s": round(startup, 3), "rss_mib": round(rss() - base, 1), "open": len(sampler._open)}))


def bench_library(argv):
    """Start-up and memory per rank against the number of stores (infra/library.py): N small MDIO stores (32 x 32 x 64) on
    local disk behind an emulated latency per request (20 ms: an S3 GET's time to first byte; opening a store takes
    13 requests). Start-up: until the rank's sampler exists. Three ways: a manifest (one file read; stores opened
    when a sample needs them), the list as train.py treats it now (rank 0 indexes it, in_flight stores at a time,
    and hands the records on), and the list as every rank opened it before (serially: only up to --old stores, it
    grows by 13 x 20 ms per store). Memory: the rank's resident growth after start-up and 128 samples."""
    import subprocess
    import tempfile

    from infra import library
    from infra import synthetic
    opts = {"latency_ms": 20.0, "stores": (100, 1000), "in_flight": 32, "old": 100}
    import configurator
    from infra import cli
    configurator.apply(opts, argv)
    cli.positive(opts, zero_ok=("latency_ms", "old"))
    lat = opts["latency_ms"] / 1000
    out, rows = {"bench": "library", "latency_ms": opts["latency_ms"]}, []
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as d:
        vols = [synthetic.synthetic_volume((32, 32, 64), seed=i) for i in range(8)]
        urls = []
        for i in range(max(opts["stores"])):
            urls.append(synthetic.write_mdio(os.path.join(d, f"s{i:05d}.mdio"), vols[i % 8], chunks=(32, 32, 64)))
        for n in opts["stores"]:
            manifest, listing = os.path.join(d, f"index_{n}.jsonl"), os.path.join(d, f"list_{n}.json")
            library.index(urls[:n], out=manifest, in_flight=32)  # made once, beforehand (no latency)
            json.dump(urls[:n], open(listing, "w"))
            for how, src in (("manifest", manifest), ("list-index", listing), ("list-serial", listing)):
                if how == "list-serial" and n > opts["old"]:
                    continue
                r = subprocess.run([sys.executable, "-m", "bench.data", "_library_worker", src, how,
                                    str(lat), str(opts["in_flight"])], capture_output=True, text=True, cwd=here,
                                   env=dict(os.environ, OMP_NUM_THREADS="1"))
                if r.returncode != 0:
                    raise SystemExit(f"library worker failed: {r.stderr[-2000:]}")
                res = json.loads(r.stdout.strip().splitlines()[-1])
                rows.append([n, how, f"{res['startup_s']:.2f}", f"{res['rss_mib']:.0f}", res["open"]])
                key = {"manifest": "manifest", "list-index": "list", "list-serial": "list_serial"}[how]
                out[f"startup_s_{key}_{n}"] = res["startup_s"]
                if how == "manifest":
                    out[f"rss_mib_{n}"] = res["rss_mib"]
    print(f"start-up per rank over a library of small stores, {opts['latency_ms']:.0f} ms per request emulated; "
          f"list-index: rank 0 indexes {opts['in_flight']} stores at a time (the other ranks wait for it); memory: "
          f"resident growth after start-up and 128 samples (at most 64 stores open)")
    table(rows, ["stores", "start-up", "seconds", "RSS MiB", "open after"])
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["_library_worker"]:  # one rank's start-up of bench_library, in a process of its own
        _library_worker(sys.argv[2:])
