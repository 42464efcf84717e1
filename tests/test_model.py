"""model.py against its definitions: patch order, positions, masking, loss, and that it can learn."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import model as M
from infra import plan


def test_patchify_roundtrip_exact():
    x = torch.randn(2, 1, 16, 24, 40)
    p = M.patchify(x, (8, 4, 8))
    assert p.shape == (2, 2 * 6 * 5, 8 * 4 * 8)
    assert torch.equal(M.unpatchify(p, (8, 4, 8), (2, 6, 5)), x)


def test_conv3d_embedding_equals_linear_on_patchify_in_grid_order():
    torch.manual_seed(0)
    patch, grid = (4, 2, 8), (3, 5, 2)  # non-cubic patch and grid
    x = torch.randn(2, 1, 12, 10, 16)
    conv = torch.nn.Conv3d(1, 7, kernel_size=patch, stride=patch).double()
    ref = conv(x.double()).flatten(2).transpose(1, 2)  # (B, L, D), Conv3d's own token order
    lin = F.linear(M.patchify(x.double(), patch), conv.weight.view(7, -1), conv.bias)
    torch.testing.assert_close(lin, ref, rtol=1e-12, atol=1e-12)
    # the model's PatchEmbed is that Conv3d, applied to cut-out patches
    pe = M.PatchEmbed(1, 7, kernel_size=patch, stride=patch).double()
    pe.load_state_dict(conv.state_dict())
    torch.testing.assert_close(pe(M.patchify(x.double(), patch)), ref, rtol=1e-12, atol=1e-12)
    # token t of that order sits at token_coords(t): check against the conv output grid directly
    out = conv(x.double())  # (B, D, gz, gy, gx)
    for t in [0, 1, 7, 29]:
        z, y, xx = M.token_coords(torch.tensor(t), grid).tolist()
        torch.testing.assert_close(ref[:, t], out[:, :, z, y, xx])


@pytest.mark.parametrize("dim", [512, 768, 1024, 1280])
def test_positions(dim):
    grid = (5, 4, 7)
    ids = torch.arange(math.prod(grid))
    pe = M.sincos_pos_embed(ids, grid, dim)
    assert pe.shape == (len(ids), dim) and pe.dtype == torch.float32
    assert torch.isfinite(pe).all()
    assert torch.equal(pe, M.sincos_pos_embed(ids, grid, dim))  # deterministic
    assert torch.unique(pe, dim=0).shape[0] == len(ids)  # unique rows
    # the z part depends on z only, the y part on y only, the x part on x only
    dz, dy, dx = M.axis_split(dim)
    assert dz + dy + dx == dim and dz % 2 == dy % 2 == dx % 2 == 0
    c = M.token_coords(ids, grid)
    for a, (lo, hi) in enumerate([(0, dz), (dz, dz + dy), (dz + dy, dim)]):
        for v in range(grid[a]):
            rows = pe[c[:, a] == v, lo:hi]
            assert torch.equal(rows, rows[:1].expand_as(rows))
        other = pe[c[:, a] == 0, lo:hi][0], pe[c[:, a] == 1, lo:hi][0]
        assert not torch.equal(*other)  # and it does depend on its own coordinate
    # a subset computed alone equals the same rows of the full set, in any shape
    sub = torch.tensor([[3, 77, 139], [0, 5, 100]])
    assert torch.equal(M.sincos_pos_embed(sub, grid, dim), pe[sub])


def test_positions_far_apart_at_big_context():
    grid = (96, 96, 128)  # 1,179,648 tokens: embed only a few, no table
    ids = torch.tensor([0, 1, 128, 96 * 128, 96 * 96 * 128 - 1])
    pe = M.sincos_pos_embed(ids, grid, 1024)
    assert torch.unique(pe, dim=0).shape[0] == 5 and torch.isfinite(pe).all()


def test_masking():
    """MAE's masking, one stratum: the tokens of least noise kept; the mask and the unshuffle that go with them."""
    B, L, keep = 3, 50, 12

    def masking(noise):
        ids_keep = M.stratified_masking(noise, 1, keep + 1, has_cls=True)  # (the cls token is one of the E kept)
        mask, ids_restore, ids_masked = M.mask_from_keep(ids_keep, L)
        return ids_keep, mask, ids_restore, ids_masked
    noise = torch.rand(B, L, generator=torch.Generator().manual_seed(1))
    ids_keep, mask, ids_restore, ids_masked = masking(noise)
    assert ids_keep.shape == (B, keep)
    assert torch.equal(mask.sum(1), torch.full((B,), float(L - keep)))
    ids_shuffle = torch.cat([ids_keep, ids_masked], dim=1)  # [kept..., masked...]
    assert torch.equal(torch.gather(ids_shuffle, 1, ids_restore), torch.arange(L).expand(B, L))
    for b in range(B):
        assert set(ids_keep[b].tolist()) == set((mask[b] == 0).nonzero().flatten().tolist())
        assert set(ids_keep[b].tolist()) == set(noise[b].argsort()[:keep].tolist())  # smallest noise kept
    again = masking(noise.clone())
    assert all(torch.equal(a, b) for a, b in zip(again, (ids_keep, mask, ids_restore, ids_masked)))


def test_loss_only_on_masked_patches():
    torch.manual_seed(0)
    patches = torch.randn(2, 10, 8)
    pred = torch.randn(2, 10, 8, requires_grad=True)
    mask = torch.zeros(2, 10)
    mask[:, ::3] = 1
    ids_masked = torch.arange(0, 10, 3).expand(2, -1)
    s, n = M.mae_loss(pred, patches, ids_masked)
    (s / n).backward()
    visible = mask == 0
    assert torch.count_nonzero(pred.grad[visible]) == 0
    assert torch.count_nonzero(pred.grad[~visible]) > 0
    # the same as the error of every patch, masked: (err * mask).sum() / mask.sum()
    err = ((pred.detach() - patches) ** 2).mean(-1)
    torch.testing.assert_close(s.detach() / n, (err * mask).sum() / mask.sum())
    # an all-masked loss is plain MSE
    s, n = M.mae_loss(pred.detach(), patches, torch.arange(10).expand(2, -1))
    torch.testing.assert_close(s / n, F.mse_loss(pred.detach(), patches))


def test_norm_pix_loss_finite_on_constant_patches():
    patches = torch.full((1, 4, 64), 3.0)
    s, n = M.mae_loss(torch.zeros(1, 4, 64), patches, torch.arange(4)[None], norm_pix_loss=True)
    assert torch.isfinite(s) and s.item() == 0.0


def test_forward_shapes_and_no_visible_leak():
    torch.manual_seed(0)
    m = M.mae("tiny", grid=(2, 3, 4), patch=(4, 4, 4))
    x = torch.randn(2, 1, 8, 12, 16)
    loss, pred, mask = m(x)
    assert pred.shape == (2, 24, 64) and mask.shape == (2, 24) and torch.isfinite(loss)
    assert int(mask.sum()) == 2 * (24 - m.n_keep())
    # the prediction of a masked token does not see that token's voxels: changing a masked patch's
    # input leaves every prediction unchanged (the encoder only sees visible patches)
    noise = torch.rand(2, 24)
    _, p1, mask = m(x, noise)
    t = int(mask[0].nonzero()[0])
    x2 = M.unpatchify(M.patchify(x, m.patch).index_put_((torch.tensor([0]), torch.tensor([t])),
                                                       torch.randn(64)), m.patch, m.grid)
    _, p2, _ = m(x2, noise)
    torch.testing.assert_close(p1, p2)


def test_flops_estimate_matches_a_count():
    m = M.mae("tiny", grid=(2, 2, 4), patch=(4, 4, 4))
    n, L, D, d, P = m.n_keep(), m.L, m.dim, m.dec_dim, m.P
    fwd = 2 * n * P * D + 4 * (24 * (n + 1) * D * D + 4 * (n + 1) ** 2 * D)
    fwd += 2 * n * D * d + 2 * (24 * L * d * d + 4 * L * L * d) + 2 * L * d * P
    assert plan.flops_per_sample(m) == 3 * fwd


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    m = M.mae("tiny", grid=(2, 2, 4), patch=(8, 8, 8))
    x = torch.randn(2, 1, 16, 16, 32)
    noise = torch.rand(2, m.L)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3)
    first = None
    for i in range(200):
        loss, _, _ = m(x, noise)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() <= 0.1 * first, (first, loss.item())


@pytest.mark.parametrize("ckpt", [True, 1, 3, 5])
def test_grad_ckpt_same_gradients(ckpt):
    """Every block (set_grad_ckpt(True)), or a run's first k of the planner's ckpt_order (plan.checkpointed): the same
    gradients as no checkpointing, and exactly the chosen blocks run their forward twice (once more in backward: that
    is the recompute). A block the model does not have is refused."""
    torch.manual_seed(0)
    a = M.mae("tiny", grid=(2, 2, 4), patch=(4, 4, 4))
    b = M.mae("tiny", grid=(2, 2, 4), patch=(4, 4, 4))
    b.set_grad_ckpt(True if ckpt is True else plan.checkpointed(b, {"grad_ckpt": True, "ckpt_blocks": ckpt}))
    b.load_state_dict(a.state_dict())
    calls = {}  # (forward hooks do not fire in checkpoint's recompute: each block's forward is wrapped instead)
    for stack, blocks in (("enc", b.blocks), ("dec", b.decoder_blocks)):
        for i, blk in enumerate(blocks):
            def counted(*a, _f=blk.forward, _key=(stack, i), **kw):
                calls[_key] = calls.get(_key, 0) + 1
                return _f(*a, **kw)
            blk.forward = counted
    x, noise = torch.randn(2, 1, 8, 8, 16), torch.rand(2, 16)
    a(x, noise)[0].backward()
    b(x, noise)[0].backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    order = plan.ckpt_order(b)
    k = len(order) if ckpt is True else ckpt
    assert {key for key, c in calls.items() if c == 2} == set(order[:k]) == b.ckpt
    assert all(c in (1, 2) for c in calls.values()) and len(calls) == len(order) == 6
    assert plan.checkpointed(b, {"grad_ckpt": True, "ckpt_blocks": -1}) == set(order)
    assert plan.checkpointed(b, {"grad_ckpt": False, "ckpt_blocks": -1}) == set()
    with pytest.raises(AssertionError, match="no such blocks"):
        b.set_grad_ckpt([("dec", 2)])


def test_ckpt_order_frees_the_most_bytes_per_recomputed_flop_first():
    """A stack's blocks go first when (8 + 4 mlp) C + 4 N is smaller (plan.ckpt_order): at big_context's shapes the
    encoder (1,664 wide, 294,912 tokens) before the decoder (512 wide, 1,179,648 tokens); in a tiny model with few
    tokens the narrower decoder first."""
    with torch.device("meta"):  # (init=False: shapes only)
        big = M.mae("G", grid=(96, 96, 128), patch=(16, 16, 16), mask_strata=8, init=False)
        tiny = M.mae("tiny", grid=(2, 2, 4), patch=(4, 4, 4), init=False)
    assert plan.ckpt_order(big)[0] == ("enc", 0) and plan.ckpt_order(big)[48] == ("dec", 0)
    assert plan.ckpt_order(tiny)[0] == ("dec", 0)
    for m in (big, tiny):  # the order is by freed bytes (16 C N per block) per recomputed FLOP
        shapes = (("enc", m.dim, plan.visible(m) + 1), ("dec", m.dec_dim, m.L))
        per = {st: 16 * C * N / plan.block_flops(m, st) for st, C, N in shapes}
        assert per[plan.ckpt_order(m)[0][0]] >= per[plan.ckpt_order(m)[-1][0]]


def test_heads_split_the_same_weights_into_another_function_that_resume_and_init_from_guard():
    """heads / dec_heads (0: the size's own, model.SIZES) change no parameter and so no checkpoint's shapes, only the
    function: a tiny MAE's weights load into its one-head twin and give other outputs. So a checkpoint or a model
    file trained with the size's own heads (0) resumes and warm-starts as before under the same counts written out,
    and another split is refused with the counts it was trained with; the UNETR fine-tuning takes the encoder
    alone, so its decoder's heads do not matter. Counts that do not divide the width are a config error naming an
    aligned one."""
    import configurator
    from infra import checkpoint, modelfile
    cfg = {**configurator.defaults(), "crop": (16, 16, 32), "patch": (8, 8, 8)}
    torch.manual_seed(0)
    own, one = M.build_model(cfg), M.build_model({**cfg, "heads": 1, "dec_heads": 1})
    assert [b.heads for b in own.blocks] == [4] * 4 and [b.heads for b in one.blocks] == [1] * 4
    assert {k: v.shape for k, v in own.state_dict().items()} == {k: v.shape for k, v in one.state_dict().items()}
    one.load_state_dict(own.state_dict())
    x, noise = torch.randn(2, 1, 16, 16, 32), torch.rand(2, 16)
    with torch.no_grad():
        a, b = (m(x, noise=noise)[0] for m in (own, one))
    assert not torch.allclose(a, b, atol=1e-4)  # the same weights, another function
    old = json.loads(json.dumps(cfg))  # as a checkpoint's COMPLETE holds it: heads 0, the size's own
    assert M.head_counts(old) == M.head_counts(cfg) == M.head_counts({**cfg, "heads": 4}) == (4, 4)
    meta = {"config": old, "world": 1, "dtype": "torch.float32"}
    for same in (cfg, {**cfg, "heads": 4, "dec_heads": 4}):
        checkpoint.check_compatible(meta, same, 1, "torch.float32", "ckpt/step_2")
        modelfile.check_init(old, same, "m.pt")
    with pytest.raises(configurator.ConfigError, match=r"trained with heads, dec_heads=\(4, 4\), this run has \(1, 4\)"):
        checkpoint.check_compatible(meta, {**cfg, "heads": 1}, 1, "torch.float32", "ckpt/step_2")
    with pytest.raises(configurator.ConfigError, match="trained with 4 encoder and 4 decoder heads and this run has 4 "
                                                       "and 1: .* set heads=4 dec_heads=4"):
        modelfile.check_init(old, {**cfg, "dec_heads": 1}, "m.pt")
    seg = {**cfg, "task": "segment", "seg_head": "unetr", "dec_heads": 1}
    modelfile.check_init(old, seg, "m.pt")  # the UNETR head takes no decoder block
    with pytest.raises(configurator.ConfigError, match="trained with 4 encoder"):
        modelfile.check_init(old, {**seg, "heads": 2}, "m.pt")
    for bad, says in (({"heads": 5}, r"heads=5: 0 \(model_size 'tiny''s own 4\) or a count that divides its width 96"),
                      ({"dec_heads": 3}, r"dec_heads=3: .* width 64, e.g. 1 \(heads of 64\)"),
                      ({"heads": -1}, "heads=-1"), ({"model_size": "G", "heads": 16.0}, "e.g. 13 \\(heads of 128\\)")):
        with pytest.raises(configurator.ConfigError, match=says):
            configurator.check_config({**cfg, **bad})
