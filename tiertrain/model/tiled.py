"""A decoder block over tiles of the sequence, for long context: what a block holds on the GPU beyond its input
and its gradient is the attention's q, k, v and output (and in the backward pass the output's gradient) and one
tile's intermediates, whatever the intermediate size: 8.8-12 H bytes per token for llama3.1-8b at 128k-512k
(dev/workset.py on an H100).

The token-wise parts (the input norm and the q/k/v projections with RoPE; the output projection, the residual,
the MLP norm and the MLP) run one tile of ctx.tile tokens at a time; the attention runs over the whole sequence,
one key/value head (and the query heads that share it) at a time, so its kernels' own buffers are a head
group's. The backward pass is written out (no autograd graph over the block), from the block's checkpoint:
    A  q, k, v tile by tile (no grad)                       C  per tile: o_proj + MLP forward and backward:
    B  attention per head group, its graph kept                gx1 into g's buffer, d(o) into a buffer
                                                            D  attention backward per head group: dq, dk, dv
                                                            E  per tile: norm + q/k/v forward and backward: g += dx
Each forward part runs once (the q/k/v projections twice: A and E), against the untiled block's forward
then backward. Weight gradients are summed over the tiles into the fp32 accumulators.
"""

from __future__ import annotations

import torch

from .llama import ATTN_IN, SINKS, Context, attend, block_out, qkv
from .moe import grad_pairs


def _out_names(w: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """The weights of phase C: o_proj and the MLP (dense or experts), all but the attention's."""
    return tuple(n for n in w if n not in ATTN_IN and n != SINKS)


def _sinks(sinks: torch.Tensor | None, g: int, r: int) -> torch.Tensor | None:
    """Head group g's sink logits."""
    return None if sinks is None else sinks[g * r : (g + 1) * r]


def _spans(x: torch.Tensor, ctx: Context):
    """(start, end) positions of each tile: ctx.tile tokens over the micro-batch's rows."""
    b, t = x.shape[:2]
    n = max(1, ctx.tile // b)
    return [(a, min(t, a + n)) for a in range(0, t, n)]


def _groups(ctx: Context) -> tuple[int, int]:
    """(number of head groups, query heads per group): one key/value head and the query heads that share it."""
    s = ctx.spec
    return s.n_kv_heads, s.num_attention_heads // s.n_kv_heads


def _project(w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Context):
    """Phase A: q, k, v of every tile, as one (B, heads per group, T, hd) tensor per head group each."""
    b, t = x.shape[:2]
    n, r = _groups(ctx)
    hd, dt, dev = ctx.spec.hd, ctx.dtype, x.device
    qs = [torch.empty(b, r, t, hd, dtype=dt, device=dev) for _ in range(n)]
    ks = [torch.empty(b, 1, t, hd, dtype=dt, device=dev) for _ in range(n)]
    vs = [torch.empty(b, 1, t, hd, dtype=dt, device=dev) for _ in range(n)]
    for a, e in _spans(x, ctx):
        q, k, v = qkv(w, x[:, a:e], ctx, a)
        for g in range(n):
            qs[g][:, :, a:e] = q[:, g * r : (g + 1) * r]
            ks[g][:, :, a:e] = k[:, g : g + 1]
            vs[g][:, :, a:e] = v[:, g : g + 1]
    return qs, ks, vs


def _tile(os: list[torch.Tensor], a: int, e: int) -> torch.Tensor:
    """The attention's output for positions a..e as (B, e - a, heads x hd), from its head groups."""
    o = torch.cat([og[:, :, a:e] for og in os], dim=1)
    return o.transpose(1, 2).reshape(o.shape[0], e - a, -1)


def forward(w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Context) -> torch.Tensor:
    """llama.block over tiles, without gradients."""
    qs, ks, vs = _project(w, x, ctx)
    r = _groups(ctx)[1]
    os = []
    for g in range(len(qs)):
        os.append(attend(qs[g], ks[g], vs[g], ctx, _sinks(w.get(SINKS), g, r)))
        qs[g] = ks[g] = vs[g] = None  # each group's inputs go as soon as its output exists
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # x may come as its bf16 checkpoint
    for a, e in _spans(x, ctx):
        y[:, a:e] = block_out(w, x[:, a:e], _tile(os, a, e), ctx, a)
    return y


def backward(
    w: dict[str, torch.Tensor], accs: dict[str, torch.Tensor], x: torch.Tensor, g: torch.Tensor, ctx: Context
) -> torch.Tensor:
    """The gradient of llama.block at x (its checkpoint) against g, the gradient of its output, which it
    overwrites and returns; each weight's gradient is added into accs[name] (fp32)."""
    x = x.detach()
    qs, ks, vs = _project(w, x, ctx)  # ---- A
    graphs = []  # ---- B: per head group (q, k, v leaves, output), the attention's graph kept
    sinks, r = _leaves(w, (SINKS,)), _groups(ctx)[1]
    for j, (q, k, v) in enumerate(zip(qs, ks, vs)):
        leaves = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_())
        with torch.enable_grad():
            graphs.append((leaves, attend(*leaves, ctx, _sinks(sinks.get(SINKS), j, r))))
    del qs, ks, vs
    os = [o.detach() for _, o in graphs]
    dos = [torch.empty_like(o) for o in os]
    n_q = dos[0].shape[1]
    outs = _leaves(w, _out_names(w))
    for a, e in _spans(x, ctx):  # ---- C
        xt, ot = x[:, a:e].detach().requires_grad_(), _tile(os, a, e).requires_grad_()
        with torch.enable_grad():
            y = block_out(outs, xt, ot, ctx, a)
        ys, gs = grad_pairs(ctx.router, y, g[:, a:e])  # and the router's load-balancing term
        d = torch.autograd.grad(ys, [xt, ot, *outs.values()], gs)
        g[:, a:e] = d[0]  # the gradient at x1 (the residual after attention)
        do = d[1].view(x.shape[0], e - a, -1, ctx.spec.hd).transpose(1, 2)
        for i, dg in enumerate(dos):
            dg[:, :, a:e] = do[:, i * n_q : (i + 1) * n_q]
        _add(accs, outs, d[2:])
    del os, outs
    dqkv = []  # ---- D
    for i, ((q, k, v), o) in enumerate(graphs):
        d = torch.autograd.grad(o, (q, k, v, *sinks.values()), dos[i])
        dqkv.append(d[:3])
        _add(accs, sinks, d[3:])
        graphs[i] = dos[i] = None  # the group's graph, output and its gradient go
    ins = _leaves(w, ATTN_IN)
    for a, e in _spans(x, ctx):  # ---- E
        xt = x[:, a:e].detach().requires_grad_()
        with torch.enable_grad():
            q, k, v = qkv(ins, xt, ctx, a)
        dq, dk, dv = (torch.cat([d[j][:, :, a:e] for d in dqkv], dim=1) for j in range(3))
        d = torch.autograd.grad((q, k, v), [xt, *ins.values()], (dq, dk, dv))
        g[:, a:e] += d[0]
        _add(accs, ins, d[1:])
    return g


def _leaves(w: dict[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Leaf tensors over the weights of `names` the block has."""
    return {n: w[n].detach().requires_grad_() for n in names if n in w}


def _add(accs: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor], grads) -> None:
    for n, gw in zip(leaves, grads):
        accs[n].add_(gw)
