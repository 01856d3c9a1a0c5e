"""A mixture-of-experts block in parts (model/parts.py): its attention part, then its experts a group at a time.

The attention part is llama.block over the part's weights: it routes the tokens and hands (h, chosen experts,
routing weights) over in ctx.routed (moe.experts), and its output is the residual with what needs no expert's
weights (a shared expert's output, gpt-oss's down-projection biases). Each group adds its experts' rows of every
token to that output: the rows, projections and weighting are moe.experts', and so is the order of the sum
(moe.add_slots: a token's rows in expert order, in fp32, going on from the last group's sum), so blocks in parts
give the bits of whole blocks.

A group's backward pass takes the block's output gradient and returns its weights' gradients and adds its share of
the gradients of h and of the routing weights to their sums (in fp32, h's in moe.add_slots' order; Sums); the
attention part is then differentiated against the output gradient and those two sums (attention_backward).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate

import torch

from . import kernels, llama, moe
from .llama import Context


@dataclass
class Routed:
    """A micro-batch's routed tokens as its block's attention part left them: what every group reads."""

    h: torch.Tensor  # (T, H) compute dtype: the MLP's input
    chosen: torch.Tensor  # (T, k) int64: each token's experts
    weights: torch.Tensor  # (T, k) fp32: their routing weights
    order: torch.Tensor  # (T k,): the (token, slot) pairs sorted by expert
    pos: torch.Tensor  # (T, k): each token's pairs' places in `order`, in expert order (moe.positions)
    starts: list[int]  # on the host: the pairs before each expert, E + 1 of them

    @classmethod
    def of(cls, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, n_experts: int) -> "Routed":
        order, pos, _, per, _ = moe.pairs(kernels.on(h), chosen, n_experts)
        per = per.tolist()  # one sync a micro-batch: the groups' rows are sliced
        return cls(h.detach(), chosen, weights.detach(), order, pos, [0, *accumulate(per)])


@dataclass
class Sums:
    """A micro-batch's gradients of h and of the routing weights, added to by each group's backward pass."""

    dh: torch.Tensor | None  # (T, H) fp32; None: zero
    dws: torch.Tensor  # (T, k) fp32, by (token, slot) of the backward pass's routing


def attention_part(w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, Routed]:
    """The attention part's forward pass on a micro-batch x (B, T, H), without gradients: (its output, fp32 (B, T,
    H): the residual after attention plus any shared expert's output; the tokens routed)."""
    ctx = dataclasses.replace(ctx, routed=[])
    y = llama.block(w, x, ctx)
    return y, Routed.of(*ctx.routed[0], ctx.spec.num_experts)


def _pairs(r: Routed, first: int, n: int, k: int, down: torch.Tensor):
    """The group's pairs (ids in the (T k) slots, sorted by expert), the first one's place in r.order, and the
    grouped matmul's ends (on a GPU, moe._grouped of `down`, the group's down projections) or the rows per expert
    (elsewhere)."""
    st = r.starts[first : first + n + 1]
    sel = r.order[st[0] : st[-1]]
    counts = [b - a for a, b in zip(st, st[1:])]
    if moe._grouped(r.h, down):
        ends = torch.tensor(list(accumulate(counts)), dtype=torch.int32).to(r.h.device, non_blocking=True)
        return sel, st[0], ends, None
    return sel, st[0], None, counts


def _experts(s, r: Routed, sel: torch.Tensor, first: int) -> torch.Tensor | None:
    """The expert of each of the group's pairs `sel`, counted from its first (gpt-oss's gate/up bias), else None."""
    e = moe._experts_of(s, r.chosen, sel)
    return None if e is None else e - first


def share(w: dict[str, torch.Tensor], r: Routed, acc: torch.Tensor, ctx: Context, first: int, n: int):
    """The rows of experts first..first+n (w: their weights) of the routed tokens added to their rows of acc (fp32
    (T, H): the block's output so far), without gradients: the new sum (acc where no token chose any of them)."""
    s, k = ctx.spec, ctx.spec.num_experts_per_tok
    sel, lo, ends, counts = _pairs(r, first, n, k, w["mlp.experts.down_proj"])
    if not sel.numel():
        return acc
    on = kernels.on(r.h)
    ws = r.weights.reshape(-1).index_select(0, sel)[:, None]
    xs = moe.gather(on, r.h, sel // k, r.h.dtype)
    y = moe._rows(w, xs, ws, _experts(s, r, sel, first), ends, counts, on, s)
    return moe.add_slots(on, acc, y, r.pos, lo, torch.float32)


def share_backward(
    leaves: dict[str, torch.Tensor], r: Routed, g: torch.Tensor, ctx: Context, first: int, n: int, sums: Sums
) -> tuple | None:
    """share's gradients against g, the block's output gradient (T, H) fp32: the group's shares of the gradients of
    h and of the routing weights are added to `sums`; returns its weights' gradients in the order of `leaves`
    (None: no token chose the group, so they are zero)."""
    s, k = ctx.spec, ctx.spec.num_experts_per_tok
    sel, lo, ends, counts = _pairs(r, first, n, k, leaves["mlp.experts.down_proj"])
    if not sel.numel():
        return None
    on, src = kernels.on(r.h), sel // k
    xs = moe.gather(on, r.h, src, r.h.dtype).requires_grad_()
    wl = r.weights.detach().requires_grad_()
    experts = _experts(s, r, sel, first)
    with torch.enable_grad():
        ws = wl.reshape(-1).index_select(0, sel)[:, None]
        y = moe._rows(leaves, xs, ws, experts, ends, counts, on, s)
    # each pair row's gradient is its token's, in the rows' dtype (moe._Combine's backward)
    d = torch.autograd.grad(
        [y], [xs, wl, *leaves.values()], [moe.gather(on, g, src, y.dtype)], allow_unused=True
    )
    sums.dh = moe.add_slots(on, sums.dh, d[0], r.pos, lo, torch.float32)
    sums.dws += d[1]
    return d[2:]


def by_expert(dws: torch.Tensor, r: Routed, n_experts: int) -> torch.Tensor:
    """The routing weights' gradient dws (T, k), by (token, slot) of r's routing, as (T, E) by expert."""
    return dws.new_zeros(dws.shape[0], n_experts).scatter_(1, r.chosen, dws)


def attention_backward(
    leaves: dict[str, torch.Tensor],
    x: torch.Tensor,
    g: torch.Tensor,
    dh: torch.Tensor,
    dws: torch.Tensor,
    ctx,
) -> tuple:
    """The attention part recomputed from the block's checkpoint x with autograd and differentiated against g (the
    block's output gradient), dh and dws (the groups' sums; dws (T, E) by expert: by_expert), and its router's
    load-balancing term: (x's gradient, then its weights' in the order of `leaves`)."""
    ctx = dataclasses.replace(ctx, routed=[])
    x = x.requires_grad_()
    with torch.enable_grad():
        y = llama.block(leaves, x, ctx)
    h, chosen, weights = ctx.routed[0]
    ys, gs = moe.grad_pairs(ctx.router, y, g)
    grads = [*gs, dh.to(h.dtype), dws.gather(1, chosen)]
    return torch.autograd.grad([*ys, h, weights], [x, *leaves.values()], grads)
