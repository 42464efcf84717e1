"""
Sliding-window prediction: a survey covered by overlapping windows of the model's crop, each window's prediction
weighted by a function that falls towards the window's edges, the weighted predictions summed and divided by the
summed weights. scripts/predict.py writes a whole survey with it, one output tile at a time.

    window_starts(S, c, stride)       origins along an axis: 0, stride, ..., and S - c last (shifted to the edge)
    axis_weights(c, blend, sigma)     (c,) the 1D weight of a window; the 3D weight is the product of the three
    normaliser(S, starts, w)          (S,) the summed 1D weights of every window over the axis
    tiles(shape, tile)                the output tiles: [(lo, hi) per axis], chunk-aligned boxes tiling the survey
    touching(starts, c, lo, hi)       the window origins along an axis whose windows overlap [lo, hi)

Why windows blend. A window's prediction is worst at its edges (the convolutions there see zeros, attention sees
only one side): pasted side by side, windows leave seams. With weights w(x) that fall to the edges, a voxel near one
window's edge takes most of its value from a window in which it is central, and

    p(x) = sum_k w(x - o_k) p_k(x) / sum_k w(x - o_k)

changes smoothly from one window to the next. The windows form a Cartesian grid (origins per axis) and w is a
product of 1D weights, so the denominator is a product too: sum_{a,b,c} w0(x - o_a) w1(y - o_b) w2(z - o_c) =
N0(x) N1(y) N2(z), three 1D sums, no survey-sized weight buffer. Weights:
  gaussian   exp(-(x + 1/2 - c/2)^2 / (2 (sigma c)^2)), sigma 1/8 of the window by default (the edges weigh e^-8 of
             the centre: small, never zero)
  cosine     sin^2(pi (x + 1/2) / c) (Hann): at overlap 1/2 the windows' weights sum to a constant
  constant   1 everywhere (plain averaging; with no overlap, plain tiling: the seams this exists to avoid)

Edges of the survey. Along an axis of S >= c voxels the last window is shifted to end at S (so every voxel lies in a
window, the last stride shorter); along an axis shorter than the window there is one window at 0 whose voxels
beyond S are zeros (what a dead trace reads as), and only its voxels inside the survey are kept.

Memory: the sums are kept per output tile (a box of whole output chunks), not for the survey: a tile's windows are
every window that overlaps it, and a window that overlaps two tiles is computed for each (the price of bounded
memory: about prod(1 + (c - stride) / T) windows computed per window of the survey, for tiles of T voxels).
"""
import math

import numpy as np

import configurator

BLENDS = ("gaussian", "cosine", "constant")


def window_starts(S, c, stride):
    """Origins (voxels) of the windows of c voxels along an axis of S: 0, stride, 2 stride, ..., and S - c last; [0]
    for an axis shorter than the window (then padded with zeros beyond S)."""
    if c >= S:
        return [0]
    o = list(range(0, S - c + 1, stride))
    return o if o[-1] == S - c else o + [S - c]


def axis_weights(c, blend="gaussian", sigma=0.125):
    """(c,) float64: a window's weight along an axis of c voxels, largest at its centre (see the docstring)."""
    x = np.arange(c) + 0.5
    if blend == "gaussian":
        return np.exp(-((x - c / 2) ** 2) / (2 * (sigma * c) ** 2))
    if blend == "cosine":
        return np.sin(np.pi * x / c) ** 2
    if blend == "constant":
        return np.ones(c)
    raise configurator.ConfigError(f"--blend={blend!r}: one of {', '.join(BLENDS)}")


def normaliser(S, starts, w):
    """(S,) the sum over an axis's windows of their weight at each voxel (voxels beyond S dropped)."""
    n = np.zeros(S)
    for o in starts:
        hi = min(S, o + len(w))
        n[o:hi] += w[:hi - o]
    return n


def tiles(shape, tile):
    """The output tiles: boxes [(lo, hi)] * 3 of `tile` voxels (the last of an axis shorter), in row-major order."""
    axes = [[(lo, min(lo + t, S)) for lo in range(0, S, t)] for S, t in zip(shape, tile)]
    return [(a, b, c) for a in axes[0] for b in axes[1] for c in axes[2]]


def touching(starts, c, lo, hi):
    """The origins along an axis whose windows [o, o + c) overlap [lo, hi)."""
    return [o for o in starts if o < hi and o + c > lo]


def default_tile(shape, crop, chunks, budget_voxels):
    """The tile (voxels per axis): per axis the smallest multiple of the output chunk holding k windows, for the
    largest k of 8, 4, 2, 1 whose tile holds at most budget_voxels (k = 1 whatever the budget), and never more than
    the survey (rounded up to whole chunks)."""
    def tile(k):
        return tuple(min(math.ceil(k * c / ch) * ch, math.ceil(S / ch) * ch) for S, c, ch in zip(shape, crop, chunks))
    for k in (8, 4, 2):
        if math.prod(tile(k)) <= budget_voxels:
            return tile(k)
    return tile(1)


def recompute(shape, crop, starts, tile):
    """Windows computed (summed over the tiles) per window of the survey: what bounded memory costs."""
    per_axis = []
    for S, c, o, t in zip(shape, crop, starts, tile):
        per_axis.append(sum(len(touching(o, c, lo, min(lo + t, S))) for lo in range(0, S, t)) / len(o))
    return math.prod(per_axis)
