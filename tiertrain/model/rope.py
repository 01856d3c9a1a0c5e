"""RoPE on q or k in bf16 (model/llama.py's _rope_eager) as a Triton kernel each way, on a GPU.

A program takes one token: every head's two halves, and the token's row of the cos and sin tables. The eager op
is four bf16 ops (x * cos, the rotated half times sin, their sum), each rounded to bf16, plus a cat, and each a
pass over q; the kernel reads x once and writes once, and rounds where the eager ops round, so it gives their bits
both ways:
    forward   y1 = r(r(x1 c1) + r(-x2 s1))        y2 = r(r(x2 c2) + r(x1 s2))
    backward  dx1 = r(r(g1 c1) + r(g2 s2))        dx2 = r(r(g2 c2) - r(g1 s1))
with r() the rounding to bf16, c and s the tables rounded to bf16, 1 and 2 the halves of the head dimension.
llama-5b's block at 8k on an H100: 0.10 ms forward where the eager ops took about 0.8
(bench/results/2026-11-26-dense-kernels.md)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    from . import rope_kernel  # imports triton

    return rope_kernel.rope


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x (B, t, heads, hd) bf16 through the kernel, with tables (t, 1, hd) or (B, t, 1, hd) fp32."""
    x = x.contiguous()
    b, t, heads, hd = x.shape
    cos, sin = cos.squeeze(-2), sin.squeeze(-2)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty_like(x)
    if y.numel():
        cs_b = cos.stride(0) if cos.dim() == 3 else 0
        _kernel()[(b * t,)](
            x, cos, sin, y, t, heads, cs_b, cos.stride(-2), HALF=hd // 2, NH=_pow2(heads), BH=_pow2(hd // 2),
            BACKWARD=backward,
        )  # fmt: skip
    return y


def _pow2(n: int) -> int:
    return max(1, 1 << (n - 1).bit_length())


class Rope(torch.autograd.Function):
    @staticmethod
    def forward(fn, x, cos, sin):
        fn.save_for_backward(cos, sin)
        return _launch(x, cos, sin, False)

    @staticmethod
    def backward(fn, g):
        cos, sin = fn.saved_tensors
        return _launch(g, cos, sin, True), None, None


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x (B, t, heads, hd) in bf16 on a GPU, the tables (t, 1, hd) or (B, t, 1, hd) in fp32: the eager
    op's value and gradient, bit for bit."""
    return Rope.apply(x, cos, sin)
