"""
The segmentation head fine-tuning puts on the MAE's encoder (model.Segmenter, seg_head="unetr"), UNETR-style:
a fault is a plane 1-3 voxels thick crossing a token of P voxels, which
one linear layer per token cannot draw. Features of several encoder depths are brought up to finer grids by
transposed convolutions and joined, level by level, down to a branch of convolutions on the amplitude itself:

  level n (tokens)      the encoder's output                      (B, dim, gz, gy, gx)
  level j, n > j > 0    up(h) ++ skip_j(block depth*j/n's output)  -> ConvBlock -> c_j channels
  level 0 (voxels)      up(h) ++ ConvBlock(amplitude)              -> ConvBlock -> 1x1x1 conv -> logits

Each level doubles the axes whose voxel size (patch / 2^k) is still the largest, so a 2 x 2 x 16 patch doubles time
three times, then all three axes once (n = 4); 16^3 doubles all three, 4 times. Under context parallelism a rank
holds a slab of inline planes at every level: the transposed convolutions (kernel = stride) stay inside it, and a
3x3x3 convolution reads one plane of each neighbouring slab (halo), zeros at the sample's two ends, which is what
padding=1 does to the whole sample: so cp ranks compute exactly what one rank does. No normalisation layer: a
norm over voxels (batch, instance, group) would need the whole sample's statistics.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _swap(to_prev, to_next, group):
    """Send to_prev to the previous rank of `group` and to_next to the next one; return (what the previous rank sent
    its next, what the next one sent its previous), zeros at the two ends (rank 0 has no previous, the last no next)."""
    r, W = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group)
    from_prev, from_next = torch.zeros_like(to_next), torch.zeros_like(to_prev)
    ops = []
    if r > 0:
        ops += [dist.P2POp(dist.isend, to_prev, ranks[r - 1], group), dist.P2POp(dist.irecv, from_prev, ranks[r - 1],
                                                                                  group)]
    if r < W - 1:
        ops += [dist.P2POp(dist.isend, to_next, ranks[r + 1], group), dist.P2POp(dist.irecv, from_next, ranks[r + 1],
                                                                                  group)]
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    return from_prev, from_next


class Halo(torch.autograd.Function):
    """x (B, C, Z_loc, Y, X), this rank's slab -> (B, C, Z_loc + 2, Y, X): the previous rank's last plane before it and
    the next rank's first plane after it. Backward: each halo's gradient goes back to the rank whose plane it was."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        top, bottom = _swap(x[:, :, :1].contiguous(), x[:, :, -1:].contiguous(), group)
        return torch.cat([top, x, bottom], dim=2)

    @staticmethod
    def backward(ctx, g):
        first, last = _swap(g[:, :, :1].contiguous(), g[:, :, -1:].contiguous(), ctx.group)
        gx = g[:, :, 1:-1].clone()
        gx[:, :, :1] += first  # the previous rank's halo was my first plane
        gx[:, :, -1:] += last  # the next rank's, my last
        return gx, None


def halo(x, ring):
    """Pad the inline axis by one plane each side: the neighbouring slabs' under cp (ring: the model's (group,
    attend), or None), zeros at the sample's ends."""
    return F.pad(x, (0, 0, 0, 0, 1, 1)) if ring is None else Halo.apply(x, ring[0])


class ConvBlock(nn.Module):
    """Two 3x3x3 convolutions, each followed by ReLU (U-Net's unit); the inline axis padded by halo()."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv3d(cin, cout, 3, padding=(0, 1, 1))
        self.conv2 = nn.Conv3d(cout, cout, 3, padding=(0, 1, 1))

    def forward(self, x, ring=None):
        return F.relu(self.conv2(halo(F.relu(self.conv1(halo(x, ring))), ring)))


def up_scales(patch):
    """The per-axis factors of each level, from the token grid down to voxels: [(2, 2, 2), ...], n of them."""
    size, scales = list(patch), []
    while max(size) > 1:
        top = max(size)
        assert all(s == top or top % s == 0 for s in size), patch
        scales.append(tuple(2 if s == top else 1 for s in size))
        size = [s // f for s, f in zip(size, scales[-1])]
    return scales


class UNETRHead(nn.Module):
    def __init__(self, dim, depth, patch, out, features=16):
        super().__init__()
        self.scales = up_scales(patch)  # scales[k]: from level n - k to level n - k - 1
        n = len(self.scales)
        self.n = n
        # channels at levels 0 .. n - 1: x 2 for every 8x fewer voxels (UNETR's doubling per level at 16^3 patches;
        # a level that doubles time alone keeps the channels, and its convolutions cost half the finer level's)
        vox, c = 1, []
        for j in range(n):
            c.append(features * 2 ** int(math.log2(vox) // 3))
            vox *= math.prod(self.scales[n - 1 - j])
        # the encoder blocks tapped for levels 1 .. n - 1 (1-based counts), then the final output for level n
        self.taps = [max(1, depth * j // n) for j in range(1, n)] + [depth]
        self.ups = nn.ModuleList()  # ups[j]: level j + 1 -> level j, on the path
        self.blocks = nn.ModuleList()  # blocks[j]: the join at level j
        self.skips = nn.ModuleList()  # skips[j - 1]: tap j brought from the token grid to level j
        for j in range(n):
            self.ups.append(nn.ConvTranspose3d(dim if j == n - 1 else c[j + 1], c[j], self.scale(j + 1),
                                               self.scale(j + 1)))
            self.blocks.append(ConvBlock(2 * c[j], c[j]))
        for j in range(1, n):
            chain = []
            for k in range(n, j, -1):  # level k -> k - 1
                chain.append(nn.ConvTranspose3d(dim if k == n else c[k], c[k - 1], self.scale(k), self.scale(k)))
            self.skips.append(nn.ModuleList(chain))
        self.stem = ConvBlock(1, c[0])  # the full-resolution branch, on the amplitude
        self.out = nn.Conv3d(c[0], out, 1)

    def scale(self, level):
        """The factors from level `level` to level - 1."""
        return self.scales[self.n - level]

    def forward(self, x, feats, g, ring=None):
        """x (B, 1, Z_loc, Y, X) this rank's amplitude, feats: n token features (B, L_loc, dim) (the taps, shallow
        first, then the encoder's output), g: this rank's token grid -> logits (B, out, Z_loc, Y, X)."""
        grid = [f.transpose(1, 2).reshape(f.shape[0], f.shape[2], *g) for f in feats]  # (B, dim, gz_loc, gy, gx)
        h = grid[-1]
        for j in range(self.n - 1, -1, -1):
            h = self.ups[j](h)
            if j:
                s = grid[j - 1]
                for t in self.skips[j - 1]:
                    s = F.relu(t(s))
            else:
                s = self.stem(x, ring)
            h = self.blocks[j](torch.cat([h, s.to(h.dtype)], 1), ring)
        return self.out(h)

    def voxels(self, grid):
        """Voxels per sample at each level 0 .. n (level n: the token grid)."""
        size, out = list(grid), [math.prod(grid)]
        for sc in self.scales:
            size = [a * f for a, f in zip(size, sc)]
            out.append(math.prod(size))
        return out[::-1]

    def saved_elems(self, grid):
        """About what autograd keeps per sample for backward (the planner's): at each level the join's input
        (2 c), its halo-padded copy, the two convolutions' outputs (c each, ReLU saves them); at full resolution
        the stem's the same on c, and the logits."""
        v, total = self.voxels(grid), 0
        for j in range(self.n):
            c = self.blocks[j].conv2.out_channels
            total += v[j] * 8 * c
        return total + v[0] * (4 * self.stem.conv2.out_channels + self.out.out_channels)

    def flops(self, grid):
        """Forward FLOPs per sample (a multiply-add is 2): every convolution at the size of its output."""
        total, vox = 0, self.voxels(grid)
        at = lambda level: vox[level]  # noqa: E731  voxels at a level
        for j in range(self.n):
            total += 2 * at(j) * self.ups[j].in_channels * self.ups[j].out_channels  # each output voxel: one tap
            b = self.blocks[j]
            total += 2 * 27 * at(j) * (b.conv1.in_channels * b.conv1.out_channels + b.conv2.in_channels *
                                       b.conv2.out_channels)
        for j, chain in enumerate(self.skips, start=1):
            for t, k in zip(chain, range(self.n, j, -1)):
                total += 2 * at(k - 1) * t.in_channels * t.out_channels
        total += 2 * 27 * at(0) * (self.stem.conv1.out_channels + self.stem.conv2.in_channels *
                                   self.stem.conv2.out_channels)
        return total + 2 * at(0) * self.out.in_channels * self.out.out_channels
