"""Credentials never leave memory. The processes a user runs against S3 are given unmistakable credentials in their
environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), as the AWS credential chain takes them,
and run against the real loopback endpoint (moto, bench/s3_loopback.py) through a proxy that records which
credentials signed each request: a short training run on an s3:// store (a checkpoint, figures, tensorboard,
log.jsonl), `python -m scripts.library index` over s3:// stores into a manifest, `python -m scripts.embed` writing
features to s3://, the dry run (DRY_RUN=1 bash launch.sh, which runs train.py --dry_run=True) and failed reads (a
missing store, access denied). Then every byte they left behind is searched: every file they wrote (log.jsonl,
checkpoint files with their COMPLETE metadata, the pickled .pt files, PNG figures and their metadata, tensorboard
events, the manifest, the exported model file), every object in every bucket (embed's zarr.json with its
attributes), and all their stdout and stderr. None of the three secrets may be anywhere.

The test has teeth: the same search, run again after secrets are planted in places it searches (a scratch file in
an out_dir, a pickled .pt, a PNG's metadata, an object in the bucket, a printed line cut short), reports each of
them; and the runs demonstrably used the credentials (they succeeded against the endpoint, and every request that
reached it was signed with the planted key id and carried the planted token)."""
import json
import os
import subprocess
import sys

import pytest

from bench.s3_loopback import FaultProxy
from conftest import ROOT, job_env, launch_quickstart, read_log, run_train, small_args
from test_embed import run_embed

pytestmark = pytest.mark.slow  # six real processes, a training run and embed among them (tests/README.md)

# Letters and digits only: JSON, repr(), URL encoding and shell quoting leave them as they are, so a search of the
# raw bytes finds them in any of those. Shaped like the real thing (a 20-character AKIA key id, a 40-odd character
# secret, a session token hundreds of characters long), and like nothing else.
KEY_ID = "AKIACANARYKEYID7X9Q2"
SECRET = "Canary0SecretAccessKey0pR4tLm8ZqW2vXc6NbJ5hKd9s"
TOKEN = "Canary0SessionToken0" + "Fq3Yw7Ue1Io5Pa9Sd2Gh6Jk0Lz4Xc8Vb" * 12
SECRETS = {"the access key id": KEY_ID, "the secret access key": SECRET, "the session token": TOKEN}
CREDENTIALS = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": TOKEN}


def needles():
    """What the search looks for: each secret's first and last 12 characters, as bytes. A secret written whole
    contains both; one cut short (a message clipped to N characters) still shows its start, and one shown by its
    end only (as consoles show a key: ****X9Q2, longer here) its end."""
    out = [(name, frag.encode()) for name, s in SECRETS.items() for frag in (s[:12], s[-12:])]
    # no secret holds another's fragment: a find names the one secret it is
    assert all(f not in s.encode() for name, f in out for other, s in SECRETS.items() if other != name)
    return out


def find_secrets(folders=(), blobs=None, texts=None):
    """Where any secret occurs: sorted [(place, which secret)] over every file under `folders` (read as raw bytes,
    whatever the format), `blobs` ({place: bytes}: the buckets' objects) and `texts` ({place: str}: stdout, stderr).
    The places name files by their path, never the secret by its value (the report must not be a leak itself)."""
    places = dict(blobs or {})
    places.update({k: v.encode() for k, v in (texts or {}).items()})
    for folder in folders:
        for root, _, files in os.walk(folder):
            for f in files:
                path = os.path.join(root, f)
                if not os.path.islink(path):
                    with open(path, "rb") as fh:
                        places[path] = fh.read()
    return sorted({(place, name) for place, data in places.items() for name, frag in needles() if frag in data})


def run_module(args, env, timeout=300):
    """python -m MODULE ARGS as a user runs it, in its own process (scripts/library.py and the like)."""
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def runs(s3, small_store, tmp_path_factory):
    """Every process, once, with the planted credentials, against the loopback S3 through recording proxies. Returns
    (root: the folder they wrote into, {name: CompletedProcess}, {name: requests to the endpoint during it}, the proxy,
    the access-denied proxy)."""
    root = tmp_path_factory.mktemp("credentials")
    s3.upload_dir(small_store, "bkt", "lib/other.mdio")  # a second store, for the library's glob
    proxy = FaultProxy(s3.port, fail=0.0)  # forwards everything, and counts who signed it
    denied = FaultProxy(s3.port, forbid=True)  # a bucket these credentials may not read: 403 to everything
    env = job_env(**CREDENTIALS)
    ep = f"--s3_endpoint={proxy.endpoint}"
    train = root / "train"
    manifest = root / "manifest.jsonl"
    steps = [
        # training on an s3:// store: log.jsonl, evaluations at steps 0 and 2 with their figures and tensorboard
        # events, the checkpoint of step 2 (ckpt_interval beyond the run: the last step's only)
        ("train", lambda: run_train(small_args(s3.url, train, s3_endpoint=proxy.endpoint, max_steps=2,
                                               eval_interval=2, figures=True, tensorboard=True), env=env)),
        ("index", lambda: run_module(["scripts.library", "index", "s3://bkt/*.mdio", "s3://bkt/lib/*.mdio",
                                      f"--out={manifest}", ep], env)),
        # the features of the trained model (its out_dir: embed exports the checkpoint into it) written to s3://
        ("embed", lambda: run_embed([str(train), s3.url, "--out=s3://bkt/features.zarr", "--dtype=float32", ep,
                                     f"--picture={root / 'pca.png'}"], env=env)),
        # the dry run: launch.sh runs train.py --dry_run=True and prints all it said, then its own lines (the
        # environment it passes on, the commands every node would run)
        ("dry_run", lambda: launch_quickstart(f"--data_paths=['{s3.url}']", f"--out_dir={root / 'qs'}", ep,
                                              DRY_RUN="1", **CREDENTIALS)),
        # failed reads: a store that is not there (train.py) and one these credentials may not read (the library)
        ("missing", lambda: run_train(small_args("s3://bkt/missing.mdio", root / "missing",
                                                 s3_endpoint=proxy.endpoint), env=env)),
        ("denied", lambda: run_module(["scripts.library", "index", s3.url, f"--out={root / 'denied.jsonl'}",
                                       f"--s3_endpoint={denied.endpoint}"], env)),
    ]
    procs, requests = {}, {}
    try:
        for name, fn in steps:
            before = proxy.stats["requests"] + denied.stats["requests"]
            procs[name] = fn()
            requests[name] = proxy.stats["requests"] + denied.stats["requests"] - before
        yield root, procs, requests, proxy, denied
    finally:
        proxy.stop()
        denied.stop()


def test_the_runs_used_the_credentials_against_the_endpoint(runs, s3):
    root, procs, requests, proxy, denied = runs
    for name in ("train", "index", "embed", "dry_run"):
        assert procs[name].returncode == 0, (name, procs[name].stderr[-3000:])
    # what they made is there: the run's steps, checkpoint and figures, the manifest's two stores, the features
    assert [r["step"] for r in read_log(root / "train")] == [0, 1]
    assert os.path.exists(root / "train" / "ckpt" / "step_0000002" / "COMPLETE")
    assert any(f.endswith(".png") for f in os.listdir(root / "train" / "figures"))
    assert sorted(json.loads(line)["url"] for line in open(root / "manifest.jsonl")) == [
        "s3://bkt/lib/other.mdio", "s3://bkt/small.mdio"]
    assert "s3://bkt/features.zarr/zarr.json" in s3.objects()
    assert "validation (train.py --dry_run=True):" in procs["dry_run"].stdout  # launch.sh passed on what it said
    # each failed read is one error line naming what failed
    for name, what in (("missing", "no Zarr store at 's3://bkt/missing.mdio'"),
                       ("denied", f"access denied to '{s3.url}'")):
        last = procs[name].stderr.strip().splitlines()[-1]
        assert procs[name].returncode == 2 and last.startswith("error:") and what in last, (name, last)
    # every process that touched data sent its requests through the proxies, and every request there (the failed
    # ones too) was signed with the planted key id and carried the planted token: the credentials really were used
    for name in ("train", "index", "embed", "missing", "denied"):
        assert requests[name] > 0, name
    for p in (proxy, denied):
        assert set(p.signed_by) == {KEY_ID} and set(p.tokens) == {TOKEN}, (len(p.signed_by), len(p.tokens))


def test_no_credential_is_written_or_printed_anywhere(runs, s3):
    root, procs, _, _, _ = runs
    texts = {f"{name} {stream}": getattr(p, stream) for name, p in procs.items() for stream in ("stdout", "stderr")}
    # what the search covers, so that it cannot pass over an empty folder: checkpoints, pickles, figures, events
    files = [os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs]
    for kind in ("COMPLETE", "log.jsonl", "manifest.jsonl", ".pt", ".png", "tfevents"):
        assert any(kind in os.path.basename(f) for f in files), kind
    assert find_secrets([root], s3.objects(), texts) == []

    # teeth: secrets planted where the search looks are each reported (then removed, the runs' files left as they
    # were): in a text file, in a pickle as torch.save writes checkpoints, in a PNG's metadata as matplotlib writes
    # figures, in an object in the bucket, and at the start of a printed line cut short
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    text, pickle, png = root / "train" / "scratch.txt", root / "train" / "ckpt" / "planted.pt", \
        root / "train" / "figures" / "planted.png"
    try:
        text.write_text(f"export AWS_SECRET_ACCESS_KEY={SECRET}\n")
        torch.save({"config": {"storage_options": {"token": TOKEN}}}, pickle)
        fig = plt.figure()
        fig.savefig(png, metadata={"Comment": f"key {KEY_ID}"})
        plt.close(fig)
        s3.client().put_object(Bucket="bkt", Key="features.zarr/planted.json", Body=json.dumps({"k": KEY_ID}).encode())
        texts["train stdout"] += f"\nerror: token {TOKEN[:30]}..."
        assert find_secrets([root], s3.objects(), texts) == sorted([
            (str(text), "the secret access key"), (str(pickle), "the session token"), (str(png), "the access key id"),
            ("s3://bkt/features.zarr/planted.json", "the access key id"), ("train stdout", "the session token")])
    finally:
        for path in (text, pickle, png):
            if path.exists():
                path.unlink()
        s3.client().delete_object(Bucket="bkt", Key="features.zarr/planted.json")
