"""scripts/export.py: one model file out of a complete checkpoint of each strategy, holding the weights the run trained.

The reference is the run itself: train.py evaluates its weights on fixed held-out samples at steps 0, 3, 6 and 8
(val_loss in log.jsonl; infra/evaluate.py), and step_0000003 / step_0000008 hold exactly those weights. The exported
model, run through the same evaluate.run in this one process, must give the same val_loss. The seeded init
(train.setup's) gives step 0's, which makes "the export differs from the init" a statement about the real init.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from infra import checkpoint
import configurator
import data
from infra import evaluate
from infra import modelfile
import model as M
from conftest import ROOT, job_env, read_val, run_train, small_args

pytestmark = pytest.mark.slow  # (tests/README.md: the editing loop's subset leaves it out)

STRATEGIES = ("zero2", "zero3", "fsdp2")


@pytest.fixture(scope="module")
def runs(small_store, strategy_runs, tmp_path_factory):
    """2-rank runs of 8 steps with complete checkpoints after steps 3 and 8: each strategy's run of
    test_strategies (conftest.strategy_runs: stopped after step 3, resumed), and a bf16 one."""
    out = {}
    for name in STRATEGIES:
        d, _, b = strategy_runs[name]
        assert b.returncode == 0, (name, b.stderr[-3000:])
        out[name] = d
    d = tmp_path_factory.mktemp("export") / "zero2_bf16"
    r = run_train(small_args(small_store, d, max_steps=8, ckpt_interval=3, keep_ckpts=3, strategy="zero2",
                                   dtype="bfloat16"),
                  nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    out["zero2_bf16"] = d
    for name, d in out.items():
        assert {3, 8} <= {s for s, _ in checkpoint.complete_checkpoints(str(d / "ckpt"))}, name
    return out


@pytest.fixture(scope="module")
def files(runs):
    """Each run's newest checkpoint exported with the defaults: {name: (path, what torch.load gives)}."""
    out = {}
    for name, d in runs.items():
        path = modelfile.export(str(d))
        out[name] = path, torch.load(path, map_location="cpu", weights_only=True)
    return out


def val_loss(model, cfg, dtype=torch.float32, world=2):
    """The run's validation loss of `model`, as train.py computes it (evaluate.run, the samplers of train.setup)
    but in this one process: each of the run's `world` ranks' share in turn (the same batches, so the same sums
    in bf16 too), summed per sample as the run's all-reduce does. One thread: the ranks ran with one."""
    held_out = not cfg["val_paths"] and cfg["val_frac"] > 0
    sampler = data.Sampler(cfg["val_paths"] or cfg["data_paths"], cfg["crop"], seed=cfg["seed"],
                           micro_batch=cfg["micro_batch"], part=("val", cfg["val_frac"]) if held_out else None,
                           stream="val")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, n = model.to(dtype).eval(), cfg["eval_samples"]
        per = [evaluate.run(model, model, sampler, cfg["seed"], n, torch.device("cpu"), dtype, cfg["micro_batch"],
                            dp_rank=r, dp_size=world)[1] for r in range(world)]
        return sum(map(sum, per)) / n
    finally:
        torch.set_num_threads(threads)
        sampler.close()


def init_model(cfg):
    torch.manual_seed(cfg["seed"])  # as train.setup, before it builds the MAE
    return modelfile.build_model(cfg)


def test_every_strategy_exports_one_file_of_fp32_weights(runs, files):
    for name, (path, obj) in files.items():
        d = runs[name]
        assert path == os.path.join(str(d), "model_step_0000008.pt")
        assert not [f for f in os.listdir(d) if ".tmp" in f], os.listdir(d)  # no temporary left behind
        _, _, meta = modelfile.find_checkpoint(str(d))
        assert set(obj) == {"format", "version", "model", "config", "step", "encoder_only", "source"}
        assert (obj["format"], obj["version"], obj["step"], obj["encoder_only"]) == ("seismic-mae", 1, 8, False)
        assert obj["config"] == meta["config"] and obj["config"]["strategy"] == name.split("_")[0]
        assert obj["source"] == {"strategy": name.split("_")[0], "world": 2, "tag": "step_0000008",
                                 "dtype": "torch.bfloat16" if "bf16" in name else "torch.float32",
                                 "ckpt_dir": os.path.join(str(d), "ckpt")}
        want = modelfile.build_model(obj["config"], device="meta").state_dict()
        assert list(obj["model"]) == list(want)  # the plain module names, in the MAE's order
        for k, t in obj["model"].items():
            assert t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous(), (name, k)
            assert t.shape == want[k].shape and not t.requires_grad, (name, k)
            assert t.untyped_storage().nbytes() == t.nbytes, (name, k)  # no shared flat vector in the file
        # one call rebuilds the config's MAE and loads strictly: the file's tensors are its parameters
        model, lmeta = modelfile.load(path)
        assert model.encoder_only is False and not model.training
        assert lmeta["step"] == 8 and lmeta["tag"] == "step_0000008"
        sd = model.state_dict()
        assert list(sd) == list(obj["model"]) and all(torch.equal(sd[k], obj["model"][k]) for k in sd)


def test_exported_weights_are_the_trained_ones(runs, files):
    """Each strategy's export reproduces its run's own validation loss at steps 3 and 8, the three fp32 exports
    agree (the strategies train the same trajectory), and every weight has moved from the init, which itself
    reproduces the step 0 validation loss."""
    cfg = files["zero2"][1]["config"]
    init = init_model(cfg)
    assert abs(val_loss(init, cfg) - read_val(runs["zero2"])[0][1]) <= 1e-6 * read_val(runs["zero2"])[0][1]
    init = init.state_dict()
    for name, d in runs.items():
        dtype = torch.bfloat16 if "bf16" in name else torch.float32
        val = dict(read_val(d))
        assert sorted(val) == [0, 3, 6, 8], val
        step3 = modelfile.export(str(d), tag="step_3", out=str(d / "three.pt"))
        for step, path in ((3, step3), (8, files[name][0])):
            model, meta = modelfile.load(path)
            assert meta["step"] == step
            # bf16: the fp32 masters, rounded to bf16 as the run computes with them, give the run's bf16 value
            got = val_loss(model, meta["config"], dtype, world=meta["source"]["world"])
            assert abs(got - val[step]) <= 1e-6 * val[step], (name, step, got, val[step])
    ref = files["zero2"][1]["model"]
    for name in ("zero3", "fsdp2"):
        sd = files[name][1]["model"]
        for k in ref:
            moved = (ref[k] - init[k]).abs().max().item()
            assert moved > 1e-4, (k, moved)  # every weight has trained
            assert (sd[k] - ref[k]).abs().max().item() <= 1e-4 * moved, (name, k)


def test_bf16_run_exports_its_fp32_masters(files):
    """The bf16 run computed with bf16 copies; the file holds the fp32 masters: nearly no value is a bf16 number."""
    sd = files["zero2_bf16"][1]["model"]
    n = sum(t.numel() for t in sd.values())
    exact = sum((t.bfloat16().float() == t).sum().item() for t in sd.values())
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert exact < 0.01 * n, (exact, n)  # bf16 copies would be 100 %


def test_encoder_only(runs, files):
    d = runs["fsdp2"]
    path = modelfile.export(str(d), encoder_only=True)
    assert path == os.path.join(str(d), "model_step_0000008_encoder.pt")
    obj = torch.load(path, map_location="cpu", weights_only=True)
    full = files["fsdp2"][1]["model"]
    assert obj["encoder_only"] is True
    assert list(obj["model"]) == [k for k in full if k.split(".")[0] in modelfile.ENCODER]
    assert {k.split(".")[0] for k in obj["model"]} == set(modelfile.ENCODER)
    assert all(torch.equal(obj["model"][k], full[k]) for k in obj["model"])
    # only the encoder's bytes are in the file (a tensor viewing a shared storage would carry the rest)
    assert os.path.getsize(path) < sum(t.nbytes for t in obj["model"].values()) + 100_000
    model, meta = modelfile.load(path)
    assert model.encoder_only is True and meta["encoder_only"] is True
    assert all(getattr(model, k) is None for k in modelfile.DECODER)
    assert list(model.state_dict()) == list(obj["model"])
    # the encoder computes what the full model's encoder computes; the decoder's absence is an error, not noise
    ref, _ = modelfile.load(files["fsdp2"][0])
    x = torch.randn(2, 1, *obj["config"]["crop"])
    ids_keep = ref.keep_ids(torch.rand(2, ref.L))
    patches = M.patchify(x, ref.patch)
    with torch.no_grad():
        assert torch.equal(model.forward_encoder(patches, ids_keep), ref.forward_encoder(patches, ids_keep))
        with pytest.raises(RuntimeError, match="encoder-only"):
            model(x, ids_keep=ids_keep)


def test_tags_and_bad_input(runs, files, tmp_path):
    d = str(runs["zero3"])
    for tag in ("step_0000003", "step_3", "3", 3):
        ckpt_dir, t, meta = modelfile.find_checkpoint(d, tag)
        assert (ckpt_dir, t, meta["step"]) == (os.path.join(d, "ckpt"), "step_0000003", 3)
    assert modelfile.find_checkpoint(os.path.join(d, "ckpt"))[1] == "step_0000008"  # given OUT_DIR/ckpt itself
    with pytest.raises(configurator.ConfigError, match="step_0000003, step_0000008"):
        modelfile.find_checkpoint(d, "step_4")
    with pytest.raises(configurator.ConfigError, match="not a checkpoint tag"):
        modelfile.find_checkpoint(d, "latest")
    # a step_* directory without COMPLETE is never taken, and is named
    os.makedirs(tmp_path / "half" / "ckpt" / "step_0000007")
    with pytest.raises(configurator.ConfigError, match="step_0000007 without COMPLETE"):
        modelfile.find_checkpoint(str(tmp_path / "half"))
    # not a model file, and a model file whose weights do not fit its config
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(configurator.ConfigError, match="not a seismic-mae model file"):
        modelfile.load(str(tmp_path / "notes.txt"))
    torch.save({"model": {}}, tmp_path / "other.pt")
    with pytest.raises(configurator.ConfigError, match="not a seismic-mae model file"):
        modelfile.load(str(tmp_path / "other.pt"))
    obj = dict(files["zero3"][1], config={**files["zero3"][1]["config"], "patch": [4, 8, 8], "crop": [16, 16, 32]})
    with pytest.raises(configurator.ConfigError, match=r"patch_embed.weight is \(96, 1, 8, 8, 8\).*patch \(4, 8, 8\)"):
        modelfile.load(obj)


def test_checkpoint_with_a_lost_shard_is_a_clear_error(runs, tmp_path):
    import shutil
    for name, lose, says in (("fsdp2", "__1_0.distcp", "No such file.*__1_0.distcp"),
                             ("zero2", "zero_pp_rank_1_mp_rank_00_optim_states.pt", "Expected 2 of '\\*_optim_states")):
        d = tmp_path / name
        shutil.copytree(runs[name] / "ckpt" / "step_0000003", d / "ckpt" / "step_0000003")
        os.remove(d / "ckpt" / "step_0000003" / lose)
        with pytest.raises(configurator.ConfigError, match=f"cannot read checkpoint .*{says}"):
            modelfile.export(str(d))
        assert not [f for f in os.listdir(d) if f != "ckpt"]  # nothing written


def test_a_failed_write_leaves_the_existing_file_whole(runs, files, monkeypatch):
    path, obj = files["zero2"]
    before = open(path, "rb").read()
    real_save = torch.save

    def dies_half_way(o, f):
        f.write(b"half a file")
        raise KeyboardInterrupt  # a kill mid-write

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        modelfile.export(str(runs["zero2"]))
    monkeypatch.setattr(torch, "save", real_save)
    assert open(path, "rb").read() == before
    assert not [f for f in os.listdir(runs["zero2"]) if ".tmp" in f]


def test_cli(runs, tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "scripts.export", *args], cwd=ROOT, env=job_env(),
                              capture_output=True, text=True, timeout=300)

    # stdout is the path alone (DeepSpeed's progress talk goes to stderr)
    out = str(tmp_path / "m.pt")
    r = cli(str(runs["zero2"]), "--tag=step_3", f"--out={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == out + "\n", r.stdout
    assert torch.load(out, weights_only=True)["step"] == 3
    r = cli(f"--check={out}")
    assert r.returncode == 0 and "loads strictly" in r.stdout, r.stderr[-3000:]
    # bad input: one line, exit 2, no traceback
    os.makedirs(tmp_path / "empty_run")
    for args, says in (((str(tmp_path / "empty_run"),), ("no complete checkpoint in", "COMPLETE marker")),
                       ((str(runs["zero2"]), "--tag=4"), ("complete ones: step_0000003, step_0000008",)),
                       ((f"--check={runs['zero2'] / 'log.jsonl'}",), ("not a seismic-mae model file",))):
        r = cli(*args)
        assert r.returncode == 2, (args, r.returncode, r.stderr[-2000:])
        lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and all(s in lines[0] for s in says) and "Traceback" not in r.stderr, (args, r.stderr)


def test_a_model_file_whose_config_lacks_a_model_key_is_refused_naming_file_and_keys(tmp_path):
    """A model file or a checkpoint carries its run's config, and its model is built from it (model.build_model): one
    written before a key that the model needs existed is refused, by every reader (load, init_from's init_source,
    resume's check_compatible, the commands), in one line naming the file, the keys missing and the fix; no default
    stands in for them. The keys checked (checkpoint.MODEL_KEYS, TASK_KEYS) are all that build_model reads: it builds
    either model from them alone. Needs no run: the file is written here."""
    cfg = {**configurator.defaults(), "model_size": "tiny", "crop": [16, 16, 32], "patch": [8, 8, 8]}
    for task in ("mae", "segment"):
        c = {**cfg, "task": task}
        M.build_model({k: c[k] for k in checkpoint.MODEL_KEYS + checkpoint.TASK_KEYS[task]}, device="meta")
    obj = {"format": modelfile.FORMAT, "version": modelfile.VERSION, "model": M.build_model(cfg).state_dict(),
           "config": cfg, "step": 0, "encoder_only": False, "source": {"tag": "step_0000000"}}
    assert modelfile.load(obj)[1]["step"] == 0  # whole, it loads
    old_cfg = {k: v for k, v in cfg.items() if k not in ("dec_heads", "norm_pix_loss")}
    old = tmp_path / "old.pt"
    torch.save({**obj, "config": old_cfg}, old)
    says = f"{old}: its config has no dec_heads, norm_pix_loss (written before those keys existed): add them"
    for read in (modelfile.load, modelfile.init_source):
        with pytest.raises(configurator.ConfigError, match=re.escape(says)):
            read(str(old))
    with pytest.raises(configurator.ConfigError, match="checkpoint ckpt/step_0000002: its config has no dec_heads, "
                                                       "norm_pix_loss .* to the config it carries"):
        checkpoint.check_compatible({"config": old_cfg, "world": 1}, cfg, 1, None, "ckpt/step_0000002")
    r = subprocess.run([sys.executable, "-m", "scripts.export", f"--check={old}"], cwd=ROOT, env=job_env(),
                       capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and says in lines[0] and "Traceback" not in r.stderr, r.stderr[-3000:]
    # a model size this code does not have (another branch's, or one since removed): refused in one line too
    with pytest.raises(configurator.ConfigError, match="its model_size 'colossal' is not one this code knows"):
        checkpoint.check_compatible({"config": {**cfg, "model_size": "colossal"}, "world": 1}, cfg, 1, None, "ckpt/x")


# ---- scripts/reconstruct.py: a model file (or a run's out_dir) and a store -> the masked MSE and the four-panel figure


def recon(*args):
    r = subprocess.run([sys.executable, "-m", "scripts.reconstruct", *args], cwd=ROOT, env=job_env(),
                       capture_output=True, text=True, timeout=300)
    return r, (__import__("json").loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None)


def test_reconstruct_reproduces_validation_sample_0(runs, files, tmp_path):
    """On validation sample 0's crop, with the run's seed and mask ratio, scripts/reconstruct.py's masked MSE is that
    sample's validation loss, computed by evaluate.run from the same file; the same from the run's out_dir
    (exported on the fly)."""
    path, obj = files["zero2"]
    cfg = obj["config"]
    model, _ = modelfile.load(path)
    sampler = data.Sampler(cfg["data_paths"], cfg["crop"], seed=cfg["seed"], part=("val", cfg["val_frac"]),
                           stream="val")
    _, origin = sampler.locate(0)
    per = evaluate.run(model, model, sampler, cfg["seed"], 1, torch.device("cpu"), torch.float32, 1)[1]
    sampler.close()
    fig = str(tmp_path / "r.png")
    r, out = recon(path, f"--origin={origin}", f"--seed={cfg['seed']}", f"--out={fig}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert abs(out["masked_mse"] - per[0]) <= 1e-5 * per[0], (out, per)
    assert out["masked_patches"] == 12 and out["tokens"] == 16  # 16 tokens, 4 visible at mask ratio 0.75
    with open(fig, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    r2, out2 = recon(str(runs["zero2"]), f"--origin={origin}", f"--seed={cfg['seed']}", f"--out={fig}")
    assert r2.returncode == 0 and out2["masked_mse"] == out["masked_mse"], r2.stderr[-3000:]
    # the same crop streamed from a real S3 endpoint on loopback
    from bench.s3_loopback import MotoS3
    s3 = MotoS3()
    try:
        url = s3.upload_dir(cfg["data_paths"][0], "recon", "small.mdio")
        r4, out4 = recon(path, f"--data={url}", f"--s3_endpoint={s3.endpoint}", f"--origin={origin}",
                         f"--seed={cfg['seed']}", f"--out={tmp_path / 'r4.png'}")  # (another figure: other data)
    finally:
        s3.stop()
    assert r4.returncode == 0 and out4["masked_mse"] == out["masked_mse"], r4.stderr[-3000:]
    # a drawn crop of another size and mask ratio (the positions are computed per token: any grid of patches)
    r3, out3 = recon(path, "--crop=(16,32,32)", "--mask_ratio=0.5", f"--out={tmp_path / 'r3.png'}")
    assert r3.returncode == 0 and out3["tokens"] == 32 and out3["masked_patches"] == 16, r3.stderr[-3000:]
    assert 32 <= out3["origin"][0] <= 48 - 16  # drawn inside the held-out inlines


def test_reconstruct_bad_input(runs, files, tmp_path):
    path, _ = files["zero2"]
    enc = modelfile.export(str(runs["zero2"]), encoder_only=True, out=str(tmp_path / "enc.pt"))
    for args, says in (((path, "--origin=(40,0,0)"), "is outside the volume (48, 32, 64)"),
                       ((path, "--patch=(16,16,16)"), "trained with patch (8, 8, 8) and --patch is (16, 16, 16)"),
                       ((path, "--crop=(8192,8192,8192)"), "on one device by the planner"),
                       ((path, "--crop=(12,16,32)"), "must be 3 multiples of the model's patch"),
                       ((path, "--crop=-16,16,32"), "give 3 positive integers"),
                       ((path, "--origin=a,b,c"), "give 3 non-negative integers"),
                       ((enc,), "holds the encoder only: it cannot reconstruct")):
        r, _ = recon(*args, f"--out={tmp_path / 'x.png'}")
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
    assert not (tmp_path / "x.png").exists()
