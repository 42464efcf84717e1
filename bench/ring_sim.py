"""
The ring in one process, for the checks that have one GPU (bench/gpu_attention.py, bench/gpu_model.py) or none
(bench/plan.py's memory of the ring's backward, tests/test_ring_attention.py):

    SelfRing(W, via)                 a "group" of W ranks that are all this one: ring_attention(q, k, v, SelfRing(W))
                                     runs the real RingAttention, every step, exchange and buffer, at a real shard's
                                     shapes, and must equal SDPA on the local q, k, v
    simulate_ring(q, k, v, P, dout)  what the ring computes over P blocks, through its own block ops and merge, with
                                     no exchange at all: the block maths alone

ring_attention.py's ring takes as its group either a process group or a stand-in like SelfRing: anything with
.size and .exchange(ts, tag).
"""

import torch
import torch.distributed as dist

import ring_attention as RA


class SelfRing:
    """A ring of `size` ranks that are all this one process: every block it sends comes back to it. For checking
    one rank's exact work on a single GPU: with the same K/V on every (simulated) rank, attention over the W
    copies equals attention over one (softmax over duplicated keys: each weight is p_j / W, W times), so the
    result must equal SDPA on the local q, k, v, forward and backward, while the ring runs all W steps, its
    exchanges and its buffers at a real shard's shapes.
      via = "p2p":  the real exchange, batch_isend_irecv to this rank's own global rank (NCCL sends to self
                    inside a group call, as its all-to-all does; gloo cannot);
      via = "copy": the exchange as a copy on a side stream, returned as a work whose wait() makes the
                    compute stream wait for it (what an NCCL Work's wait() does); on CPU, a plain copy."""

    def __init__(self, size, via="copy"):
        assert size >= 1 and via in ("p2p", "copy"), (size, via)
        self.size, self.via, self.stream = size, via, None

    def exchange(self, ts, tag):
        """Post the exchange of one ring step, as ring_attention's own does: (works, bufs), bufs like ts, which a
        real ring receives from the previous rank and this one receives from itself."""
        if self.via == "p2p":  # to our own global rank in the default group, where it is our rank
            me = dist.get_rank() if dist.is_initialized() else 0
            return RA._exchange(ts, me, me, None, tag)
        bufs = [torch.empty_like(t) for t in ts]
        if not ts[0].is_cuda:
            for b, t in zip(bufs, ts):
                b.copy_(t)
            return [], bufs
        if self.stream is None:
            self.stream = torch.cuda.Stream(priority=-1)  # high priority, as TORCH_NCCL_HIGH_PRIORITY gives NCCL
        self.stream.wait_stream(torch.cuda.current_stream())  # the tensors are ready when the compute stream is
        with torch.cuda.stream(self.stream):
            for b, t in zip(bufs, ts):
                b.copy_(t, non_blocking=True)
                for x in (b, t):  # the allocator must not hand these out again before the side stream is done
                    x.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record()
        return [_StreamWork(done)], bufs


class _StreamWork:
    """The copy's event as a work: wait() makes the compute stream wait for it."""

    def __init__(self, event):
        self.event = event

    def wait(self):
        torch.cuda.current_stream().wait_event(self.event)


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
            ob, lb, e = RA.block_fwd(qi, kj, vj, scale)
            ex = ex if ex is not None else e
            o, l = RA.merge(o, l, ob, lb)
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
            a, b, c = RA.block_bwd(doi.contiguous(), qi, kj, vj, outs[i], lses[i], scale, extras[i])
            dqs[i] += a
            dks[j] += b
            dvs[j] += c
    cat = lambda xs, t: torch.cat(xs, dim=2).to(t.dtype)  # noqa: E731
    return out, (cat(dqs, q), cat(dks, k), cat(dvs, v))
