"""Stateless templates of the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3).

A template is a function of (weight views, activations). Weights arrive in the compute dtype; the
residual stream, norms, softmax and the loss stay in fp32, and matmul inputs are cast to the compute
dtype: in bf16 this is the arithmetic of torch.autocast over an fp32 model. The math follows
transformers' LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM (rotate-half RoPE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .spec import ModelSpec

_SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    d = spec.hd
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = spec.rope_scaling or {}
    if rs.get("rope_type", rs.get("type", "default")) != "llama3":
        return inv
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


@dataclass
class Context:
    """What every template call of a run shares: the shape, the compute dtype, the RoPE tables."""

    spec: ModelSpec
    dtype: torch.dtype
    cos: torch.Tensor  # (S, head_dim) fp32
    sin: torch.Tensor
    tile: int = 0  # tokens per tile of a block (RunPlan.tile); 0: a block runs on all its tokens at once

    @classmethod
    def build(
        cls, spec: ModelSpec, seq_len: int, dtype: torch.dtype, device: torch.device, tile: int = 0
    ) -> "Context":
        pos = torch.arange(seq_len, dtype=torch.float32)
        freqs = pos[:, None] * rope_inv_freq(spec)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return cls(spec, dtype, emb.cos().to(device), emb.sin().to(device), tile)

    def tiled(self, x: torch.Tensor) -> bool:
        """Whether a block runs over tiles of the sequence on this micro-batch (model.tiled)."""
        return bool(self.tile) and x.shape[0] * x.shape[1] > self.tile


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs=None) -> torch.Tensor:
    """Causal attention over (B, heads, T, head_dim); k and v may have fewer heads (GQA). `docs`: the rows'
    segments (model.docs.Docs), attended to one by one; None: each row is one."""
    if docs is not None:
        return docs.attention(q, k, v)
    if _SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
    )


def embed(w: dict[str, torch.Tensor], tokens: torch.Tensor, ctx: Context) -> torch.Tensor:
    return F.embedding(tokens, w["embed_tokens.weight"]).float()


ATTN_IN = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
)
MLP_WEIGHTS = (
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def qkv(w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Context, start: int = 0, docs=None):
    """The attention's inputs for the positions start.. of x (B, t, H): q (B, heads, t, hd), k and v
    (B, kv heads, t, hd), in the compute dtype, RoPE applied (at the positions of `docs` where given)."""
    s, dt = ctx.spec, ctx.dtype
    b, t, _ = x.shape
    h = rms_norm(x, w["input_layernorm.weight"], s.rms_norm_eps).to(dt)
    q = F.linear(h, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"))
    k = F.linear(h, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias"))
    v = F.linear(h, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias"))
    q = q.view(b, t, s.num_attention_heads, s.hd)
    k = k.view(b, t, s.n_kv_heads, s.hd)
    v = v.view(b, t, s.n_kv_heads, s.hd).transpose(1, 2)
    if s.qk_norm:
        q = rms_norm(q, w["self_attn.q_norm.weight"], s.rms_norm_eps).to(dt)
        k = rms_norm(k, w["self_attn.k_norm.weight"], s.rms_norm_eps).to(dt)
    cos, sin = (
        docs.rope(start, t) if docs is not None else (ctx.cos[start : start + t], ctx.sin[start : start + t])
    )
    return _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin), v


def block_out(w: dict[str, torch.Tensor], x: torch.Tensor, o: torch.Tensor, ctx: Context) -> torch.Tensor:
    """The block after its attention, on any slice of tokens: x (B, t, H) and the attention's output o
    (B, t, heads x hd) give x1 = x + o_proj(o), then x1 + MLP(norm(x1))."""
    x = x + F.linear(o, w["self_attn.o_proj.weight"]).float()
    norm, gate, up, down = (w[n] for n in MLP_WEIGHTS)
    h = rms_norm(x, norm, ctx.spec.rms_norm_eps).to(ctx.dtype)
    m = F.silu(F.linear(h, gate)) * F.linear(h, up)
    return x + F.linear(m, down).float()


def block(w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Context, docs=None) -> torch.Tensor:
    """A decoder block on all its tokens at once (model.tiled runs it over tiles of the sequence); `docs`: the
    rows' segments (model.docs), None: each row is one."""
    b, t, _ = x.shape
    q, k, v = qkv(w, x, ctx, docs=docs)
    o = attention(q, k, v, docs).transpose(1, 2).reshape(b, t, q.shape[1] * q.shape[3])
    return block_out(w, x, o, ctx)


def final_norm(w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Context) -> torch.Tensor:
    """The head's first half: final RMSNorm, cast for the LM-head matmul."""
    return rms_norm(x, w["norm.weight"], ctx.spec.rms_norm_eps).to(ctx.dtype)


def logits(w: dict[str, torch.Tensor], h: torch.Tensor, ctx: Context) -> torch.Tensor:
    """The head's second half, applied to a chunk of tokens at a time: fp32 logits."""
    return F.linear(h, w["lm_head.weight"]).float()
