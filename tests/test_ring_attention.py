"""Ring attention on real gloo ranks against full F.scaled_dot_product_attention: outputs and gradients; PyTorch's ring
(infra/torch_cp.py) against both, and its guard; the ring's block maths in one process (bench/ring_sim.py)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ring_attention as RA
from bench.ring_sim import simulate_ring
from dist_util import run_ranks
from infra import torch_cp as TC

CASES = [  # (dtype, head dim, N_local, heads, tolerance)
    (torch.float32, 32, 13, 2, 1e-5),
    (torch.float32, 64, 8, 3, 1e-5),
    (torch.float32, 80, 21, 1, 1e-5),
    (torch.bfloat16, 64, 13, 2, 2e-2),
    (torch.bfloat16, 80, 7, 2, 2e-2),
]


def _reference(seed, W, dtype, d, n, h):
    """The same full-sequence inputs on every rank, full SDPA in fp64 as the reference."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, h, W * n, d, generator=g) for _ in range(4))
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qr, kr, vr)
    out.backward(dout.double())
    return (q, k, v, dout), (out.detach(), qr.grad, kr.grad, vr.grad)


def _close(a, b, tol, what):
    err = (a.double() - b).abs().max().item()
    scale = max(1.0, b.abs().max().item())
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol} x {scale:.3g}"


def _check_ring(rank, W):
    for i, (dtype, d, n, h, tol) in enumerate(CASES):
        (q, k, v, dout), refs = _reference(i, W, dtype, d, n, h)
        sl = slice(rank * n, (rank + 1) * n)  # this rank's contiguous share
        ql, kl, vl = (t[:, :, sl].clone().requires_grad_() for t in (q, k, v))
        for repeat in range(2):  # the same result when called again: no stale buffers
            for t in (ql, kl, vl):
                t.grad = None
            out = RA.ring_attention(ql, kl, vl)
            out.backward(dout[:, :, sl])
            for got, ref, name in zip((out, ql.grad, kl.grad, vl.grad), refs, ("out", "dq", "dk", "dv")):
                _close(got.detach(), ref[:, :, sl], tol, f"W={W} {dtype} d={d} n={n} {name} call {repeat}")
            assert out.dtype == dtype and ql.grad.dtype == dtype


@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_ring_matches_full_attention(W):
    run_ranks(W, _check_ring)


def _check_deep(rank, W):
    """Ring attention in every layer of a small stack, forward and backward, against the same stack with
    full attention on the gathered sequence: no deadlock, and the gradients of the weights agree."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 3 * 64).double() for _ in range(6)]
    x = torch.randn(1, 4 * W, 64, dtype=torch.float64)

    def stack(x, attn):
        for lin in layers:
            q, k, v = lin(x).view(1, -1, 3, 2, 32).permute(2, 0, 3, 1, 4)
            x = x + attn(q, k, v).transpose(1, 2).reshape(1, -1, 64)
        return x

    full = stack(x, F.scaled_dot_product_attention).pow(2).sum()
    ref = torch.autograd.grad(full, [lin.weight for lin in layers])
    local = stack(x[:, rank * 4:(rank + 1) * 4], RA.ring_attention).pow(2).sum()
    grads = torch.autograd.grad(local, [lin.weight for lin in layers])
    for g_, r in zip(grads, ref):
        g_ = g_.clone()
        dist.all_reduce(g_)  # each rank holds its share's contribution: their sum is the full gradient
        torch.testing.assert_close(g_, r, rtol=1e-9, atol=1e-9)


def test_ring_in_every_layer_no_deadlock():
    run_ranks(3, _check_deep)


def _check_torch_cp(rank, W):
    """cp_impl='torch': PyTorch's own ring functions in our autograd.Function, forward and backward, against fp64
    SDPA and against our ring (head dims of the ViT-G encoder, 104, and decoder, 32)."""
    for i, (dtype, d, n, h, tol) in enumerate(CASES + [(torch.float32, 104, 10, 2, 1e-5)]):
        (q, k, v, dout), refs = _reference(100 + i, W, dtype, d, n, h)
        sl = slice(rank * n, (rank + 1) * n)
        got = {}
        for name, fn in (("torch", TC.torch_cp_attention), ("ring", RA.ring_attention)):
            x = [t[:, :, sl].clone().requires_grad_() for t in (q, k, v)]
            out = fn(*x)
            out.backward(dout[:, :, sl])
            got[name] = [out.detach(), *(t.grad for t in x)]
            for a, ref, what in zip(got[name], refs, ("out", "dq", "dk", "dv")):
                _close(a, ref[:, :, sl], tol, f"{name} W={W} {dtype} d={d} {what}")
        for a, b in zip(got["torch"], got["ring"]):
            _close(a, b.double(), tol, f"torch vs ring W={W} {dtype} d={d}")


@pytest.mark.parametrize("W", [2, 3])
def test_torch_context_parallel_equals_ring_forward_and_backward(W):
    run_ranks(W, _check_torch_cp)


class _LocalBackward:
    """PyTorch's ring module with a broken backward: each rank's own diagonal block only (what a backward that
    escapes the ring gives: silently wrong dq/dk/dv)."""

    def __init__(self, cp):
        self._cp = cp

    def __getattr__(self, name):
        return getattr(self._cp, name)

    @staticmethod
    def _templated_ring_attention_backward(group, seq_dim, op, grad_out, grad_out_name, query, key, value, out,
                                           logsumexp, is_causal, **kw):
        return op(**{grad_out_name: grad_out}, query=query, key=key, value=value, out=out, logsumexp=logsumexp,
                  is_causal=is_causal, **kw)


def _check_guard_refuses(rank, W):
    real = TC._torch_ring
    TC._torch_ring = lambda: _LocalBackward(real())
    try:
        with pytest.raises(TC.CPMismatchError, match="cp_impl='torch' disagrees with ring_attention"):
            TC.verify_torch_cp(dist.group.WORLD, torch.device("cpu"), torch.float32, 32)
        q = torch.randn(1, 2, 8, 32)
        with pytest.raises(TC.CPMismatchError):  # and the attention call itself refuses, on every rank
            TC.torch_cp_attention(q, q, q)
    finally:
        TC._torch_ring = real
    TC.verify_torch_cp(dist.group.WORLD, torch.device("cpu"), torch.float32, 32)  # the real one passes


def test_torch_cp_guard_refuses_a_wrong_backward():
    run_ranks(2, _check_guard_refuses)


def test_simulated_ring_matches_full_attention_on_this_device():
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 60, 64) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr)
    ref.backward(dout)
    out, (dq, dk, dv) = simulate_ring(q, k, v, 4, dout=dout)
    for a, b in zip((out, dq, dk, dv), (ref, qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [4, 12, 100, 264])
def test_unsupported_head_dim_is_a_clear_error(d):
    q = torch.randn(1, 1, 4, d)
    with pytest.raises(ValueError, match=f"head dim {d} is unsupported"):
        RA.ring_attention(q, q, q)
