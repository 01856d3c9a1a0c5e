"""Attention kept within each segment of a row (a packed sample, a document, the padding): a micro-batch's
segments, taken from where its positions restart at 0 (rows.py), with RoPE at those positions.

On a GPU in bf16 or fp16, torch's variable-length flash attention (torch.nn.attention.varlen, in torch 2.13) runs over
every row's segments at once, never an S x S mask; elsewhere (a CPU, fp32), and for a block whose sliding window is
shorter than a segment or whose attention has sinks (gpt-oss), the segments run one after another through the block's
own attention, each exactly as its sample alone.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import numpy as np
import torch

from . import attention, llama


@functools.cache
def _varlen():
    """torch's variable-length flash attention and what its signature takes (imported and read once, on first
    use on a GPU; None in a torch without it): (the function, its causal switch, whether it takes GQA)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params  # enable_gqa: torch 2.12 on


@dataclass(frozen=True)
class Docs:
    """A micro-batch's segments: each row's (start, end) spans, and the same as the cumulative offsets over the
    flattened rows that the varlen kernel takes; the RoPE tables gathered at each token's position; which tokens
    are a sample's (a packed row's padding is not)."""

    spans: tuple[tuple[tuple[int, int], ...], ...]
    cu: torch.Tensor  # int32 (segments + 1,) on the device
    longest: int
    cos: torch.Tensor  # (B, 1, S, head_dim) fp32
    sin: torch.Tensor
    valid: torch.Tensor | None = None  # (B, S) fp32, 0 on padding (position -1); None: no padding

    @classmethod
    def build(cls, positions: np.ndarray, ctx: llama.Context) -> "Docs":
        """From a micro-batch's positions (B, S): a segment begins where they are 0, and where a row's padding
        (position -1) begins."""
        b, s = positions.shape
        spans, cu = [], [0]
        pad = positions < 0
        for r in range(b):
            starts = (positions[r] == 0) | (pad[r] & np.append(True, ~pad[r][:-1]))
            cuts = np.append(np.flatnonzero(starts), s)
            row = tuple((int(a), int(e)) for a, e in zip(cuts[:-1], cuts[1:]))
            spans.append(row)
            cu += [r * s + e for _, e in row]
        dev = ctx.cos.device
        pos = torch.from_numpy(np.ascontiguousarray(np.maximum(positions, 0))).to(dev)  # padding's RoPE: any
        return cls(
            tuple(spans),
            torch.tensor(cu, dtype=torch.int32).to(dev),
            max(e - a for row in spans for a, e in row),
            ctx.cos[pos].unsqueeze(1),
            ctx.sin[pos].unsqueeze(1),
            torch.from_numpy(~pad).float().to(dev) if pad.any() else None,
        )

    def valid_at(self, start: int, t: int) -> torch.Tensor | None:
        """Which of the tokens at positions start..start+t of every row are a sample's, flattened (B x t,) as a
        block's MLP takes them; None: all."""
        return None if self.valid is None else self.valid[:, start : start + t].reshape(-1)

    def rope(self, start: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables of positions start..start+t of every row, (B, 1, t, head_dim)."""
        return self.cos[:, :, start : start + t], self.sin[:, :, start : start + t]

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window=None, sinks=None, kernel="", det=False
    ) -> torch.Tensor:
        """Causal attention within each segment, over (B, heads, S, head_dim); k and v may have fewer heads. `window`,
        `sinks`, `kernel`, `det`: the block's, as llama.attention takes them (a window no segment exceeds is none)."""
        b, h, s, d = q.shape
        plain = sinks is None and (window is None or window >= self.longest)
        fast = plain and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and d <= 256
        kernel_fn = _varlen() if fast else None
        if kernel_fn is not None:
            varlen_attn, causal, gqa = kernel_fn

            def flat(x):
                return x.transpose(1, 2).reshape(b * s, x.shape[1], d)

            kw = dict(causal)
            if gqa:
                kw["enable_gqa"] = h != k.shape[1]
            elif h != k.shape[1]:  # an older torch's kernel takes as many key/value heads as query heads
                k, v = (x.repeat_interleave(h // k.shape[1], 1) for x in (k, v))
            o = varlen_attn(flat(q), flat(k), flat(v), self.cu, self.cu, self.longest, self.longest, **kw)
            if det:  # its backward's dQ, like the dense kernels', repeats its bits only in deterministic mode
                attention._deterministic_backward(o, direct=True)
            return o.view(b, s, h, d).transpose(1, 2)
        rows = []
        for r, row in enumerate(self.spans):
            one = slice(r, r + 1)
            parts = [
                llama.attention(q[one, :, a:e], k[one, :, a:e], v[one, :, a:e], window, sinks, kernel, det)
                for a, e in row
            ]
            rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
        return torch.cat(rows) if len(rows) > 1 else rows[0]
