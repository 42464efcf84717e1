"""Runs that grow. Elastic resume (infra/checkpoint.py): a checkpoint continued on another world size or dp x cp layout
follows the run it came from exactly, for zero2, zero3 and fsdp2; a crash in the middle of the ZeRO conversion harms
nothing; a changed global batch goes on at the next unseen sample. Warm start (train.py's init_from): a new run on
twice the lateral crop starts from a quickstart model; a mismatched model is a clear error; the context-extension
config pair shares one model."""
import hashlib
import json
import os
import shutil

import pytest
import torch

from infra import checkpoint
import configurator
from infra import modelfile
from conftest import STRATEGY_ARGS, job_env, read_log, read_val, run_train, small_args
from test_launch import launch

pytestmark = pytest.mark.slow  # (tests/README.md: the editing loop's subset leaves it out)


def copy_checkpoint(src_out, tag, out_dir):
    shutil.copytree(os.path.join(src_out, "ckpt", tag), os.path.join(out_dir, "ckpt", tag))


def follows(ref_dir, out_dir, steps, vals, rel=1e-6):
    """out_dir's log holds exactly `steps` (each step's last record) and validation at `vals`, equal to ref_dir's:
    the same lr, losses within `rel` (observed: 1e-7, the float sums of another rank count)."""
    ref, got = {r["step"]: r for r in read_log(ref_dir)}, {r["step"]: r for r in read_log(out_dir)}
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:
        a, b = ref[s], got[s]
        assert a["lr"] == b["lr"] and abs(a["loss"] - b["loss"]) <= rel * abs(a["loss"]), (s, a, b)
    rv, gv = dict(read_val(ref_dir)), dict(read_val(out_dir))
    assert sorted(gv) == list(vals), gv
    for s in vals:
        assert abs(rv[s] - gv[s]) <= rel * abs(rv[s]), (s, rv, gv)


def digest(folder):
    """{file: sha256} of a checkpoint's own files (not its universal/ conversion)."""
    return {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()
            for n in sorted(os.listdir(folder)) if os.path.isfile(os.path.join(folder, n))}


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "fsdp2"])
def test_two_ranks_to_one_and_back_to_two_follow_the_run_that_stayed_on_two(strategy, small_store, strategy_runs,
                                                                            tmp_path):
    """Checkpoint 3 of a 2-rank run (micro_batch 2, grad_accum 2: global batch 8) goes on on 1 rank with micro_batch 4
    for three steps (stopped after step 5: checkpoint 6, written by 1 rank), then on 2 ranks again to step 8. Each
    half trains with the optimizer state the other world size wrote (AdamW's moments and step count: a wrong one
    shows in the next update). Every loss and validation loss equals the same checkpoint continued on 2 ranks (the
    strategy_runs run's second half). ZeRO goes through DeepSpeed's universal checkpoint, FSDP2 through DCP."""
    src = strategy_runs[strategy][0]
    d = tmp_path / "run"
    copy_checkpoint(src, "step_0000003", d)
    one = run_train(small_args(small_store, d, strategy=strategy, micro_batch=4, stop_step=6, **STRATEGY_ARGS), nproc=1)
    assert one.returncode == 0, one.stderr[-3000:]
    assert f"resumed from {d}/ckpt/step_0000003 (step 3)" in one.stdout, one.stdout[-2000:]
    zero = strategy != "fsdp2"
    assert (d / "ckpt" / "step_0000003" / "universal" / "COMPLETE").exists() == zero
    assert ("converting" in one.stdout) == zero
    two = run_train(small_args(small_store, d, strategy=strategy, **STRATEGY_ARGS), nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert f"resumed from {d}/ckpt/step_0000006 (step 6)" in two.stdout, two.stdout[-2000:]
    assert (d / "ckpt" / "step_0000006" / "universal" / "COMPLETE").exists() == zero
    follows(src, d, range(3, 8), [6, 8])


def test_a_crash_mid_conversion_leaves_the_checkpoint_whole_and_the_next_launch_converts_again(small_store,
                                                                                             strategy_runs, tmp_path):
    """Rank 0 dies once ds_to_universal has written the universal checkpoint into universal.tmp/, before it is
    flushed, marked and renamed. The checkpoint's own files are byte for byte what they were, nothing was trained, and
    the next launch removes the leftover, converts again and resumes on the trajectory. (That launch also meets a
    published universal/ damaged since: it does not load, so it is made again rather than the checkpoint given up.)"""
    src = strategy_runs["zero2"][0]
    d = tmp_path / "run"
    copy_checkpoint(src, "step_0000003", d)
    ck = d / "ckpt" / "step_0000003"
    before = digest(ck)
    args = small_args(small_store, d, micro_batch=4, stop_step=4, **STRATEGY_ARGS)
    crash = run_train(args, nproc=1, script="tests/train_hooks.py", env=job_env(MAE_FAULT="die_in_conversion"))
    assert crash.returncode == 17, crash.stderr[-3000:]
    assert (ck / "universal.tmp" / "zero").is_dir() and not (ck / "universal").exists()
    assert digest(ck) == before and checkpoint.complete_checkpoints(str(d / "ckpt")) == [(3, "step_0000003")]
    assert not (d / "log.jsonl").exists()
    # and a published conversion damaged since (a truncated file): the load fails, the conversion is made again
    shutil.copytree(ck / "universal.tmp", ck / "universal")
    (ck / "universal" / "COMPLETE").write_text("{}")
    f = ck / "universal" / "zero" / "blocks.0.qkv.weight" / "fp32.pt"
    os.truncate(f, f.stat().st_size // 2)
    again = run_train(args, nproc=1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"the universal checkpoint of {ck} does not load" in again.stdout, again.stdout[-3000:]
    assert "converting" in again.stdout and f"resumed from {ck} (step 3)" in again.stdout, again.stdout[-2000:]
    assert not (ck / "universal.tmp").exists() and (ck / "universal" / "COMPLETE").exists()
    assert digest(ck) == before
    follows(src, d, [3], [])


def test_dp2_resumed_as_cp2_and_a_changed_batch_going_on_by_samples_seen(small_store, tmp_path):
    """A dp 2 run stopped after step 4 goes on as cp 2 (one sample split over both ranks, micro_batch 4: the same
    global batch 8): every loss equals a one-rank run of the whole schedule. mask_strata=2 throughout, so that the
    masks do not depend on cp. The same checkpoint resumed on 1 rank with global batch 4 and allow_batch_change reads
    the next unseen samples, 32..39 over its two steps, and its checkpoint says 40 were seen."""
    common = dict(max_steps=8, grad_accum=2, mask_strata=2, ckpt_interval=4)
    ref = run_train(small_args(small_store, tmp_path / "ref", micro_batch=4, **common), nproc=1)
    assert ref.returncode == 0, ref.stderr[-3000:]
    d = tmp_path / "run"
    dp = run_train(small_args(small_store, d, stop_step=4, **common), nproc=2)
    assert dp.returncode == 0, dp.stderr[-3000:]
    copy_checkpoint(d, "step_0000004", tmp_path / "batch")
    cp = run_train(small_args(small_store, d, cp=2, micro_batch=4, **common), nproc=2)
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert "(step 4)" in cp.stdout and "dp 1 x cp 2" in cp.stdout, cp.stdout[-2000:]
    follows(tmp_path / "ref", d, range(8), [0, 3, 6, 8], rel=1e-5)  # (ring attention: other float sums)

    samples = tmp_path / "samples"
    samples.mkdir()
    b = run_train(small_args(small_store, tmp_path / "batch", micro_batch=2, allow_batch_change=True, stop_step=6,
                             **common), nproc=1, script="tests/train_hooks.py", env=job_env(MAE_SAMPLES=str(samples)))
    assert b.returncode == 0, b.stderr[-3000:]
    assert "global batch 8 -> 4 (allow_batch_change): the data stream goes on at sample 32" in b.stdout, b.stdout[-2000:]
    ids = [i for line in open(samples / "rank0.jsonl") for i in json.loads(line)["ids"]]
    assert sorted(ids) == list(range(32, 40)), ids
    state = torch.load(tmp_path / "batch" / "ckpt" / "step_0000006" / "mp_rank_00_model_states.pt",
                       map_location="cpu", weights_only=False)
    assert state["samples_seen"] == 40


def test_init_from_a_quickstart_model_on_twice_the_lateral_crop(quickstart, tmp_path):
    """The quickstart's model (16 x 16 x 64 crops) starts a run on 32 x 32 x 64 crops of the same volume: its first
    training and validation losses are far below a cold start's on the same samples. The model file and the out_dir
    give the same weights (the out_dir's checkpoint exported by rank 0 of 2); an encoder-only file sets the encoder
    and leaves the decoder fresh. A relaunch resumes the run's own
    checkpoint and leaves init_from alone; another patch or width is a clear error before any work."""
    store, out, r = quickstart
    assert r.returncode == 0, r.stderr[-3000:]
    model_file = modelfile.export(out, out=str(tmp_path / "quickstart.pt"))
    base = ["config/quickstart.py", f"--data_paths=['{store}']", "--make_synthetic=False", "--crop=(32,32,64)",
            "--max_steps=2", "--log_interval=1", "--figures=False", "--eval_interval=1000",
            "--val_floor=False"]  # (the floor, kriging at these crops, costs more than the runs; test_floor.py's)

    def run(name, *extra, nproc=1):
        p = run_train(base + [f"--out_dir={tmp_path / name}", *extra], nproc=nproc)
        return p, (read_log(tmp_path / name)[0]["loss"] if p.returncode == 0 else None), \
            (dict(read_val(tmp_path / name)).get(0) if p.returncode == 0 else None)

    cold, cold_loss, cold_val = run("cold")
    assert cold.returncode == 0, cold.stderr[-3000:]
    warm, warm_loss, warm_val = run("warm", f"--init_from={model_file}")
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert f"init_from {model_file}: every weight of a tiny MAE trained 500 steps" in warm.stdout, warm.stdout[-2000:]
    assert warm_loss < 0.6 * cold_loss and warm_val < 0.6 * cold_val, (warm_loss, cold_loss, warm_val, cold_val)
    fromdir, _, dir_val = run("fromdir", f"--init_from={out}", nproc=2)
    assert fromdir.returncode == 0, fromdir.stderr[-3000:]
    assert (tmp_path / "fromdir" / "init_from.pt").exists()
    assert abs(dir_val - warm_val) <= 1e-6 * warm_val, (dir_val, warm_val)  # validation does not depend on dp
    encoder = modelfile.export(out, out=str(tmp_path / "encoder.pt"), encoder_only=True)  # the decoder starts fresh
    enc, _, _ = run("encoder", f"--init_from={encoder}")
    assert enc.returncode == 0 and "the encoder of a tiny MAE" in enc.stdout and "decoder starts fresh" in enc.stdout
    again = run_train(base + [f"--out_dir={tmp_path / 'warm'}", f"--init_from={model_file}", "--max_steps=3"])
    assert again.returncode == 0 and "not used" in again.stdout and "(step 2)" in again.stdout, again.stdout[-2000:]
    # another patch: the run's own check, before any work; another width: the dry run's (launch.sh's pre-flight)
    bad = run_train(base + [f"--out_dir={tmp_path / 'bad'}", f"--init_from={model_file}", "--patch=(4,4,16)"])
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert bad.stderr.strip().splitlines()[-1].startswith(
        f"error: init_from {model_file} was trained with patch (2, 2, 16) and this run has (4, 4, 16)"), bad.stderr
    assert not (tmp_path / "bad" / "log.jsonl").exists()
    dry = run_train(base + [f"--out_dir={tmp_path / 'bad'}", f"--init_from={out}", "--model_size=small",
                            "--dry_run=True"])
    assert dry.returncode == 2, dry.stderr[-3000:]
    assert "is model_size 'tiny' (96 wide, 4 blocks) and this run builds 'small' (384 wide, 12 blocks)" in dry.stderr


def test_the_context_extension_pair_shares_one_model(tmp_path):
    """config/context_102k.py (stage 1) and config/context_1m.py (stage 2: big_context's run, init_from stage 1) pass
    their dry runs: stage 2 against a stage-1 out_dir (its COMPLETE marker, which is what the dry run reads: the
    config that trained it) and refuses to start without one."""
    r = launch(["config/context_102k.py"], DRY_RUN="1")
    assert r.returncode == 0 and "-> fits" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    cfg = configurator.defaults()
    configurator.apply(cfg, ["config/context_102k.py"])
    marker = tmp_path / "stage1" / "ckpt" / "step_0020000" / "COMPLETE"
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"step": 20000, "world": 128, "dtype": "torch.bfloat16", "config": cfg}))
    r = launch(["config/context_1m.py", f"--init_from={tmp_path / 'stage1'}"], DRY_RUN="1")
    assert r.returncode == 0 and "-> fits" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert (f"init_from: {tmp_path / 'stage1'}/ckpt/step_0020000 (step 20000), a G MAE trained on (640, 640, 1024) "
            f"crops: fits this run ((1536, 1536, 2048) crops)") in r.stdout, r.stdout[-2000:]
    assert "1,179,648 tokens" in r.stdout
    r = launch(["config/context_1m.py", f"--init_from={tmp_path / 'nowhere'}"], DRY_RUN="1")
    assert r.returncode != 0 and "no such file or directory" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
