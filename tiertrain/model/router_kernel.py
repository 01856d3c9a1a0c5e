"""The router (model/moe.py's _route) as one Triton kernel each way on a GPU: from its logits (T, E), in the
compute dtype, to each token's k experts and routing weights, and the softmax over every expert that the routers'
load-balancing loss reads.

A program takes R tokens, each row of E logits held whole (E at most route_kernels.MAX_EXPERTS). Forward: the
softmax in fp32; the k largest (of the softmax for qwen and mixtral, of the logits for gpt-oss) picked one after
another, equal values in the order of their indices, as a stable sort's; then the weights: the k values rescaled
to sum to one (mixtral, qwen with norm_topk_prob), as they are (qwen without), or their softmax (gpt-oss).
Backward: the softmax and the k values recomputed from the logits (the forward's bits), the weights' gradient
through their rescaling (or softmax) to the chosen columns, the load-balancing loss's gradient of the softmax added
where there is one, and both through the softmax to the logits, written in their dtype.

torch's ops took eight kernels forward (a cast, the softmax, a top k that selects and then sorts, a sum, a division)
and about ten backward, some 40 us of the experts' 4.7 ms at 8k tokens of Qwen3-30B-A3B on an H100, and as much
again in the gaps between them. The values agree with those ops to fp32's rounding (exp and the sums' order are
the kernel's own), and a rerun gives the same bits.
"""

from __future__ import annotations

import functools

import torch

ROWS = 16  # tokens a program takes


def _pow2(n: int) -> int:
    return max(1, 1 << (n - 1).bit_length())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _softmax(x):
        p = tl.exp(x - tl.max(x, axis=1)[:, None])  # the padding's -inf gives 0
        return p / tl.sum(p, axis=1)[:, None]

    @triton.jit
    def _rows(logits, t, e, R: tl.constexpr, EP: tl.constexpr):
        """A program's R rows of logits: (their indices, the columns, which rows are live, the rows' offsets, the
        mask of their columns, the logits in fp32 (padding -inf), their softmax); the forward's and the backward's
        alike, so the backward recomputes the forward's softmax to the bit."""
        rows = tl.program_id(0) * R + tl.arange(0, R)
        cols = tl.arange(0, EP)
        live = rows < t
        at = rows.to(tl.int64)[:, None] * e + cols[None, :]
        m = live[:, None] & (cols < e)[None, :]
        x = tl.load(logits + at, mask=m, other=float("-inf")).to(tl.float32)
        return rows, cols, live, at, m, x, _softmax(x)

    @triton.jit
    def _weights(v, kcols, K: tl.constexpr, GPT_OSS: tl.constexpr, NORM: tl.constexpr):
        """The routing weights of the k values v (R, KP; padding 0 past K)."""
        if GPT_OSS:
            return _softmax(tl.where(kcols[None, :] < K, v, float("-inf")))
        if NORM:
            return v / tl.sum(v, axis=1)[:, None]
        return v

    @triton.jit
    def forward(
        logits, weights, chosen, probs, t, e,
        K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, R: tl.constexpr,
        GPT_OSS: tl.constexpr, NORM: tl.constexpr, PROBS: tl.constexpr,
    ):  # fmt: skip
        rows, cols, live, at, m, x, p = _rows(logits, t, e, R, EP)
        kcols = tl.arange(0, KP)
        if PROBS:
            tl.store(probs + at, p, mask=m)
        v = x if GPT_OSS else p
        # a NaN is the largest value, as torch's top k takes it, so the k picked stay distinct experts (a NaN
        # loses every comparison, so the pick would depend on the reduction's order, padding included)
        v = tl.where((cols < e)[None, :], tl.where(v != v, float("inf"), v), float("-inf"))
        top = tl.zeros([R, KP], dtype=tl.float32)
        for j in tl.static_range(K):
            best, idx = tl.max(v, axis=1, return_indices=True, return_indices_tie_break_left=True)
            top = tl.where(kcols[None, :] == j, best[:, None], top)
            tl.store(chosen + rows * K + j, idx.to(tl.int64), mask=live)
            v = tl.where(cols[None, :] == idx[:, None], float("-inf"), v)
        w = _weights(top, kcols, K, GPT_OSS, NORM)
        tl.store(weights + rows[:, None] * K + kcols[None, :], w, mask=live[:, None] & (kcols < K)[None, :])

    @triton.jit
    def backward(
        logits, chosen, dw, dp, dx, t, e, dp_stride,
        K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, R: tl.constexpr,
        GPT_OSS: tl.constexpr, NORM: tl.constexpr, DP: tl.constexpr,
    ):  # fmt: skip
        rows, cols, live, at, m, x, p = _rows(logits, t, e, R, EP)
        kcols = tl.arange(0, KP)
        v = x if GPT_OSS else p
        km = live[:, None] & (kcols < K)[None, :]
        idx = tl.load(chosen + rows[:, None] * K + kcols[None, :], mask=km, other=-1)
        top = tl.zeros([R, KP], dtype=tl.float32)
        for j in tl.static_range(K):
            ij = tl.sum(tl.where(kcols[None, :] == j, idx, 0), axis=1)
            vj = tl.sum(tl.where(cols[None, :] == ij[:, None], v, 0.0), axis=1)
            top = tl.where(kcols[None, :] == j, vj[:, None], top)
        g = tl.load(dw + rows[:, None] * K + kcols[None, :], mask=km, other=0.0)
        w = _weights(top, kcols, K, GPT_OSS, NORM)
        if GPT_OSS:  # through the softmax of the k logits
            gv = w * (g - tl.sum(g * w, axis=1)[:, None])
        elif NORM:  # w = v / sum(v)
            gv = (g - tl.sum(g * w, axis=1)[:, None]) / tl.sum(top, axis=1)[:, None]
        else:
            gv = g
        gcol = tl.zeros([R, EP], dtype=tl.float32)  # the chosen columns' gradient
        for j in tl.static_range(K):
            ij = tl.sum(tl.where(kcols[None, :] == j, idx, 0), axis=1)
            gj = tl.sum(tl.where(kcols[None, :] == j, gv, 0.0), axis=1)
            gcol = tl.where(cols[None, :] == ij[:, None], gj[:, None], gcol)
        if DP:  # the load-balancing loss's gradient of the softmax
            gp = tl.load(dp + rows.to(tl.int64)[:, None] * dp_stride + cols[None, :], mask=m, other=0.0)
        else:
            gp = tl.zeros([R, EP], dtype=tl.float32)
        if GPT_OSS:
            gx = gcol + p * (gp - tl.sum(gp * p, axis=1)[:, None])
        else:
            gp = gp + gcol
            gx = p * (gp - tl.sum(gp * p, axis=1)[:, None])
        tl.store(dx + at, gx.to(dx.dtype.element_ty), mask=m)

    return forward, backward


class Route(torch.autograd.Function):
    """(weights (T, k) fp32, chosen (T, k) int64, probs (T, E) fp32: the softmax; (0, E) unless `probs`) of router
    logits (T, E); gradients for the weights and the softmax, to the logits."""

    @staticmethod
    def forward(fn, logits, k: int, gpt_oss: bool, norm: bool, probs: bool):
        logits = logits.contiguous()
        t, e = logits.shape
        weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
        chosen = torch.empty(t, k, dtype=torch.int64, device=logits.device)
        p = torch.empty(t if probs else 0, e, dtype=torch.float32, device=logits.device)
        fn.args = dict(K=k, KP=max(2, _pow2(k)), EP=max(2, _pow2(e)), R=ROWS, GPT_OSS=gpt_oss, NORM=norm)
        if t:
            _kernels()[0][(-(-t // ROWS),)](logits, weights, chosen, p, t, e, PROBS=probs, **fn.args)
        fn.save_for_backward(logits, chosen)
        fn.mark_non_differentiable(chosen)
        fn.set_materialize_grads(False)  # no (T, E) of zeros for a softmax no loss reads
        return weights, chosen, p

    @staticmethod
    def backward(fn, dw, _, dp):
        logits, chosen = fn.saved_tensors
        t, e = logits.shape
        dx = torch.empty_like(logits)
        has_dp = dp is not None and dp.numel() > 0
        if dw is None:
            dw = torch.zeros_like(chosen, dtype=torch.float32)
        if has_dp and dp.stride(-1) != 1:
            dp = dp.contiguous()
        if t:
            _kernels()[1][(-(-t // ROWS),)](
                logits, chosen, dw.contiguous(), dp if has_dp else dw, dx, t, e,
                dp.stride(0) if has_dp else 0, DP=has_dp, **fn.args,
            )  # fmt: skip
        return dx, None, None, None, None


def route(logits: torch.Tensor, k: int, gpt_oss: bool, norm: bool, probs: bool):
    """model/moe.py's _route on a GPU: (weights, chosen, the softmax or None), as Route."""
    weights, chosen, p = Route.apply(logits, k, gpt_oss, norm, probs)
    return weights, chosen, p if probs else None
