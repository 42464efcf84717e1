"""
Ring attention: exact non-causal attention over a sequence split across the ranks of a process group.

Each of the W ranks of a context-parallel (CP) group holds a contiguous 1/W share of the sequence:
q, k, v of shape (B, H, N_local, Dh). Attention needs every query against every key, so the K/V shares
travel around a ring: at step s rank r computes its queries against the K/V block of rank (r - s) mod W,
while that block is already being sent on to rank r + 1. After W steps every query has seen every key,
no rank ever held more than two K/V blocks, and no N x N (or even N_local x N_local) score matrix was
built in Python: each block goes through the fused attention op that returns the log-sum-exp.

    ring_attention(q, k, v, group=None, scale=None) -> out (B, H, N_local, Dh), differentiable

(The same attention through PyTorch's own ring functions, cp_impl='torch', is infra/torch_cp.py, checked against
this ring; the ring run in one process, for checks on one GPU, is bench/ring_sim.py.)

The maths, for one query row q (dropping the row index):
  scores    s_j = scale * q . k_j,   softmax weights  p_j = exp(s_j - lse),   lse = log sum_j exp(s_j)
  For a block b of keys the fused op returns out_b = sum_{j in b} exp(s_j - lse_b) v_j and lse_b.
  MERGE (forward). With the blocks seen so far summarised by (out, lse):
      lse' = log(exp(lse) + exp(lse_b)) = lse - logsigmoid(lse - lse_b)
      out' = (exp(lse) out + exp(lse_b) out_b) / exp(lse')
           = sigmoid(lse - lse_b) out + sigmoid(lse_b - lse) out_b
           = out - sigmoid(lse_b - lse) (out - out_b)
  Both forms use only differences of lse, so nothing overflows, and it is done in fp32.
  BACKWARD. With D = rowsum(dout * out) over the *global* out, the exact gradients are
      dv_j = p_j dout,   dp_j = dout . v_j,   ds_j = p_j (dp_j - D),   dq = scale sum_j ds_j k_j,
      dk_j = scale ds_j q
  and p_j = exp(s_j - lse) uses the *global* lse. Every term is a sum over key blocks of a term that
  only needs that block's k, v plus the global (out, lse, dout). The fused backward op computes exactly
  those block terms when it is given the global out and lse instead of the block's own: so
  dq = sum over blocks (accumulated locally, fp32), and dk/dv of a block are summed over the ranks that
  used it, by travelling around the ring with the block and arriving home after W hops.
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Dropout inside attention: none (MAE uses none). The fused ops take it as an argument; it must stay 0 because
# the ring reuses block 0's extra outputs (the CUDA kernels' RNG state among them) for every block's
# backward: with dropout each block would need its own RNG state.
DROPOUT = 0.0


# Time the ring spent waiting for transfers. On CPU (gloo) Work.wait() blocks the host: host time. On GPU
# (NCCL) it does not: it makes the compute stream wait for the transfer, and the host runs on. There the
# stall is measured on the stream with a pair of CUDA events around each wait, read (one sync) when asked.
_waits = {"host_s": 0.0, "events": []}


def comm_wait_s(reset=False):
    """Seconds this process's ring spent waiting for transfers since the last reset (bench/step.py reads it)."""
    if _waits["events"]:
        torch.cuda.synchronize()
        _waits["host_s"] += sum(a.elapsed_time(b) for a, b in _waits["events"]) / 1000
        _waits["events"] = []
    out = _waits["host_s"]
    if reset:
        _waits["host_s"] = 0.0
    return out

# -----------------------------------------------------------------------------
# the fused block ops: one call = one (q block) x (k/v block) attention returning out and lse


def check_head_dim(d):
    """The fused attention kernels (CUDA flash and memory-efficient) need a head dim that is a multiple of
    8, at most 256. We hold the CPU path to the same rule so that what passes on CPU runs on GPU."""
    if d % 8 != 0 or not 8 <= d <= 256:
        raise ValueError(f"attention head dim {d} is unsupported by the fused attention ops (needs a multiple "
                         f"of 8 in [8, 256]): change dim / heads, e.g. dim = 64 * heads")


def block_kernel(q, k, v, scale):
    """Which fused kernel runs a block: the one F.scaled_dot_product_attention would pick for these inputs (so
    torch.nn.attention.sdpa_kernel pins it, as for plain SDPA): 'cpu' (the CPU flash kernel), or on CUDA 'cudnn'
    (cuDNN's, what SDPA picked for bf16 on an H200 in the GPU check's runs, made with torch 2.11: the fastest there,
    see bench/gpu.py attention_rates and docs/gpu_check/), 'flash' (FlashAttention-2) or 'efficient'
    (memory-efficient, the one for fp32)."""
    if q.device.type == "cpu":
        return "cpu"
    from torch.nn.attention import SDPBackend
    choice = torch._fused_sdp_choice(q, k, v, None, DROPOUT, False, scale=scale)
    kernel = {SDPBackend.CUDNN_ATTENTION.value: "cudnn", SDPBackend.FLASH_ATTENTION.value: "flash",
              SDPBackend.EFFICIENT_ATTENTION.value: "efficient"}.get(choice)
    if kernel is None:
        raise RuntimeError(f"no fused attention kernel takes these inputs (SDPA picks backend {choice}; head dim "
                           f"{q.shape[-1]}, {q.dtype}): the ring needs one that returns the log-sum-exp")
    return kernel


def block_fwd(q, k, v, scale):
    """out (B, H, Nq, Dh) in q.dtype, lse (B, H, Nq) fp32 contiguous, and what the kernel's backward needs
    (the kernel's name first, then its extra outputs)."""
    kernel = block_kernel(q, k, v, scale)
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, DROPOUT, False, scale=scale)
        return out, lse.contiguous(), (kernel,)
    if kernel == "cudnn":  # its lse may keep a trailing dim of 1 (B, H, N, 1): merged without it, given back with it
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, DROPOUT, False, False, scale=scale)
        return r[0], r[1].reshape(r[1].shape[:3]).contiguous(), (kernel, r[1].dim(), *r[2:8])
    if kernel == "flash":
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, DROPOUT, False, False, scale=scale)
        return r[0], r[1].contiguous(), (kernel, *r[2:8])  # cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused
    # memory-efficient (fp32 on GPU): its lse is padded along N to a multiple of 32; keep the first Nq columns
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, DROPOUT, False, scale=scale)
    return out, lse[:, :, : q.shape[2]].contiguous(), (kernel, seed, offset)


def block_bwd(dout, q, k, v, out, lse, scale, extra):
    """(dq, dk, dv) of one block, given the GLOBAL out and lse (see the module docstring)."""
    kernel, *ex = extra
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, DROPOUT, False, scale=scale)
    if kernel == "cudnn":
        lse_dims, cum_q, cum_k, max_q, max_k, seed, offset = ex
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse.unsqueeze(-1) if lse_dims == 4 else lse,
            philox_seed=seed, philox_offset=offset, attn_bias=None, cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q,
            max_k=max_k, dropout_p=DROPOUT, is_causal=False, scale=scale)[:3]
    if kernel == "flash":
        cum_q, cum_k, _, _, rng_state, unused = ex
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], DROPOUT, False, rng_state, unused,
            scale=scale)
    seed, offset = ex
    # back to the padded layout the kernel expects, padded as the kernel pads: +inf, so that a padded row's
    # weights exp(s - lse) are 0 whatever its scores
    pad = (-lse.shape[2]) % 32
    lse_p = F.pad(lse, (0, pad), value=float("inf")) if pad else lse
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse_p, seed, offset, DROPOUT, [True, True, True, False], False, scale=scale)
    return dq, dk, dv


def merge(out, lse, out_b, lse_b):
    """Fold block result (out_b, lse_b) into the running (out, lse), fp32, in place; first call: copy."""
    acc = torch.promote_types(out_b.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    if out is None:
        return out_b.to(acc), lse_b.to(acc)
    out.lerp_(out_b.to(acc), torch.sigmoid(lse_b - lse).unsqueeze(-1))  # out - w (out - out_b), no temporary
    lse.sub_(F.logsigmoid(lse - lse_b))
    return out, lse


# -----------------------------------------------------------------------------
# the ring: point-to-point exchange with the neighbours


def _ring(group):
    """The ring of `group`: (W, exchange), its size and exchange(ts, tag) -> (works, bufs), which posts one step's
    exchange with the neighbours. `group` is a process group (None: the default one), or a stand-in ring in this
    one process: anything with .size and .exchange(ts, tag) (bench/ring_sim.py's SelfRing, with which the GPU
    check runs one rank's exact ring on a single GPU)."""
    if hasattr(group, "exchange"):
        return group.size, group.exchange
    W = dist.get_world_size(group)
    if W == 1:
        return 1, None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(W))  # P2P takes global ranks
    r = dist.get_rank(group)
    nxt, prv = ranks[(r + 1) % W], ranks[(r - 1) % W]
    return W, lambda ts, tag: _exchange(ts, nxt, prv, group, tag)


def _exchange(ts, nxt, prv, group, tag):
    """Post: send each tensor of ts to the next rank, receive tensors like them from the previous one.
    Returns (works, bufs). Nothing waits here: the caller computes, then calls _wait(works). (Sending k and
    v as two messages, rather than one stacked tensor, saves a copy of the local K/V.)"""
    bufs = [torch.empty_like(t) for t in ts]
    ops = [dist.P2POp(dist.isend, t, nxt, group, tag + i) for i, t in enumerate(ts)]
    ops += [dist.P2POp(dist.irecv, b, prv, group, tag + i) for i, b in enumerate(bufs)]
    return dist.batch_isend_irecv(ops), bufs


def _wait(works, device):
    if device.type == "cuda":  # the stream's stall, between two events (see comm_wait_s)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for w in works:
            w.wait()
        b.record()
        ev = _waits["events"]
        ev.append((a, b))
        if len(ev) > 256:  # in a long run nobody may ask: fold the pairs that have finished, keep it bounded
            done = 0
            while done < len(ev) and ev[done][1].query():
                done += 1
            _waits["host_s"] += sum(x.elapsed_time(y) for x, y in ev[:done]) / 1000
            del ev[:done]
        return
    t = time.perf_counter()
    for w in works:
        w.wait()
    _waits["host_s"] += time.perf_counter() - t


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        W, exchange = _ring(group)
        kv = [k, v]  # the block we compute with; at step s it is rank (r - s)'s
        out = lse = extra = None
        for step in range(W):
            if step < W - 1:  # double buffering: the next block is in flight while we compute this one
                works, kv_next = exchange(kv, 0)
            out_b, lse_b, ex = block_fwd(q, kv[0], kv[1], scale)  # (B, H, N, Dh), (B, H, N) fp32
            # block 0's extras serve every block's backward: shapes are the same, and with no dropout the
            # RNG state is unused
            assert DROPOUT == 0.0, "the ring reuses block 0's extra outputs: valid only without dropout"
            extra = extra if extra is not None else ex
            out, lse = merge(out, lse, out_b, lse_b)
            if step < W - 1:
                _wait(works, q.device)
                kv = kv_next  # the block that just arrived; the old one is freed
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.extra = group, scale, extra
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        W, exchange = _ring(group)
        dout = dout.contiguous()
        if W == 1:
            dq, dk, dv = block_bwd(dout, q, k, v, out, lse, scale, ctx.extra)
            return dq, dk, dv, None, None
        acc = torch.promote_types(q.dtype, torch.float32)  # accumulate in fp32 (fp64 for fp64 inputs)
        dq = torch.zeros_like(q, dtype=acc)
        kv = [k, v]
        dkv = dkv_works = dkv_in = None
        for step in range(W):
            # at this step we hold the K/V block of rank (r - step); its dk/dv accumulator arrives from
            # rank r - 1, which held the same block one step ago
            if step < W - 1:
                kv_works, kv_next = exchange(kv, 0)
            # always the K/V block received at THIS step (never a copy from step 0: that would be a
            # silently wrong gradient)
            dq_b, dk_b, dv_b = block_bwd(dout, q, kv[0], kv[1], out, lse, scale, ctx.extra)
            dq += dq_b
            if step == 0:
                dkv = [dk_b.to(acc).contiguous(), dv_b.to(acc).contiguous()]  # (op outputs may be strided)
            else:
                _wait(dkv_works, q.device)  # the accumulator has been travelling while we computed
                dkv = [dkv_in[0].add_(dk_b), dkv_in[1].add_(dv_b)]
            del dq_b, dk_b, dv_b  # folded in: not held through the next block's backward
            # send the accumulator on with its block; the one we receive belongs to the next block we hold
            dkv_works, dkv_in = exchange(dkv, 2)
            if step < W - 1:
                _wait(kv_works, q.device)
                kv = kv_next
        # the last hop brought our own block's accumulator home: its dk/dv summed over all W ranks
        _wait(dkv_works, q.device)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None


@torch._disable_dynamo  # one opaque op to torch.compile (train.py's compile=True): its P2P ops, timings and
# autograd.Function are not traced; a compiled block runs up to it and on from its output (a graph break there).
# (torch.compiler.disable imports torch._dynamo at import, seconds for every script that imports this file;
# this imports it at the first call. A training run imports it anyway: every torch.optim optimizer does.)
def ring_attention(q, k, v, group=None, scale=None):
    """Non-causal attention of local queries against the keys/values of every rank in `group`.
    q, k, v: (B, H, N_local, Dh), the same N_local on every rank, ranks holding consecutive shares in
    group order. Returns (B, H, N_local, Dh): this rank's rows of softmax(q k^T * scale) v."""
    check_head_dim(q.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, scale)
