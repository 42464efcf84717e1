"""train.py as real jobs: ZeRO-2 gradient averaging, exact resume (past a damaged checkpoint), divergence handling,
bad input."""
import glob
import os

import pytest
import torch

import configurator
import data
from infra import checkpoint
from infra import strategies
import train
from conftest import read_log, read_val, run_train, small_args


def losses(out_dir):
    return [r["loss"] for r in read_log(out_dir)]


def test_lr_schedule():
    cfg = {"warmup_steps": 10, "max_steps": 100, "min_lr": 1e-5}
    lrs = [train.get_lr(s, 1e-3, cfg) for s in range(100)]
    assert lrs[0] > 0
    assert max(lrs) == pytest.approx(1e-3) and lrs.index(max(lrs)) in (9, 10)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))  # rising during warmup
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # falling after
    assert lrs[-1] == pytest.approx(1e-5)


@pytest.mark.slow
def test_zero2_two_ranks_equal_one_rank_with_double_batch(small_store, tmp_path):
    """Per-rank batch b on 2 ranks must follow the same trajectory as batch 2b on 1 rank: proof that
    ZeRO-2 averages gradients over ranks (and that the samples are a function of the global index)."""
    one = run_train(small_args(small_store, tmp_path / "one", micro_batch=4), nproc=1)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_train(small_args(small_store, tmp_path / "two", micro_batch=2), nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)


def test_stop_and_resume_is_exact_even_past_a_damaged_checkpoint(small_store, tmp_path):
    """A run stopped after step 4 (checkpoints 2 and 4), whose newest checkpoint then loses the end of one rank's
    shard (a truncated copy): the relaunch says so, names the file, moves that checkpoint aside (kept), resumes
    from step 2 and ends on the uninterrupted run's trajectory."""
    args = dict(max_steps=8, grad_accum=2, ckpt_interval=2)
    full = run_train(small_args(small_store, tmp_path / "full", **args), nproc=2)
    assert full.returncode == 0, full.stderr[-3000:]
    part = run_train(small_args(small_store, tmp_path / "part", stop_step=4, **args), nproc=2)
    assert part.returncode == 0, part.stderr[-3000:]
    ckpt = tmp_path / "part" / "ckpt"
    assert [s for s, _ in checkpoint.complete_checkpoints(str(ckpt))] == [2, 4]
    shard = ckpt / "step_0000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(shard, shard.stat().st_size // 2)
    damaged_size = shard.stat().st_size
    rest = run_train(small_args(small_store, tmp_path / "part", **args), nproc=2)
    assert rest.returncode == 0, rest.stderr[-3000:]
    warning = next(x for x in rest.stdout.splitlines() if x.startswith("WARNING: checkpoint"))
    assert ("step_0000004 is marked complete but does not load: files that no longer read: "
            "zero_pp_rank_1_mp_rank_00_optim_states.pt. Moved aside") in warning, warning
    assert "resumed from" in rest.stdout and "(step 2)" in rest.stdout
    assert (ckpt / "damaged_step_0000004" / shard.name).stat().st_size == damaged_size  # kept aside, as it was
    # the last record of each step (steps 2 and 3 ran twice) follows the uninterrupted run
    a, b = read_log(tmp_path / "full"), {r["step"]: r for r in read_log(tmp_path / "part")}
    assert sorted(b) == list(range(8))
    for x in a:
        y = b[x["step"]]
        assert x["lr"] == y["lr"] and abs(x["loss"] - y["loss"]) <= 1e-6 * abs(x["loss"]), (a, b)
    # the held-out loss: 0 and 3 before the stop, 3 again, 6 and 8 after the resume, as in the uninterrupted run
    va, vb = dict(read_val(tmp_path / "full")), dict(read_val(tmp_path / "part"))
    assert sorted(va) == sorted(vb) == [0, 3, 6, 8]
    for k in va:
        assert abs(va[k] - vb[k]) <= 1e-6 * abs(va[k]), (va, vb)
    # a run that is already complete resumes, does nothing, and leaves the checkpoint alone
    again = run_train(small_args(small_store, tmp_path / "part", **args), nproc=1)
    assert again.returncode == 0 and "run already complete" in again.stdout, again.stderr[-2000:]
    # going on with another global batch (1 rank with the same micro_batch: half of it) is a clear error before any
    # work (test_elastic: the same batch on other ranks goes on exactly; allow_batch_change goes on by samples)
    other = run_train(small_args(small_store, tmp_path / "part", **{**args, "max_steps": 10}), nproc=1)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-2000:]
    assert ("trained with global batch 8 (micro_batch 2 x grad_accum 2 x dp 2), and this run's is 4 (micro_batch 2 x "
            "grad_accum 2 x dp 1): set micro_batch x grad_accum = 8 to continue the same run, or set "
            "allow_batch_change=True") in other.stderr, other.stderr[-2000:]
    assert [s for s, _ in checkpoint.complete_checkpoints(str(ckpt))] == [6, 8]
    assert (ckpt / "damaged_step_0000004").is_dir()  # never deleted by the rotation


@pytest.mark.slow
def test_resume_refuses_a_changed_mask_or_dtype(small_store, tmp_path):
    """What the masks and the arithmetic depend on must not change under a resumed run (as the crop must not)."""
    first = run_train(small_args(small_store, tmp_path, max_steps=2, mask_ratio=0.75), nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]
    for change, message in (("--mask_ratio=0.5", "trained with mask_ratio=0.75, this run has 0.5"),
                            ("--mask_strata=2", "trained with mask_strata=1, this run has 2"),  # 0 (= cp = 1) before
                            ("--dtype=bfloat16", "trained with dtype='torch.float32', this run has 'torch.bfloat16'"),
                            ("--val_frac=0.5", "trained with val_paths or val_frac=0.3333333333333333, this run has 0.5")):
        r = run_train(small_args(small_store, tmp_path, max_steps=4, mask_ratio=0.75) + [change], nproc=1)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(read_log(tmp_path)) == 2  # nothing trained
    ok = run_train(small_args(small_store, tmp_path, max_steps=3, mask_ratio=0.75), nproc=1)  # unchanged: resumes
    assert ok.returncode == 0 and "resumed from" in ok.stdout, ok.stderr[-2000:]


def test_keeps_newest_complete_checkpoints(small_store, tmp_path):
    r = run_train(small_args(small_store, tmp_path, max_steps=5, ckpt_interval=1, keep_ckpts=2), nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path / "ckpt"))] == [4, 5]


def test_divergence_stops_with_step_and_no_bad_checkpoint(small_store, tmp_path):
    r = run_train(small_args(small_store, tmp_path, max_steps=20, ckpt_interval=1, blr=1e33, grad_clip=0.0), nproc=1)
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    msg = r.stderr.strip().splitlines()[-1]
    assert msg.startswith("error: non-finite") and " step " in msg, msg
    # every checkpoint that was written holds finite weights
    for _, tag in checkpoint.complete_checkpoints(str(tmp_path / "ckpt")):
        (f,) = glob.glob(str(tmp_path / "ckpt" / tag / "mp_rank_00_model_states.pt"))
        sd = torch.load(f, map_location="cpu", weights_only=False)["module"]
        assert all(torch.isfinite(v).all() for v in sd.values()), tag


# ---- bad input: one clear error before training starts


def cfg_of(**kw):
    cfg = configurator.defaults()
    cfg.update(kw)
    return cfg


def test_unknown_key_and_wrong_type():
    with pytest.raises(configurator.ConfigError, match="unknown config key 'max_step'"):
        configurator.apply(cfg_of(), ["--max_step=10"])
    with pytest.raises(configurator.ConfigError, match="'max_steps'.*must be int"):
        configurator.apply(cfg_of(), ["--max_steps=ten"])
    assert configurator.apply(cfg_of(), ["--blr=1"])["blr"] == 1.0  # int accepted for float
    assert configurator.apply(cfg_of(), ["--crop=(32,32,64)"])["crop"] == (32, 32, 64)


def test_a_mistyped_key_suggests_the_keys_spelled_like_it():
    """A typo names the key it was meant to be, whatever its first word (mak_steps shares no prefix with max_steps:
    the list once showed the first ten keys alphabetically); a key like none of them says where the keys are."""
    with pytest.raises(configurator.ConfigError) as e:
        configurator.apply(cfg_of(), ["--mak_steps=5"])
    assert "unknown config key 'mak_steps' (from --mak_steps=5); did you mean max_steps" in str(e.value), e.value
    with pytest.raises(configurator.ConfigError) as e:
        configurator.apply(cfg_of(), ["--zqxv=5"])
    assert str(e.value) == ("unknown config key 'zqxv' (from --zqxv=5); no known key is like it: every key, its default "
                            "and meaning are at the top of configurator.py"), e.value


def test_validation_errors(small_store):
    with pytest.raises(configurator.ConfigError, match="not divisible by patch"):
        configurator.check_config(cfg_of(crop=(20, 16, 16), patch=(8, 8, 8)))
    for r in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(configurator.ConfigError, match="mask_ratio must be in"):
            configurator.check_config(cfg_of(mask_ratio=r))
    with pytest.raises(data.DataError, match="larger than the volume"):
        data.Sampler([small_store], (16, 16, 128))
    with pytest.raises(data.DataError, match="does not exist"):
        data.Sampler(["/nonexistent/x.mdio"], (16, 16, 16))


@pytest.mark.parametrize("extra,expect", [
    (["--max_step=3"], "unknown config key 'max_step'"),
    (["--mak_steps=3"], "unknown config key 'mak_steps' (from --mak_steps=3); did you mean max_steps"),
    (["--micro_batch=2.5"], "'micro_batch'"),
    (["--crop=(20,16,32)"], "not divisible by patch"),
    (["--crop=(16,16,128)"], "larger than the volume"),
    (["--data_paths=['/nonexistent/a.mdio']"], "does not exist"),
    (["--mask_ratio=1.0"], "mask_ratio must be in (0, 1)"),
])
def test_bad_input_fails_cleanly_before_training(small_store, tmp_path, extra, expect):
    r = run_train(small_args(small_store, tmp_path) + extra, nproc=1)
    assert r.returncode == 2
    assert expect in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not os.path.exists(tmp_path / "log.jsonl")  # nothing trained, nothing written


def test_fsync_tree_flushes_every_file_and_directory(tmp_path, monkeypatch):
    # a checkpoint-shaped tree; record which paths os.fsync is called on (through /proc/self/fd)
    for rel in ("a.pt", "zero/rank_0.pt", "zero/rank_1.pt", "zero/deeper/x.distcp"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"w")
    synced, real = set(), os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.add(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    checkpoint.fsync_tree(str(tmp_path))
    assert synced == {str(p) for p in tmp_path.rglob("*")} | {str(tmp_path)}  # every file and directory


def test_checkpoint_is_on_disk_before_it_is_marked_complete(tmp_path, monkeypatch):
    """save_checkpoint (a real FSDP2 engine, world 1) flushes every file of the checkpoint before it renames
    COMPLETE into place, then flushes the rename and the checkpoint directory's own entry."""
    import torch.distributed as dist
    from model import configure_optimizers, mae
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        cfg = configurator.defaults()
        cfg.update(strategy="fsdp2", grad_clip=0.0)
        engine = strategies.FSDP2Engine(mae("tiny", grid=(2, 2, 2), patch=(4, 4, 4)), cfg, torch.float32,
                                        torch.device("cpu"), lambda m: configure_optimizers(m, cfg, 1e-3))
        events, real_fsync, real_replace = [], os.fsync, os.replace

        def fsync(fd):
            events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            return real_fsync(fd)

        def replace(a, b):
            events.append(("replace", os.fspath(b)))
            return real_replace(a, b)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        checkpoint.save(engine, str(tmp_path), 5, {"step": 5, "config": cfg}, keep=2, rank=0)
    finally:
        dist.destroy_process_group()
    step_dir = tmp_path / "step_0000005"
    complete = events.index(("replace", str(step_dir / "COMPLETE")))
    before = {p for kind, p in events[:complete] if kind == "fsync"}
    files = {str(p) for p in step_dir.rglob("*") if p.is_file() and p.name != "COMPLETE"}
    assert len(files) >= 3 and files <= before, (files - before, events)  # shards, metadata, client state
    assert str(step_dir / "COMPLETE.tmp") in before  # the marker's own bytes
    after = [p for kind, p in events[complete:] if kind == "fsync"]
    assert after[:2] == [str(step_dir), str(tmp_path)], after
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path))] == [5]


@pytest.mark.parametrize("strategy,shard", [("zero3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                            ("fsdp2", "__1_0.distcp")])
@pytest.mark.slow
def test_sharded_strategies_fall_back_past_a_damaged_shard(small_store, tmp_path, strategy, shard):
    """Under ZeRO-3 a rank whose own shard loads goes on into collectives inside load_checkpoint, and FSDP2's DCP
    load is collective: the damage must be found before any rank loads (no hang), and the run goes on from the
    checkpoint before."""
    args = dict(max_steps=5, ckpt_interval=2, strategy=strategy)
    first = run_train(small_args(small_store, tmp_path, stop_step=4, **args), nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    f = tmp_path / "ckpt" / "step_0000004" / shard
    os.truncate(f, f.stat().st_size // 2)
    rest = run_train(small_args(small_store, tmp_path, **args), nproc=2, timeout=300)
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert f"does not load: files that no longer read: {shard}" in rest.stdout and "(step 2)" in rest.stdout
    assert [s for s, _ in checkpoint.complete_checkpoints(str(tmp_path / "ckpt"))] == [4, 5]
    assert (tmp_path / "ckpt" / "damaged_step_0000004" / shard).exists()
