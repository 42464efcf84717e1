"""
Ring attention: exact non-causal attention over a sequence split across the ranks of a process group.

Each of the W ranks of a context-parallel (CP) group holds a contiguous 1/W share of the sequence:
q, k, v of shape (B, H, N_local, Dh). Attention needs every query against every key, so the K/V shares
travel around a ring: at step s rank r computes its queries against the K/V block of rank (r - s) mod W,
while that block is already being sent on to rank r + 1. After W steps every query has seen every key,
no rank ever held more than two K/V blocks, and no N x N (or even N_local x N_local) score matrix was
built in Python: each block goes through the fused attention op that returns the log-sum-exp.

    ring_attention(q, k, v, group=None, scale=None) -> out (B, H, N_local, Dh), differentiable
    torch_cp_attention(q, k, v, group)              -> the same through PyTorch's context_parallel (forward)
    simulate_ring(q, k, v, P)                       -> the same block math over P blocks in one process

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
# the ring reuses block 0's extra outputs (the CUDA flash op's RNG state among them) for every block's
# backward: with dropout each block would need its own RNG state.
DROPOUT = 0.0


# Time the ring spent waiting for transfers. On CPU (gloo) Work.wait() blocks the host: host time. On GPU
# (NCCL) it does not: it makes the compute stream wait for the transfer, and the host runs on. There the
# stall is measured on the stream with a pair of CUDA events around each wait, read (one sync) when asked.
_waits = {"host_s": 0.0, "events": []}


def comm_wait_s(reset=False):
    """Seconds this process's ring spent waiting for transfers since the last reset (bench.py reads it)."""
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


def block_fwd(q, k, v, scale):
    """out (B, H, Nq, Dh) in q.dtype, lse (B, H, Nq) fp32 contiguous, and the op's extra outputs that its
    backward needs (CUDA flash only)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, DROPOUT, False, scale=scale)
        return out, lse.contiguous(), None
    if q.dtype in (torch.float16, torch.bfloat16):
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, DROPOUT, False, False, scale=scale)
        return r[0], r[1].contiguous(), r[2:8]  # cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused
    # fp32 on GPU: flash needs 16-bit inputs, the memory-efficient kernel takes fp32. Its lse is padded
    # along N to a multiple of 32; keep the first Nq columns.
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, DROPOUT, False, scale=scale)
    return out, lse[:, :, : q.shape[2]].contiguous(), (seed, offset)


def block_bwd(dout, q, k, v, out, lse, scale, extra):
    """(dq, dk, dv) of one block, given the GLOBAL out and lse (see the module docstring)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, DROPOUT, False, scale=scale)
    if q.dtype in (torch.float16, torch.bfloat16):
        cum_q, cum_k, _, _, rng_state, unused = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], DROPOUT, False, rng_state, unused,
            scale=scale)
    seed, offset = extra
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


def _neighbours(group):
    """Global ranks of the next and previous member of `group` (P2P takes global ranks)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    r, w = dist.get_rank(group), len(ranks)
    return ranks[(r + 1) % w], ranks[(r - 1) % w]


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
        W = dist.get_world_size(group)
        nxt, prv = _neighbours(group) if W > 1 else (None, None)
        kv = [k, v]  # the block we compute with; at step s it is rank (r - s)'s
        out = lse = extra = None
        for step in range(W):
            if step < W - 1:  # double buffering: the next block is in flight while we compute this one
                works, kv_next = _exchange(kv, nxt, prv, group, tag=0)
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
        W = dist.get_world_size(group)
        dout = dout.contiguous()
        if W == 1:
            dq, dk, dv = block_bwd(dout, q, k, v, out, lse, scale, ctx.extra)
            return dq, dk, dv, None, None
        nxt, prv = _neighbours(group)
        acc = torch.promote_types(q.dtype, torch.float32)  # accumulate in fp32 (fp64 for fp64 inputs)
        dq = torch.zeros_like(q, dtype=acc)
        kv = [k, v]
        dkv = dkv_works = dkv_in = None
        for step in range(W):
            # at this step we hold the K/V block of rank (r - step); its dk/dv accumulator arrives from
            # rank r - 1, which held the same block one step ago
            if step < W - 1:
                kv_works, kv_next = _exchange(kv, nxt, prv, group, tag=0)
            # always the K/V block received at THIS step (never a copy from step 0: that would be a
            # silently wrong gradient)
            dq_b, dk_b, dv_b = block_bwd(dout, q, kv[0], kv[1], out, lse, scale, ctx.extra)
            dq += dq_b
            if step == 0:
                dkv = [dk_b.to(acc).contiguous(), dv_b.to(acc).contiguous()]  # (op outputs may be strided)
            else:
                _wait(dkv_works, q.device)  # the accumulator has been travelling while we computed
                dkv = [dkv_in[0].add_(dk_b), dkv_in[1].add_(dv_b)]
            # send the accumulator on with its block; the one we receive belongs to the next block we hold
            dkv_works, dkv_in = _exchange(dkv, nxt, prv, group, tag=2)
            if step < W - 1:
                _wait(kv_works, q.device)
                kv = kv_next
        # the last hop brought our own block's accumulator home: its dk/dv summed over all W ranks
        _wait(dkv_works, q.device)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None


@torch.compiler.disable  # one opaque op to torch.compile (train.py's compile=True): its P2P ops, timings and
# autograd.Function are not traced; a compiled block runs up to it and on from its output (a graph break there)
def ring_attention(q, k, v, group=None, scale=None):
    """Non-causal attention of local queries against the keys/values of every rank in `group`.
    q, k, v: (B, H, N_local, Dh), the same N_local on every rank, ranks holding consecutive shares in
    group order. Returns (B, H, N_local, Dh): this rank's rows of softmax(q k^T * scale) v."""
    check_head_dim(q.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, scale)


# -----------------------------------------------------------------------------
# PyTorch's own context parallelism, as the alternative (cp_impl = 'torch')


@torch.compiler.disable  # (as ring_attention: its global dispatcher switch is no graph op)
def torch_cp_attention(q, k, v, group=None):
    """The same attention through torch.distributed.tensor.experimental's context_parallel machinery:
    q, k, v become DTensors sharded on the sequence dim over a mesh of `group`, and SDPA on them dispatches
    to PyTorch's ring attention. Load balancing is turned off: it reorders the sequence head-tail, which
    only helps causal attention, and our shares are plain contiguous slabs. torch 2.13 has no CPU backward
    for it (train.py refuses cp_impl='torch' on CPU)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import _attention as cp

    group = group if group is not None else dist.group.WORLD
    mesh = DeviceMesh.from_group(group, q.device.type)
    cp._cp_options.enable_load_balance = False
    cp._enable_context_parallel_dispatcher()
    try:
        qd, kd, vd = (DTensor.from_local(t.contiguous(), mesh, [Shard(2)], run_check=False) for t in (q, k, v))
        return F.scaled_dot_product_attention(qd, kd, vd).to_local()
    finally:
        cp._disable_context_parallel_dispatcher()


# -----------------------------------------------------------------------------
# the block maths in one process, for checking the GPU op path without P2P


def simulate_ring(q, k, v, P, dout=None, scale=None):
    """What the ring computes, for the full sequence split into P query and key blocks in one process:
    forward merges, and backward with the global out/lse, through the same block_fwd/block_bwd/merge.
    Returns out, and (dq, dk, dv) when dout is given."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qs, ks, vs = ([c.contiguous() for c in t.chunk(P, dim=2)] for t in (q, k, v))
    outs, lses, extras = [], [], []
    for qi in qs:
        o = l = ex = None
        for kj, vj in zip(ks, vs):
            ob, lb, e = block_fwd(qi, kj, vj, scale)
            ex = ex if ex is not None else e
            o, l = merge(o, l, ob, lb)
        outs.append(o.to(q.dtype))
        lses.append(l)
        extras.append(ex)
    out = torch.cat(outs, dim=2)
    if dout is None:
        return out
    acc = torch.promote_types(q.dtype, torch.float32)
    dqs = [torch.zeros_like(qi, dtype=acc) for qi in qs]
    dks = [torch.zeros_like(kj, dtype=acc) for kj in ks]
    dvs = [torch.zeros_like(vj, dtype=acc) for vj in vs]
    for i, (qi, doi) in enumerate(zip(qs, dout.contiguous().chunk(P, dim=2))):
        for j, (kj, vj) in enumerate(zip(ks, vs)):
            a, b, c = block_bwd(doi.contiguous(), qi, kj, vj, outs[i], lses[i], scale, extras[i])
            dqs[i] += a
            dks[j] += b
            dvs[j] += c
    cat = lambda xs, t: torch.cat(xs, dim=2).to(t.dtype)  # noqa: E731
    return out, (cat(dqs, q), cat(dks, k), cat(dvs, v))
