"""Fine-tuning for segmentation (task="segment") through train.py's one loop: under cp 2 the same losses and the same
validation loss, IoU and Dice as on one rank (fp32); a stopped and resumed run follows the uninterrupted one; a
start from a pretrained model file and from its out_dir are the same start, and not a start from scratch; bad labels
are one clear error before any checkpoint. And the fault generator behind it (FaultSeg3D's recipe): its labels sit
on the faults it made."""
import json
import os

import numpy as np
import pytest
import zarr

from conftest import run_train, small_args
from infra import modelfile, synthetic

SHAPE = (48, 32, 64)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """A FaultSeg3D-style volume with its fault labels, as an MDIO v1 store in 16^3 chunks."""
    root = tmp_path_factory.mktemp("labelled")
    vol, fault, _ = synthetic.faultseg_volume(SHAPE, seed=11)
    return synthetic.write_mdio(str(root / "fs.mdio"), vol, chunks=(16, 16, 16), fault=fault.astype(bool))


def seg_args(store, out, **kw):
    """Fine-tuning with the default head (UNETR)."""
    return small_args(store, out, **{"task": "segment", "max_steps": 6, **kw})


def val_records(out):
    return [r for r in map(json.loads, open(os.path.join(out, "log.jsonl"))) if "val_loss" in r]


def train_losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(out, "log.jsonl"))) if "loss" in r}


@pytest.fixture(scope="module")
def one_rank(labelled, tmp_path_factory):
    out = tmp_path_factory.mktemp("seg_cp1")
    r = run_train(seg_args(labelled, out, figures=True))
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def close(a, b, tol):
    return abs(a - b) <= tol * max(1.0, abs(b))


@pytest.mark.slow
def test_cp2_fine_tunes_as_one_rank(labelled, one_rank, tmp_path):
    out1, r1 = one_rank
    assert "fine-tuning: segment" in r1.stdout and "all visible, 2 classes of 'fault'" in r1.stdout
    out2 = tmp_path / "cp2"
    r2 = run_train(seg_args(labelled, out2, cp=2, figures=True), nproc=2)
    assert r2.returncode == 0, r2.stderr[-3000:]
    l1, l2 = train_losses(out1), train_losses(out2)
    assert sorted(l1) == sorted(l2) == list(range(6))
    assert all(close(l2[s], l1[s], 1e-5) for s in l1), (l1, l2)
    v1, v2 = val_records(out1), val_records(out2)
    assert [v["step"] for v in v1] == [v["step"] for v in v2] == [0, 3, 6]
    for a, b in zip(v1, v2):
        assert close(b["val_loss"], a["val_loss"], 1e-5), (a, b)
        for key in ("val_iou", "val_dice"):
            assert len(a[key]) == 2 and all(close(y, x, 1e-5) for x, y in zip(a[key], b[key])), (key, a, b)
    assert v1[-1]["val_loss"] != v1[0]["val_loss"]  # the steps changed the model (that it learns: the test below)
    for out in (out1, out2):  # (under cp 2 the slices are gathered from both ranks)
        assert os.path.exists(out / "figures" / "segment_step_0000006.png")


def test_the_unetr_head_learns_and_every_weight_of_it_gets_a_gradient():
    """On one labelled crop, 40 AdamW steps of the UNETR segmenter: the loss falls to under 0.6 of where it began, and
    every weight (encoder and head, each level's transposed and 3x3x3 convolutions) got a gradient. Whether it draws
    faults better than the linear head on held-out volumes is the label-efficiency table's (docs/after_training.md)."""
    import torch

    import model as M
    vol, fault, _ = synthetic.faultseg_volume(SHAPE, seed=11)
    x = torch.stack([torch.from_numpy(vol[:16, :16, :32]), torch.from_numpy(fault[:16, :16, :32]).float()])[None]
    torch.manual_seed(0)
    m = M.segmenter("tiny", grid=(2, 2, 4), patch=(8, 8, 8), seg_classes=2, seg_pos_weight=10.0, seg_features=8)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    first = None
    for _ in range(40):
        loss, _ = m(x)
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        if first == loss.item():
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in m.named_parameters()
                       if n != "cls_token"), [n for n, p in m.named_parameters() if p.grad is None]  # (no cls: 0)
        opt.step()
    assert loss.item() < 0.6 * first, (first, loss.item())


def test_configure_optimizers_groups_every_parameter_once_with_its_decay_and_depth():
    """model.configure_optimizers, the one optimizer: every parameter in exactly one group; weight decay on matrices
    and kernels alone (never a bias, a norm or the cls token); with layer_decay 0.75 a fine-tuned block i steps at
    0.75^(depth - i) of the lr, the patch embedding at 0.75^(depth + 1), the head at the full lr; pretraining (and
    layer_decay 1) has two groups and no lr_scale."""
    import configurator
    import model as M
    cfg = {**configurator.defaults(), "model_size": "tiny", "crop": (16, 16, 32), "patch": (8, 8, 8),
           "task": "segment", "label_var": "fault", "layer_decay": 0.75, "weight_decay": 0.05}
    m = M.build_model(cfg, device="meta")
    depth, names = len(m.blocks), {p: n for n, p in m.named_parameters()}
    opt = M.configure_optimizers(m, cfg, lr=1e-3)
    grouped = [names[p] for g in opt.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(names.values())  # each once
    for g in opt.param_groups:
        for p in g["params"]:
            n = names[p]
            assert g["weight_decay"] == (0.05 if p.ndim >= 2 and "token" not in n else 0.0), n
            want = (0.75 ** (depth + 1) if n.startswith(("patch_embed", "cls_token")) else
                    0.75 ** (depth - int(n.split(".")[1])) if n.startswith("blocks.") else 1.0)
            assert g["lr_scale"] == pytest.approx(want), (n, g["lr_scale"], want)
    assert {names[p] for g in opt.param_groups if g["lr_scale"] == 1.0 for p in g["params"]} >= {
        n for n in names.values() if not n.startswith(("blocks.", "patch_embed", "cls_token"))}
    for c in ({**cfg, "layer_decay": 1.0}, {**cfg, "task": "mae"}, {**cfg, "task": "mae", "freeze_encoder_steps": 3}):
        opt = M.configure_optimizers(M.build_model(c, device="meta"), c, lr=1e-3)
        assert len(opt.param_groups) == 2 and all("lr_scale" not in g for g in opt.param_groups)
    c = {**cfg, "layer_decay": 1.0, "freeze_encoder_steps": 3}  # the groups by depth, each marked encoder or not
    m = M.build_model(c, device="meta")
    names, opt = {p: n for n, p in m.named_parameters()}, M.configure_optimizers(m, c, lr=1e-3)
    assert all(g["lr_scale"] == 1.0 for g in opt.param_groups)
    assert {names[p] for g in opt.param_groups if g["encoder"] for p in g["params"]} == {
        n for n in names.values() if n.startswith(("blocks.", "patch_embed", "cls_token"))}


@pytest.mark.slow
def test_bf16_fine_tuning_stays_with_fp32(labelled, one_rank, tmp_path):
    """The UNETR segmenter in bf16 (its convolutions, transposed convolutions and halos in the compute dtype): the
    same run's losses within 2 % of fp32's, step by step."""
    out1, _ = one_rank
    out = tmp_path / "bf16"
    r = run_train(seg_args(labelled, out, dtype="bfloat16"))
    assert r.returncode == 0 and "torch.bfloat16" in r.stdout, r.stderr[-3000:]
    a, b = train_losses(out1), train_losses(out)
    assert sorted(a) == sorted(b) and all(close(b[s], a[s], 2e-2) for s in a), (a, b)


@pytest.mark.slow
def test_stopped_and_resumed_fine_tuning_follows_the_uninterrupted_run(labelled, one_rank, tmp_path):
    out1, _ = one_rank
    out = tmp_path / "resumed"
    a = run_train(seg_args(labelled, out, stop_step=3))
    assert a.returncode == 0, a.stderr[-3000:]
    b = run_train(seg_args(labelled, out))
    assert b.returncode == 0 and "resum" in b.stdout.lower(), b.stderr[-3000:]
    whole, parts = train_losses(out1), train_losses(out)  # (the resumed steps' records are the last ones)
    assert all(close(parts[s], whole[s], 1e-6) for s in whole), (whole, parts)
    assert close(val_records(out)[-1]["val_loss"], val_records(out1)[-1]["val_loss"], 1e-6)


@pytest.mark.slow
def test_every_strategy_fine_tunes_alike_with_layer_decay(labelled, tmp_path):
    """zero2, zero3 and fsdp2 on 2 ranks, fine-tuning with layer_decay 0.75 (one optimizer group per encoder depth,
    each with its lr_scale): the same losses and validation to 1e-4, as pretraining's strategies agree; and
    layer_decay changes the run (the scaled lrs reach every strategy's optimizer)."""
    logs = {}
    for name, kw in (("zero2", {}), ("zero3", {"strategy": "zero3"}), ("fsdp2", {"strategy": "fsdp2"}),
                     ("no_decay", {"layer_decay": 1.0})):
        out = tmp_path / name
        r = run_train(seg_args(labelled, out, **{"layer_decay": 0.75, **kw}), nproc=2)
        assert r.returncode == 0, (name, r.stderr[-3000:])
        logs[name] = train_losses(out), val_records(out)
    ref, ref_val = logs["zero2"]
    for name in ("zero3", "fsdp2"):
        losses, val = logs[name]
        assert all(close(losses[s], ref[s], 1e-4) for s in ref), (name, losses, ref)
        assert all(close(v["val_loss"], w["val_loss"], 1e-4) for v, w in zip(val, ref_val)), name
    assert abs(logs["no_decay"][0][5] - ref[5]) > 1e-4 * ref[5]

@pytest.mark.slow
def test_a_frozen_encoder_stays_the_pretrained_one_until_it_thaws_under_every_strategy(labelled, tmp_path):
    """freeze_encoder_steps (linear probing, then fine-tuning): frozen for all 4 steps, the fine-tuned encoder is the
    pretrained one bit for bit while its head has learnt; frozen for 2, the run is the all-frozen one's through the
    frozen steps (the same losses) and then leaves it, its encoder moved; zero3 and fsdp2 do as zero2 does (2 ranks
    each)."""
    import torch
    pre = tmp_path / "pre"
    assert run_train(small_args(labelled, pre, max_steps=6)).returncode == 0
    file = modelfile.export(str(pre), out=str(tmp_path / "pre.pt"))
    runs = {}
    for name, freeze, kw in (("all", 4, {}), ("half", 2, {}), ("half_zero3", 2, {"strategy": "zero3"}),
                             ("half_fsdp2", 2, {"strategy": "fsdp2"})):
        out = tmp_path / name
        r = run_train(seg_args(labelled, out, max_steps=4, init_from=file, freeze_encoder_steps=freeze, **kw),
                      nproc=2)
        assert r.returncode == 0, (name, r.stderr[-3000:])
        runs[name] = train_losses(out), modelfile.load(modelfile.export(str(out)))[0].state_dict()
    start = modelfile.load(file)[0].state_dict()
    enc = [k for k in start if k.startswith(("patch_embed", "cls_token", "blocks."))]
    head = [k for k in runs["all"][1] if k not in start]
    assert enc and head
    assert all(torch.equal(runs["all"][1][k], start[k]) for k in enc)
    (all_loss, _), (half_loss, half_sd) = runs["all"], runs["half"]
    assert [half_loss[s] for s in (0, 1, 2)] == [all_loss[s] for s in (0, 1, 2)] and half_loss[3] != all_loss[3]
    assert not all(torch.equal(half_sd[k], start[k]) for k in enc)
    for name in ("half_zero3", "half_fsdp2"):
        other = runs[name][0]
        assert all(close(other[s], half_loss[s], 1e-4) for s in half_loss), (name, other, half_loss)


@pytest.mark.slow
def test_starts_from_a_pretrained_model_file_and_its_out_dir_alike(labelled, tmp_path):
    pre = tmp_path / "pre"
    r = run_train(small_args(labelled, pre, max_steps=6))  # pretraining (task mae) on the same store
    assert r.returncode == 0, r.stderr[-3000:]
    file = modelfile.export(str(pre), out=str(tmp_path / "pre.pt"))
    starts = {}
    for name, src, head in (("file", file, "unetr"), ("out_dir", str(pre), "unetr"), ("scratch", "", "unetr"),
                            ("linear", file, "linear")):
        out = tmp_path / name
        r = run_train(seg_args(labelled, out, max_steps=1, init_from=src, seg_head=head))
        assert r.returncode == 0, r.stderr[-3000:]
        if head == "linear":  # the probe's head: the MAE's decoder blocks too, only its output layer is new
            assert "every weight but the head's output layer of a tiny MAE trained 6 steps" in r.stdout, r.stdout
        elif src:
            assert "the encoder of a tiny MAE trained 6 steps" in r.stdout and "UNETR head starts fresh" in r.stdout
        starts[name] = val_records(out)[0]  # the model before any fine-tuning step
    assert starts["file"] == {**starts["out_dir"], "eval_s": starts["file"]["eval_s"]}
    assert starts["file"]["val_loss"] != starts["scratch"]["val_loss"]


@pytest.mark.slow
def test_bad_labels_are_one_clear_error_before_any_checkpoint(labelled, tmp_path):
    other = tmp_path / "other.mdio"
    vol, fault, _ = synthetic.faultseg_volume(SHAPE, seed=12)
    synthetic.write_mdio(str(other), vol, chunks=(16, 16, 16), fault=fault.astype(bool))
    g = zarr.open_group(str(other), mode="r+")
    g.create_array("small", shape=(8, 8, 8), chunks=(8, 8, 8), dtype="uint8")  # labels of another shape
    g.create_array("soft", shape=SHAPE, chunks=(16, 16, 16), dtype="float32")  # not classes
    g["fault"][:] = 3 * fault  # classes beyond classes=2
    for store, kw, says in ((labelled, {"label_var": "facies"}, "has no label variable 'facies'"),
                            (str(other), {"label_var": "small"}, "has shape (8, 8, 8), the amplitude (48, 32, 64)"),
                            (str(other), {"label_var": "soft"}, "is float32; class labels are integers"),
                            (str(other), {}, "holds class 3 in the crop"),
                            (labelled, {"classes": 1}, "classes must be >= 2")):
        out = tmp_path / f"bad_{len(os.listdir(tmp_path))}"
        r = run_train(seg_args(store, out, **kw))
        assert r.returncode == 2, (kw, r.stderr[-3000:])
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and says in last and "Traceback" not in r.stderr, (kw, r.stderr[-3000:])
        assert not os.path.exists(out / "ckpt"), kw


def _dilate(m, r):
    out = m.copy()
    for ax in range(3):
        for s in range(1, r + 1):
            out |= np.roll(m, s, ax) | np.roll(m, -s, ax)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_faultseg_labels_sit_on_the_faults_it_made(seed):
    """The recipe's ranges (5-8 faults, dip 62-82 degrees, throw 5-30 samples); the newest fault's plane (no later
    fault moved it) is labelled exactly where its throw is at least a sample; and, without noise, the amplitude
    changes from voxel to voxel far more on the labelled voxels than away from them, which the same mask moved by
    6 crosslines does not show (a mask off the faults fails)."""
    vol, fault, faults = synthetic.faultseg_volume(SHAPE, seed=seed, snr_db=100.0, recipe_size=0)  # (drawn at SHAPE)
    m = fault.astype(bool)
    assert vol.dtype == np.float32 and abs(vol.mean()) < 1e-4 and abs(vol.std() - 1) < 1e-3
    assert 5 <= len(faults) <= 8 and all(62 <= f["dip_deg"] <= 82 and 5 <= f["throw"] <= 30 for f in faults)
    f = faults[-1]
    x = np.stack(np.meshgrid(*(np.arange(n, dtype=np.float64) for n in SHAPE), indexing="ij"), -1) - f["centre"]
    throw = f["throw"] * np.exp(-((x @ f["along"]) ** 2 + (x @ f["down"]) ** 2) / (2 * f["spread"] ** 2))
    newest = (np.abs(x @ f["normal"]) <= synthetic.FAULT_HALF_WIDTH) & (throw >= 1.0)
    assert newest.any() and (m | ~newest).all()
    g = np.zeros(SHAPE)
    g[:-1] += np.abs(np.diff(vol, axis=0))
    g[:, :-1] += np.abs(np.diff(vol, axis=1))
    far = ~_dilate(m, 4)
    on, shifted = g[m].mean() / g[far].mean(), g[np.roll(m, 6, 1)].mean() / g[far].mean()
    assert on > 1.7 and on > 1.35 * shifted, (on, shifted)


def test_faults_are_as_dense_as_the_recipe_makes_them_at_its_size():
    """A 64^3 volume is cut from one drawn at the recipe's 128^3, so its faults are about as dense as FaultSeg3D's;
    the recipe's 5-8 faults drawn into 64^3 itself put about twice the voxels on a fault."""
    cut = np.mean([synthetic.faultseg_volume((64, 64, 64), seed=s)[1].mean() for s in range(4)])
    drawn = np.mean([synthetic.faultseg_volume((64, 64, 64), seed=s, recipe_size=0)[1].mean() for s in range(4)])
    assert cut < 0.16 < drawn, (cut, drawn)


def test_flipped_crops_are_the_crops_mirrored_with_their_labels_and_their_cp_slabs_side_by_side(labelled):
    """flip=True (train.py's flip_crops): each sample is the unflipped sampler's same sample, amplitude and labels
    mirrored alike along inline and / or crossline as flips(g) says, all four ways among 32 samples; under cp 2 the two
    ranks' slabs side by side are exactly the one-rank sample, mirrored along inline included."""
    import torch

    import data
    crop, kw = (16, 16, 32), dict(seed=3, micro_batch=8, label_var="fault")
    plain, flip = data.Sampler([labelled], crop, **kw), data.Sampler([labelled], crop, flip=True, **kw)
    ranks = [data.Sampler([labelled], crop, flip=True, cp_rank=r, cp_size=2, **kw) for r in (0, 1)]
    seen = set()
    for step in range(4):
        (x0, ids), (x1, ids1) = plain.batch(step), flip.batch(step)  # (8, 2, 16, 16, 32): amplitude, labels
        assert ids == ids1 and x1[:, 1].sum() > 0
        for i, g in enumerate(ids):
            f = flip.flips(g)
            seen.add(f)
            want = torch.flip(x0[i], [d + 1 for d, on in enumerate(f) if on])  # (2, Z, Y, X): both channels
            assert torch.equal(x1[i], want), (g, f)
            if any(f):
                assert not torch.equal(x1[i], x0[i])
        assert torch.equal(torch.cat([r.batch(step)[0] for r in ranks], dim=2), x1)
    assert seen == {(False, False), (True, False), (False, True), (True, True)}
    assert plain.flips(0) == (False, False)
    for s in (plain, flip, *ranks):
        s.close()


def test_the_label_efficiency_presets_yield_to_a_given_option_and_the_gpu_one_runs_on_its_crop():
    """--quick and --gpu set the other options' defaults, so an option given beside one wins (`--gpu
    --pretrain_steps=7`); without them the defaults hold. The GPU preset, which no test can run at its size, passes
    the command's own checks, its patch holds more voxels than its model is wide (the recipe's point), and its MAE
    (masked loss) and segmenter (one logit per voxel through the UNETR head) run on one of its crops."""
    import math

    import torch

    import configurator
    from model import SIZES, build_model
    from experiments import label_efficiency as le
    a, counts = le.options(["--gpu", "--pretrain_steps=7", "--labels=1"])
    assert a.pretrain_steps == 7 and counts == [1] and a.pretrain_batch == le.GPU["pretrain_batch"]
    assert a.crop == (64, 64, 64) and a.patch == (8, 8, 16) and a.shape == 128 and a.freeze == 400
    assert math.prod(a.patch) > SIZES[a.model_size][0]
    assert not le.options(["--gpu", "--freeze=0"])[0].freeze  # (the preset's freeze given back)
    with pytest.raises(configurator.ConfigError, match="two presets"):
        le.options(["--gpu", "--quick"])
    assert le.options(["--quick", "--seeds=3"])[0].seeds == 3 and le.options(["--quick"])[0].seeds == 2
    plain = le.options([])[0]
    assert (plain.crop, plain.patch, plain.model_size, plain.freeze) == ((16, 16, 64), (2, 2, 16), "tiny", 0)
    cfg = {**configurator.defaults(), "model_size": a.model_size, "crop": a.crop, "patch": a.patch,
           "norm_pix_loss": True, "seg_head": "unetr", "seg_features": a.seg_features}
    torch.manual_seed(0)
    x = torch.randn(1, 1, *a.crop)
    with torch.no_grad():
        loss = build_model(cfg)(x)[0]
        logits = build_model({**cfg, "task": "segment"}).seg_logits(x)  # (B, L, P, classes)
    assert torch.isfinite(loss) and logits.shape == (1, 8 * 8 * 4, 8 * 8 * 16, 1) and torch.isfinite(logits).all()


def test_the_label_efficiency_windows_blend_as_their_definition_says():
    """The benchmark's ViT scoring (experiments.label_efficiency.predict): at overlap 0 the windows tile the volume, each
    voxel its one window's probability; at overlap 0.5 each voxel is sum_k w_k p_k / sum_k w_k over the windows
    covering it, checked against a survey-sized weight buffer built here window by window (the code sums 1D weights)."""
    import numpy as np
    import torch

    import configurator
    import model as M
    from infra import sliding
    from experiments import label_efficiency as le
    crop, shape = (8, 8, 16), (24, 16, 32)
    torch.manual_seed(0)
    net = M.build_model({**configurator.defaults(), "model_size": "tiny", "crop": crop, "patch": (2, 2, 8),
                         "task": "segment", "seg_head": "unetr", "seg_features": 4}).eval()
    vol = np.random.default_rng(0).standard_normal(shape).astype(np.float32)

    def window(i, j, k):  # (*crop) the model's probabilities on one window
        x = torch.from_numpy(vol[i:i + crop[0], j:j + crop[1], k:k + crop[2]].copy())[None, None]
        return M.unpatchify(torch.sigmoid(net.seg_logits(x)[..., 0]), net.patch, net.grid)[0, 0].numpy()

    with torch.no_grad():
        tiled, blended = le.predict("vit", net, vol, crop), le.predict("vit", net, vol, crop, overlap=0.5)
        want = np.zeros(shape)
        for i in range(0, shape[0], crop[0]):
            for j in range(0, shape[1], crop[1]):
                for k in range(0, shape[2], crop[2]):
                    want[i:i + crop[0], j:j + crop[1], k:k + crop[2]] = window(i, j, k)
        np.testing.assert_allclose(tiled, want, atol=1e-6)
        w = np.einsum("i,j,k->ijk", *(sliding.axis_weights(c) for c in crop))
        num, den, n = np.zeros(shape), np.zeros(shape), 0
        for i in range(0, shape[0] - crop[0] + 1, crop[0] // 2):
            for j in range(0, shape[1] - crop[1] + 1, crop[1] // 2):
                for k in range(0, shape[2] - crop[2] + 1, crop[2] // 2):
                    box = np.s_[i:i + crop[0], j:j + crop[1], k:k + crop[2]]
                    num[box] += w * window(i, j, k)
                    den[box] += w
                    n += 1
    assert n == 5 * 3 * 3
    np.testing.assert_allclose(blended, num / den, atol=1e-5)
    assert np.abs(blended - tiled).max() > 1e-3  # the overlapping windows do change the probabilities


def test_the_label_efficiency_scores_match_their_definitions_on_small_cases():
    """experiments.label_efficiency.scores: IoU and Dice at 0.5, AP, the fraction called fault and the IoU at the best
    single threshold, on cases worked by hand; a threshold cannot split voxels of equal probability, and a map that ranks
    every fault first but never reaches 0.5 scores IoU 0 at 0.5 and 1 at its best threshold."""
    import numpy as np

    from experiments import label_efficiency as le
    s = le.scores(np.array([0.9, 0.8, 0.8, 0.1]), np.array([1, 0, 1, 0]))
    # at 0.5: called 3 of 4, tp 2, fp 1, fn 0; thresholds keep the top 1, 3 or 4: IoU 1/2, 2/3, 2/4
    assert s["iou"] == 2 / 3 and s["dice"] == 4 / 5 and s["called"] == 3 / 4 and s["iou_best"] == 2 / 3
    assert abs(s["ap"] - (1 / 1 + 2 / 3) / 2) < 1e-12  # precision at each fault's rank (the tie in stable order)
    tie = le.scores(np.array([0.9, 0.9, 0.1]), np.array([1, 0, 0]))
    assert tie["iou_best"] == 1 / 2  # the top 1 alone (IoU 1) is not a threshold: it would split the tie at 0.9
    label = np.random.default_rng(0).random((6, 6, 6)) < 0.2
    low = le.scores(0.2 + 0.3 * label, label)  # every fault ranked above every other voxel, none above 0.5
    assert low["iou"] == 0 and low["called"] == 0 and low["iou_best"] == 1 and low["ap"] == 1


@pytest.mark.slow
def test_the_label_efficiency_table_runs_small(tmp_path):
    """`python -m experiments.label_efficiency --quick`: the models on the same draws, the table, and its JSON line last
    with by_labels (IoU means per model, the paired difference to each baseline and its standard error, the best
    one's, and `won`). Not thresholded: which wins is a measurement (README). With --freeze over all its steps and
    --freeze_twin the pretrained ViT's encoder is the pretraining's bit for bit, the frozen twin's is its seed's fresh
    init, and the twin trained whole beside it has moved from that init."""
    import glob
    import subprocess
    import sys

    import torch

    from conftest import ROOT, job_env
    from model import build_model
    r = subprocess.run([sys.executable, "-m", "experiments.label_efficiency", "--quick", "--flip", "--freeze=10",
                        "--freeze_twin", "--snr_db=0", f"--out={tmp_path / 'le'}"], cwd=ROOT, env=job_env(),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "label_efficiency" and list(out["by_labels"]) == ["1"] and out["seeds"] == 2
    row = out["by_labels"]["1"]
    baselines = ("scratch", "scratch_whole", "unet")  # with --freeze_twin: the frozen twin and the twin trained whole
    assert all(0.0 <= row[k] <= 1.0 for k in ("pretrained", *baselines)) and row["se"] is not None
    assert abs(row["diff"] - (row["pretrained"] - row[row["better_scratch"]])) < 2e-4  # paired means: linear
    assert row[row["better_scratch"]] == max(row[k] for k in baselines)
    for k in baselines:
        assert abs(row[f"diff_{k}"] - (row["pretrained"] - row[k])) < 2e-4 and row[f"se_{k}"] is not None
    assert row["won"] == all(row[f"diff_{k}"] > 2 * row[f"se_{k}"] for k in baselines)
    for k in ("pretrained", *baselines):  # the calibration diagnostics: 0.5 is one of the thresholds iou_best tries
        assert row["iou_best"][k] >= row[k] - 1e-4 and 0 <= row["called"][k] <= 1
        assert len(row["seeds"][k]["iou"]) == 2 and abs(np.mean(row["seeds"][k]["iou"]) - row[k]) < 2e-4
    for k in baselines:  # paired on the best-threshold IoU as on the IoU at 0.5
        d = np.subtract(row["seeds"]["pretrained"]["iou_best"], row["seeds"][k]["iou_best"])
        assert abs(row[f"best_diff_{k}"] - d.mean()) < 2e-4 and row[f"best_se_{k}"] is not None
    assert 0 < out["fault_fraction"] < 1 and "IoU at the best single threshold" in r.stdout
    assert "3D U-Net from scratch" in r.stdout and "ViT from scratch, trained whole" in r.stdout
    pre = out["pretraining"]  # the MAE's validation loss beside its floor, and the flag when it is not below it
    assert 0 < pre["val_floor"] < 1.5 and pre["below_floor"] == (pre["val_loss"] < pre["val_floor"])
    assert ("ABOVE THE FLOOR" in r.stdout) == (not pre["below_floor"])
    assert out["crop"] == [16, 16, 32] and out["patch"] == [2, 2, 16] and out["seg_head"] == "unetr" and out["flip"]
    assert out["freeze"] == 10 and out["freeze_twin"] and out["snr_db"] == 0
    from infra import reader  # --snr_db: the recipe's volume with its noise at 0 dB, bit for bit
    vol = reader.Volume(str(tmp_path / "le" / "unlabelled_100000.mdio")).read((0, 0, 0), (32,) * 3, normalize=False)
    assert np.array_equal(vol, synthetic.faultseg_volume((32,) * 3, seed=100000, snr_db=0)[0])
    assert not np.allclose(vol, synthetic.faultseg_volume((32,) * 3, seed=100000)[0], atol=1e-3)
    last = lambda run: sorted(glob.glob(str(tmp_path / "le" / run / "model_step_*.pt")))[-1]  # noqa: E731
    pre = modelfile.load(last("pretrained"))[0].state_dict()
    twin, meta = modelfile.load(last("scratch_n1_s0"))
    torch.manual_seed(meta["config"]["seed"])
    fresh = build_model(meta["config"]).state_dict()
    enc = [k for k in pre if k.startswith(("patch_embed", "cls_token", "blocks."))]
    assert enc and all(torch.equal(modelfile.load(last("pretrained_n1_s0"))[0].state_dict()[k], pre[k]) for k in enc)
    assert all(torch.equal(twin.state_dict()[k], fresh[k]) for k in enc)
    head = [k for k in fresh if k.startswith("head.")]  # (the head learnt)
    assert head and not all(torch.equal(twin.state_dict()[k], fresh[k]) for k in head)
    whole = modelfile.load(last("scratch_whole_n1_s0"))[0].state_dict()  # the other twin: the same init, all learnt
    assert not any(torch.equal(whole[k], fresh[k]) for k in enc if k.startswith("blocks.") and k.endswith("weight"))


def test_the_quickstart_store_keeps_its_amplitude_and_carries_its_fault_labels(tmp_path):
    """ensure_synthetic (make_synthetic): the amplitude is synthetic_volume's, bit for bit (the quickstart's data did
    not change), and `fault` beside it is that volume's own fault mask."""
    from infra import reader
    shape = (48, 32, 64)
    path = synthetic.ensure_synthetic(str(tmp_path / "qs.mdio"), shape, seed=3, chunks=(16, 16, 32))
    vol, mask, _ = synthetic.synthetic_volume(shape, seed=3, labels=True)
    assert np.array_equal(synthetic.synthetic_volume(shape, seed=3), vol, equal_nan=True)
    v = reader.Volume(path)
    assert np.array_equal(v.read((0, 0, 0), shape, normalize=False), vol, equal_nan=True)
    assert np.array_equal(v.variable("fault").read((0, 0, 0), shape, normalize=False), mask.astype(np.float32))
