"""data.py against a real S3 HTTP endpoint on loopback (moto), with and without injected faults."""
import json
import time

import numpy as np
import pytest
import zarr

import data
from infra import reader
from conftest import read_log, run_train, small_args, job_env
from bench.s3_loopback import FaultProxy


CROPS = [((0, 0, 0), (32, 32, 64)), ((3, 5, 7), (20, 17, 40)), ((16, 0, 48), (16, 32, 16))]


@pytest.mark.parametrize("in_flight", [1, 8])
def test_s3_reads_equal_local_reads(s3, small_store, in_flight):
    local = reader.Volume(small_store)
    remote = reader.Volume(s3.url, reader.ReadOptions(in_flight=in_flight, endpoint_url=s3.endpoint))
    assert remote.shape == local.shape and (remote.mean, remote.std) == (local.mean, local.std)
    assert np.array_equal(remote.trace_mask, local.trace_mask)
    for origin, shape in CROPS:
        a = remote.read(origin, shape, normalize=False)
        b = local.read(origin, shape, normalize=False)
        assert np.array_equal(a, b, equal_nan=True)
        assert np.array_equal(remote.read(origin, shape), local.read(origin, shape))
    # side by side, as a micro batch is read: the same crops
    for a, (origin, shape) in zip(reader.read_crops([(remote, o, s) for o, s in CROPS]), CROPS):
        assert np.array_equal(a, local.read(origin, shape))


def test_faults_are_retried_and_reads_stay_exact(s3, small_store):
    proxy = FaultProxy(s3.port, fail=0.3, delay_s=1.0, seed=1)
    try:
        remote = reader.Volume(s3.url, reader.ReadOptions(in_flight=8, endpoint_url=proxy.endpoint, timeout_s=0.5,
                                                      retries=8))
        local = reader.Volume(small_store)
        for origin, shape in CROPS:
            assert np.array_equal(remote.read(origin, shape, normalize=False),
                                  local.read(origin, shape, normalize=False), equal_nan=True)
        got = reader.read_crops([(remote, o, s) for o, s in CROPS * 2], normalize=False)  # 8 in flight at a time
        for a, (origin, shape) in zip(got, CROPS * 2):
            assert np.array_equal(a, local.read(origin, shape, normalize=False), equal_nan=True)
        assert proxy.stats["503"] > 0 and proxy.stats["drop"] > 0 and proxy.stats["delay"] > 0, proxy.stats
    finally:
        proxy.stop()


def test_requests_in_flight_reach_the_limit_and_never_pass_it(small_store):
    """ReadOptions.in_flight is the number of GETs on the wire at once, over every crop being read side by side:
    counted at the store under the reader (each GET held 10 ms, as behind latency)."""
    import asyncio

    import zarr

    class Counting(zarr.storage.WrapperStore):
        now = top = 0

        async def get(self, key, prototype, byte_range=None):
            Counting.now += 1
            Counting.top = max(Counting.top, Counting.now)
            try:
                await asyncio.sleep(0.01)
                return await self._store.get(key, prototype, byte_range)
            finally:
                Counting.now -= 1

    for n in (1, 3, 8):
        Counting.top = 0
        vol = reader.Volume(small_store, reader.ReadOptions(in_flight=n),
                          store=Counting(zarr.storage.LocalStore(small_store, read_only=True)))
        crops = [((0, 0, 0), (32, 32, 64)), ((16, 0, 48), (16, 32, 16)), ((3, 5, 7), (20, 17, 40))]  # 16, 2, 12 chunks
        got = reader.read_crops([(vol, o, s) for o, s in crops], normalize=False)
        assert Counting.top == n, (n, Counting.top)
        for a, (o, s) in zip(got, crops):
            assert np.array_equal(a, reader.Volume(small_store).read(o, s, normalize=False), equal_nan=True)


def test_a_chunk_that_keeps_failing_is_an_error_naming_its_key(s3):
    proxy = FaultProxy(s3.port, fail=0.0)
    try:
        vol = reader.Volume(s3.url, reader.ReadOptions(in_flight=2, endpoint_url=proxy.endpoint, retries=2, timeout_s=0.5,
                                                   backoff_s=0.01))
        proxy.fail, proxy.kinds, proxy.delay_s = 1.0, ("delay",), 2.0  # every request now hangs: timeouts
        t = time.time()
        with pytest.raises(data.DataError, match=r"chunk 'amplitude/c/0/0/0' of 's3://bkt/small.mdio': the endpoint "
                                                 rf"{proxy.endpoint} did not answer in 3 tries of read_timeout_s=0.5 s"):
            vol.read((0, 0, 0), (4, 4, 4))
        assert time.time() - t < 20  # bounded: 3 attempts x 0.5 s timeout + backoff
    finally:
        proxy.stop()


def test_corrupt_chunk_names_its_key(s3, small_store):
    url = s3.upload_dir(small_store, "bkt", "corrupt.mdio")
    s3.client().put_object(Bucket="bkt", Key="corrupt.mdio/amplitude/c/1/0/2", Body=b"\x02\x01garbage" * 10)
    vol = reader.Volume(url, reader.ReadOptions(endpoint_url=s3.endpoint, retries=1, backoff_s=0.01))
    vol.read((0, 0, 0), (16, 16, 16))  # other chunks are fine
    with pytest.raises(data.DataError, match=r"chunk 'amplitude/c/1/0/2' of 's3://bkt/corrupt.mdio'"):
        vol.read((16, 0, 32), (16, 16, 16))


def test_missing_chunk_is_the_fill_value_not_an_error(s3, small_store):
    url = s3.upload_dir(small_store, "bkt", "holey.mdio")
    s3.client().delete_object(Bucket="bkt", Key="holey.mdio/amplitude/c/0/1/1")
    vol = reader.Volume(url, reader.ReadOptions(endpoint_url=s3.endpoint))
    raw = vol.read((0, 16, 16), (16, 16, 16), normalize=False)
    assert np.isnan(raw).all()  # MDIO's fill value: a dead region
    assert (vol.read((0, 16, 16), (16, 16, 16)) == 0).all()


def test_bad_s3_input_is_a_clear_error(s3, tmp_path):
    opts = reader.ReadOptions(endpoint_url=s3.endpoint)
    with pytest.raises(data.DataError, match="bucket of 's3://no-such-bucket/x.mdio' does not exist"):
        reader.Volume("s3://no-such-bucket/x.mdio", opts)
    with pytest.raises(data.DataError, match="no Zarr store at 's3://bkt/missing.mdio'"):
        reader.Volume("s3://bkt/missing.mdio", opts)
    proxy = FaultProxy(s3.port, forbid=True)
    try:
        with pytest.raises(data.DataError, match="access denied"):
            reader.Volume(s3.url, reader.ReadOptions(endpoint_url=proxy.endpoint, retries=0))
    finally:
        proxy.stop()
    # a store without the variable, and a 2D store
    g = zarr.open_group(str(tmp_path / "novar.zarr"), mode="w")
    g.create_array("seismic", shape=(8, 8, 8), dtype="float32")
    g2 = zarr.open_group(str(tmp_path / "twod.zarr"), mode="w")
    g2.attrs["attributes"] = {"defaultVariableName": "amplitude"}
    g2.create_array("amplitude", shape=(8, 8), dtype="float32")
    for name in ("novar.zarr", "twod.zarr"):
        s3.upload_dir(str(tmp_path / name), "bkt", name)
    with pytest.raises(data.DataError, match="has no variable 'amplitude'"):
        reader.Volume("s3://bkt/novar.zarr", opts)
    with pytest.raises(data.DataError, match="2D array of shape"):
        reader.Volume("s3://bkt/twod.zarr", opts)
    with pytest.raises(data.DataError, match="larger than the volume"):
        data.Sampler([s3.url], (16, 16, 128), opts=opts)


def test_make_synthetic_never_writes_to_a_remote_path(s3, tmp_path):
    """make_synthetic=True (config/quickstart.py) with an s3:// data path that holds no store: one error line naming
    the path and the fix, exit code 2, and nothing written to any bucket (it used to write the synthetic volume to
    the URL, through AWS's default endpoint whatever s3_endpoint said). The check goes to the run's endpoint: through
    any other, the store could not be found missing, and the line would be another."""
    before = s3.objects()
    r = run_train(["config/quickstart.py", "--data_paths=['s3://bkt/missing.mdio']", f"--s3_endpoint={s3.endpoint}",
                   f"--out_dir={tmp_path / 'out'}"])
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("error: data path 's3://bkt/missing.mdio' holds no store"), \
        r.stderr[-3000:]
    assert "only to a local path" in last and "make_synthetic=False" in last
    # the same function, in this process: a bucket that does not exist is no place to write either
    from configurator import ConfigError
    from infra import synthetic
    with pytest.raises(ConfigError, match="'s3://no-such-bucket/x.mdio' holds no store"):
        synthetic.ensure_synthetic("s3://no-such-bucket/x.mdio", (16, 16, 32),
                                   opts=reader.ReadOptions(endpoint_url=s3.endpoint))
    assert s3.objects() == before
    # file:// is a local path: the store is written there
    synthetic.ensure_synthetic(f"file://{tmp_path / 'local.mdio'}", (16, 16, 32), chunks=(16, 16, 32))
    assert reader.Volume(str(tmp_path / "local.mdio")).shape == (16, 16, 32)


@pytest.mark.slow
def test_make_synthetic_with_a_remote_store_there_trains_on_it_and_writes_nothing(s3, tmp_path):
    """make_synthetic=True (config/quickstart.py) and an s3:// store that exists: it is the data, as it is; the run
    trains and the buckets are unchanged."""
    before = s3.objects()
    out = tmp_path / "out"
    r = run_train(["config/quickstart.py", *small_args(s3.url, out, s3_endpoint=s3.endpoint, max_steps=2)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in read_log(out)] == [0, 1]
    with open(out / "ckpt" / "step_0000002" / "COMPLETE") as f:
        assert json.load(f)["config"]["make_synthetic"] is True  # (the quickstart's, not overridden)
    assert s3.objects() == before


def test_aligned_crops_and_live_fraction(small_store):
    s = data.Sampler([small_store], (16, 16, 32), align=True, min_live=1.0)  # chunks (16, 16, 16)
    vol = s.volume(0)
    for g in range(50):
        _, origin = s.locate(g)
        assert all(o % c == 0 for o, c in zip(origin, vol.chunks))  # crop >= chunk: on boundaries
        assert vol.live_fraction(origin, s.crop) == 1.0  # the dead corner is never picked
    s2 = data.Sampler([small_store], (8, 5, 16), align=True)  # crop < chunk: inside one chunk
    seen = set()
    for g in range(200):
        _, o = s2.locate(g)
        assert all(a // ch == (a + c - 1) // ch for a, c, ch in zip(o, s2.crop, vol.chunks))
        seen.add(o)
    assert len(seen) > 100  # and still many different crops
    with pytest.raises(data.DataError, match="live-trace fraction"):
        data.Sampler([small_store], (48, 32, 32), min_live=1.0).locate(0)


@pytest.mark.slow
def test_training_through_faulty_s3_equals_fault_free(s3, small_store, tmp_path):
    """20 steps reading from S3 through a proxy that fails 10 % of requests complete, and every sample is
    the fault-free run's, bit for bit (Sampler level), so the losses are identical too (validation only at the
    start and the end: its reads go through the faulty proxy as well, and its 1 s delays add up)."""
    proxy = FaultProxy(s3.port, fail=0.1, delay_s=1.0, seed=2)
    try:
        env = job_env()
        args = dict(max_steps=20, log_interval=10, read_timeout_s=0.5, eval_interval=1000)
        clean = run_train(small_args(s3.url, tmp_path / "clean", s3_endpoint=s3.endpoint, **args), env=env)
        assert clean.returncode == 0, clean.stderr[-3000:]
        faulty = run_train(small_args(s3.url, tmp_path / "faulty", s3_endpoint=proxy.endpoint, **args), env=env)
        assert faulty.returncode == 0, faulty.stderr[-3000:]
        assert proxy.stats["503"] + proxy.stats["drop"] + proxy.stats["delay"] > 10, proxy.stats
        assert [r["loss"] for r in read_log(tmp_path / "clean")] == [r["loss"] for r in read_log(tmp_path / "faulty")]
        # and sample by sample, through the proxy against the local store
        a = data.Sampler([s3.url], (16, 16, 32), micro_batch=2,
                         opts=reader.ReadOptions(in_flight=8, endpoint_url=proxy.endpoint, timeout_s=0.5))
        b = data.Sampler([small_store], (16, 16, 32), micro_batch=2)
        for step in range(20):
            assert np.array_equal(a.batch(step)[0].numpy(), b.batch(step)[0].numpy())
        a.close()
        b.close()
    finally:
        proxy.stop()


def test_throttled_s3_gives_the_batches_of_fault_free_s3(s3, capfd, monkeypatch):
    """A proxy answers 40 % of GETs 503 SlowDown or 429 Too Many Requests: the sampler's batches are those read from
    the fault-free endpoint, bit for bit, with read_retries=0 (a fault would be an error at once: throttling answers
    use up none of the retries). Each answer is counted once (the reader's count is the proxy's: no second retry
    layer underneath), and said in a line at the store's 1st, 10th, 100th answer, not one per request."""
    from infra import throttle
    monkeypatch.setattr(throttle, "COUNT", __import__("collections").Counter())
    proxy = FaultProxy(s3.port, fail=0.4, kinds=("503", "429"), seed=3)
    try:
        opts = reader.ReadOptions(in_flight=8, endpoint_url=proxy.endpoint, retries=0, backoff_s=0.002)
        a = data.Sampler([s3.url], (16, 16, 32), micro_batch=2, opts=opts)
        b = data.Sampler([s3.url], (16, 16, 32), micro_batch=2, opts=reader.ReadOptions(endpoint_url=s3.endpoint))
        for step in range(5):
            assert np.array_equal(a.batch(step)[0].numpy(), b.batch(step)[0].numpy())
        a.close()
        b.close()
        assert proxy.stats["503"] > 10 and proxy.stats["429"] > 10, proxy.stats
        assert sum(throttle.COUNT.values()) == proxy.stats["503"] + proxy.stats["429"], (throttle.COUNT, proxy.stats)
        lines = [x for x in capfd.readouterr().err.splitlines() if "throttled (" in x]
        for store, n in throttle.COUNT.items():
            said = [x for x in lines if x.startswith(f"WARNING: {store} at {proxy.endpoint}")]
            assert len(said) == len(str(n)), (store, n, said)  # at 1, 10, 100, ... answers
    finally:
        proxy.stop()


def test_throttling_is_known_by_its_answer_and_its_patience_ends_in_a_clear_error(s3, monkeypatch):
    """throttle.answer knows botocore's throttling codes and HTTP 429 / 503, as s3fs raises them (an OSError whose
    cause is the ClientError), and nothing else; a request throttled for longer than throttle.PATIENCE_S stops with
    a DataError that names the chunk, the answer and what lowers the request rate."""
    from botocore.exceptions import ClientError

    from infra import throttle

    def boto(code, status):
        return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                           "GetObject")
    for code, status in (("SlowDown", 503), ("Throttling", 400), ("ThrottlingException", 400),
                         ("RequestLimitExceeded", 503), ("TooManyRequests", 429)):
        err = OSError(16, "Please reduce your request rate.")
        err.__cause__ = boto(code, status)
        assert throttle.answer(err) == f"{code} (HTTP {status})"
    assert throttle.answer(boto("InternalError", 500)) is None and throttle.answer(TimeoutError()) is None
    assert throttle.answer(OSError("reset")) is None
    monkeypatch.setattr(throttle, "PATIENCE_S", 0.3)
    proxy = FaultProxy(s3.port, fail=0.0, kinds=("503",))
    try:
        vol = reader.Volume(s3.url, reader.ReadOptions(endpoint_url=proxy.endpoint, backoff_s=0.01))
        proxy.fail = 1.0
        with pytest.raises(data.DataError, match=r"chunk 'amplitude/c/0/0/0' of 's3://bkt/small.mdio': throttled for "
                                                 r"\d+ s without a break \(SlowDown \(HTTP 503\), .*S3 documents 5,500 "
                                                 r"GET/s per partitioned prefix.*larger chunks, align_crops=True"):
            vol.read((0, 0, 0), (4, 4, 4))
    finally:
        proxy.stop()


def test_the_planners_s3_requests_by_hand():
    """GETs per sample, and per second per node and per store prefix, against a hand count: one GET per chunk the
    crop touches (data.Sampler's draws), each cp rank its own slab's; the formula for unaligned crops against every
    origin counted out."""
    import itertools
    import math

    import configurator
    from infra import plan
    from conftest import ROOT

    def cfg(name, *over):
        c = configurator.defaults()
        configurator.apply(c, [f"{ROOT}/config/{name}.py", *over])
        return c
    # base_102k: 640 x 640 x 1024 in 128^3 chunks: 5 x 5 x 8 = 200 aligned; unaligned each axis of n touches
    # 1 + (n - 1) / 128 on average, i.e. 6 chunks but once in 128 origins 5, and 9 but once in 128 origins 8
    for align, gets in ((True, 200), (False, (5 + 127 / 128) ** 2 * (8 + 127 / 128))):
        p = plan.plan(cfg("base_102k", f"--align_crops={align}", "--data_paths=['s3://a/x.mdio','s3://b/y.mdio']"), 128)
        assert math.isclose(p["s3_gets_per_sample"], gets)
        assert math.isclose(p["s3_gets_per_s_per_node"], p["samples_per_s"] / 16 * gets)
        assert p["s3_prefixes"] == 2 and math.isclose(p["s3_gets_per_s_per_prefix"], p["samples_per_s"] * gets / 2)
        assert p["s3_prefixes_needed"] == math.ceil(p["samples_per_s"] * gets / plan.S3_GET_PER_PREFIX)
    # big_context, cp 8: slabs of 192 inlines; in 128^3 each touches 2 chunks (a chunk shared by two slabs is read by
    # both ranks): 16 x 12 x 16; in 256^3 the slabs touch 1, 2, 2, 1, 1, 2, 2, 1: 12 x 6 x 8
    assert plan.plan(cfg("big_context", "--align_crops=True"), 128)["s3_gets_per_sample"] == 16 * 12 * 16
    p = plan.plan(cfg("big_context", "--align_crops=True", "--store_chunks=(256,256,256)"), 128)
    assert p["s3_gets_per_sample"] == 12 * 6 * 8 and p["s3_chunks"] == [256, 256, 256]
    # fine-tuning reads the labels' chunks too; a glob's stores are not counted; the quickstart's own store
    assert plan.plan(cfg("base_102k", "--align_crops=True", "--task=segment"), 128)["s3_gets_per_sample"] == 400
    assert plan.plan(cfg("base_102k", "--data_paths=['s3://a/*.mdio']"), 128)["s3_prefixes"] is None
    assert plan.plan(cfg("quickstart"), 8)["s3_gets_per_sample"] == 1  # 16 x 16 x 64 inside one 32 x 32 x 128 chunk
    # the unaligned formula, against every origin modulo the chunks (with cp slabs)
    crop, chunks, cp = (12, 7, 5), (8, 4, 4), 2
    counts = [math.prod([sum((o + r * 6 + 5) // 8 - (o + r * 6) // 8 + 1 for r in range(cp)),
                         (o1 + 6) // 4 - o1 // 4 + 1, (o2 + 4) // 4 - o2 // 4 + 1])
              for o, o1, o2 in itertools.product(range(8), range(4), range(4))]
    assert math.isclose(plan.chunk_gets(crop, chunks, cp), sum(counts) / len(counts))


def test_the_dry_run_warns_of_a_request_rate_over_s3s_and_names_the_fixes(tmp_path, capsys):
    """base_102k on S3 (unaligned crops, 128^3 chunks, one store): over the rate S3 documents per prefix, the dry run
    says so and names each fix with the rate it gives; aligned crops in 128 x 128 x 512 chunks are under it, and
    no warning is printed."""
    import configurator
    from infra import dryrun, plan
    from conftest import ROOT
    cfg = configurator.defaults()
    configurator.apply(cfg, [f"{ROOT}/config/base_102k.py", "--data_paths=['s3://bkt/survey.mdio']",
                             f"--out_dir={tmp_path / 'out'}"])
    dryrun.check_launch(cfg)
    out = capsys.readouterr().out
    p = plan.plan(cfg, 128)
    assert p["s3_gets_per_s_per_prefix"] > plan.S3_GET_PER_PREFIX
    assert f"~{p['s3_gets_per_s_per_node']:,.0f} GET/s per node" in out
    assert (f"warning: S3 request rate: ~{p['s3_gets_per_s_per_prefix']:,.0f} GET/s on each store's prefix is "
            f"{p['s3_gets_per_s_per_prefix'] / 5500:.1f} x the 5,500 S3 documents") in out, out
    for fix in ("align_crops=True: crops on chunk boundaries", "larger chunks: stores written in chunks of 128 x 128 x "
                "512", "more stores, each on a prefix of its own", "fewer in_flight does not lower the rate"):
        assert fix in out, (fix, out)
    configurator.apply(cfg, ["--align_crops=True", "--store_chunks=(128,128,512)"])
    dryrun.check_launch(cfg)
    out = capsys.readouterr().out
    assert "S3 requests: 50.0 GETs per sample (chunks of 128 x 128 x 512 touched, aligned)" in out and \
        "warning: S3" not in out, out


def test_anonymous_access_public_vs_private(s3, small_store):
    """s3_anon=True sends unsigned requests: a public-read store opens, a private one is 'access denied'."""
    import os
    c = s3.client()
    c.create_bucket(Bucket="public", ACL="public-read")
    for root, _, files in os.walk(small_store):
        for f in files:
            p = os.path.join(root, f)
            c.upload_file(p, "public", "small.mdio/" + os.path.relpath(p, small_store), ExtraArgs={"ACL": "public-read"})
    anon = reader.ReadOptions(anon=True, endpoint_url=s3.endpoint)
    pub = reader.Volume("s3://public/small.mdio", anon)
    assert np.array_equal(pub.read((0, 0, 0), (8, 8, 8)), reader.Volume(small_store).read((0, 0, 0), (8, 8, 8)))
    with pytest.raises(data.DataError, match="access denied"):
        reader.Volume(s3.url, anon)


@pytest.mark.slow
def test_embed_reads_a_survey_from_s3_and_writes_its_features_there(s3, small_store, strategy_runs, tmp_path):
    """scripts/embed.py with s3:// in and out (2 dp ranks, stopped after 3 windows each and restarted: the markers are S3
    objects, listed once) gives the features of a local run, and the store opens with plain zarr over S3."""
    import zarr
    from test_embed import run_embed
    model = str(strategy_runs["zero2"][0])
    local = str(tmp_path / "local.zarr")
    assert run_embed([model, small_store, f"--out={local}", "--dtype=float32"]).returncode == 0
    remote = "s3://bkt/features.zarr"
    args = [model, s3.url, f"--out={remote}", "--dtype=float32", f"--s3_endpoint={s3.endpoint}",
            f"--picture={tmp_path / 'pca.png'}"]
    r = run_embed(args + ["--stop_after=3"], nproc=2)
    assert r.returncode != 0 and r.stdout.count("stopped after 3 windows") == 2, r.stderr[-3000:]  # (torchrun: 75 -> 1)
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket="bkt", Prefix="features.zarr/embed_done/")["Contents"]]
    assert len(keys) == 6, keys  # 3 windows on each of the two ranks
    r = run_embed(args, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    g = zarr.open_group(remote, mode="r", storage_options={"client_kwargs": {"endpoint_url": s3.endpoint}})
    ref = zarr.open_group(local, mode="r")
    assert g["features"].metadata.dimension_names == ("inline", "crossline", "time", "feature")
    assert np.abs(np.asarray(g["features"][:]) - np.asarray(ref["features"][:])).max() <= 1e-4
    assert np.array_equal(g["inline"][:], ref["inline"][:]) and np.array_equal(g["time"][:], ref["time"][:])
    assert (tmp_path / "pca.png").stat().st_size > 10_000
