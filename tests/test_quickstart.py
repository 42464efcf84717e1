"""The main job, as a user runs it: bash launch.sh config/quickstart.py (2 CPU ranks; conftest.quickstart)."""
import os

import pytest

from conftest import launch_quickstart, read_log, read_val
from infra import checkpoint

pytestmark = pytest.mark.slow  # (tests/README.md: the editing loop's subset leaves it out)


def test_quickstart_learns_evaluates_and_checkpoints(quickstart):
    store, out, r = quickstart
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.path.exists(os.path.join(store, "zarr.json"))  # the synthetic volume was created
    log = read_log(out)
    assert len(log) == 500
    first = sum(x["loss"] for x in log[:20]) / 20
    last = sum(x["loss"] for x in log[-20:]) / 20
    assert last <= 0.5 * first, (first, last)
    assert [s for s, _ in checkpoint.complete_checkpoints(os.path.join(out, "ckpt"))] == [400, 500]
    # held out: the validation loss at steps 0, 250 and 500 falls by at least half, and the figures are there
    val = read_val(out)
    assert [s for s, _ in val] == [0, 250, 500] and val[-1][1] <= 0.5 * val[0][1], val
    assert sorted(os.listdir(os.path.join(out, "figures"))) == [
        "loss.png", "recon_step_0000000.png", "recon_step_0000250.png", "recon_step_0000500.png"]
    assert "evaluation took" in r.stdout
    again = launch_quickstart(f"--data_paths=['{store}']", f"--out_dir={out}")  # same command: nothing left to do
    assert again.returncode == 0 and "run already complete" in again.stdout
    assert [x["step"] for x in read_log(out)] == list(range(500))  # (asked for more, it resumes: test_launch.py)
