"""The context-parallel MAE: cp ranks on one sample compute what one rank computes on the whole sample."""
import math

import pytest
import torch
import torch.distributed as dist

import model as M
import ring_attention as RA
from dist_util import run_ranks
from infra.torch_cp import torch_cp_attention


def _make(strata):
    torch.manual_seed(0)
    # grid 8 x 2 x 3 = 48 tokens of 4^3 voxels; head dims 24 and 16 (multiples of 8, as the fused ops need)
    return M.mae("tiny", grid=(8, 2, 3), patch=(4, 4, 4), mask_ratio=0.7, mask_strata=strata)


def _check_cp_equals_single(rank, W, impl):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 32, 8, 12, generator=g)
    noise = torch.rand(2, 48, generator=g)
    # reference: one rank, whole sample, the same stratified mask (mask_strata = W)
    ref = _make(W)
    loss_ref, pred_ref, mask_ref = ref(x, noise)
    loss_ref.backward()
    # context parallel: this rank's slab of inline planes, its share of the noise
    m = _make(W)
    m.set_context_parallel(dist.group.WORLD, {"ring": RA.ring_attention, "torch": torch_cp_attention}[impl])
    Z, Lr = 32 // W, 48 // W
    sl = slice(rank * Lr, (rank + 1) * Lr)
    loss, pred, mask = m(x[:, :, rank * Z:(rank + 1) * Z], noise[:, sl])
    assert torch.equal(mask, mask_ref[:, sl])
    (loss * W).backward()  # train.py's rule: loss x cp, gradients averaged over all ranks
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, loss_ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pred.detach(), pred_ref.detach()[:, sl], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        grad /= W
        torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda s: f"{name}: {s}")


@pytest.mark.parametrize("W", [2, 4])
def test_cp_mae_equals_single_rank_loss_and_every_gradient(W):
    run_ranks(W, _check_cp_equals_single, "ring")


def test_cp_mae_torch_impl_equals_single_rank_loss_and_every_gradient():
    run_ranks(2, _check_cp_equals_single, "torch")


def test_stratified_masking_with_one_stratum_is_mae_masking():
    noise = torch.rand(3, 40)
    E = M.encoder_tokens_per_stratum(40, 0.75, 1)
    ids = M.stratified_masking(noise, 1, E, has_cls=True)
    # MAE's masking (models_mae.py random_masking): keep the 10 of least noise; the mask unshuffled by ids_restore
    ids_shuffle = torch.argsort(noise, dim=1)
    ref_keep = ids_shuffle[:, :int(40 * 0.25)]
    ref_mask = torch.ones(3, 40)
    ref_mask[:, :int(40 * 0.25)] = 0
    ref_mask = torch.gather(ref_mask, 1, torch.argsort(ids_shuffle, dim=1))
    assert torch.equal(ids, ref_keep)
    mask, ids_restore, masked = M.mask_from_keep(ids, 40)
    assert torch.equal(mask, ref_mask)
    assert torch.equal(masked, torch.argsort(mask, dim=1, descending=True, stable=True)[:, :30])
    assert torch.equal(torch.gather(mask, 1, masked), torch.ones(3, 30))  # all masked, ascending
    assert (masked.diff(dim=1) > 0).all()
    # ids_restore puts [kept..., masked...] back in order
    order = torch.cat([ids, masked], dim=1)
    assert torch.equal(torch.gather(order, 1, ids_restore), torch.arange(40).expand(3, 40))


@pytest.mark.parametrize("grid", [(8, 8, 8), (40, 40, 64), (96, 96, 128), (4, 3, 5), (16, 1, 7)])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.9])
def test_mask_lengths_divide_by_cp(grid, cp, ratio):
    if grid[0] % cp:
        pytest.skip("grid not divisible by cp (train.py rejects it)")
    L = math.prod(grid)
    E = M.encoder_tokens_per_stratum(L, ratio, cp)
    n_vis = cp * E - 1
    per_rank = [(E - 1 if r == 0 else E) + (1 if r == 0 else 0) for r in range(cp)]  # patches (+ cls)
    assert len(set(per_rank)) == 1 and sum(per_rank) == n_vis + 1 and (n_vis + 1) % cp == 0
    assert L % cp == 0  # the decoder sequence
    realised = 1 - n_vis / L
    assert abs(realised - ratio) <= (cp / 2 + 1) / L + 1e-12
    # and the masking function realises exactly these counts on every rank
    noise = torch.rand(1, L // cp)
    for r in range(cp):
        assert M.stratified_masking(noise, 1, E, has_cls=(r == 0)).shape[1] == per_rank[r] - (r == 0)
