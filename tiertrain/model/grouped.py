"""A mixture-of-experts block in parts (model/parts.py): its attention part, then its experts a group at a time.

The attention part is llama.block over the part's weights: it routes the tokens and hands (h, chosen experts,
routing weights) over in ctx.routed (moe.experts), and its output is the residual with any shared expert's output.
Each group adds its experts' share of every token's routed rows: the rows, projections and weighting are
moe.experts', and a token's k slots are summed a group at a time, in fp32, where moe.experts sums them at once.

A group's backward pass takes the block's output gradient and returns its weights' gradients and its share of the
gradients of h and of the routing weights, summed over the groups in fp32 (engine/groups.py); the attention part is
then differentiated against the output gradient and those two sums (attention_backward).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from . import kernels, llama, moe
from .llama import Context


@dataclass
class Routed:
    """A micro-batch's routed tokens as its block's attention part left them: what every group reads."""

    h: torch.Tensor  # (T, H) compute dtype: the MLP's input
    chosen: torch.Tensor  # (T, k) int64: each token's experts
    weights: torch.Tensor  # (T, k) fp32: their routing weights
    order: torch.Tensor  # (T k,): the (token, slot) pairs sorted by expert
    starts: list[int]  # on the host: the pairs before each expert, E + 1 of them

    @classmethod
    def of(cls, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, n_experts: int) -> "Routed":
        order = moe.sort_pairs(chosen, n_experts)
        per = moe._counts(chosen, n_experts).tolist()  # one sync a micro-batch: the groups' rows are sliced
        return cls(h.detach(), chosen, weights.detach(), order, [0, *accumulate(per)])


def attention_part(w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, Routed]:
    """The attention part's forward pass on a micro-batch x (B, T, H), without gradients: (its output, fp32 (B, T,
    H): the residual after attention plus any shared expert's output; the tokens routed)."""
    ctx = dataclasses.replace(ctx, routed=[])
    y = llama.block(w, x, ctx)
    return y, Routed.of(*ctx.routed[0], ctx.spec.num_experts)


def _pairs(r: Routed, first: int, n: int, k: int, down: torch.Tensor):
    """The group's pairs (ids in the (T k) slots, sorted by expert), their tokens, and the grouped matmul's ends
    (on a GPU, moe._grouped of `down`, the group's down projections) or the rows per expert (elsewhere)."""
    st = r.starts[first : first + n + 1]
    sel = r.order[st[0] : st[-1]]
    counts = [b - a for a, b in zip(st, st[1:])]
    if moe._grouped(r.h, down):
        ends = torch.tensor(list(accumulate(counts)), dtype=torch.int32).to(r.h.device, non_blocking=True)
        return sel, sel // k, ends, None
    return sel, sel // k, None, counts


def _experts(s, r: Routed, sel: torch.Tensor, first: int) -> torch.Tensor | None:
    """The expert of each of the group's pairs `sel`, counted from its first (gpt-oss's gate/up bias), else None."""
    e = moe._experts_of(s, r.chosen, sel)
    return None if e is None else e - first


def _slot_sum(y: torch.Tensor, sel: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """Pair rows y at slots `sel` (the others zero) summed over each token's k slots: fp32 (t, D)."""
    buf = y.new_zeros(t * k, y.shape[-1])
    buf.index_copy_(0, sel, y)
    return buf.view(t, k, -1).sum(1, dtype=torch.float32)


def _down_bias(w, chosen: torch.Tensor, weights: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """gpt-oss's down-projection bias of the group's experts, each token's slots there weighted and summed."""
    inside = (chosen >= first) & (chosen < first + n)
    idx = (chosen - first).clamp(0, n - 1)
    b = w["mlp.experts.down_proj_bias"].float()
    return F.embedding_bag(idx, b, per_sample_weights=weights * inside, mode="sum")


def share(w: dict[str, torch.Tensor], r: Routed, ctx: Context, first: int, n: int) -> torch.Tensor | None:
    """The share of experts first..first+n (w: their weights) in the MoE output of the routed tokens, fp32 (T, H),
    without gradients; None where no token chose any of them."""
    s, k = ctx.spec, ctx.spec.num_experts_per_tok
    sel, src, ends, counts = _pairs(r, first, n, k, w["mlp.experts.down_proj"])
    if not sel.numel():
        return None
    ws = r.weights.reshape(-1).index_select(0, sel)[:, None]
    y = moe._rows(
        w, r.h.index_select(0, src), ws, _experts(s, r, sel, first), ends, counts, kernels.on(r.h), s
    )
    out = _slot_sum(y, sel, r.h.shape[0], k)
    if s.model_type == "gpt_oss":
        out += _down_bias(w, r.chosen, r.weights, first, n)
    return out


def share_backward(
    leaves: dict[str, torch.Tensor],
    r: Routed,
    g: torch.Tensor,
    ctx: Context,
    first: int,
    n: int,
    dh: torch.Tensor,
    dws: torch.Tensor,
) -> tuple | None:
    """share's gradients against g, the block's output gradient (T, H) fp32: the group's share of h's gradient is
    added into dh (T, H) fp32 and of the routing weights' into dws (T, k) fp32; returns its weights' gradients in
    the order of `leaves` (None: no token chose the group, so they are zero)."""
    s, k = ctx.spec, ctx.spec.num_experts_per_tok
    sel, src, ends, counts = _pairs(r, first, n, k, leaves["mlp.experts.down_proj"])
    if not sel.numel():
        return None
    xs = r.h.index_select(0, src).requires_grad_()
    wl = r.weights.detach().requires_grad_()
    experts = _experts(s, r, sel, first)
    with torch.enable_grad():
        ws = wl.reshape(-1).index_select(0, sel)[:, None]
        y = moe._rows(leaves, xs, ws, experts, ends, counts, kernels.on(r.h), s)
        # each pair row's gradient is its token's, in the rows' dtype (moe._Combine's backward)
        outs, grads = [y], [g.to(y.dtype).index_select(0, src)]
        if s.model_type == "gpt_oss":
            outs.append(_down_bias(leaves, r.chosen, wl, first, n))
            grads.append(g)
    d = torch.autograd.grad(outs, [xs, wl, *leaves.values()], grads, allow_unused=True)
    dh += _slot_sum(d[0], sel, r.h.shape[0], k)
    dws += d[1]
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
