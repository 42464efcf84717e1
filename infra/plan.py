"""
The planner: an analytic model of one training step on a GPU cluster, as pure functions of the config (train.py's
keys). Memory per GPU under each strategy (ZeRO-2, ZeRO-3, FSDP2), activations with and without checkpointing,
the ring's buffers, FLOPs, ring traffic, S3 bandwidth, the step time (attention at the fused kernel's rates, the
rest at an MFU assumption) and the samples/s it gives, the time a stop signal needs.

    python -m scripts.plan config/big_context.py [--nodes=16 --gpu=H100 --mfu=0.35 ...]   the plan, JSON last

train.py's dry run (DRY_RUN=1 bash launch.sh ...) prints it too. Its terms are checked against measurements on
this machine by bench/plan.py (calibrate: FLOPs, activation bytes and the ring's backward memory on small models;
memory_check: the weight, gradient and optimizer bytes each strategy really allocates on 2 and 4 CPU ranks):
`python -m bench plan CONFIG` is this plan with those checks. This file imports neither train.py nor bench/step.py (both
import it).
"""

import argparse
import math

import configurator
from model import ADAMW_STATE_BYTES, SIZES, Segmenter, aligned_heads, build_model, head_counts


def table(rows, header):
    """Print rows as right-aligned columns under header."""
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))  # noqa: E731
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


GPUS = {  # dense bf16 FLOP/s, memory, NVLink per direction, network per node (bytes/s)
    "H200": {"flops": 989e12, "mem_gb": 141, "nvlink": 450e9, "net_node": 3200e9 / 8},
    "H100": {"flops": 989e12, "mem_gb": 80, "nvlink": 450e9, "net_node": 3200e9 / 8},
}
BLOCK_SAVED = 17  # activations saved per token per block, in units of width C (see activation_bytes)


# -----------------------------------------------------------------------------
# FLOPs: what a model computes per sample (the MFU's numerator; sample_seconds prices them)


def visible(m):
    """Visible patch tokens per sample of model m, as the FLOP and memory counts take them: the MAE's n_keep(); a
    segmenter masks nothing and has no cls token, so its encoder's L tokens count as L - 1 visible: for either
    model the encoder's sequence is visible(m) + 1."""
    return m.L - 1 if isinstance(m, Segmenter) else m.n_keep()


def block_flops(m, stack):
    """Forward FLOPs of one block of `stack` ("enc" or "dec") of model m per sample (see flops_per_sample)."""
    mlp = int(m.blocks[0].fc1.out_features / m.dim) if len(m.blocks) else 4
    N, C = (visible(m) + 1, m.dim) if stack == "enc" else (m.L, m.dec_dim)
    return (8 + 4 * mlp) * N * C * C + 4 * N * N * C


def flops_per_sample(m):
    """Training FLOPs per sample of model m (model.MAE or model.Segmenter): forward + backward = 3 x forward;
    matmuls and attention only, the usual convention for MFU. A multiply-add counts 2 FLOPs.
      per block on N tokens of width C: qkv 6NC^2 + proj 2NC^2 + mlp 16NC^2 (ratio 4) + attention 4N^2C
    The MAE embeds its n visible patches, runs its encoder on them and cls, its decoder on all L tokens; a segmenter
    embeds and encodes every token, then its head: UNETR's convolutions (unetr.py), or the decoder's blocks and
    seg_pred."""
    enc = len(m.blocks) * block_flops(m, "enc")
    if isinstance(m, Segmenter) and m.seg_head == "unetr":
        return 3 * (2 * m.L * m.P * m.dim + enc + m.head.flops(m.grid))
    if isinstance(m, Segmenter):
        return 3 * (2 * m.L * m.P * m.dim + enc + 2 * m.L * m.dim * m.dec_dim
                    + len(m.decoder_blocks) * block_flops(m, "dec") + 2 * m.L * m.dec_dim * m.P * m.seg_out)
    n = visible(m)
    dec = 2 * n * m.dim * m.dec_dim + len(m.decoder_blocks) * block_flops(m, "dec") + 2 * m.L * m.dec_dim * m.P
    return 3 * (2 * n * m.P * m.dim + enc + dec)


# -----------------------------------------------------------------------------
# activation checkpointing: which blocks a run recomputes (the model checkpoints the ones it is given:
# model.Encoder.set_grad_ckpt), and what that costs


def ckpt_order(m):
    """Every block of model m, ("enc" | "dec", index), in the order activation checkpointing takes them: most
    activation bytes freed per FLOP recomputed first. A checkpointed block keeps its input (C per token) instead of
    17 C (BLOCK_SAVED), so it frees ~16 C N bytes per sample and costs its forward again, (8 + 4 mlp) N C^2 +
    4 N^2 C FLOPs (block_flops): the ratio is ~16 / ((8 + 4 mlp) C + 4 N), larger for the stack with the smaller
    (8 + 4 mlp) C + 4 N. Under cp both N and the bytes divide by cp, the order does not change. At
    big_context the encoder (C 1,664, N 294,912) frees 4x more per FLOP than the decoder (C 512, N
    1,179,648: its attention over the whole sample makes its recompute dear): encoder blocks go first.
    Within a stack the blocks are alike; the first ones go first."""
    mlp = int(m.blocks[0].fc1.out_features / m.dim) if len(m.blocks) else 4
    cost = {"enc": (8 + 4 * mlp) * m.dim + 4 * (visible(m) + 1), "dec": (8 + 4 * mlp) * m.dec_dim + 4 * m.L}
    stacks = sorted(("enc", "dec"), key=lambda st: cost[st])  # (stable: encoder first on a tie)
    return [(st, i) for st in stacks for i in range(len(m.blocks if st == "enc" else m.decoder_blocks))]


def checkpointed(m, cfg):
    """The blocks of model m that a run of config cfg checkpoints, for m.set_grad_ckpt: none without grad_ckpt; with
    it every block (ckpt_blocks = -1) or the first ckpt_blocks of ckpt_order(m) (configurator checks the count)."""
    if not cfg["grad_ckpt"]:
        return set()
    order = ckpt_order(m)
    return set(order if cfg["ckpt_blocks"] < 0 else order[:cfg["ckpt_blocks"]])


def recompute_flops(m):
    """FLOPs per sample that activation checkpointing adds: the forward of every block m checkpoints, again in
    backward."""
    return sum(block_flops(m, st) for st, _ in m.ckpt)


def activation_bytes(m, micro_batch, cp, elem, ckpt=None):
    """(persistent, transient) bytes of activations on one rank for a model `m` (model.MAE) whose tokens are
    split over cp ranks; elem = bytes per activation element (2 for bf16). ckpt: the blocks checkpointed (True
    every one, False none, k the first k of ckpt_order(m)); None: those m checkpoints (m.ckpt).
    persistent: what autograd keeps from forward to backward. A pre-norm block on N tokens of width C saves,
      per token: LayerNorm inputs (2C), qkv input (C), q, k, v (3C) and output (C) of the fused attention
      (+ its fp32 log-sum-exp, 4H bytes), proj input (C), fc1 input (C), GELU input (4C), fc2 input (4C) =
      17C. With checkpointing only each block's input (C) stays. Around the blocks: the visible patches, the
      inputs of the final norms, decoder_embed and the head, gather indices; the loss (model.mae_loss) keeps
      one fp32 P-wide difference per MASKED token (nm of them: only masked patches go through the error).
    transient: the largest short-lived working set on top: with checkpointing one block recomputed in
      backward (17C per token, of the widest checkpointed stack); the head's predictions for all tokens (elem), and for the masked ones their
      gathered copy and its fp32 cast, the gathered targets and their fp32 cast, the squared error (in
      backward the same sizes again, scattered back into an all-token gradient); the input slab (it arrives in
      the compute dtype: train.prepare_batch casts it on the host) and its patchified copy."""
    ne, nd = (visible(m) + 1) / cp, m.L / cp
    nm = (m.L - visible(m)) / cp  # masked tokens on this rank
    order = ckpt_order(m)
    chosen = m.ckpt if ckpt is None else order if ckpt is True else order[:int(ckpt)]
    persistent, recompute = 0.0, 0.0
    for stack, blocks, N, C in (("enc", m.blocks, ne, m.dim), ("dec", m.decoder_blocks, nd, m.dec_dim)):
        if not len(blocks):
            continue
        per_block = BLOCK_SAVED * C * N * elem + 4 * blocks[0].heads * N
        n_ckpt = sum(st == stack for st, _ in chosen)
        persistent += n_ckpt * C * N * elem + (len(blocks) - n_ckpt) * per_block
        recompute = max(recompute, per_block if n_ckpt else 0.0)
    persistent += nm * m.P * 4
    # around the blocks: visible patches (patch_embed input), final norm and decoder_embed inputs, decoder norm
    # and head inputs, and the int64 gather indices
    persistent += (ne * (m.P + 2 * m.dim) + nd * 2 * m.dec_dim) * elem + (ne + nd + nm) * 8
    transient = recompute + nd * m.P * elem + nm * m.P * (2 * elem + 3 * 4) + nd * m.P * 2 * elem
    if isinstance(m, Segmenter) and m.seg_head == "unetr":  # its convolutions keep their inputs, down to every voxel
        persistent += m.head.saved_elems(m.grid) / cp * elem
    return micro_batch * persistent, micro_batch * transient


def param_counts(m):
    """Parameter counts of a model.MAE (works on the meta device): all of them, the largest block, the ones
    outside the blocks (embeddings, tokens, final norms, head), those ZeRO-3 never partitions, the largest tensor."""
    from infra import strategies
    ps, blocks = list(m.parameters()), list(m.blocks) + list(m.decoder_blocks)
    per_block = [sum(p.numel() for p in b.parameters()) for b in blocks]
    P = sum(p.numel() for p in ps)
    return {"P": P, "block": max(per_block), "root": P - sum(per_block),
            "small": sum(p.numel() for p in ps if p.numel() <= strategies.ZERO3_PERSIST),
            "largest": max(p.numel() for p in ps)}


def state_bytes(n, strategy, W, d, cfg, on_gpu=True):
    """Weights, gradients and optimizer state on one of W ranks, in bytes, as four terms:
      persistent: held from step to step;
      held:       added for all of forward and backward (gathered weights, buckets), besides the activations;
      grads:      gradients that build up during backward while the activations are being freed;
      opt:        added during the optimizer step.
    n = param_counts(model); d = bytes per element of the compute dtype (2 bf16, 4 fp32); gradients are reduced
    and kept in fp32 (train.py: communication_data_type and grad_accum_dtype, FSDP2's reduce_dtype). Under every
    strategy Adam keeps fp32 master weights (4 bytes) and m, v (model.ADAMW_STATE_BYTES) for this rank's share
    P/W: (4 + ADAMW_STATE_BYTES) P/W. Each other term is a tensor that DeepSpeed 0.19 / PyTorch 2.13 allocate
    (found with the profiler and in their source); memory_check measures them on CPU. What differs on a GPU
    (on_gpu) is taken from the source, not measured: two reduce buckets (overlap_comm), AdamW's foreach step (one
    temporary per group where the CPU's per-tensor step makes two), and no gloo copies."""
    P, Pw, blk, B = n["P"], n["P"] / W, n["block"], cfg["zero_bucket"]
    master_adam = 4 + ADAMW_STATE_BYTES  # per parameter of this rank's share: the fp32 master and AdamW's moments
    Bn = min(B, P)  # a bucket never holds more gradients than there are
    to32 = 4 if d != 4 else 0  # a cast to fp32 for the reduction (none when the compute dtype is fp32)
    if strategy == "fsdp2":  # AdamW over DTensor shards: foreach on GPU, per tensor on CPU
        adam_tmp = 4 * Pw if on_gpu else 2 * 4 * n["largest"] / W
    else:  # DeepSpeed's optimizer sees one flat fp32 tensor per group: per tensor is the whole share
        adam_tmp = 4 * Pw if on_gpu else 2 * 4 * Pw
    if strategy == "zero2":
        persistent = d * P + master_adam * Pw  # weights replicated on every rank; master + Adam for this rank's share
        held = ((2 if on_gpu else 1) * d * B  # reduce bucket(s): two with overlap_comm (GPU)
                + (d + to32) * Bn  # allreduce_bucket: a flat copy of the bucket, then its fp32 cast
                + d * blk)  # one block's full gradients, before they are copied into the bucket
        grads = 4 * Pw  # this rank's gradient share, fp32 (grad_accum_dtype), filled bucket by bucket
        # at the step: the gradient share; with fp32 weights also a flat copy of it for the step (with bf16 weights
        # DeepSpeed accumulates into a separate fp32 buffer that the step reads in place: measured), AdamW's
        opt = 4 * Pw + (4 * Pw if d == 4 else 0) + adam_tmp
    elif strategy == "zero3":
        persistent = (d * Pw  # weight shards
                      + master_adam * Pw  # master + Adam
                      + 4 * Pw  # the gradient share: a flat buffer, kept, in fp32 (grad_accum_dtype)
                      + d * n["small"]  # parameters too small to partition, whole on every rank
                      + 4 * B  # the reduce bucket, in the communication dtype (fp32)
                      + (0 if on_gpu else 4 * blk))  # gloo keeps its copy of the last reduce-scatter input
        # gathered weights: ZeRO-3 keeps a gathered weight that the forward+backward trace uses again within
        # stage3_max_reuse_distance elements and prefetches up to stage3_max_live_parameters resident (train.py
        # sets both to zero3_max_live): about that many stay gathered (measured: the change of the peak follows
        # zero3_max_live one for one), plus the submodule in use (at most the largest tensor) and the prefetch
        gathered = min(P - n["small"], cfg["zero3_max_live"]) + n["largest"] + min(B // 10, cfg["zero3_max_live"])
        held = (d * gathered
                + 4 * Bn  # reduce_scatter_coalesced's flat fp32 copy of a bucket
                + (0 if on_gpu else 4 * Bn))  # and gloo's copy of that (NCCL reduce-scatters in place)
        grads = 0.0  # (the share is the persistent flat buffer)
        opt = 4 * Pw + adam_tmp  # the fp32 copy of the gradient share, AdamW temporaries
    elif strategy == "fsdp2":
        persistent = master_adam * Pw  # fp32 weight shards (they are the master weights) and Adam m, v
        held = (d * n["root"]  # the parameters outside the blocks, unsharded from forward to backward
                + 2 * d * blk  # this block and the prefetched next one, gathered in the compute dtype
                + d * blk + 4 * blk  # a block's unsharded gradients and their fp32 reduce-scatter input
                + (0 if on_gpu else 4 * blk))  # gloo's copy of that input
        grads = 4 * Pw  # fp32 gradient shards
        opt = 4 * Pw + adam_tmp  # gradient shards, AdamW temporaries
    else:
        raise ValueError(strategy)
    return {"persistent": persistent, "held": held, "grads": grads, "opt": opt}


def step_bytes(st, act):
    """What a rank holds over a step, in the terms memory_check measures: the state between steps, the peak in
    forward/backward (gathered weights and buckets, plus whichever is larger of the activations `act` and the
    gradients that replace them during backward), the peak in the optimizer step, and the larger peak."""
    out = {"state between steps": st["persistent"],
           "peak in fwd/bwd": st["persistent"] + st["held"] + max(act, st["grads"]),
           "peak in optimizer step": st["persistent"] + st["opt"]}
    out["peak"] = max(out["peak in fwd/bwd"], out["peak in optimizer step"])
    return out


# The fused attention kernel's useful rate by head dim, forward + backward (FLOPs 4 N^2 d per head forward and
# ATTN_BWD x that backward, over the time of both), TFLOP/s on one H200 in bf16, non-causal, 102,400 tokens: the
# kernel F.scaled_dot_product_attention picks there, which is the one the ring's blocks run (ring_attention.
# block_kernel): cuDNN's in the runs these figures come from (torch 2.11). Measured by `bash bench/gpu_check.sh`
# (bench/gpu.py, section attention_rates; the run is docs/gpu_check/h200_run1.jsonl, where FlashAttention-2
# measured 225 / 302 / 325 and the memory-efficient kernel 64 / 117 / 148 at the same head dims). Head dims in between run on the next
# tile size up (104 on 128's kernel: 104/128 of its FLOPs are ours; measured at 104: 442, this model gives 462);
# above 128 (unmeasured) taken as 128's rate. Another GPU or library: run the check and put its numbers here.
ATTN_TFLOPS = {32: 247, 64: 449, 128: 569}
ATTN_TILES = (32, 64, 96, 128, 160, 192, 224, 256)
ATTN_BWD = 2.5  # the fused backward's FLOPs per forward FLOP: it recomputes the scores (5 matmuls against the
#                 forward's 2); the kernels' rates are quoted on these counts


def head_tile(d):
    """The head dim the fused kernels run at for head dim d: the next multiple of 32 (ATTN_TILES)."""
    return next(t for t in ATTN_TILES if t >= d)


def attention_tflops(d):
    """Useful attention TFLOP/s (forward + backward) of the fused kernel at head dim d (ATTN_TFLOPS, see there)."""
    tile = head_tile(d)
    if tile in ATTN_TFLOPS:
        rate = ATTN_TFLOPS[tile]
    elif tile > max(ATTN_TFLOPS):
        rate = ATTN_TFLOPS[max(ATTN_TFLOPS)]
    else:  # between two measured sizes: linear in the tile size
        lo = max(t for t in ATTN_TFLOPS if t < tile)
        hi = min(t for t in ATTN_TFLOPS if t > tile)
        rate = ATTN_TFLOPS[lo] + (ATTN_TFLOPS[hi] - ATTN_TFLOPS[lo]) * (tile - lo) / (hi - lo)
    return rate * d / tile


def shapes(m, cp=1):
    """Each stack's attention and matmul shapes per rank, with what does not suit the GPU's kernels flagged: a head
    dim that is not a multiple of 64 (fused attention runs on 64-wide tiles or steps of 32: the rest is padding
    or a slower kernel), a width or matmul dimension that is not a multiple of 128 (tensor-core tiles). Returns
    (rows, flags, attention seconds per sample on one GPU at the kernel's rate for each head dim and at 128's)."""
    rows, flags, t_attn, t_attn128 = [], [], 0.0, 0.0
    mlp = m.blocks[0].fc1.out_features // m.dim if len(m.blocks) else 4
    for stack, blocks, N, C in (("encoder", m.blocks, visible(m) + 1, m.dim), ("decoder", m.decoder_blocks, m.L, m.dec_dim)):
        if not len(blocks):
            continue
        H = blocks[0].heads
        d = C // H
        n = N / cp
        rows.append([stack, f"{len(blocks)} x attention", f"{H} heads x {d}", f"{n:,.0f} x {N:,} tokens",
                     f"{attention_tflops(d):.0f} TFLOP/s (128: {attention_tflops(128):.0f})"])
        for name, k_, n_ in (("qkv", C, 3 * C), ("proj", C, C), ("fc1", C, mlp * C), ("fc2", mlp * C, C)):
            rows.append([stack, name, f"({n:,.0f} x {k_}) @ ({k_} x {n_})", "", ""])
            if (k_ % 128 or n_ % 128) and C % 128 == 0:
                flags.append(f"{stack} {name}: ({k_} x {n_}) is not in multiples of 128")
        if d % 64:
            flags.append(f"{stack} head dim {d} = {C} / {H} is not a multiple of 64: runs at "
                         f"{attention_tflops(d):.0f} TFLOP/s against {attention_tflops(128):.0f} at 128 "
                         f"({C // 128} heads of 128)" if C % 128 == 0 else
                         f"{stack} head dim {d} = {C} / {H} is not a multiple of 64")
        if C % 128:
            flags.append(f"{stack} width {C} is not a multiple of 128")
        fl = (1 + ATTN_BWD) * 4 * N * N * C * len(blocks)  # fwd + bwd, as the kernels execute them
        t_attn += fl / (attention_tflops(d) * 1e12)
        t_attn128 += fl / (attention_tflops(128) * 1e12)
    return rows, flags, t_attn, t_attn128


def stacks(m):
    """(name, blocks, tokens, width) of each non-empty stack of model.MAE m, per sample: the encoder attends over
    the visible tokens and cls, the decoder over every token."""
    return [(st, b, N, C) for st, b, N, C in (("enc", m.blocks, visible(m) + 1, m.dim),
                                             ("dec", m.decoder_blocks, m.L, m.dec_dim)) if len(b)]


def sample_seconds(m, k, gpu, mfu, train=True):
    """GPU-seconds of one sample on one GPU of kind `gpu` (a GPUS row): a training pass (forward + backward, the
    first k blocks of ckpt_order(m) recomputed in backward) or, train=False, an evaluation (forward only). Three
    terms; the pass takes max(flop, attention + other):
      flop:      the FLOPs the planner counts (flops_per_sample(m): backward = 2 x forward; plus the forward of
                 each recomputed block) at the MFU assumption, mfu x peak;
      attention: the fused attention kernel at its rate for each stack's head dim (attention_tflops), on the FLOPs
                 it executes: 4 N^2 C per block forward, ATTN_BWD x that in backward, one forward more per
                 recomputed block;
      other:     the FLOPs that are not attention (qkv, proj, MLP, embeddings, head) at the MFU assumption.
    Where the kernel runs below mfu x peak (every rate in ATTN_TFLOPS does, at 40 % of an H200's peak), the second
    term binds, the more so the larger attention's share of the FLOPs: at 1.18 M tokens it is ~98 % and the step
    is twice the FLOP-bound one; at short context the two nearly agree. Where the kernel outruns the MFU assumption
    by more than its backward's extra FLOPs ((1 + ATTN_BWD) / 3; a low --mfu), the first binds: the MFU assumption
    then covers what the kernels' rates leave out."""
    rate = gpu["flops"] * mfu
    chosen = ckpt_order(m)[:k] if train else []
    flops = flops_per_sample(m) + sum(block_flops(m, st) for st, _ in chosen) if train else flops_per_sample(m) / 3
    attn_s = attn_counted = 0.0
    for stack, blocks, N, C in stacks(m):
        fwd = 4 * N * N * C  # one block's attention forward: q k^T and p v, 2 N^2 C each
        n_ckpt = sum(st == stack for st, _ in chosen)
        if train:
            attn_counted += (3 * len(blocks) + n_ckpt) * fwd  # as flops_per_sample and the recompute count it
            attn_s += ((1 + ATTN_BWD) * len(blocks) + n_ckpt) * fwd / (attention_tflops(C // blocks[0].heads) * 1e12)
        else:
            attn_counted += len(blocks) * fwd
            attn_s += len(blocks) * fwd / (attention_tflops(C // blocks[0].heads) * 1e12)
    return {"flop": flops / rate, "attention": attn_s, "other": (flops - attn_counted) / rate,
            "time": max(flops / rate, attn_s + (flops - attn_counted) / rate)}


def ring_bytes(N, C, d, elem, W, on_gpu=True):
    """Bytes one rank's ring attention (ring_attention.RingAttention) holds on top of the activations, which
    count its q, k, v, out and lse: one sample, N tokens on this rank, width C = heads x d, elem bytes per element
    of the compute dtype (e below), W ranks in the ring. Its peak is in backward, inside the fused backward of the
    block at a step 1 <= s <= W - 2, when all of these are alive (per token and channel, in bytes):
      RingAttention.backward:
        dout made contiguous (it arrives as a transposed view of proj's input gradient)         e
        dq, the fp32 accumulator                                                               4
        the K/V block received at the last step, and the next one in flight (none when W = 2)   2e + 2e
        the dk/dv accumulator sent on at the last step (its name, dkv, still holds it)          2 x 4
        and the one arriving for this step's block (dkv_in)                                    2 x 4
        (the last step's dq_b, dk_b, dv_b are dropped once folded in: not held)
      the fused backward of this step's block (block_bwd):
        its dq, dk, dv                                                                         3e
        its contiguous copy of dout: aten's flash backward reads (B, N, H, d) and calls
          .contiguous() on the ring's (B, H, N, d) (on CPU the kernel does the same)          e
        on a GPU, FlashAttention-2's fp32 dq accumulator at the head dim rounded up to its tile
          (104 -> 128: head_tile) and its fp32 softmax_d, one per row; kept as the allowance for
          whichever kernel runs (cuDNN's on an H200, whose workspace is its own)                (4 tile + 4) / d
        (on CPU, instead, scratch tiles per thread of a fixed size, not per token: not counted)
    = 9e + 20 + (4 tile + 4) / d bytes per token and channel, less 2e when W = 2. bf16: 43.0 at head dim 104, 42.1
    at 32. The forward holds less: the received and the in-flight K/V (4e), the fp32 out accumulator and a block's
    out with its fp32 cast (e + 8). Measured by bench_plan.calibrate on CPU (fp32 and bf16; W = 2 and 4, one rank's
    exact computation with the exchange done as a local copy: 2 to 4 real gloo ranks allocate the same) to within
    the CPU kernel's fixed scratch; the GPU terms are from PyTorch's flash backward source. On the H200 the whole
    block (its activations and this) peaked below the planner's sum (bench/gpu.py big_blocks)."""
    e = elem
    per = e + 4 + 2 * e + (2 * e if W > 2 else 0) + 2 * 4 + 2 * 4 + 3 * e + e
    if on_gpu:
        per += (4 * head_tile(d) + 4) / d
    return per * N * C


# S3's documented request rate: "at least 3,500 PUT/COPY/POST/DELETE or 5,500 GET/HEAD requests per second per
# partitioned Amazon S3 prefix" (Amazon S3 User Guide, "Best practices design patterns: optimizing Amazon S3
# performance": https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html). Above it S3
# answers 503 SlowDown until it has partitioned the prefix further, which it does gradually and without a promise.
# The limit counts requests, not bytes: each chunk is one GET whatever its size, so the chunk shape sets the rate.
S3_GET_PER_PREFIX = 5500
S3_PUT_PER_PREFIX = 3500


def chunk_gets(crop, chunks, cp=1, align=False):
    """Expected chunk GETs for one sample of `crop` voxels from a store chunked `chunks`, summed over its cp ranks
    (data.Sampler: rank r reads the inline slab [r S, (r + 1) S) of the crop, S = crop[0] / cp). A chunk the crop
    only touches is a whole GET (and all its bytes), and one that two slabs share is fetched by both ranks. Along
    each axis, a window of n voxels at offset a from the crop's origin touches, in chunks of c:
      align, crop >= chunk (the origin on a chunk boundary): floor((a + n - 1) / c) - floor(a / c) + 1
      align, crop < chunk (the crop inside one chunk): 1
      not aligned (the origin uniform modulo c): 1 + (n - 1) / c on average (from offset r within a chunk it touches
        floor((r + n - 1) / c) + 1, whose mean over r = 0 .. c - 1 is that, by Hermite's identity)
    The axes' origins are drawn independently (data._draw), so the mean of the product is the product of the means."""
    slab = crop[0] // cp
    total = 1.0
    for axis, (n, c) in enumerate(zip(crop, chunks)):
        windows = [(r * slab, slab) for r in range(cp)] if axis == 0 else [(0, n)]
        if align and n >= c:
            total *= sum((a + w - 1) // c - a // c + 1 for a, w in windows)
        elif align:
            total *= len(windows)
        else:
            total *= sum(1 + (w - 1) / c for _, w in windows)
    return total


def store_prefixes(paths):
    """How many S3 key prefixes the reads of `paths` (data_paths) spread over, as far as the config says: every store
    named is one (all its chunk keys start with its path, so S3 partitions it as one prefix until its load makes S3
    split it, which it may do late or not at all). A glob pattern or an @manifest names stores that only a listing
    counts: None."""
    if any(str(x).startswith("@") or any(ch in str(x) for ch in "*?[") for x in paths):
        return None
    return len(set(map(str, paths)))


ACT_MARGIN = 1.15  # the least checkpointing that fits plans for 15 % more activations than modelled (the
#                    activation model's largest error measured here, bench/plan.py calibrate: 14 %)


def checkpoint_bytes(n_params, elem):
    """The bytes of one checkpoint of a model of n_params parameters whose compute dtype has `elem` bytes (or is that
    torch.dtype): fp32 master weights, AdamW's m and v, and the weights in the compute dtype. The room a checkpoint
    write asks the file system for first (infra/ops.py), and the planner's write time."""
    elem = elem if isinstance(elem, int) else elem.itemsize
    return n_params * (4 + ADAMW_STATE_BYTES + elem)


def plan(cfg, world, gpu="H200", mfu=0.4, gpus_per_node=8):
    """The analytic plan of config `cfg` (train.py's keys) on `world` GPUs of kind `gpu`. mfu: the fraction of
    the GPU's peak FLOP/s sustained on the FLOPs the step executes; those include the forward of every
    checkpointed block again in backward (so checkpointing costs time, as on the GPU). Attention is priced
    apart, at the fused kernel's rate for each head dim (sample_seconds): the step takes the longer of the two.
    Each of a cp group's ranks does 1/cp of each of its samples (the ring splits the queries, and so the
    attention, evenly), so a step lasts micro_batch x grad_accum samples' GPU-seconds / cp, and samples/s =
    world / (GPU-seconds per sample)."""
    g = GPUS[gpu]
    cp = cfg["cp"]
    m = build_model(cfg, device="meta")  # shapes only
    m.set_grad_ckpt(checkpointed(m, cfg))  # the run's checkpointed blocks
    n = param_counts(m)
    P, W = n["P"], world
    elem = 4 if cfg["dtype"] == "float32" else 2  # 'auto' is bf16 on a GPU
    states = {k: state_bytes(n, k, W, elem, cfg) for k in ("zero2", "zero3", "fsdp2")}
    workspace = 3e9  # CUDA context, cuBLAS/flash workspaces, allocator slack
    ring = 0.0
    if cp > 1:  # what the ring's backward holds beyond the activations, for the stack where it is largest
        ring = cfg["micro_batch"] * max(ring_bytes(N / cp, C, C // blocks[0].heads, elem, cp)
                                        for _, blocks, N, C in stacks(m))
    fps = flops_per_sample(m)
    n_blocks = len(ckpt_order(m))
    strategy = cfg["strategy"]

    def at(k, margin=1.0):  # (memory per GPU by strategy in GB, samples/s) with the first k blocks checkpointed
        act = margin * sum(activation_bytes(m, cfg["micro_batch"], cp, elem, k))  # peak: both at once
        mem_k = {s_: (step_bytes(st, act + ring)["peak"] + workspace) / 1e9 for s_, st in states.items()}
        return mem_k, W / sample_seconds(m, k, g, mfu)["time"]

    k_cfg = len(m.ckpt)
    mem, sps = at(k_cfg)
    act = sum(activation_bytes(m, cfg["micro_batch"], cp, elem))
    act_none, act_all = (sum(activation_bytes(m, cfg["micro_batch"], cp, elem, k)) for k in (0, n_blocks))
    limit = 0.92 * g["mem_gb"]
    # the least checkpointing that fits with ACT_MARGIN on the activations (memory falls as k grows)
    k_fit = next((k for k in range(n_blocks + 1) if at(k, ACT_MARGIN)[0][strategy] <= limit), None)
    sps_fit = at(k_fit)[1] if k_fit is not None else 0.0
    sps_full = at(n_blocks)[1]
    # ring traffic per step per rank (all layers, fwd + bwd) and whether compute hides one hop
    ring_traffic, hidden = 0.0, True
    for blocks, N, C in ((m.blocks, (visible(m) + 1) / cp, m.dim), (m.decoder_blocks, m.L / cp, m.dec_dim)):
        if cp > 1 and len(blocks):
            per_layer = (cp - 1) * (2 * N * C * elem) * 2 + (cp - 1) * (2 * N * C * 4)  # K/V fwd + bwd, dK/dV fp32
            ring_traffic += len(blocks) * per_layer * cfg["micro_batch"]
            hop_comm = 2 * N * C * elem / g["nvlink"]
            hop_compute = 4 * N * N * C / (attention_tflops(C // blocks[0].heads) * 1e12)  # one block's forward
            hidden = hidden and hop_comm <= hop_compute
    voxels = math.prod(cfg["crop"])
    s3_node = sps / max(1, W // gpus_per_node) * voxels * 4  # float32 voxels of every sample, per node
    # S3 requests: each chunk a crop touches is a GET (S3_GET_PER_PREFIX), the labels' too when fine-tuning. The
    # chunks are the stores' own, which the config can only state: store_chunks (the synthetic store's when the run
    # writes it)
    s3_chunks = tuple(cfg["synthetic_chunks"] if cfg["make_synthetic"] else cfg["store_chunks"])
    s3_gets = chunk_gets(cfg["crop"], s3_chunks, cp, cfg["align_crops"]) * (2 if cfg["task"] == "segment" else 1)
    s3_prefixes = store_prefixes(cfg["data_paths"])
    fits = mem[strategy] <= limit
    shape_rows, shape_flags, t_attn, t_attn128 = shapes(m, cp)
    # the step: a cp group's micro_batch x grad_accum samples, each spread over its cp ranks
    per_step = cfg["micro_batch"] * cfg["grad_accum"] / cp
    t = sample_seconds(m, k_cfg, g, mfu)
    step_s = per_step * t["time"]
    # what a stop signal costs (stop.StopRequest), so that SLURM's warning before the time limit (launch.sh's
    # srun --signal=USR1@lead) leaves time for it: the step in progress and, on a GPU, one more (the stop flag is
    # read a step late), an evaluation that may be running (forwards only, priced as the step is: ceil(eval_samples
    # / dp) samples per cp group), and the checkpoint write: fp32 master weights and AdamW's m and v (4 +
    # ADAMW_STATE_BYTES per parameter, partitioned) and the weights in the compute dtype, at out_dir's write bandwidth.
    has_val = bool(cfg["val_paths"]) or cfg["val_frac"] > 0
    eval_s = (math.ceil(cfg["eval_samples"] / (W // cp)) * sample_seconds(m, 0, g, mfu, train=False)["time"] / cp
              if has_val else 0.0)
    ckpt_bytes = checkpoint_bytes(P, elem)
    ckpt_s = ckpt_bytes / (cfg["ckpt_write_gbps"] * 1e9)
    # x 1.5 for the planner's error, + 60 s: SLURM may send the signal up to a minute early or late (its timer)
    stop_lead = math.ceil(60 + 1.5 * (2 * step_s + eval_s + ckpt_s))
    return {"gpu": gpu, "world": W, "gpus_per_node": gpus_per_node, "dp": W // cp, "cp": cp, "params": P, "tokens": m.L, "visible": visible(m),
            "enc_tokens_per_rank": (visible(m) + 1) / cp, "dec_tokens_per_rank": m.L / cp,
            "flops_per_sample": fps, "mfu": mfu, "samples_per_s": sps,
            "mem_per_gpu_gb": round(mem[strategy], 2), "mem_by_strategy_gb": {k: round(v, 2) for k, v in mem.items()},
            "states_gb": {k: round(step_bytes(st, 0)["peak"] / 1e9, 2) for k, st in states.items()},
            "activations_gb": round(act / 1e9, 2), "activations_no_ckpt_gb": round(act_none / 1e9, 2),
            "activations_full_ckpt_gb": round(act_all / 1e9, 2),
            "ckpt_blocks": k_cfg, "blocks": n_blocks, "ckpt_order": list(dict.fromkeys(st for st, _ in ckpt_order(m))),
            "ckpt_blocks_fit": k_fit, "samples_per_s_ckpt_fit": sps_fit, "samples_per_s_full_ckpt": sps_full,
            "recompute_flops_per_sample": recompute_flops(m),
            "head_dims": {"enc": m.dim // m.blocks[0].heads,
                          "dec": m.dec_dim // m.decoder_blocks[0].heads if len(m.decoder_blocks) else None},
            "shape_flags": shape_flags, "shapes": shape_rows,
            "attention_gpu_s_per_sample": t_attn, "attention_gpu_s_per_sample_at_128": t_attn128,
            "ring_gb_per_step_per_rank": round(ring_traffic / 1e9, 2), "ring_hidden_by_compute": hidden,
            "s3_gb_per_s_per_node": round(s3_node / 1e9, 3),
            "s3_chunks": list(s3_chunks), "s3_aligned": bool(cfg["align_crops"]), "s3_gets_per_sample": s3_gets,
            "s3_gets_per_s": sps * s3_gets, "s3_gets_per_s_per_node": sps / max(1, W // gpus_per_node) * s3_gets,
            "s3_prefixes": s3_prefixes, "s3_gets_per_s_per_prefix": sps * s3_gets / (s3_prefixes or 1),
            "s3_prefixes_needed": math.ceil(sps * s3_gets / S3_GET_PER_PREFIX),
            # whole chunks, float32 uncompressed: the crop's voxels and the rest of the chunks at its borders
            "s3_fetched_gb_per_s_per_node": round(sps / max(1, W // gpus_per_node) * s3_gets * math.prod(s3_chunks)
                                                  * 4 / 1e9, 3),
            "strategy": strategy, "grad_ckpt": cfg["grad_ckpt"],
            "fits": bool(fits), "limit_gb": round(limit, 1),
            "step_s": step_s, "flop_bound_s_per_step": per_step * t["flop"],
            "attention_s_per_step": per_step * t["attention"], "other_s_per_step": per_step * t["other"],
            "eval_s": eval_s, "ckpt_gb": round(ckpt_bytes / 1e9, 2), "ckpt_bytes": ckpt_bytes, "ckpt_s": ckpt_s,
            "stop_lead_s": stop_lead}


# -----------------------------------------------------------------------------
# the plan of a command line, and its table (python -m scripts.plan, python -m bench plan)


def achieved_mfu(p):
    """The model FLOP utilisation plan p predicts: useful FLOPs (attention counted, recomputation not) per second
    over the GPUs' peak, flops_per_sample x samples/s / (world x peak). Below plan()'s mfu, the assumption for the
    FLOPs outside attention, wherever the fused attention kernel runs slower than that."""
    return p["flops_per_sample"] * p["samples_per_s"] / (p["world"] * GPUS[p["gpu"]]["flops"])


def head_layouts(cfg, p):
    """The same plan at the config's heads and at the other layout of the same widths: the size's own heads
    (model.SIZES) where the config sets others, else heads of 128 (or 64) where the widths allow (model.aligned_heads).
    Returns rows of {layout, heads, dec_heads, head_dims, step_s, samples_per_s, mfu}: [] where no other layout exists."""
    dim, _, h0, dec_dim, _, dh0 = SIZES[cfg["model_size"]]
    mine = head_counts(cfg)
    other = (h0, dh0) if mine != (h0, dh0) else (aligned_heads(dim) or h0, aligned_heads(dec_dim) or dh0)
    if other == mine:
        return []
    rows = []
    for layout, (h, dh) in (("config", mine), ("own" if other == (h0, dh0) else "aligned", other)):
        q = p if layout == "config" else plan({**cfg, "heads": h, "dec_heads": dh}, p["world"], p["gpu"], p["mfu"],
                                              p["gpus_per_node"])
        rows.append({"layout": layout, "heads": h, "dec_heads": dh, "head_dims": q["head_dims"], "step_s": q["step_s"],
                     "samples_per_s": q["samples_per_s"], "mfu": achieved_mfu(q)})
    return rows


def report(p, name):
    """Print plan p (plan()'s dict) as a table; name: where the config came from."""
    print(f"{name} on {p['world'] // p['gpus_per_node']} x {p['gpus_per_node']} {p['gpu']} = {p['world']} GPUs "
          f"(dp {p['dp']} x cp {p['cp']}), {p['strategy']}, {p['ckpt_blocks']} of {p['blocks']} blocks checkpointed")
    rows = [["params", f"{p['params'] / 1e6:.1f} M"], ["tokens / visible", f"{p['tokens']:,} / {p['visible']:,}"],
            ["encoder / decoder tokens per rank", f"{p['enc_tokens_per_rank']:,.0f} / {p['dec_tokens_per_rank']:,.0f}"],
            ["FLOPs per sample (fwd+bwd)", f"{p['flops_per_sample'] / 1e12:.1f} TFLOP"]]
    for k in ("zero2", "zero3", "fsdp2"):
        rows.append([f"memory per GPU, {k}", f"{p['mem_by_strategy_gb'][k]:.1f} GB (states {p['states_gb'][k]:.1f})"])
    first = {"enc": "encoder", "dec": "decoder"}[p["ckpt_order"][0]]
    fit = (f"{p['ckpt_blocks_fit']} -> {p['samples_per_s_ckpt_fit']:.2f} samples/s" if p["ckpt_blocks_fit"] is not None
           else "none fits")
    rows += [["activations per GPU", f"{p['activations_gb']:.1f} GB (every block checkpointed: "
                                     f"{p['activations_full_ckpt_gb']:.1f} GB, none: {p['activations_no_ckpt_gb']:.1f} GB)"],
             ["checkpointed blocks", f"{p['ckpt_blocks']} of {p['blocks']} ({first} blocks first: most bytes per "
                                     f"recomputed FLOP)"],
             [f"least that fits (activations x {ACT_MARGIN})", f"{fit}; every block: "
                                                             f"{p['samples_per_s_full_ckpt']:.2f} samples/s"],
             ["ring traffic per step per rank", f"{p['ring_gb_per_step_per_rank']:.1f} GB, "
                                               f"{'hidden' if p['ring_hidden_by_compute'] else 'NOT hidden'} by compute"],
             ["step time (per rank)", f"{p['step_s']:.1f} s = max({p['flop_bound_s_per_step']:.1f} s FLOP-bound, "
                                      f"{p['attention_s_per_step']:.1f} s attention + "
                                      f"{p['other_s_per_step']:.1f} s rest)"],
             ["predicted samples/s", f"{p['samples_per_s']:.2f} (recompute: "
                                     f"{p['recompute_flops_per_sample'] / 1e12:.1f} TFLOP per sample)"],
             ["stop lead (SLURM's warning)", f"{p['stop_lead_s']} s: 60 + 1.5 x (2 steps + an evaluation of "
                                             f"{p['eval_s']:.1f} s + the checkpoint write of {p['ckpt_s']:.1f} s)"],
             ["S3 read per node at that rate", f"{p['s3_gb_per_s_per_node']:.2f} GB/s (float32, uncompressed)"],
             ["S3 GETs per sample", f"{p['s3_gets_per_sample']:,.1f} (chunks of {' x '.join(map(str, p['s3_chunks']))} "
                                    f"touched, {'aligned' if p['s3_aligned'] else 'unaligned'}; whole chunks: "
                                    f"{p['s3_fetched_gb_per_s_per_node']:.2f} GB/s per node)"],
             ["S3 GET/s at that rate", f"{p['s3_gets_per_s_per_node']:,.0f} per node, "
                                       f"{p['s3_gets_per_s_per_prefix']:,.0f} per store prefix "
                                       f"({p['s3_prefixes'] or 'stores not counted: 1'} of them) of S3's "
                                       f"{S3_GET_PER_PREFIX:,}" + (" -> OVER" if p["s3_gets_per_s_per_prefix"] >
                                                                   S3_GET_PER_PREFIX else "")],
             ["fits", f"{'yes' if p['fits'] else 'NO'}: {p['mem_per_gpu_gb']:.1f} GB of {p['limit_gb']} GB usable"]]
    table(rows, ["quantity", "value"])
    print("\nshapes per rank (tokens: this rank's x the sequence attended to; attention rate: ATTN_TFLOPS, infra/plan.py):")
    table(p["shapes"], ["stack", "op", "shape", "tokens", "attention rate"])
    for f in p["shape_flags"]:
        print(f"  flag: {f}")
    print(f"  attention, fwd + bwd, at those rates: {p['attention_gpu_s_per_sample']:.1f} GPU-s per sample "
          f"({p['attention_gpu_s_per_sample_at_128']:.1f} if every head dim ran at 128's rate)")


def config_plan(argv, check=None):
    """(the config of argv: config files and --key=value over the defaults; its plan). check(cfg): the config check
    to pass first (scripts/plan.py's: configurator.check_config, so that a config the run refuses is refused here too)."""
    ap = argparse.ArgumentParser(prog="python -m scripts.plan", description=__doc__.split("\n")[1])
    ap.add_argument("configs", nargs="*", help="config files (config/*.py), then --key=value overrides, as train.py")
    ap.add_argument("--gpu", default="H200", help=f"one of {sorted(GPUS)}")
    ap.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilisation outside attention (0.4)")
    a, overrides = ap.parse_known_args(argv)
    if a.gpu not in GPUS:
        raise configurator.ConfigError(f"--gpu={a.gpu!r} is not one of {sorted(GPUS)}")
    if not 0 < a.mfu <= 1:
        raise configurator.ConfigError(f"--mfu={a.mfu}: a fraction of the GPU's peak, in (0, 1] (e.g. 0.4)")
    cfg = configurator.defaults()
    configurator.apply(cfg, a.configs + overrides)
    if check:
        check(cfg)
    gpn = cfg["gpus_per_node"] or 8
    return cfg, plan(cfg, cfg["nodes"] * gpn, a.gpu, a.mfu, gpn)
