"""
The floor a pretraining must beat: the masked loss of a predictor that learns nothing, on the same masked patches.

    table = floor.covariance(crops, patch)                 the voxels' covariance by lag, from training crops
    pred = floor.predict(x, ids_keep, patch, table)        every masked patch, linearly from the visible voxels
    evaluate.floor_of(job)                                 train.py's: the validation's floor, computed once

An MAE whose masked loss is not below this number has learnt less about the data than linear interpolation with the
data's own covariance: on any data, it is the check that pretraining learnt something. The predictor is simple
kriging, the best linear predictor of the hidden voxels from the visible ones under a stationary covariance:

    y_hat = c_vm^T C_vv^-1 v        v (K,): K visible voxels near the masked patch,
                                    C_vv (K, K): their covariances, c_vm (K, P): theirs with the patch's P voxels,

all read from one table C(dz, dy, dx) of the training crops' covariance by lag (stationary: it depends on the lag
alone), estimated by FFT autocorrelation (the data are normalised: mean ~0):

    C(d) = sum over crops and voxels p of x[p] x[p + d]  /  the number of such pairs.

The K voxels of a masked patch: of the visible voxels within one patch of it along every axis, the K whose
covariance with the patch's nearest voxel is largest (the offsets' order is fixed once, from the table; K = 4 P,
at most 256). With norm_pix_loss the target is the patch normalised by its own mean and std, so the prediction is
normalised too and scaled by one number alpha, fitted by least squares on training crops:

    pred = alpha (y_hat - mean y_hat) / std y_hat

The table and alpha are all it fits. Cost: about K^3 / 3 + K P multiply-adds per masked patch, once per
run (train.py computes it at the first evaluation, on rank 0, on the whole samples: infra/evaluate.py).

The floor is a yardstick beside validation, never a reason for a run to end: data it cannot be computed on (training
crops with no signal, whose table is all zeros and whose C_vv is singular; non-finite values) raise Unsolvable,
saying why, and evaluate.floor_of logs a WARNING and leaves val_floor out of the log.
"""

import math

import torch

import model as M

K_MAX = 256  # visible voxels per masked patch at most (the solve is K^3 / 3; 512 lowers the floor by < 0.01)
FIT_CROPS = 32  # training crops the covariance table is fitted on (fewer when crops are large: FIT_VOXELS) ...
FIT_ALPHA = 8  # ... and the first of them, alpha (one number)
FIT_VOXELS = 2 ** 24  # at most this many voxels of them (a 640 x 640 x 1024 crop alone is 25 times more: 1 crop)
WHOLE_MAX = 2 ** 29  # voxels of one whole sample rank 0 reads for it (2 GB in fp32): above, the floor is skipped
NUGGET = 1e-3  # times C(0), added to C_vv's diagonal: an estimated table is only nearly positive definite


class Unsolvable(ArithmeticError):
    """The floor cannot be computed on these data; the message says why (evaluate.floor_of: a WARNING, no floor)."""


def reach(patch):
    """The lags the predictor reads along each axis: candidates lie within one patch of the masked patch,
    offsets [-p, 2p), so a lag between two of them or one of them and the patch is at most 3p - 1."""
    return tuple(3 * p - 1 for p in patch)


def covariance(crops, patch):
    """crops (N, 1, Z, Y, X) float: training crops -> the covariance table (2R + 1 per axis, R = reach(patch)),
    C(d) at index d + R, float64. Lags a crop cannot measure (|d| >= its size) are 0."""
    x = crops.double()[:, 0]
    if not bool(torch.isfinite(x).all()):
        raise Unsolvable("the training crops it is fitted on hold non-finite values")
    x = x - x.mean()
    N, shape = x.shape[0], x.shape[1:]
    R = reach(patch)
    # zero padding to at least size + lag: no wrap-around in the circular correlation
    size = [s + min(r, s - 1) for s, r in zip(shape, R)]
    f = torch.fft.rfftn(x, s=size, dim=(1, 2, 3))
    acf = torch.fft.irfftn(f * f.conj(), s=size, dim=(1, 2, 3)).sum(0)  # acf[d] = sum_p x[p] x[p + d], d mod size
    table = torch.zeros([2 * r + 1 for r in R], dtype=torch.float64)  # (on the host: small)
    lags = [torch.arange(-min(r, s - 1), min(r, s - 1) + 1, device=x.device) for r, s in zip(R, shape)]
    pairs = [(s - lag.abs()).double() for lag, s in zip(lags, shape)]  # pairs per lag along each axis, per crop
    sub = acf[torch.meshgrid(*[lag % n for lag, n in zip(lags, size)], indexing="ij")]
    count = N * pairs[0][:, None, None] * pairs[1][None, :, None] * pairs[2][None, None, :]
    table[tuple(slice(r - (len(lag) // 2), r + len(lag) // 2 + 1) for r, lag in zip(R, lags))] = (sub / count).cpu()
    return table


def candidates(patch, table, K):
    """The offsets (relative to a patch's first voxel) a masked patch may read, outside the patch and within one
    patch of it: (C, 3) int64, in descending |covariance| with the patch's nearest voxel; C = min(all, 16 K)."""
    R = reach(patch)
    axes = [torch.arange(-p, 2 * p) for p in patch]
    offs = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    inside = ((offs >= 0) & (offs < torch.tensor(patch))).all(1)
    offs = offs[~inside]
    nearest = offs - offs.clamp(min=torch.zeros(3, dtype=torch.long), max=torch.tensor(patch) - 1)
    score = table[tuple((nearest + torch.tensor(R)).unbind(1))].abs()
    order = torch.argsort(score, descending=True, stable=True)
    return offs[order[: 16 * K]]


def flat(coords, strides):
    """(..., 3) coordinates -> (...) flat indices with the given strides."""
    return coords[..., 0] * strides[0] + coords[..., 1] * strides[1] + coords[..., 2]


@torch.no_grad()
def predict(x, ids_keep, patch, table, K=None, budget=None):
    """x (B, 1, Z, Y, X) whole samples, ids_keep (B, n) their visible tokens -> (B, L, P) float32: every masked
    patch's y_hat (raw voxels; the visible ones' rows are 0). budget: table entries looked up per chunk of patches
    (default 2^24 on a CPU, 2^27 on a GPU)."""
    dev = x.device
    budget = budget or (2 ** 27 if dev.type == "cuda" else 2 ** 24)
    B, _, Z, Y, X = x.shape
    grid = M.token_grid((Z, Y, X), patch)
    L, P = math.prod(grid), math.prod(patch)
    K = K or min(K_MAX, 4 * P)
    if not bool(torch.isfinite(table).all()) or not float(table[tuple(reach(patch))]) > 0:
        raise Unsolvable(f"the covariance table is {'not finite' if not bool(torch.isfinite(table).all()) else 'zero'}"
                         f" at lag 0 (training crops with no signal: every voxel the same)")
    if not bool(torch.isfinite(x).all()):
        raise Unsolvable("the samples it predicts hold non-finite values")
    table = table.to(dev)
    R = torch.tensor(reach(patch), device=dev)
    S = [2 * r + 1 for r in reach(patch)]
    tflat = table.float().reshape(-1)
    c0 = float(table[tuple(reach(patch))])
    offs = candidates(patch, table.cpu(), K).to(dev)  # (C, 3)
    K = min(K, len(offs))
    # the patch's voxels in patchify's order, (P, 3)
    box = torch.stack(torch.meshgrid(*[torch.arange(p, device=dev) for p in patch], indexing="ij"), -1).reshape(-1, 3)
    vis_tok = torch.zeros(B, L, dtype=torch.bool, device=dev)
    vis_tok.scatter_(1, ids_keep.to(dev), True)
    vis = M.unpatchify(vis_tok[..., None].expand(-1, -1, P).float(), patch, grid)[:, 0] > 0.5  # (B, Z, Y, X)
    xs = x[:, 0].float()
    b_ids, t_ids = (~vis_tok).nonzero(as_tuple=True)  # the masked patches
    out = torch.zeros(B, L, P, device=dev)
    # lag a - b has the flat index flat(a) - flat(b) + flat(R) in the table (its strides): linear in a and b
    strides = (S[1] * S[2], S[2])
    f_box, f_R = flat(box, strides), int(flat(R, strides))
    n = max(1, budget // (K * (K + P)))
    rank = len(offs) - torch.arange(len(offs), device=dev)  # earlier in the order: larger
    for s in range(0, len(b_ids), n):
        b, t = b_ids[s:s + n], t_ids[s:s + n]
        origin = M.token_coords(t, grid) * torch.tensor(patch, device=dev)  # (m, 3)
        pos = origin[:, None, :] + offs[None]  # (m, C, 3)
        inb = ((pos >= 0) & (pos < torch.tensor([Z, Y, X], device=dev))).all(-1)
        pc = pos.clamp(min=torch.zeros(3, dtype=torch.long, device=dev), max=torch.tensor([Z - 1, Y - 1, X - 1],
                                                                                         device=dev))
        ok = inb & vis[b[:, None], pc[..., 0], pc[..., 1], pc[..., 2]]  # (m, C) visible and inside the sample
        top, idx = (ok * rank).topk(K, dim=1)  # the first K usable offsets in the order
        here = top > 0  # (m, K): fewer than K usable leaves the rest out
        sel = offs[idx]  # (m, K, 3)
        p = (origin[:, None, :] + sel).clamp(min=torch.zeros(3, dtype=torch.long, device=dev),
                                              max=torch.tensor([Z - 1, Y - 1, X - 1], device=dev))
        v = xs[b[:, None], p[..., 0], p[..., 1], p[..., 2]] * here  # (m, K)
        fs = flat(sel, strides)  # (m, K)
        Cvv = tflat[fs[:, :, None] - fs[:, None, :] + f_R]  # (m, K, K)
        both = here[:, :, None] & here[:, None, :]
        eye = torch.eye(K, device=dev, dtype=torch.bool)
        Cvv = torch.where(both, Cvv, 0.0) + torch.where(eye, torch.where(here, NUGGET * c0, 1.0)[:, :, None], 0.0)
        Cvm = tflat[fs[:, :, None] - f_box[None, None, :] + f_R] * here[:, :, None]  # (m, K, P)
        a, info = torch.linalg.solve_ex(Cvv, v[..., None])  # (m, K, 1): C_vv^-1 v, one right-hand side
        if bool((info != 0).any()):  # (solve_ex reports a singular C_vv where solve would raise a raw LinAlgError)
            raise Unsolvable(f"C_vv of {int((info != 0).sum())} masked patch(es) is singular (the covariance table "
                             f"is not positive definite even with the nugget)")
        out[b, t] = (Cvm * a).sum(1)  # c_vm^T C_vv^-1 v
    return out


normalise = M.norm_patches  # each patch by its own mean and std, as mae_loss normalises the target


def fit_scale(crops, ids_keep, patch, table):
    """alpha: the least-squares multiple of the normalised y_hat that best fits the normalised targets of the
    masked patches of these (training) crops."""
    y_hat = predict(crops, ids_keep, patch, table)
    patches = M.patchify(crops.float(), patch)
    _, _, ids_masked = M.mask_from_keep(ids_keep, patches.shape[1])
    n = normalise(M.gather_tokens(y_hat, ids_masked))
    t = normalise(M.gather_tokens(patches, ids_masked))
    return float((n * t).sum() / (n * n).sum().clamp(min=1e-12))


def floor_pred(x, ids_keep, patch, table, norm_pix_loss, alpha=1.0):
    """The floor's prediction (B, L, P), in the units the model's pred is scored in (mae_loss)."""
    y_hat = predict(x, ids_keep, patch, table)
    return alpha * normalise(y_hat) if norm_pix_loss else y_hat


def loss_per_sample(pred, x, ids_keep, model):
    """pred (B, L, P) scored as the validation scores the model's: each sample's masked loss (mae_loss / count)."""
    patches = M.patchify(x.float(), model.patch)
    _, _, ids_masked = M.mask_from_keep(ids_keep, patches.shape[1])
    out = []
    for b in range(len(x)):
        s, c = M.mae_loss(pred[b:b + 1], patches[b:b + 1], ids_masked[b:b + 1], model.norm_pix_loss)
        out.append(s / c)
    return torch.stack(out)
