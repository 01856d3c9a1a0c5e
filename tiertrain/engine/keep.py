"""Kept blocks (RunPlan: recompute false, train.keep_activations) in the step: a block's forward pass with autograd,
its graph kept on the GPU for its backward pass, which goes through it and recomputes nothing. Step (engine/
schedule.py) calls these for the blocks its `kept` names."""

from __future__ import annotations

import torch

from ..model import llama
from ..model.moe import grad_pairs


def forward(
    step, unit: int, w: dict[str, torch.Tensor], xr: list[torch.Tensor], xs: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The block's forward pass with autograd from `xr`, its inputs as a recompute would take them (Step.inputs),
    its graph kept for the backward pass; the outputs, the residual stream kept whole where `xr` rounded `xs`
    (Step.residual), inside the graph: its roots are the next block's inputs, no copy beside them. What the
    graph saves of the weights is saved as (offset, shape, stride) in the unit's flat slot: the slot is refilled
    by other units in between, and the backward pass loads the unit's weights again (weights_now)."""
    flat = step.slots.use(unit)
    ptr, base = flat.untyped_storage().data_ptr(), flat.storage_offset()

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() == ptr:
            return t.storage_offset() - base, t.shape, t.stride()
        return t

    def unpack(p):  # on the autograd engine's thread: it reads weights_now, set before the backward pass
        if isinstance(p, tuple):
            now = step.weights_now[unit]
            return now.as_strided(p[1], p[2], now.storage_offset() + p[0])
        return p

    leaves = {n: v.detach().requires_grad_() for n, v in w.items()}
    ins = [x.detach().float().requires_grad_() for x in xr]  # as recomputed: the checkpoint comes back fp32
    rounded = any(r is not x for r, x in zip(xr, xs))
    outs, terms = [], []
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        for m, x in enumerate(ins):
            ctx = step.at(unit, m)
            y = llama.block(leaves, x, ctx)
            # Step.residual's arithmetic; the sub and the add pass the gradient on as it is and save nothing
            outs.append(y - xr[m] + xs[m] if rounded else y)
            terms.append(ctx.router.terms if ctx.router else [])  # its router's sums, weighed later
            if ctx.router:
                ctx.router.terms = []
    step.graphs[unit] = (ins, outs, leaves, terms)
    return [y.detach() for y in outs]


def backward(step, unit: int, leaves, pairs, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Step.block_backward through the graph the forward pass kept: the gradients reach its own leaves, and
    its saved weights are read from the unit's weights as loaded for this pass."""
    ins, outs, kept_leaves, terms = step.graphs.pop(unit)
    step.weights_now[unit] = step.slots.use(unit)
    by_id = {id(v): n for n, v in leaves.items()}
    pairs = [(kept_leaves[by_id[id(p)]], acc) for p, acc in pairs]
    out_grads = []
    for m, g in enumerate(grads):
        router = step.at(unit, m).router
        if router is not None:
            router.terms = terms[m]
        ys, gs = grad_pairs(router, outs[m], g)
        out = torch.autograd.grad(ys, [ins[m]] + [p for p, _ in pairs], gs)
        outs[m] = ins[m] = terms[m] = None  # the micro-batch's graph goes with its last reference
        out_grads.append(out[0])
        for (_, acc), gw in zip(pairs, out[1:]):
            acc.add_(gw)
    del step.weights_now[unit]
    return out_grads
