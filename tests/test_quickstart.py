"""The main job, as a user runs it: bash launch.sh config/quickstart.py (2 CPU ranks; conftest.quickstart)."""
import json
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
    assert again.returncode == 0 and "run already complete" in again.stdout, again.stderr[-3000:]
    assert [x["step"] for x in read_log(out)] == list(range(500))  # (asked for more, it resumes: test_launch.py)


def test_fine_tuning_the_quickstart_runs_out_of_the_box(quickstart):
    """bash launch.sh config/quickstart.py --task=segment --init_from=OUT: the quickstart's store carries its fault
    labels, the pretrained run is the start, and the fine-tuning run goes to OUT_segment (the pretraining run's
    out_dir is never written into); validation reports IoU and Dice."""
    store, out, r = quickstart
    assert r.returncode == 0, r.stderr[-3000:]
    before = sorted(os.listdir(os.path.join(out, "ckpt")))
    seg = launch_quickstart(f"--data_paths=['{store}']", f"--out_dir={out}", "--task=segment", f"--init_from={out}",
                            "--max_steps=40", "--eval_interval=20")
    assert seg.returncode == 0, seg.stderr[-3000:]
    assert f"init_from {out}" in seg.stdout and "the encoder of a tiny MAE" in seg.stdout  # (UNETR head: fresh)
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == before
    val = [x for x in map(json.loads, open(os.path.join(out + "_segment", "log.jsonl")))
           if "val_iou" in x]
    assert [x["step"] for x in val] == [0, 20, 40] and all(len(x["val_iou"]) == 2 for x in val)
    assert val[-1]["val_loss"] < val[0]["val_loss"], val
