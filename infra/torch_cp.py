"""
PyTorch's own context parallelism (cp_impl='torch'): the same exact attention as ring_attention.py's ring, computed by
PyTorch's ring functions, as the alternative a run may choose; and the guard that checks it against our ring.

    torch_cp_attention(q, k, v, group)          -> (B, H, N_local, Dh), as ring_attention.ring_attention returns
    verify_torch_cp(group, device, dtype, dh)   -> None, or CPMismatchError: PyTorch's ring and ours disagree here

Why it is checked against our ring. PyTorch's context_parallel() reaches its ring through a dispatcher that is
switched on for a whole region, forward AND backward (it must still be on during loss.backward(), or the backward of
the attention op takes DTensor's ordinary sharding rules: a local-only or gathered backward, not the ring). A model
that is context-parallel in its attention calls alone has no such region. So we call the two functions that
dispatcher ends in, `_templated_ring_attention` and `_templated_ring_attention_backward`, from an autograd.Function
of our own: PyTorch's rotation, merge and backward accumulation, run exactly when autograd asks for them, on the CP
group, with the K/V passed from rank to rank ("alltoall" rotation), not all-gathered. Those functions are private:
their place and behaviour change between releases, and a backward that escapes the ring trains silently on wrong
gradients. So the first call on each group, device, dtype and head dim runs one small problem through both rings,
forward and backward, and refuses the run if they differ (verify_torch_cp; train.py calls it before any work).

The attention op each block runs is the one our ring's blocks run (ring_attention.block_kernel: the one SDPA picks),
so the two rings differ only in how the blocks travel and merge. Like the ring, this is imported by whoever chooses
it (train.py passes torch_cp_attention to model.set_context_parallel): model.py knows only the function it is given.
"""

import torch
import torch.distributed as dist

from ring_attention import DROPOUT, RingAttention, block_bwd, block_fwd, block_kernel, check_head_dim


def _torch_ring():
    """PyTorch's ring functions and its options (private API: its place moved between releases)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    except ImportError:
        try:
            from torch.distributed.tensor.experimental import _attention as cp
        except ImportError:
            cp = None
    if cp is None or not all(hasattr(cp, n) for n in ("_templated_ring_attention", "_templated_ring_attention_backward",
                                                     "_cp_options", "_RotateMethod")):
        raise RuntimeError(f"cp_impl='torch' needs PyTorch's ring functions (_templated_ring_attention and its "
                           f"_backward in torch.distributed.tensor.experimental), which torch {torch.__version__} "
                           f"does not have where they are looked for: use cp_impl='ring'")
    return cp


def _torch_op(q, k, v, scale):
    """The attention op for PyTorch's ring: the kernel our ring's blocks run (block_kernel: the one SDPA would
    pick), as (forward op, backward op, name of its gradient argument, forward kwargs, names of the forward's
    extra outputs that the backward takes): the ops and arguments of PyTorch's own ring handlers."""
    aten = torch.ops.aten
    base = dict(dropout_p=DROPOUT, scale=scale)
    kernel = block_kernel(q, k, v, scale)
    if kernel == "cpu":
        return (aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default, "grad_out", base, ())
    if kernel == "flash":
        return (aten._scaled_dot_product_flash_attention.default,
                aten._scaled_dot_product_flash_attention_backward.default, "grad_out", base,
                ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset"))
    if kernel == "cudnn":
        return (aten._scaled_dot_product_cudnn_attention.default,
                aten._scaled_dot_product_cudnn_attention_backward.default, "grad_out",
                dict(base, attn_bias=None, compute_log_sumexp=True),
                ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset"))
    return _efficient_fwd, _efficient_bwd, "grad_out", base, ("philox_seed", "philox_offset")


def _efficient_fwd(query, key, value, is_causal=False, dropout_p=DROPOUT, scale=None):
    """The memory-efficient op as our block_fwd runs it (its log-sum-exp cut from the kernel's padding to one value
    per row, which PyTorch's merge needs), in the form PyTorch's ring calls: (out, lse, *extras)."""
    out, lse, (_, seed, offset) = block_fwd(query, key, value, scale)
    return out, lse, seed, offset


def _efficient_bwd(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, is_causal=False,
                   dropout_p=DROPOUT, scale=None):
    return block_bwd(grad_out, query, key, value, out, logsumexp, scale, ("efficient", philox_seed, philox_offset))


class _TorchOptions:
    """PyTorch's ring reads module-level options: the rotation ("alltoall": blocks passed on, never every K/V
    gathered), no load balancing (it reorders the sequence head-tail, which only helps causal attention; our
    shares are contiguous slabs), partial results merged in fp32. Set for the call, restored after."""

    def __init__(self, cp):
        self.o, self.cp = cp._cp_options, cp

    def __enter__(self):
        self.saved = (self.o.rotate_method, self.o.enable_load_balance, self.o.convert_to_f32)
        self.o.rotate_method, self.o.enable_load_balance = self.cp._RotateMethod.ALL_TO_ALL, False
        self.o.convert_to_f32 = True

    def __exit__(self, *exc):
        self.o.rotate_method, self.o.enable_load_balance, self.o.convert_to_f32 = self.saved


class TorchRingAttention(torch.autograd.Function):
    """q, k, v (B, H, N_local, Dh) -> out, through PyTorch's ring functions forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        cp = _torch_ring()
        fwd, bwd, grad_name, kw, extra_names = _torch_op(q, k, v, scale)
        with _TorchOptions(cp):
            out, lse, *rest = cp._templated_ring_attention(group, 2, fwd, q, k, v, is_causal=False, **kw)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.bwd, ctx.grad_name = group, bwd, grad_name
        ctx.kw = dict(dict(zip(extra_names, rest)), **{n: kw[n] for n in kw if n != "compute_log_sumexp"})
        return out

    @staticmethod
    def backward(ctx, dout):
        cp = _torch_ring()
        q, k, v, out, lse = ctx.saved_tensors
        with _TorchOptions(cp):
            dq, dk, dv, *_ = cp._templated_ring_attention_backward(
                ctx.group, 2, ctx.bwd, dout.contiguous(), ctx.grad_name, q, k, v, out, lse, False, **ctx.kw)
        return dq, dk, dv, None, None


class CPMismatchError(RuntimeError):
    """PyTorch's ring and ours disagree on this machine: cp_impl='torch' would train on wrong numbers."""


_verified = set()  # (group, device, dtype, head dim) already checked against our ring


def verify_torch_cp(group, device, dtype, head_dim):
    """The check no CPU can make for every build: one small random problem through PyTorch's ring and ours,
    forward and backward, on this CP group, device and dtype. Every rank draws the same full problem and takes
    its share; the worst relative difference is agreed over the group, so every rank gives the same verdict.
    Raises CPMismatchError if they differ beyond the dtype's tolerance."""
    key = (id(group), str(device), dtype, head_dim)
    if key in _verified:
        return
    W, r = dist.get_world_size(group), dist.get_rank(group)
    n = 48  # tokens per rank: not a multiple of 32 (the efficient kernel's padding is exercised)
    g = torch.Generator().manual_seed(1234)
    full = [torch.randn(1, 2, W * n, head_dim, generator=g) for _ in range(4)]
    q, k, v, dout = (t[:, :, r * n:(r + 1) * n].to(device, dtype) for t in full)
    res = []
    # its own little graph, whatever the caller is in: no_grad (validation), or a checkpointed block's forward
    # (whose saved-tensor hooks must not see these tensors: the innermost hooks win, and these keep them as they are)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        for fn in (TorchRingAttention.apply, RingAttention.apply):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            o = fn(*x, group, head_dim ** -0.5)
            o.backward(dout)
            res.append([o.detach().float()] + [t.grad.float() for t in x])
    err = torch.stack([(a - b).abs().max() / b.abs().max().clamp_min(1e-6) for a, b in zip(*res)]).max()
    dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)  # on `device`: NCCL serves CUDA tensors only
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    if not err.item() <= tol:  # (NaN refuses too)
        raise CPMismatchError(
            f"cp_impl='torch' disagrees with ring_attention on this machine ({device.type}, {dtype}, head dim "
            f"{head_dim}, cp {W}): largest relative difference {err.item():.3g} > {tol} in the outputs or gradients. "
            f"PyTorch's private ring functions behave differently in torch {torch.__version__}: use cp_impl='ring'")
    _verified.add(key)


@torch._disable_dynamo  # (as ring_attention: its collectives and autograd.Function are not traced)
def torch_cp_attention(q, k, v, group=None, scale=None):
    """The same attention as ring_attention, through PyTorch's own ring functions (see above), checked against
    ring_attention the first time it runs on a group, device, dtype and head dim (verify_torch_cp)."""
    check_head_dim(q.shape[-1])
    group = group if group is not None else dist.group.WORLD
    verify_torch_cp(group, q.device, q.dtype, q.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return TorchRingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, scale)

