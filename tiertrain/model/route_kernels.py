"""The routed pairs' bookkeeping (model/moe.py) as Triton kernels on a GPU: the pairs sorted by expert with each
token's places and each expert's count, and the rows gathered to their pairs (the router itself:
model/router_kernel.py).

At 8k tokens of Qwen3-30B-A3B's experts on an H100 torch's ops for these took about 0.35 ms of the experts' 4.7 ms
forward and backward pass: a radix sort of the pairs, a sort of each token's places, counts and a cumsum (some 25
small kernels) and row gathers at about 1.8 TB/s. Here:
- pairs: a counting sort, stable like the argsort it replaces, so its outputs are that argsort's bits. Each block
  of pairs counts its experts, one program turns the counts into each (block, expert)'s first place, and each
  block sorts its pairs by (expert, place in block) and writes them there. A last kernel sorts each token's k
  places.
- gather: R pair rows a program, a block of columns each, cast on the way (the backward's fp32 gradient to the
  rows' bf16): the index_select's bits, faster than its one row a program.
With the router's kernel (model/router_kernel.py) the experts' pass at 8k went from 1.54-1.57x a dense MLP of the
same active FLOPs to 1.45-1.48x (bench/results/2026-11-27-issue40-route-kernels.md).
"""

from __future__ import annotations

import functools

import torch

GATHER_ROWS, GATHER_BLOCK = 4, 256  # rows and columns a gather program copies
MAX_EXPERTS = (
    256  # more and moe.py keeps torch's ops (the counts' table and the router's rows grow with them)
)
MAX_BLOCKS = 64  # the counting sort's blocks of pairs: one program scans their counts
MAX_BLOCK = 8192  # pairs a block sorts; more pairs than MAX_BLOCKS x this and moe.py keeps torch's ops


def _pow2(n: int) -> int:
    return max(1, 1 << (n - 1).bit_length())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gather(x, idx, out, n, width, R: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * R + tl.arange(0, R)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = rows < n
        src = tl.load(idx + rows, mask=live, other=0).to(tl.int64)
        m = live[:, None] & (cols < width)[None, :]
        v = tl.load(x + src[:, None] * width + cols[None, :], mask=m, other=0.0)
        tl.store(out + rows.to(tl.int64)[:, None] * width + cols[None, :], v.to(out.dtype.element_ty), mask=m)

    @triton.jit
    def count(keys, counts, n, EP: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        i = b * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        key = tl.load(keys + i, mask=live, other=0).to(tl.int32)
        tl.atomic_add(counts + b * EP + key, tl.full([BLOCK], 1, tl.int32), mask=live)

    @triton.jit
    def scan(counts, first, ends, per, nb, e, NB: tl.constexpr, EP: tl.constexpr):
        b = tl.arange(0, NB)[:, None]
        x = tl.arange(0, EP)[None, :]
        m = (b < nb) & (x < e)
        c = tl.load(counts + b * EP + x, mask=m, other=0)
        total = tl.sum(c, axis=0)  # each expert's pairs
        base = tl.cumsum(total, axis=0) - total  # the pairs of the experts before it
        # a block's pair of expert x, the i-th of the block in (expert, place) order, goes to first[b, x] + i:
        # after the earlier experts' pairs and this expert's in earlier blocks, less the block's earlier experts'
        at = base[None, :] + (tl.cumsum(c, axis=0) - c) - (tl.cumsum(c, axis=1) - c)
        tl.store(first + b * EP + x, at, mask=m)
        xs = tl.arange(0, EP)
        tl.store(ends + xs, base + total, mask=xs < e)
        tl.store(per + xs, total.to(tl.int64), mask=xs < e)

    @triton.jit
    def place(keys, first, order, src, inv, n, k, e, EP: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        j = tl.arange(0, BLOCK)
        live = b * BLOCK + j < n
        key = tl.load(keys + b * BLOCK + j, mask=live, other=e).to(tl.int32)  # padding sorts last
        s = tl.sort(key * BLOCK + j)  # by expert, then by place in the block: stable
        x, sj = s // BLOCK, s % BLOCK
        ok = x < e
        at = tl.load(first + b * EP + x, mask=ok, other=0) + j
        pair = b * BLOCK + sj
        tl.store(order + at, pair.to(tl.int64), mask=ok)
        tl.store(src + at, (pair // k).to(tl.int64), mask=ok)
        tl.store(inv + pair, at, mask=ok)

    @triton.jit
    def positions(inv, pos, t, K: tl.constexpr, KP: tl.constexpr, R: tl.constexpr):
        rows = tl.program_id(0) * R + tl.arange(0, R)
        c = tl.arange(0, KP)
        m = (rows < t)[:, None] & (c < K)[None, :]
        v = tl.load(inv + rows[:, None] * K + c[None, :], mask=m, other=2147483647)
        tl.store(pos + rows[:, None] * K + c[None, :], tl.sort(v, dim=1).to(tl.int64), mask=m)

    return dict(gather=gather, count=count, scan=scan, place=place, positions=positions)


def gather(x: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype)[idx] for x (N, D) and idx (n,): the rows idx of x, cast."""
    x, idx = x.contiguous(), idx.contiguous()
    n, width = idx.shape[0], x.shape[1]
    out = torch.empty(n, width, dtype=dtype, device=x.device)
    if out.numel():
        grid = (-(-n // GATHER_ROWS), -(-width // GATHER_BLOCK))
        _kernels()["gather"][grid](
            x, idx, out, n, width, R=GATHER_ROWS, BLOCK=GATHER_BLOCK, num_warps=4
        )  # fmt: skip
    return out


def sorts(chosen: torch.Tensor, n_experts: int) -> bool:
    """Whether pairs() takes these: at most MAX_EXPERTS experts, at most MAX_BLOCKS x MAX_BLOCK pairs."""
    return n_experts <= MAX_EXPERTS and chosen.numel() <= MAX_BLOCKS * MAX_BLOCK


def pairs(chosen: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, ...]:
    """model/moe.py's _pairs on a GPU (sorts() says which): (order, pos, src, per, ends) of the chosen experts
    (T, k)."""
    t, k = chosen.shape
    n, dev = t * k, chosen.device
    keys = chosen.reshape(-1).contiguous()
    order = torch.empty(n, dtype=torch.int64, device=dev)
    src = torch.empty_like(order)
    pos = torch.empty(t, k, dtype=torch.int64, device=dev)
    # the scan writes every expert's count and end where there are pairs
    per = (torch.empty if n else torch.zeros)(n_experts, dtype=torch.int64, device=dev)
    ends = (torch.empty if n else torch.zeros)(n_experts, dtype=torch.int32, device=dev)
    if not n:
        return order, pos, src, per, ends
    ep, block = _pow2(n_experts), max(1024, _pow2(-(-n // MAX_BLOCKS)))
    nb = -(-n // block)
    kern = _kernels()
    counts = torch.zeros(nb, ep, dtype=torch.int32, device=dev)
    first = torch.empty_like(counts)
    inv = torch.empty(n, dtype=torch.int32, device=dev)
    kern["count"][(nb,)](keys, counts, n, EP=ep, BLOCK=block, num_warps=4)
    kern["scan"][(1,)](counts, first, ends, per, nb, n_experts, NB=_pow2(nb), EP=ep, num_warps=8)
    kern["place"][(nb,)](keys, first, order, src, inv, n, k, n_experts, EP=ep, BLOCK=block, num_warps=8)
    rows = 32
    kern["positions"][(-(-t // rows),)](inv, pos, t, K=k, KP=max(2, _pow2(k)), R=rows, num_warps=4)
    return order, pos, src, per, ends
