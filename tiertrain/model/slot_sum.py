"""Each token's k slots summed from the experts' pair rows (model/moe.py's _sum_slots), as one Triton kernel on a
GPU. A program takes one token and a block of columns: it loads the block of each of the token's k rows by their
index (contiguous, 2 KB in bf16), adds them in fp32 in slot order, and writes the block once: in fp32 for the
residual, in the rows' dtype for a gradient. torch.compile's version of the same gather and sum read at about
1 TB/s on an H100 (bench/results/2026-11-25-issue40-experts.md); this one reads each pair row once near the
memory's rate (bench/results/2026-11-26-issue40-slot-sum.md). The sum's order is the slots', whatever the launch:
a rerun gives the same bits."""

from __future__ import annotations

import functools

import torch

BLOCK = 1024  # columns per program (2 KB of a bf16 row); a hidden size over it takes several programs a token


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sum_slots(y, inv, out, width, K: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):  # slot order, as the eager sum's fp32 accumulation
            row = tl.load(inv + token * K + j).to(tl.int64)
            acc += tl.load(y + row * width + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out + token * width + cols, acc.to(out.dtype.element_ty), mask=inside)

    return sum_slots


def sum_slots(y: torch.Tensor, inv: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows y (T k, D) on a GPU back to their T tokens: out[t] = sum over j < k of y[inv[t k + j]], added in fp32
    and written in `dtype`."""
    y, inv = y.contiguous(), inv.contiguous()
    width = y.shape[-1]
    out = torch.empty(inv.numel() // k, width, dtype=dtype, device=y.device)
    if out.numel():
        grid = (out.shape[0], -(-width // BLOCK))
        _kernel()[grid](y, inv, out, width, K=k, BLOCK=BLOCK, num_warps=4)
    return out
