"""
A 3D Vision Transformer masked autoencoder (ViT-MAE) for seismic volumes.

Read top to bottom:
  1. patchify / unpatchify     volume  <->  sequence of 16x16x16-voxel patches
  2. 3D sin-cos positions      computed from token grid coordinates, for any subset of tokens
  3. masking                   mask noise per sample; the tokens of least noise kept, per stratum (MAE's argsort)
  4. attention + Block         every attention call goes through `attention()`
  5. Encoder, MAE, Segmenter   the shared encoder; the MAE: encoder on visible tokens + cls, decoder on all tokens;
                               the segmenter: encoder on every token, a head to every voxel; their losses
  6. configure_optimizers      AdamW and its parameter groups (weight decay, layer decay): the one optimizer
  7. model sizes               one-line functions, tiny .. G; build_model(cfg): the model of a config

Axis convention. A volume is (inline, crossline, time), the MDIO order. In torch it is a tensor
(B, 1, Z, Y, X) with Z = inline, Y = crossline, X = time, i.e. Conv3d's (D, H, W). A token grid is
(gz, gy, gx) = (Z/pz, Y/py, X/px) and token t sits at grid coordinate
    z = t // (gy*gx),  y = (t // gx) % gy,  x = t % gx          (row-major, time fastest)
which is the order Conv3d's output has after .flatten(2), the order of patchify(), and the order
the positional embedding uses. Grids are rarely cubic (640x640x1024 voxels -> 40x40x64 tokens).

After facebookresearch/mae (models_mae.py), with two departures that matter at 1.2 M tokens:
  * no L x D positional table is stored (at L = 1,179,648 and D = 1024 it would be 4.8 GB in fp32):
    positions are computed on the fly for exactly the tokens that are used;
  * no B*L*D index tensor is ever built: gathers use index.expand(), a stride-0 view.
And one departure in the architecture: the decoder runs on the L patch tokens only, without the cls
token (see MAE.forward_decoder for why).

Context parallelism (cp > 1). The cp ranks of a group work on the same sample; rank r holds the
contiguous share of tokens [r*L/cp, (r+1)*L/cp), which in (z, y, x) order is a slab of gz/cp inline
planes, so it reads and patchifies only its own slab of the volume. The mask is stratified (below) so
that every rank keeps the same number of encoder tokens from its own share: no all-to-all is needed,
encoder and decoder sequences split evenly, and attention is the ring (ring_attention.py).
"""

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ring_attention
from unetr import UNETRHead  # fine-tuning's segmentation head (seg_head="unetr")

# -----------------------------------------------------------------------------
# 1. patchify / unpatchify


def patchify(x, patch):
    """(B, 1, Z, Y, X) -> (B, L, pz*py*px), tokens in (z, y, x) row-major order, voxels inside a patch
    in (pz, py, px) row-major order: the same layout as a Conv3d kernel (out, 1, pz, py, px)."""
    B, C, Z, Y, X = x.shape
    pz, py, px = patch
    assert C == 1 and Z % pz == 0 and Y % py == 0 and X % px == 0, (x.shape, patch)
    gz, gy, gx = Z // pz, Y // py, X // px
    x = x.reshape(B, gz, pz, gy, py, gx, px)
    x = x.permute(0, 1, 3, 5, 2, 4, 6)  # (B, gz, gy, gx, pz, py, px)
    return x.reshape(B, gz * gy * gx, pz * py * px)


def unpatchify(p, patch, grid):
    """(B, L, pz*py*px) -> (B, 1, Z, Y, X); the exact inverse of patchify."""
    B = p.shape[0]
    pz, py, px = patch
    gz, gy, gx = grid
    x = p.reshape(B, gz, gy, gx, pz, py, px).permute(0, 1, 4, 2, 5, 3, 6)  # (B, gz, pz, gy, py, gx, px)
    return x.reshape(B, 1, gz * pz, gy * py, gx * px)


# -----------------------------------------------------------------------------
# 2. 3D sin-cos positional embedding, computed per token


def token_coords(ids, grid):
    """Token indices (any shape) -> grid coordinates (..., 3) as (z, y, x)."""
    gz, gy, gx = grid
    return torch.stack([ids // (gy * gx), (ids // gx) % gy, ids % gx], dim=-1)


def axis_split(dim):
    """How many channels each axis gets. Each axis needs an even number (half sin, half cos).
    D = 768 splits evenly (256 each); D = 512, 1024, 1280 do not divide by 6, so the first two axes get
    2*floor(D/6) and the last axis (time, the longest grid axis) takes the rest:
        512 -> 170, 170, 172     1024 -> 340, 340, 344     1280 -> 426, 426, 428"""
    assert dim % 2 == 0 and dim >= 6, f"embedding dim must be even and >= 6, got {dim}"
    d = 2 * (dim // 6)
    return d, d, dim - 2 * d


def sincos_1d(pos, dim):
    """pos (N,) float64 -> (N, dim): [sin(pos * w_k), cos(pos * w_k)], w_k = 10000^(-k / (dim/2))."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64, device=pos.device) / (dim / 2))
    angle = pos[:, None] * omega[None, :]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)


def sincos_pos_embed(ids, grid, dim, dtype=torch.float32):
    """Fixed 3D sin-cos embedding of the tokens `ids` (any shape, int64) on `grid`: (*ids.shape, dim).
    Row t depends only on t's coordinates, so any subset of tokens can be embedded alone (no L x D table).
    Each axis has a small table (g_a x d_a: at most 128 x 428 numbers), computed in float64 and cast once;
    the rows are gathered from the three tables by coordinate, directly in `dtype`, so the only large
    tensor is the output itself (not a float64 intermediate: 12 GB at 1.2 M tokens x 512)."""
    coords = token_coords(ids.reshape(-1), grid)  # (N, 3) int64
    parts = []
    for a, d in enumerate(axis_split(dim)):
        table = sincos_1d(torch.arange(grid[a], dtype=torch.float64, device=ids.device), d).to(dtype)
        parts.append(table[coords[:, a]])  # (N, d)
    return torch.cat(parts, dim=1).reshape(*ids.shape, dim)


# -----------------------------------------------------------------------------
# 3. masking
#
# MAE keeps, per sample, the tokens with the smallest noise. Here the noise is a function of the sample (mask_noise),
# and the tokens are kept per stratum (stratified_masking) so that under context parallelism every cp rank keeps the
# same number from its own share. With one stratum it is MAE's argsort masking exactly.


def mask_noise(seed, ids, L, cp_rank=0, cp_size=1, stream="train"):
    """Masking noise for sample indices `ids` of a stream, this rank's share: (len(ids), L / cp_size) float32. Like
    the crops (data.py), a function of the sample alone (key [seed, g, 1]; validation [seed, g, 3]): identical within
    a CP group, different between samples, and the same whatever the dp/cp layout or a resume (4 bytes per token:
    4.7 MB at 1.2 M tokens). Drawn on the host, in the prefetch threads (train.py) and in validation alike."""
    share = slice(cp_rank * L // cp_size, (cp_rank + 1) * L // cp_size)
    key = 3 if stream == "val" else 1
    return torch.from_numpy(np.stack([np.random.default_rng([seed, g, key]).random(L, dtype=np.float32)[share]
                                      for g in ids]))


def encoder_tokens_per_stratum(L, mask_ratio, strata):
    """The encoder tokens per stratum, E, when the L tokens are split into `strata` equal consecutive strata
    and every stratum keeps E tokens, counting the cls token in stratum 0 (which keeps E - 1 patches).
    Then the encoder sequence, n_visible + 1 = strata * E, divides by strata and so by cp; the decoder
    sequence is L, which divides too. E is the nearest to MAE's int(L * (1 - mask_ratio)) + 1 that does this:
    this is the "mask ratio adjustment" that context parallelism needs."""
    target = int(L * (1 - mask_ratio)) + 1
    return min(L // strata, max(1, round(target / strata)))


def stratified_masking(noise, strata, per_stratum, has_cls):
    """noise (B, L_loc) -> ids_keep (B, n): the per_stratum (E) lowest-noise tokens of each of `strata` equal
    consecutive strata of this rank's tokens (E - 1 in the first stratum of the rank that holds the cls token), each
    stratum's in order of increasing noise. With one stratum and E = n + 1 (the cls counted) it is MAE's ids_keep,
    argsort(noise)[:, :n]."""
    B, L_loc = noise.shape
    Ls = L_loc // strata
    keep = []
    for s in range(strata):
        k = per_stratum - 1 if (has_cls and s == 0) else per_stratum
        keep.append(torch.argsort(noise[:, s * Ls:(s + 1) * Ls], dim=1)[:, :k] + s * Ls)
    return torch.cat(keep, dim=1)


def mask_from_keep(ids_keep, L):
    """What the decoder and the loss need from kept indices ids_keep (B, n) out of L tokens:
      mask        (B, L)      1 = masked, 0 = visible, in token order
      ids_restore (B, L)      puts the sequence [kept..., masked...] back in token order (the unshuffle)
      ids_masked  (B, L - n)  the masked tokens, ascending
    The masked tokens follow the kept ones in index order (MAE: in noise order): they all become the same mask
    token, so their order is free."""
    B, n = ids_keep.shape
    mask = torch.ones(B, L, device=ids_keep.device)
    mask.scatter_(1, ids_keep, 0.0)
    masked = torch.argsort(mask, dim=1, descending=True, stable=True)[:, : L - n]  # masked ids, ascending
    ids_restore = torch.argsort(torch.cat([ids_keep, masked], dim=1), dim=1)
    return mask, ids_restore, masked


def gather_tokens(x, ids):
    """x (B, L, D), ids (B, n) -> (B, n, D). The index is expanded as a stride-0 view, so no B*n*D int64
    tensor is allocated (MAE's ids.unsqueeze(-1).repeat(1, 1, D) would be 9 GB at 1.2 M tokens)."""
    return torch.gather(x, 1, ids.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


# -----------------------------------------------------------------------------
# 4. attention and the transformer block


def attention(q, k, v, ring=None):
    """The one attention call of the model. q, k, v: (B, H, N, Dh) -> (B, H, N, Dh), non-causal.
    ring = None: all N tokens are here, plain fused SDPA. ring = (group, attend): these are this rank's N of the
    sequence split over the cp ranks of `group`, and attend(q, k, v, group) is attention over the whole of it
    (set_context_parallel)."""
    if ring is None:
        return F.scaled_dot_product_attention(q, k, v)
    group, attend = ring
    return attend(q, k, v, group)


class PatchEmbed(nn.Conv3d):
    """The patch embedding: a Conv3d (1 channel in, dim out, kernel = stride = patch), applied as a matmul on
    patches that are already cut out, (B, n, P) -> (B, n, dim): the same function (tests/test_model.py
    proves it) at a quarter of the cost when 75 % are masked, since only visible patches are embedded.
    It is its own module, called through forward, so that sharded strategies (ZeRO-3, FSDP2) gather its
    weights when it runs."""

    def forward(self, patches):
        return F.linear(patches, self.weight.view(self.out_channels, -1), self.bias)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim, heads, mlp_ratio=4.0):
        super().__init__()
        assert dim % heads == 0, f"dim {dim} not divisible by heads {heads}"
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x, ring=None):  # (B, N, dim), N = this rank's tokens
        B, N, C = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(B, N, 3, self.heads, C // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, N, Dh)
        a = attention(q, k, v, ring).transpose(1, 2).reshape(B, N, C)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


# -----------------------------------------------------------------------------
# 5. the models: the encoder both share, the masked autoencoder, the segmenter


class Encoder(nn.Module):
    """The ViT encoder the MAE and the segmenter share: the patch embedding, the cls token, the blocks and the final
    norm; and what runs every block stack of either model: context parallelism (set_context_parallel) and activation
    checkpointing (set_grad_ckpt). A subclass adds its decoder or head after these (so that the parameters keep the
    names and the order that model files and checkpoints hold), a decoder_blocks list (empty where it has none: the
    code that walks the stacks walks both) and its dec_dim; then calls initialize_weights."""

    def __init__(self, grid, patch, dim, depth, heads, mlp_ratio):
        super().__init__()
        self.grid, self.patch = tuple(grid), tuple(patch)
        self.L = math.prod(self.grid)  # tokens per sample
        self.P = math.prod(self.patch)  # voxels per patch
        self.dim = dim
        self.ring = None  # (group, attend) under context parallelism (the cp ranks' ring): set_context_parallel
        self.ckpt = set()  # the blocks activation checkpointing recomputes, {("enc" | "dec", index)}: set_grad_ckpt
        # the Conv3d patch embedding, applied to the patches it is given only (PatchEmbed)
        self.patch_embed = PatchEmbed(1, dim, kernel_size=self.patch, stride=self.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def initialize_weights(self):
        # MAE init: xavier-uniform on every Linear and on the patch embedding seen as a (dim, P) Linear,
        # zero biases, LayerNorm (1, 0), and N(0, 0.02) for the cls and mask tokens.
        w = self.patch_embed.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.patch_embed.bias)
        for name, p in self.named_parameters():
            if name.endswith("_token"):  # cls_token, and the MAE's mask_token
                nn.init.normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def set_grad_ckpt(self, blocks):
        """Activation checkpointing of `blocks`, ("enc" | "dec", index) pairs: True every block, False none. Which
        blocks a run checkpoints is the planner's choice (infra/plan.py: checkpointed, by ckpt_order); it changes
        how training recomputes, not the function."""
        every = [(st, i) for st, b in (("enc", self.blocks), ("dec", self.decoder_blocks)) for i in range(len(b))]
        self.ckpt = set(every if blocks is True else blocks or ())
        assert self.ckpt <= set(every), f"no such blocks to checkpoint: {sorted(self.ckpt - set(every))}"

    def set_context_parallel(self, group, attend=ring_attention.ring_attention):
        """Split every sample over the ranks of `group` (None or a group of 1: no context parallelism), its attention
        computed by attend(q, k, v, group): our ring, or any function that computes the same (train.py passes
        infra/torch_cp.py's torch_cp_attention for cp_impl='torch')."""
        size = dist.get_world_size(group) if group is not None else 1
        if size > 1:
            assert self.grid[0] % size == 0, (self.grid, size)
        self.ring = (group, attend) if size > 1 else None

    def cp_place(self):
        """(this rank's place in the cp group, the group's size): (0, 1) without context parallelism."""
        return (dist.get_rank(self.ring[0]), dist.get_world_size(self.ring[0])) if self.ring else (0, 1)

    def run_blocks(self, blocks, x, stack, taps=None):
        """x through `blocks`; taps (UNETR's): {block count k: None}, each set to the output after k blocks."""
        for i, blk in enumerate(blocks):
            # activation checkpointing: keep only the block's input, recompute the block in backward
            if (stack, i) in self.ckpt and self.training:
                x = checkpoint(blk, x, self.ring, use_reentrant=False)
            else:
                x = blk(x, self.ring)
            if taps is not None and i + 1 in taps:
                taps[i + 1] = x
        return x

    def forward_encoder(self, patches, ids_keep, offset=0, has_cls=True, taps=None):
        """patches (B, L_loc, P) of this rank's tokens (global ids offset + 0..L_loc-1), ids_keep (B, n) local
        -> latent (B, has_cls + n, dim): the cls token first (on the rank that holds it), then visible tokens.
        taps: {block count k: None}, each set to the output after k blocks (before the final norm)."""
        B = patches.shape[0]
        vis = gather_tokens(patches, ids_keep)  # (B, n, P)
        x = self.patch_embed(vis)  # (B, n, dim)
        x = x + sincos_pos_embed(ids_keep + offset, self.grid, self.dim, x.dtype)  # global positions
        if has_cls:
            cls = self.cls_token.to(x.dtype).expand(B, -1, -1)  # position of cls: zero vector, nothing added
            x = torch.cat([cls, x], dim=1)  # (B, 1 + n, dim)
        else:
            # keep cls_token in this rank's graph (zero gradient): ZeRO buckets gradients as they become
            # ready, and every rank must produce a gradient for the same parameters
            x = x + 0.0 * self.cls_token.to(x.dtype)
        x = self.run_blocks(self.blocks, x, "enc", taps)
        return self.norm(x)


class MAE(Encoder):
    """Pretraining: the encoder on the visible tokens and cls, a narrower, shallower decoder on every token (with its
    own fixed positions and a mask token for the masked ones), each patch's voxels predicted, the loss on the
    masked patches (mae_loss)."""

    def __init__(self, grid=(4, 4, 4), patch=(16, 16, 16), dim=1024, depth=24, heads=16,
                 dec_dim=512, dec_depth=8, dec_heads=16, mlp_ratio=4.0, mask_ratio=0.75,
                 norm_pix_loss=False, mask_strata=1, init=True):
        super().__init__(grid, patch, dim, depth, heads, mlp_ratio)
        self.dec_dim = dec_dim
        self.mask_ratio, self.norm_pix_loss = mask_ratio, norm_pix_loss
        # masking strata (a multiple of cp; train.py sets it to cp unless configured): the mask, and so the
        # model's function, depends on the strata and not on how many ranks compute it
        self.mask_strata = mask_strata
        self.per_stratum = encoder_tokens_per_stratum(self.L, mask_ratio, mask_strata)  # E, encoder tokens
        self.decoder_embed = nn.Linear(dim, dec_dim)
        self.decoder_norm = nn.LayerNorm(dec_dim, eps=1e-6)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.decoder_blocks = nn.ModuleList([Block(dec_dim, dec_heads, mlp_ratio) for _ in range(dec_depth)])
        self.decoder_pred = nn.Linear(dec_dim, self.P)
        if init:  # (False: the caller loads weights next, or wants shapes only: build_model on meta)
            self.initialize_weights()

    def n_keep(self):
        """Visible tokens per sample: MAE's int(L * (1 - mask_ratio)), adjusted so that visible + cls
        divides by mask_strata (see encoder_tokens_per_stratum)."""
        return self.mask_strata * self.per_stratum - 1

    def keep_ids(self, noise, cp_rank=0, cp=1):
        """noise (B, L / cp): masking noise of cp rank cp_rank's tokens -> ids_keep (B, n) int64, local indices
        of the tokens it keeps visible. train.py calls this in the prefetch thread, on the fp32 noise, so the
        mask never passes through a float cast of the model's inputs (FSDP2 casts every floating input to the
        compute dtype: in bf16, noise ties would decide the mask) and is the same under every strategy."""
        assert self.mask_strata % cp == 0, f"mask_strata {self.mask_strata} does not split over cp {cp}"
        return stratified_masking(noise, self.mask_strata // cp, self.per_stratum, has_cls=(cp_rank == 0))

    def forward_decoder(self, latent, ids_restore, offset=0, has_cls=True):
        """latent (B, has_cls + n, dim) -> pred (B, L_loc, P), this rank's tokens in their original order.
        The cls token is not passed to the decoder (MAE passes it, then drops its output). Leaving it out
        makes the decoder sequence exactly the L patch tokens, which split evenly over context-parallel
        ranks (the published system had to keep the decoder length divisible by cp). The cls token still
        learns: every visible token attends to it in the encoder."""
        B, L_loc = ids_restore.shape
        x = self.decoder_embed(latent[:, 1:] if has_cls else latent)  # (B, n, dec_dim), visible tokens only
        masked = self.mask_token.to(x.dtype).expand(B, L_loc - x.shape[1], -1)  # (B, L_loc - n, dec_dim), a view
        x = gather_tokens(torch.cat([x, masked], dim=1), ids_restore)  # unshuffle -> (B, L_loc, dec_dim)
        ids = torch.arange(offset, offset + L_loc, device=x.device)
        x = x + sincos_pos_embed(ids, self.grid, self.dec_dim, x.dtype)  # (L_loc, dec_dim), broadcast
        x = self.run_blocks(self.decoder_blocks, x, "dec")
        return self.decoder_pred(self.decoder_norm(x))  # (B, L_loc, P)

    def forward(self, x, noise=None, ids_keep=None):
        """x (B, 1, Z_loc, Y, X): normalised voxels of this rank's slab (the whole sample without cp).
        ids_keep (B, n): the kept tokens (local indices, from keep_ids; what training passes), or noise
        (B, L_loc): masking noise for this rank's tokens (tests), or neither: random. Returns (loss, pred
        (B, L_loc, P), mask (B, L_loc)), where loss = this rank's masked squared error / the masked count of
        the whole sample (summed over cp)."""
        r, W = self.cp_place()
        patches = patchify(x, self.patch)  # (B, L_loc, P)
        L_loc = patches.shape[1]
        assert L_loc * W == self.L, f"slab of {L_loc} tokens x cp {W} != {self.L} tokens"
        if ids_keep is None:
            if noise is None:
                noise = torch.rand(x.shape[0], L_loc, device=x.device)
            ids_keep = self.keep_ids(noise, r, W)
        mask, ids_restore, ids_masked = mask_from_keep(ids_keep, L_loc)
        latent = self.forward_encoder(patches, ids_keep, offset=r * L_loc, has_cls=(r == 0))
        pred = self.forward_decoder(latent, ids_restore, offset=r * L_loc, has_cls=(r == 0))
        loss_sum, count = mae_loss(pred, patches, ids_masked, self.norm_pix_loss)
        if W > 1:
            dist.all_reduce(count, group=self.ring[0])  # masked patches of the whole sample (no gradient flows here)
        return loss_sum / count, pred, mask


class Segmenter(Encoder):
    """Fine-tuning: the encoder on every token (no mask; no cls token, so that under cp every rank holds as many
    tokens as the others), then a segmentation head that gives every voxel seg_classes class logits (one logit when
    binary). seg_head="unetr" (unetr.py): the head draws every voxel from the encoder's features at several depths
    and the amplitude itself; "linear", the probe's: the MAE decoder's blocks on every token, then each patch's
    voxels' logits from its token alone (seg_pred, in place of decoder_pred and the mask token). Its encoder
    weights are an MAE's (init_from)."""

    def __init__(self, grid=(4, 4, 4), patch=(16, 16, 16), dim=1024, depth=24, heads=16,
                 dec_dim=512, dec_depth=8, dec_heads=16, mlp_ratio=4.0,
                 seg_classes=2, seg_pos_weight=1.0, seg_head="unetr", seg_features=16, init=True):
        super().__init__(grid, patch, dim, depth, heads, mlp_ratio)
        self.dec_dim = dec_dim
        self.seg_classes, self.seg_out = seg_classes, (1 if seg_classes == 2 else seg_classes)
        self.seg_pos_weight = seg_pos_weight  # binary: the loss weight of class-1 voxels (seg_loss)
        self.seg_head = seg_head
        if seg_head == "unetr":
            self.head = UNETRHead(dim, depth, self.patch, self.seg_out, seg_features)  # unetr.py
            dec_depth = 0  # (no decoder: decoder_blocks stays an empty list)
        else:
            self.decoder_embed = nn.Linear(dim, dec_dim)
            self.decoder_norm = nn.LayerNorm(dec_dim, eps=1e-6)
        self.decoder_blocks = nn.ModuleList([Block(dec_dim, dec_heads, mlp_ratio) for _ in range(dec_depth)])
        if seg_head == "linear":
            self.seg_pred = nn.Linear(dec_dim, self.P * self.seg_out)
        if init:  # (as the MAE's)
            self.initialize_weights()

    def seg_logits(self, x):
        """x (B, 1, Z_loc, Y, X) normalised voxels of this rank's slab -> logits (B, L_loc, P, seg_out)."""
        r, _ = self.cp_place()
        patches = patchify(x, self.patch)  # (B, L_loc, P)
        B, L_loc, _ = patches.shape
        ids = torch.arange(L_loc, device=x.device)
        taps = {k: None for k in self.head.taps[:-1]} if self.seg_head == "unetr" else None
        latent = self.forward_encoder(patches, ids[None].expand(B, -1), offset=r * L_loc, has_cls=False, taps=taps)
        if taps is not None:
            g = (x.shape[2] // self.patch[0],) + self.grid[1:]  # this rank's token grid: a slab of gz / cp planes
            logits = self.head(x, [taps[k] for k in self.head.taps[:-1]] + [latent], g, self.ring)  # (B, C, Z_loc..)
            return torch.stack([patchify(logits[:, c:c + 1], self.patch) for c in range(self.seg_out)], -1)
        h = self.decoder_embed(latent) + sincos_pos_embed(ids + r * L_loc, self.grid, self.dec_dim, latent.dtype)
        h = self.decoder_norm(self.run_blocks(self.decoder_blocks, h, "dec"))
        return self.seg_pred(h).view(B, L_loc, self.P, self.seg_out)

    def forward(self, x, ids_keep=None):
        """x (B, 2, Z_loc, Y, X): channel 0 the normalised voxels of this rank's slab, channel 1 their classes
        (ids_keep: None, nothing is masked; train.py calls both models alike). Returns (loss, logits (B, L_loc, P,
        seg_out)), loss = this rank's summed voxel loss (seg_loss) / the voxels of the whole micro batch, so that
        summed over cp it is the mean voxel loss, as the MAE's loss is."""
        assert ids_keep is None, "the segmenter sees every token: nothing to keep"
        logits = self.seg_logits(x[:, :1])
        labels = patchify(x[:, 1:], self.patch)  # (B, L_loc, P) classes
        return seg_loss(logits, labels, self.seg_pos_weight) / (x.shape[0] * self.L * self.P), logits


def seg_loss(logits, labels, pos_weight=1.0):
    """Summed voxel cross-entropy: logits (B, N, P, C) in any float dtype, labels (B, N, P) class indices (as floats).
    Binary (C = 1: one logit, class 1 = a fault): BCE with class-1 voxels weighted by pos_weight (thin faults are a
    few per cent of the voxels; unweighted, calling every voxel 0 is a good loss). C > 1: softmax cross-entropy.
    Computed in fp32."""
    logits = logits.float()
    if logits.shape[-1] == 1:
        y = labels.float()
        return F.binary_cross_entropy_with_logits(logits[..., 0], y, reduction="sum",
                                                  pos_weight=torch.tensor(pos_weight, device=y.device))
    return F.cross_entropy(logits.flatten(0, 2), labels.flatten().long(), reduction="sum")


def mae_loss(pred, patches, ids_masked, norm_pix_loss=False):
    """Mean squared error per patch, summed over the masked patches ids_masked (B, m) only. Returns (sum,
    count) so that a caller can divide by a count that spans several ranks (context parallelism).
    Only the masked patches are selected and go through the error in fp32: (B, m, P) temporaries, where
    computing it for all tokens and multiplying by the mask would hold (B, L, P) fp32 ones (at big_context
    2.4 GB each per rank; the visible quarter of them for nothing).
    norm_pix_loss: each target patch is normalised by its own mean and variance (+1e-6, so a constant
    patch gives 0 / 1e-3 = 0, finite)."""
    B, L, P = pred.shape
    # rows of the (B*L, P) views: index_select, whose backward needs only the index (gather's would keep all of
    # pred alive until backward: 1.2 GB per rank at big_context)
    rows = (ids_masked + L * torch.arange(B, device=pred.device)[:, None]).reshape(-1)  # (B*m,)
    target = patches.reshape(B * L, P).index_select(0, rows).float()  # (B*m, P)
    if norm_pix_loss:
        target = norm_patches(target)
    err = (pred.reshape(B * L, P).index_select(0, rows).float() - target).pow(2).mean(dim=-1)  # (B*m,)
    return err.sum(), torch.full((), float(rows.numel()), device=pred.device)  # a fill, not a host copy


def norm_patches(t):
    """(..., P) -> each patch by its own mean and (unbiased) std, + 1e-6 under the root: norm_pix_loss's target."""
    return (t - t.mean(dim=-1, keepdim=True)) / (t.var(dim=-1, keepdim=True) + 1e-6) ** 0.5


# -----------------------------------------------------------------------------
# 6. the optimizer: AdamW, as MAE pretrains and fine-tunes. The one place it is made: every strategy steps the
# optimizer built here (infra/strategies.py wraps it), the planner counts its state (ADAMW_STATE_BYTES), and the
# label-efficiency benchmark's U-Net trains with it too. To try another optimizer, edit this function.

ADAMW_STATE_BYTES = 8  # per parameter: AdamW's two moments (exp_avg, exp_avg_sq), fp32 (infra/plan.py counts them)


def configure_optimizers(model, cfg, lr):
    """AdamW(lr, betas=(beta1, beta2)) over `model`'s parameters, in groups:
      weight decay (cfg["weight_decay"]) on weight matrices and conv kernels only; none on biases, norms and the
        cls / mask tokens (p.ndim < 2, or "token" in the name);
      fine-tuning with layer_decay < 1 (task="segment", MAE's recipe): one group per encoder depth k, each with
        lr_scale = layer_decay^(depth + 1 - k): k = 0 the patch embedding and cls token, k = i + 1 block i,
        k = depth + 1 (scale 1) the final norm and the head. Deep layers move at the full lr, the patch embedding
        least: it learnt the most general features in pretraining;
      fine-tuning with freeze_encoder_steps > 0: the same groups (lr_scale 1 when layer_decay is 1), those of
        k <= depth marked "encoder": for the first freeze_encoder_steps steps their lr is 0 and the head (with the
        final norm) learns alone on the pretrained features, then everything learns (linear probing, then fine-tuning:
        the head is no longer random when the encoder starts to move, so its gradients distort the features less).
    train.py's train_step sets each group's lr to the schedule's x its lr_scale (1 where a group has none), 0 for
    an "encoder" group while it is frozen."""
    def decays(n, p):
        return p.ndim >= 2 and "token" not in n
    if cfg["task"] != "segment" or (cfg["layer_decay"] >= 1.0 and not cfg["freeze_encoder_steps"]):
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": cfg["weight_decay"]},
                  {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
    else:
        depth = len(model.blocks)

        def layer(n):
            if n.startswith(("patch_embed", "cls_token")):
                return 0
            if n.startswith("blocks."):
                return int(n.split(".")[1]) + 1
            return depth + 1
        by_key = {}
        for n, p in model.named_parameters():
            k, wd = layer(n), decays(n, p)
            g = by_key.setdefault((k, wd), {"params": [], "weight_decay": cfg["weight_decay"] if wd else 0.0,
                                            "lr_scale": cfg["layer_decay"] ** (depth + 1 - k), "encoder": k <= depth})
            g["params"].append(p)
        groups = [by_key[k] for k in sorted(by_key)]
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg["beta1"], cfg["beta2"]))


# -----------------------------------------------------------------------------
# 7. model sizes (encoder width / depth / heads after ViT; the decoder narrower and shallower, after MAE)
#
# One line per size. `heads` and `dec_heads` are the published ViTs' head counts; a config may override them
# (config keys heads / dec_heads, 0 = these): the widths fix every parameter (qkv is C x 3C whatever the split), the
# heads fix the function and the attention kernel's shape. Head dims that are multiples of 64, best 128, run the
# fused kernels fastest (infra/plan.py's ATTN_TFLOPS and its shape flags): ViT-G's 1664 / 16 = 104 and the
# decoders' 512 / 16 = 32 do not, 1664 / 13 = 128 and 512 / 4 = 128 do; the production configs set those.

SIZES = {  # name: (dim, depth, heads, dec_dim, dec_depth, dec_heads)
    "tiny":  (96, 4, 4, 64, 2, 4),
    "mini":  (192, 6, 3, 64, 2, 4),  # 6x tiny's encoder: experiments/label_efficiency's width question (via train.py)
    "small": (384, 12, 6, 256, 4, 8),
    "base":  (768, 12, 12, 512, 8, 16),
    "large": (1024, 24, 16, 512, 8, 16),
    "huge":  (1280, 32, 16, 512, 8, 16),
    "giant": (1408, 40, 16, 512, 8, 16),  # ViT-g
    "G":     (1664, 48, 16, 512, 8, 16),  # ViT-G
}


def widths(size, heads=0, dec_heads=0):
    """The widths, depths and head counts of a named size (SIZES), its own heads unless heads / dec_heads (> 0)."""
    dim, depth, h, dec_dim, dec_depth, dh = SIZES[size]
    return dict(dim=dim, depth=depth, heads=heads or h, dec_dim=dec_dim, dec_depth=dec_depth, dec_heads=dec_heads or dh)


def mae(size, heads=0, dec_heads=0, **kw):
    """The MAE of a named size."""
    return MAE(**widths(size, heads, dec_heads), **kw)


def segmenter(size, heads=0, dec_heads=0, **kw):
    """The segmenter of a named size: its encoder is the MAE's of that size."""
    return Segmenter(**widths(size, heads, dec_heads), **kw)


def aligned_heads(width):
    """The head count that gives heads of 128 (else 64) for a stack `width` wide; None where neither divides it."""
    return next((width // d for d in (128, 64) if width % d == 0), None)


def head_counts(cfg):
    """(encoder heads, decoder heads) a config's MAE has: its heads / dec_heads, or its size's own where 0."""
    w = widths(cfg["model_size"], cfg["heads"], cfg["dec_heads"])
    return w["heads"], w["dec_heads"]


def token_grid(shape, patch):
    """Tokens along each axis of a crop or volume: (64, 64, 128) voxels / (16, 16, 16) -> (4, 4, 8); a partial
    patch at the far edge has no token."""
    return tuple(s // p for s, p in zip(shape, patch))


def build_model(cfg, device=None):
    """The one place a model is built from a config (train.py's keys: a run's, or a model file's): the MAE, or for
    task="segment" the Segmenter (fine-tuning: the MAE's encoder and a segmentation head). Not seeded:
    train.py seeds with cfg["seed"] first; seed before calling this for the run's init. device="meta": shapes and
    parameter counts, no memory, and no init (no values to set; and normal_ on meta imports torch._dynamo, 2 s of
    every dry run, planner call and model file load). No activation checkpointing: a run that trains sets its
    blocks (model.set_grad_ckpt(infra.plan.checkpointed(model, cfg)))."""
    device = torch.device(device if device is not None else torch.get_default_device())
    common = dict(grid=token_grid(cfg["crop"], cfg["patch"]), patch=tuple(cfg["patch"]), init=device.type != "meta",
                  **widths(cfg["model_size"], cfg["heads"], cfg["dec_heads"]))
    with device:
        if cfg["task"] == "segment":
            return Segmenter(**common, seg_classes=cfg["classes"], seg_pos_weight=cfg["pos_weight"],
                             seg_head=cfg["seg_head"], seg_features=cfg["seg_features"])
        return MAE(**common, mask_ratio=cfg["mask_ratio"], norm_pix_loss=cfg["norm_pix_loss"],
                   mask_strata=cfg["mask_strata"] or cfg["cp"])
