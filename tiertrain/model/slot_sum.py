"""Each token's k slots added from the experts' pair rows (model/moe.py's add_slots), as one Triton kernel on a
GPU. A program takes one token and a block of columns: it starts from the token's running sum (or zero), loads the
block of each of its rows in the range given, by their index (contiguous, 2 KB in bf16), adds them in fp32 in
expert order, and writes the block once: in fp32 for the residual or the running sum, in the rows' dtype for a
gradient. torch.compile's version of the same gather and sum read at about 1 TB/s on an H100
(bench/results/2026-11-25-issue40-experts.md); this one reads each pair row once near the memory's rate
(bench/results/2026-11-26-issue40-slot-sum.md). The order is the experts', whatever the launch and however the
rows come in ranges (expert groups): a rerun, and a run in groups, give the same bits."""

from __future__ import annotations

import functools

import torch

BLOCK = 1024  # columns per program (2 KB of a bf16 row); a hidden size over it takes several programs a token


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_slots(acc, y, pos, out, lo, n, width, K: tl.constexpr, START: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        if START:
            a = tl.load(acc + token * width + cols, mask=inside, other=0.0)
        else:
            a = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):  # expert order, as the eager op's fp32 additions
            row = tl.load(pos + token * K + j).to(tl.int64) - lo
            hit = (row >= 0) & (row < n)  # a row of the range given; the others are left for their own call
            v = tl.load(y + row * width + cols, mask=inside & hit, other=0.0).to(tl.float32)
            a = tl.where(hit, a + v, a)
        tl.store(out + token * width + cols, a.to(out.dtype.element_ty), mask=inside)

    return add_slots


def add_slots(
    acc: torch.Tensor | None, y: torch.Tensor, pos: torch.Tensor, lo: int, dtype: torch.dtype
) -> torch.Tensor:
    """model/moe.add_slots on a GPU: each token's rows of y (sorted pairs lo .. lo + len(y)) added to its row of
    acc (fp32 (T, D); None: zero) in the order of pos (T, k), in fp32, written in `dtype` (T, D)."""
    y, pos = y.contiguous(), pos.contiguous()
    t, k = pos.shape
    width = y.shape[-1]
    out = torch.empty(t, width, dtype=dtype, device=y.device)
    if out.numel():
        start = acc is not None
        grid = (t, -(-width // BLOCK))
        _kernel()[grid](
            acc.contiguous() if start else out,
            y,
            pos,
            out,
            lo,
            y.shape[0],
            width,
            K=k,
            START=start,
            BLOCK=BLOCK,
            num_warps=4,
        )
    return out
