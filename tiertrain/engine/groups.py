"""A block in parts (expert groups, model/parts.py) in the step: its forward and backward pass over every
micro-batch, each part's weights loaded once a pass while the next part's copy runs. Step (engine/schedule.py)
calls these for the blocks its `parts` name; the math is model/grouped.py's.

forward   attention part: the block's checkpoint saved, then per micro-batch its output and the routed tokens;
          groups 1..G: each adds its experts' rows to the output, in a whole block's order (moe.add_slots)
backward  attention part without gradients, from the checkpoint: the routed tokens again; groups G..1: each
          differentiated against the block's output gradient, its weights' gradient drained as it ends, its shares
          of h's and the routing weights' gradients added to their sums (fp32); the attention part with autograd
          against all three, its gradient drained, the block input's gradient out; the block's norm by pieces,
          the parts' in order: a whole block's bits (model/parts.norm_pieces)
The attention part loads twice in the backward pass (a slot holds one part); the groups' sums live on the GPU
until the attention part's backward: (4 H + 4 k) bytes a token of the rank's batch, beside the routed tokens.
"""

from __future__ import annotations

import torch

from ..model import grouped


def forward(step, i: int, xs: list[torch.Tensor], train: bool, timed) -> list[torch.Tensor]:
    """Block i's forward pass (its attention part already loading: Step.load); starts the next unit's load."""
    slots, parts = step.slots, step.parts[i]
    w = step.bind(i, 0)
    slots.load_part(i, 1, last=len(parts) == 2)  # into the other slot, beside the attention part's compute
    xr = step.inputs(xs)  # what the block computes from: as its checkpoint holds it
    if train:
        step.ck.save(i, xr)
    with timed("forward"):
        outs = [grouped.attention_part(w, x, step.at(i, m)) for m, x in enumerate(xr)]
    step.release(i, 0)
    ys, routed = [y for y, _ in outs], [r for _, r in outs]
    del outs
    for g in range(1, len(parts)):
        w, p = step.bind(i, g), parts[g]
        with timed("forward"):
            for m, r in enumerate(routed):
                y = ys[m].view(-1, ys[m].shape[-1])
                ys[m] = grouped.share(w, r, y, step.ctxs[i], p.first, p.experts).view_as(ys[m])
        step.release(i, g)
        if g + 1 < len(parts):
            slots.load_part(i, g + 1, last=g + 2 == len(parts))
        else:
            step.load(i + 1)
    with timed("forward"):
        return step.residual(ys, xr, xs)


def backward(step, i: int, gx: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Block i's backward pass (its attention part already loading; its checkpoint prefetched), the gradients of
    its outputs `gx` in: (the gradients of its inputs, its gradient's norms by pieces: model/parts.norm_pieces'
    order) out. Starts the previous unit's load and its checkpoint's prefetch."""
    slots, grads, ck, clock, parts = step.slots, step.grads, step.ck, step.clock, step.parts[i]
    n = len(parts) - 1
    saved = ck.get(i)
    if i > 1 and i - 1 not in step.kept:
        ck.prefetch(i - 1)  # beside the whole block's backward pass, as a whole block's
    w = step.bind(i, 0)
    slots.load_part(i, n, last=False)
    with clock.computing("backward"), torch.no_grad():
        routed = [grouped.attention_part(w, x, step.at(i, m))[1] for m, x in enumerate(saved)]
    step.release(i, 0)
    sums = [grouped.Sums(None, torch.zeros_like(r.weights)) for r in routed]
    norms: list = [None] * len(parts)  # by part: the groups drain last to first
    for g in range(n, 0, -1):
        leaves, pairs = step.bind_for_grad(i, g)
        slots.load_part(i, g - 1, last=g == 1)  # after the first group, the attention part again
        p = parts[g]
        with clock.computing("backward"):
            for m, r in enumerate(routed):
                gm = gx[m].reshape(-1, gx[m].shape[-1])
                d = grouped.share_backward(leaves, r, gm, step.ctxs[i], p.first, p.experts, sums[m])
                for (_, acc), gw in zip(pairs, d or ()):
                    if gw is not None:  # an expert of the group that no token chose
                        acc.add_(gw)
        step.release(i, g)
        norms[g] = grads.drain_part(i, g, last=False)
    # by expert: the attention part's recompute with autograd may route in another order (another kernel)
    dh = [u.dh for u in sums]
    dws = [grouped.by_expert(u.dws, r, step.ctx.spec.num_experts) for u, r in zip(sums, routed)]
    del routed, sums
    leaves, pairs = step.bind_for_grad(i, 0)
    step.load(i - 1)
    out = []
    with clock.computing("backward"):
        for m, x in enumerate(saved):
            d = grouped.attention_backward(leaves, x, gx[m], dh[m], dws[m], step.at(i, m))
            dh[m] = dws[m] = None
            out.append(d[0])
            for (_, acc), gw in zip(pairs, d[1:]):
                acc.add_(gw)
    step.release(i, 0)
    ck.drop(i)
    norms[0] = grads.drain_part(i, 0, last=True)
    return out, torch.cat(norms)
