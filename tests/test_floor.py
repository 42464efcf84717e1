"""The floor a pretraining must beat (infra/floor.py): kriging scores on a field of known covariance what theory says
it should; it cannot see the masked voxels (white noise: nothing to predict); and it is scored on exactly the
validation's masked patches (a planted perfect predictor scores 0 through the same path, the floor's own prediction
planted as the model scores exactly val_floor, and the whole-sample masks are the cp ranks' shares joined)."""
import math
import types

import numpy as np
import torch

import data
import model as M
from infra import evaluate, floor, synthetic


def ar1_traces(shape, rho, seed):
    """Independent traces, each a stationary AR(1) series along time with unit variance and lag-one correlation
    rho: covariance rho^|dt| along a trace, 0 across traces."""
    rng = np.random.default_rng(seed)
    e = rng.normal(size=shape)
    x = np.empty(shape)
    x[..., 0] = e[..., 0]
    for t in range(1, shape[-1]):
        x[..., t] = rho * x[..., t - 1] + math.sqrt(1 - rho ** 2) * e[..., t]
    return torch.from_numpy(x).float()[:, None]  # (N, 1, Z, Y, X)


def markov_error(vis_tok, grid, patch, rho):
    """The expected squared error of the best linear predictor of each masked voxel of an AR(1) trace from the
    visible voxels the floor may read (its own trace within one patch along time: the nearest visible voxel on each
    side is all a Markov series needs): sigma^2 (1 - rho^2a)(1 - rho^2b) / (1 - rho^2(a + b)) with both at
    distances a, b; 1 - rho^2a with one; 1 with none. Mean over the masked voxels."""
    pt, errs = patch[2], []
    for b in range(vis_tok.shape[0]):
        v = vis_tok[b].reshape(grid)
        for z, y, t in zip(*np.nonzero(~v)):
            above = t > 0 and v[z, y, t - 1]
            below = t < grid[2] - 1 and v[z, y, t + 1]
            for k in range(pt):
                a, c = k + 1, pt - k
                if above and below:
                    e = (1 - rho ** (2 * a)) * (1 - rho ** (2 * c)) / (1 - rho ** (2 * (a + c)))
                else:
                    e = 1 - rho ** (2 * a) if above else (1 - rho ** (2 * c) if below else 1.0)
                errs.append(e)
    return float(np.mean(errs))


def test_kriging_scores_what_theory_says_on_a_field_of_known_covariance():
    crop, patch, rho = (4, 4, 64), (1, 1, 4), 0.9
    m = M.mae("tiny", grid=M.token_grid(crop, patch), patch=patch)  # raw voxels: norm_pix_loss False
    table = floor.covariance(ar1_traces((64, *crop), rho, seed=0), patch)
    assert abs(table[tuple(floor.reach(patch))] - 1) < 0.03  # C(0): unit variance
    x = ar1_traces((512, *crop), rho, seed=1)  # (a mean over many samples: one sample's error is noisy)
    keep = m.keep_ids(torch.rand(512, m.L, generator=torch.Generator().manual_seed(2)))
    got = float(floor.loss_per_sample(floor.floor_pred(x, keep, patch, table, False), x, keep, m).mean())
    vis = torch.zeros(512, m.L, dtype=torch.bool).scatter_(1, keep, True).numpy()
    want = markov_error(vis, m.grid, patch, rho)
    assert 0.3 < want < 0.9 and abs(got - want) < 0.02 * want, (got, want)


def test_the_floor_cannot_see_the_masked_voxels():
    """White noise: no voxel says anything about another, so under norm_pix the floor is ~1 (predicting nothing);
    a predictor that read the masked voxels would score far below it."""
    crop, patch = (8, 8, 32), (2, 2, 8)
    m = M.mae("tiny", grid=M.token_grid(crop, patch), patch=patch, norm_pix_loss=True)
    g = torch.Generator().manual_seed(0)
    fit, x = torch.randn(32, 1, *crop, generator=g), torch.randn(16, 1, *crop, generator=g)
    table = floor.covariance(fit, patch)
    keep_fit, keep = m.keep_ids(torch.rand(32, m.L, generator=g)), m.keep_ids(torch.rand(16, m.L, generator=g))
    alpha = floor.fit_scale(fit, keep_fit, patch, table)
    got = float(floor.loss_per_sample(floor.floor_pred(x, keep, patch, table, True, alpha), x, keep, m).mean())
    assert abs(alpha) < 0.2 and 0.97 < got < 1.05, (alpha, got)


def test_the_floor_is_scored_on_the_validation_masked_patches(tmp_path):
    """Through evaluate.run (the validation's own path): the normalised targets planted as the prediction score 0,
    and the floor's own prediction planted as the model's scores exactly floor_of's val_floor, so the two number
    the same patches of the same samples. The floor is below 1 (it predicts something) on a seismic-like volume."""
    crop, patch = (16, 16, 32), (2, 2, 8)
    vol, fault, _ = synthetic.faultseg_volume((48, 32, 64), seed=3)
    store = synthetic.write_mdio(str(tmp_path / "v.mdio"), vol, chunks=(16, 16, 32))
    m = M.mae("tiny", grid=M.token_grid(crop, patch), patch=patch, norm_pix_loss=True, mask_strata=2)
    sampler = data.Sampler([store], crop, part=("train", 1 / 3), weighting="volume", micro_batch=3)
    val = data.Sampler([store], crop, part=("val", 1 / 3), stream="val", weighting="volume", micro_batch=3)
    cfg = {"task": "mae", "seed": 0, "eval_samples": 5, "micro_batch": 3, "crop": crop}
    job = types.SimpleNamespace(cfg=cfg, model=m, rank=0, device=torch.device("cpu"), sampler=sampler,
                                val_sampler=val, log=lambda *a: None)
    got = evaluate.floor_of(job)
    assert 0.1 < got["val_floor"] < 0.95, got

    def perfect(x, ids_keep):  # the target itself, as mae_loss normalises it
        return None, floor.normalise(M.patchify(x.float(), patch)), None
    zero, _, _ = evaluate.run(perfect, m, val, 0, 5, "cpu", torch.float32, 3)
    assert zero < 1e-9

    fit = list(range(min(floor.FIT_CROPS, floor.FIT_VOXELS // math.prod(crop))))
    crops = sampler.whole().read(fit)
    table = floor.covariance(crops, patch)
    few = fit[:floor.FIT_ALPHA]
    keep_fit = m.keep_ids(M.mask_noise(0, few, m.L), 0, 1)
    alpha = floor.fit_scale(crops[:len(few)], keep_fit, patch, table)

    def planted(x, ids_keep):
        return None, floor.floor_pred(x.float(), ids_keep, patch, table, True, alpha), None
    as_model, _, _ = evaluate.run(planted, m, val, 0, 5, "cpu", torch.float32, 3)
    assert abs(as_model - got["val_floor"]) < 1e-6, (as_model, got)


def test_the_whole_sample_masks_are_the_cp_ranks_shares_joined():
    m = M.mae("tiny", grid=(8, 4, 4), patch=(2, 2, 2), mask_strata=4)
    whole = m.keep_ids(M.mask_noise(5, [0, 1, 2], m.L, 0, 1, stream="val"), 0, 1)
    shares = [m.keep_ids(M.mask_noise(5, [0, 1, 2], m.L, r, 2, stream="val"), r, 2) + r * m.L // 2 for r in (0, 1)]
    assert torch.equal(torch.sort(whole, 1).values, torch.sort(torch.cat(shares, 1), 1).values)
