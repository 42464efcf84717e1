"""infra/library.py and data.Sampler over a library of stores: globs and manifests give the same batches as the explicit
list, the index goes on after a crash, draws follow the weights (chi-square), stores are opened only when needed
and a bounded number kept open, a store gone since it was indexed fails at its first read, naming it; bad patterns
and manifest lines are clear errors; a run trains from a manifest with its held-out split; and on loopback S3."""
import json
import shutil

import numpy as np
import pytest
import torch

import configurator
import data
from infra import reader
from infra import library
from infra import synthetic
from conftest import read_log, read_val, run_train, small_args
from bench.s3_loopback import MotoS3

SHAPES = {"a.mdio": (48, 32, 64), "b.mdio": (32, 32, 64), "c.mdio": (64, 48, 64)}  # three surveys of different size


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """Three small MDIO stores (each with a dead corner, synthetic's) in one folder."""
    root = tmp_path_factory.mktemp("library")
    for i, (name, shape) in enumerate(SHAPES.items()):
        synthetic.write_mdio(str(root / name), synthetic.synthetic_volume(shape, seed=10 + i), chunks=(16, 16, 16))
    return root


def batches(sampler, steps=3):
    return [sampler.batch(s) for s in range(steps)]


def same(a, b):
    return all(torch.equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(a, b))


def test_glob_manifest_and_list_give_identical_batches(lib, tmp_path):
    urls = [str(lib / n) for n in sorted(SHAPES)]
    manifest = str(tmp_path / "index.jsonl")
    records = library.index([str(lib / "*.mdio")], out=manifest)
    assert [r["url"] for r in records] == urls
    lines = [json.loads(x) for x in open(manifest)]
    assert [tuple(r["shape"]) for r in lines] == [SHAPES[n] for n in sorted(SHAPES)]
    assert all(0.9 < r["live_fraction"] < 1.0 and r["format"] == "mdio_v1" for r in lines)  # the dead corner
    kw = dict(crop=(16, 16, 32), seed=5, micro_batch=4, weighting="volume", min_live=0.5)
    by_list = data.Sampler(urls, **kw)
    by_manifest = data.Sampler(library.expand(["@" + manifest]), **kw)
    by_glob = data.Sampler(library.index([str(lib / "*.mdio")]), **kw)
    assert not by_manifest._open  # a manifest opens nothing at start-up
    ref = batches(by_list)
    assert same(ref, batches(by_manifest)) and same(ref, batches(by_glob))
    assert {by_list.locate(g)[0] for g in range(40)} == {0, 1, 2}  # every store is drawn


def test_index_goes_on_where_it_stopped(lib, tmp_path):
    """A manifest cut short (a crash after two stores, and half of a third line): the index opens only the third."""
    manifest = tmp_path / "index.jsonl"
    library.index([str(lib / "*.mdio")], out=str(manifest))
    full = manifest.read_text().splitlines()
    manifest.write_text("\n".join(full[:2]) + "\n" + full[2][:40])
    seen = []
    records = library.index([str(lib / "*.mdio")], out=str(manifest), log=seen.append)
    assert len(seen) == 1 and str(lib / "c.mdio") in seen[0], seen
    assert sorted(manifest.read_text().splitlines()) == sorted(full)
    assert [r["url"] for r in records] == [json.loads(x)["url"] for x in full]
    # marking a store already indexed: its line changes, nothing is opened (the manifest's other lines kept: add)
    seen.clear()
    with pytest.raises(configurator.ConfigError, match="is a manifest of 2 other store"):
        library.index([str(lib / "c.mdio")], out=str(manifest), extra={"split": "val"}, log=seen.append)
    library.index([str(lib / "c.mdio")], out=str(manifest), extra={"split": "val"}, log=seen.append, add=True)
    lines = {json.loads(x)["url"]: json.loads(x) for x in manifest.read_text().splitlines()}
    assert not seen and lines[str(lib / "c.mdio")]["split"] == "val" and "split" not in lines[str(lib / "a.mdio")]


def chi_square(counts, weights):
    n, w = sum(counts), np.asarray(weights, dtype=float) / sum(weights)
    return float((((np.asarray(counts) - n * w) ** 2) / (n * w)).sum())


@pytest.mark.parametrize("weighting", ["volume", "uniform", "manifest"])
def test_draws_follow_the_weights(weighting):
    """20,000 draws over three stores, counted per store, against the weights: a chi-square statistic under 13.8
    (2 degrees of freedom: exceeded by chance with probability 0.001). Records only: nothing is opened."""
    recs = [{"url": f"/nowhere/{i}.mdio", "format": "mdio_v1", "shape": list(s), "chunks": [16, 16, 16],
             "dtype": "float32", "mean": 0.0, "std": 1.0, "live_fraction": lf, "bytes": 0, "weight": wt}
            for i, (s, lf, wt) in enumerate((((48, 32, 64), 1.0, 1.0), ((32, 32, 64), 0.5, 3.0),
                                             ((128, 96, 64), 0.9, 0.5)))]
    s = data.Sampler(recs, (16, 16, 32), seed=1, weighting=weighting)
    counts = np.bincount([s.locate(g)[0] for g in range(20_000)], minlength=3)
    want = {"volume": [1.0 * 48 * 32 * 64, 0.5 * 32 * 32 * 64, 0.9 * 128 * 96 * 64], "uniform": [1, 1, 1],
            "manifest": [1.0, 3.0, 0.5]}[weighting]
    assert chi_square(counts, want) < 13.8, (weighting, counts, want)
    other = {"volume": "uniform", "uniform": "volume", "manifest": "volume"}[weighting]  # the test can fail
    want_other = {"volume": [1.0 * 48 * 32 * 64, 0.5 * 32 * 32 * 64, 0.9 * 128 * 96 * 64], "uniform": [1, 1, 1]}
    assert chi_square(counts, want_other[other]) > 100, (counts, other)
    assert not s._open


def test_stores_open_when_needed_and_a_bounded_number_stay_open(lib, tmp_path):
    records = library.index([str(lib / "*.mdio")])
    s = data.Sampler(records, (16, 16, 32), seed=2, micro_batch=4, max_open=2)
    for step in range(8):
        s.batch(step)
        assert len(s._open) <= 2
    assert s.bytes_read() == 8 * 4 * 16 * 16 * 32 * 4


def test_a_store_gone_since_it_was_indexed_fails_at_its_first_read_naming_it(lib, tmp_path):
    for n in SHAPES:
        shutil.copytree(lib / n, tmp_path / n)
    records = library.index([str(tmp_path / "*.mdio")])
    shutil.rmtree(tmp_path / "b.mdio")
    s = data.Sampler(records, (16, 16, 32), seed=2, micro_batch=4, weighting="uniform")  # starts: opens nothing
    with pytest.raises(data.DataError, match=f"data path '{tmp_path / 'b.mdio'}' does not exist"):
        for step in range(20):
            s.batch(step)
    # a store that changed shape since is named too
    synthetic.write_mdio(str(tmp_path / "b.mdio"), synthetic.synthetic_volume((32, 32, 48), seed=1), chunks=(16, 16, 16))
    s = data.Sampler(records, (16, 16, 32), seed=2, micro_batch=4, weighting="uniform")
    with pytest.raises(data.DataError, match="the store changed since it was indexed"):
        for step in range(20):
            s.batch(step)


def test_bad_patterns_and_manifests_are_clear_errors(lib, tmp_path):
    with pytest.raises(data.DataError, match="matches nothing"):
        library.expand([str(lib / "*.zarr")])
    m = tmp_path / "bad.jsonl"
    good = json.dumps(library.index([str(lib / "a.mdio")])[0])
    m.write_text(good + "\n" + '{"url": "x.mdio", "shape": [1, 2, 3]}' + "\n")
    with pytest.raises(data.DataError, match=r"line 2 is not a store record \(missing \['format'"):
        library.expand(["@" + str(m)])
    m.write_text(good + "\nnot json\n")
    with pytest.raises(data.DataError, match="line 2 is not a store record"):
        library.expand(["@" + str(m)])
    with pytest.raises(data.DataError, match="cannot read manifest"):
        library.expand(["@" + str(tmp_path / "none.jsonl")])
    with pytest.raises(data.DataError, match="no usable weight"):
        data.Sampler(library.index([str(lib / "*.mdio")]), (16, 16, 32), weighting="manifest")


def test_the_index_command(lib, tmp_path):
    """`python -m scripts.library index`: the manifest index() writes, its path as the last line; a pattern that
    matches nothing is one `error:` line and exit code 2, no traceback, no manifest."""
    import subprocess
    import sys

    from conftest import ROOT, job_env
    out = tmp_path / "cli.jsonl"
    r = subprocess.run([sys.executable, "-m", "scripts.library", "index", str(lib / "*.mdio"), f"--out={out}",
                        "--split=train"], cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == str(out)
    want = [{**rec, "split": "train"} for rec in library.index([str(lib / "*.mdio")])]
    assert [json.loads(x) for x in out.read_text().splitlines()] == want
    r = subprocess.run([sys.executable, "-m", "scripts.library", "index", str(lib / "*.zarr"), f"--out={out}.none"],
                       cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: ") and "matches nothing" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "cli.jsonl.none").exists()


@pytest.mark.slow
def test_a_run_from_a_manifest_with_a_held_out_store(lib, tmp_path):
    """train.py with data_paths=[@manifest]: c.mdio marked split "val" is the validation set (whole store), a and b
    are trained on; the same run through the explicit lists (data_paths a, b; val_paths c) gives the same losses.
    A glob that matches nothing ends the run before any work, with one line."""
    m = tmp_path / "index.jsonl"
    library.index([str(lib / "a.mdio"), str(lib / "b.mdio")], out=str(m))
    library.index([str(lib / "c.mdio")], out=str(m), extra={"split": "val"}, add=True)
    r = run_train(small_args(lib / "a.mdio", tmp_path / "m", data_paths=["@" + str(m)], max_steps=4), nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data: 2 training store(s), 1 held-out" in r.stdout, r.stdout[-2000:]
    e = run_train(small_args(lib / "a.mdio", tmp_path / "e", data_paths=[str(lib / "a.mdio"), str(lib / "b.mdio")],
                             val_paths=[str(lib / "c.mdio")], max_steps=4), nproc=1)
    assert e.returncode == 0, e.stderr[-3000:]
    assert [x["loss"] for x in read_log(tmp_path / "m")] == [x["loss"] for x in read_log(tmp_path / "e")]
    assert read_val(tmp_path / "m") == read_val(tmp_path / "e") and len(read_val(tmp_path / "e")) >= 2
    # going on with the stores drawn otherwise: allowed, and said (the stream is no longer the run's own)
    w = run_train(small_args(lib / "a.mdio", tmp_path / "m", data_paths=["@" + str(m)], max_steps=5,
                             sample_weighting="uniform"), nproc=1)
    assert w.returncode == 0 and "WARNING: the training stores or sample_weighting differ" in w.stdout, w.stdout[-2000:]
    bad = run_train(small_args(lib / "a.mdio", tmp_path / "bad", data_paths=[str(lib / "*.segy")]), nproc=1)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "matches nothing" in bad.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_glob_and_manifest_on_loopback_s3(lib):
    """The same library uploaded to a real S3 endpoint on loopback: the glob, the index written to s3:// and the
    sampler reading through it give the local batches."""
    m = MotoS3()
    try:
        for n in SHAPES:
            m.upload_dir(str(lib / n), "lib", f"surveys/{n}")
        opts = reader.ReadOptions(in_flight=8, endpoint_url=m.endpoint)
        manifest = "s3://lib/surveys/index.jsonl"
        records = library.index(["s3://lib/surveys/*.mdio"], opts, out=manifest)
        assert [r["url"] for r in records] == [f"s3://lib/surveys/{n}" for n in sorted(SHAPES)]
        kw = dict(crop=(16, 16, 32), seed=5, micro_batch=4, weighting="volume")
        remote = data.Sampler(library.expand(["@" + manifest], opts), opts=opts, **kw)
        local = data.Sampler([str(lib / n) for n in sorted(SHAPES)], **kw)
        assert same(batches(local), batches(remote))
        # an object there that is not a manifest is never written over, on S3 as locally
        m.client().put_object(Bucket="lib", Key="notes.csv", Body=b"a,b,c\n")
        with pytest.raises(configurator.ConfigError, match="is an object that is not a manifest"):
            library.index(["s3://lib/surveys/*.mdio"], opts, out="s3://lib/notes.csv")
        assert m.client().get_object(Bucket="lib", Key="notes.csv")["Body"].read() == b"a,b,c\n"
    finally:
        m.stop()
