"""The experts' gated activation (model/moe.py's _glu) as two Triton kernels on a GPU, forward and backward.

A program takes one pair row and walks its intermediate columns a block at a time. The forward kernel reads the
row's gate and up halves (SwiGLU's [gate; up], or gpt-oss's interleaved pairs, clamped) and writes the activation
times the row's routing weight. The backward kernel reads them again with the activation's gradient, writes the
gate/up gradient, and sums the routing weight's gradient over the row in the same pass. torch.compile's version
took two kernels for that backward (a pointwise one, then a reduction over the row), and its guards and autograd
wrappers cost the CPU more than the kernels took at 8k tokens (bench/results/2026-11-26-issue40-glu.md).
Everything is fp32 inside, rounded once to the rows' dtype; the sum runs in a fixed order, so a rerun gives the
same bits."""

from __future__ import annotations

import functools

import torch

BLOCK = 1024  # intermediate columns a program holds at a time (a row of a wider expert takes several)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def forward(y, ws, out, inter, limit, alpha, GPT_OSS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(ws + row)
        for c in range(0, inter, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            inside = cols < inter
            if GPT_OSS:  # gate and up interleaved, clamped; (u + 1) * glu(g), glu(g) = g * sigmoid(alpha g)
                g = tl.load(y + row * 2 * inter + 2 * cols, mask=inside, other=0.0).to(tl.float32)
                u = tl.load(y + row * 2 * inter + 2 * cols + 1, mask=inside, other=0.0).to(tl.float32)
                # clamped as torch's clamp does: a NaN stays one
                g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
                u = tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL)
                u = tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL)
                a = (u + 1) * (g * tl.sigmoid(g * alpha)) * w
            else:  # [gate; up]: silu(g) * u
                g = tl.load(y + row * 2 * inter + cols, mask=inside, other=0.0).to(tl.float32)
                u = tl.load(y + row * 2 * inter + inter + cols, mask=inside, other=0.0).to(tl.float32)
                a = g * tl.sigmoid(g) * u * w
            tl.store(out + row * inter + cols, a.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def backward(y, ws, da, dy, dws, inter, limit, alpha, GPT_OSS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(ws + row)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(0, inter, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            inside = cols < inter
            d = tl.load(da + row * inter + cols, mask=inside, other=0.0).to(tl.float32)
            dp = d * w  # the gradient of the unweighted activation
            if GPT_OSS:
                g = tl.load(y + row * 2 * inter + 2 * cols, mask=inside, other=0.0).to(tl.float32)
                u = tl.load(y + row * 2 * inter + 2 * cols + 1, mask=inside, other=0.0).to(tl.float32)
                keep_g, keep_u = g <= limit, (u >= -limit) & (u <= limit)  # where clamp passes a gradient
                # clamped as torch's clamp does: a NaN stays one
                g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
                u = tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL)
                u = tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL)
                s = tl.sigmoid(g * alpha)
                glu = g * s
                acc += d * ((u + 1) * glu)
                du = dp * glu
                dg = dp * (u + 1) * (s + g * alpha * s * (1 - s))
                base = dy + row * 2 * inter + 2 * cols
                tl.store(base, tl.where(keep_g, dg, 0.0).to(dy.dtype.element_ty), mask=inside)
                tl.store(base + 1, tl.where(keep_u, du, 0.0).to(dy.dtype.element_ty), mask=inside)
            else:
                g = tl.load(y + row * 2 * inter + cols, mask=inside, other=0.0).to(tl.float32)
                u = tl.load(y + row * 2 * inter + inter + cols, mask=inside, other=0.0).to(tl.float32)
                s = tl.sigmoid(g)
                silu = g * s
                acc += d * (silu * u)
                du = dp * silu
                dg = dp * u * (s * (1 + g * (1 - s)))
                base = dy + row * 2 * inter + cols
                tl.store(base, dg.to(dy.dtype.element_ty), mask=inside)
                tl.store(base + inter, du.to(dy.dtype.element_ty), mask=inside)
        tl.store(dws + row, tl.sum(acc, axis=0))

    return forward, backward


def _launch(y: torch.Tensor) -> tuple[tuple[int], int]:
    """The grid (a program a row) and the column block: the intermediate size's power of two, up to BLOCK."""
    inter = y.shape[-1] // 2
    return (y.shape[0],), min(BLOCK, max(16, 1 << (inter - 1).bit_length()))


class Activation(torch.autograd.Function):
    """The gated activation of gate/up rows y (T k, 2 I) weighted by ws (T k, 1) fp32, in y's dtype (moe._glu);
    its backward gives y's gradient in y's dtype and ws's in fp32."""

    @staticmethod
    def forward(fn, y, ws, gpt_oss: bool, limit: float, alpha: float):
        y, ws = y.contiguous(), ws.contiguous()
        fn.save_for_backward(y, ws)
        fn.args = (gpt_oss, limit, alpha)
        out = y.new_empty(y.shape[0], y.shape[-1] // 2)
        if out.numel():
            grid, block = _launch(y)
            _kernels()[0][grid](y, ws, out, out.shape[-1], limit, alpha, GPT_OSS=gpt_oss, BLOCK=block)
        return out

    @staticmethod
    def backward(fn, da):
        y, ws = fn.saved_tensors
        gpt_oss, limit, alpha = fn.args
        dy, dws = torch.empty_like(y), torch.empty_like(ws)
        if dy.numel():
            grid, block = _launch(y)
            inter = y.shape[-1] // 2
            _kernels()[1][grid](
                y, ws, da.contiguous(), dy, dws, inter, limit, alpha, GPT_OSS=gpt_oss, BLOCK=block
            )
        return dy, dws, None, None, None


def activation(y: torch.Tensor, ws: torch.Tensor, gpt_oss: bool, limit: float, alpha: float) -> torch.Tensor:
    """moe._glu's value and gradients on a GPU: the rows' gated activation times their routing weights."""
    return Activation.apply(y, ws, gpt_oss, limit, alpha)
