"""infra/progress.py in its two modes, and a real command in each: on a terminal (a pty) a tqdm bar with the count
on stderr; into a pipe plain lines, at most every MAE_PROGRESS_EVERY_S seconds and one at the end, with the count
and an ETA and no carriage return; under torchrun only rank 0 says anything. In every mode stdout carries exactly
the command's own lines (the tests of several commands read its last line as JSON), and torch.save through
CountingWrites writes the same bytes, each one counted."""
import io
import json
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

from conftest import ROOT, job_env
from infra import library, synthetic
from infra.progress import CountingWrites, Progress

# a loop of 10 things with a line of its own on stdout after each 5th, as the commands have them; each thing takes
# longer than tqdm's 0.1 s between redraws, so that the terminal sees every count
LOOP = """
import time
from infra.progress import Progress
with Progress(total=10, desc="demo", unit="thing") as bar:
    for i in range(10):
        time.sleep(0.12)
        bar.update()
        if i % 5 == 4:
            bar.write(f"own line {i}")
print("last")
"""
OWN = "own line 4\nown line 9\nlast\n"
PLAIN = re.compile(r"^demo: (\d+)/10 \(\d+\.\d%\) \| [\d.]+ (thing/s|s/thing) \| elapsed \d\d:\d\d \| ETA \d\d:\d\d$")


def on_a_terminal(cmd, env):
    """Run cmd with stderr on a pty (stdout a pipe, as `M=$(...)` has it): (stdout, what the terminal got)."""
    master, slave = os.openpty()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    got = []

    def read():  # until the child's end closes the pty (EIO)
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:
                return
            if not b:
                return
            got.append(b)
    t = threading.Thread(target=read)
    t.start()
    out = p.communicate(timeout=120)[0]
    t.join(timeout=30)
    os.close(master)
    assert p.returncode == 0, b"".join(got).decode(errors="replace")[-2000:]
    return out.decode(), b"".join(got).decode(errors="replace")


def in_a_pipe(cmd, env):
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, r.stderr


def test_a_pipe_gets_plain_periodic_lines_with_the_count_and_eta():
    out, err = in_a_pipe([sys.executable, "-c", LOOP], job_env(MAE_PROGRESS_EVERY_S="0.3"))
    assert out == OWN  # stdout: the command's own lines, nothing else
    assert "\r" not in err
    lines = err.splitlines()
    counts = [int(PLAIN.match(x).group(1)) for x in lines]  # every line the plain format (a non-match fails here)
    assert len(counts) >= 3 and counts == sorted(set(counts)) and counts[-1] == 10  # periodic, then the end, once


def test_the_interval_bounds_the_lines_and_other_ranks_say_nothing():
    out, err = in_a_pipe([sys.executable, "-c", LOOP], job_env(MAE_PROGRESS_EVERY_S="600"))
    assert out == OWN and len(err.splitlines()) == 1 and PLAIN.match(err.strip()).group(1) == "10"  # only the end
    out, err = in_a_pipe([sys.executable, "-c", LOOP], job_env(MAE_PROGRESS_EVERY_S="0", RANK="1"))
    assert out == OWN and err == ""


def test_a_terminal_gets_a_tqdm_bar_with_the_count():
    out, tty = on_a_terminal([sys.executable, "-c", LOOP], job_env())
    assert out == OWN  # the lines written past the bar reach stdout unchanged
    assert "\r" in tty and "3/10" in tty and "10/10" in tty and "thing/s" in tty  # a bar redrawn in place
    assert not any(PLAIN.match(x) for x in tty.replace("\r", "\n").splitlines())  # no plain lines


# DeepSpeed's universal conversion (ds_to_universal, a subprocess of infra/checkpoint.to_universal) draws tqdm bars of
# its own: a stand-in with a bar, output on stdout and an exit code
CONVERTER = ("import sys, time; from tqdm import tqdm\n"
             "[time.sleep(0.02) for _ in tqdm(range(20), desc='Extracting')]\n"
             "print('converter says last'); sys.exit(3)")
RELAY = (f"import sys; from infra.checkpoint import _run_showing_progress\n"
         f"rc, last = _run_showing_progress([sys.executable, '-c', {CONVERTER!r}])\n"
         f"print(rc, last)")


def test_the_universal_conversion_shows_the_converters_progress_in_both_modes():
    """Its bars pass through to our stderr: on a terminal as they are, in a log one line per redraw (no carriage
    return); its exit code and last line are kept for the error message."""
    out, err = in_a_pipe([sys.executable, "-c", RELAY], job_env(MAE_PROGRESS_EVERY_S="0"))
    assert out == "3 converter says last\n"
    assert "\r" not in err and "Extracting: 100%" in err and "20/20" in err, err
    out, tty = on_a_terminal([sys.executable, "-c", RELAY], job_env())
    assert out == "3 converter says last\n" and "\r" in tty and "20/20" in tty, tty


def test_counting_writes_keeps_torch_save_byte_for_byte():
    obj = {"model": {f"w{i}": torch.randn(i + 1, 7) for i in range(5)}, "step": 3}
    plain, counted = io.BytesIO(), io.BytesIO()
    torch.save(obj, plain)
    bar = Progress(total=sum(t.nbytes for t in obj["model"].values()), desc="saving", unit="B", unit_scale=True,
                   every_s=1e9)
    torch.save(obj, CountingWrites(counted, bar))
    assert counted.getvalue() == plain.getvalue() and bar.n == len(plain.getvalue()) == bar.total  # grown to it
    bar.close()


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress_library")
    for i in range(4):
        synthetic.write_mdio(str(root / f"s{i}.mdio"), synthetic.synthetic_volume((32, 32, 64), seed=i),
                             chunks=(16, 16, 32))
    return root


def test_the_library_index_in_both_modes_keeps_its_stdout_and_manifest(stores, tmp_path):
    """`python -m scripts.library index` over 4 stores, one at a time: on a terminal a bar counting stores, into a
    pipe plain lines; in both, stdout is the command's lines as before (one per store, the summary, the manifest's
    path last) and the manifest is index()'s."""
    want = library.index([str(stores / "*.mdio")])
    per_store = sorted(f"indexed {r['url']}: {r['shape']} {r['format']}, live {r['live_fraction']:.2f}" for r in want)

    def check(out, manifest):
        lines = out.splitlines()
        assert lines[-1] == str(manifest) and sorted(lines[:-2]) == per_store, out
        assert re.fullmatch(r"4 stores, [\d.]+ GB of voxels, indexed in [\d.]+ s", lines[-2]), out
        assert [json.loads(x) for x in manifest.read_text().splitlines()] == want

    def cmd(manifest):
        return [sys.executable, "-m", "scripts.library", "index", str(stores / "*.mdio"), f"--out={manifest}",
                "--in_flight=1"]
    manifest = tmp_path / "tty.jsonl"
    out, tty = on_a_terminal(cmd(manifest), job_env())
    check(out, manifest)
    assert "\r" in tty and "4/4" in tty and "store/s" in tty
    manifest = tmp_path / "pipe.jsonl"
    out, err = in_a_pipe(cmd(manifest), job_env(MAE_PROGRESS_EVERY_S="0"))
    check(out, manifest)
    lines = [x for x in err.splitlines() if x.startswith("indexing: ")]
    assert "\r" not in err and len(lines) >= 2 and lines[-1].startswith("indexing: 4/4 (100.0%) | ")
    assert all(" | ETA " in x for x in lines)
