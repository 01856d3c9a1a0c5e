"""A plain nn.Module of the same model: the oracle of the parity tests and the all-in-GPU baseline.

Written apart from the templates on purpose (nn.Linear, nn.Embedding, its own norm and RoPE code), so
that agreement between the two is evidence, not an identity. Parameter names are Hugging Face's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .llama import rope_inv_freq
from .spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        var = x32.pow(2).mean(-1, keepdim=True)
        return x32 * torch.rsqrt(var + self.eps) * self.weight.float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_attention_heads * s.hd, bias=s.attention_bias)
        self.k_proj = nn.Linear(s.hidden_size, s.n_kv_heads * s.hd, bias=s.attention_bias)
        self.v_proj = nn.Linear(s.hidden_size, s.n_kv_heads * s.hd, bias=s.attention_bias)
        self.o_proj = nn.Linear(s.num_attention_heads * s.hd, s.hidden_size, bias=s.attention_out_bias)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.hd, s.rms_norm_eps)
            self.k_norm = RMSNorm(s.hd, s.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s = self.s
        b, t, _ = h.shape
        q = self.q_proj(h).view(b, t, s.num_attention_heads, s.hd)
        k = self.k_proj(h).view(b, t, s.n_kv_heads, s.hd)
        v = self.v_proj(h).view(b, t, s.n_kv_heads, s.hd)
        if s.qk_norm:
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        q, k, v = (
            _rotate(q.transpose(1, 2), cos, sin),
            _rotate(k.transpose(1, 2), cos, sin),
            v.transpose(1, 2),
        )
        rep = s.num_attention_heads // s.n_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x.float() + self.self_attn(self.input_layernorm(x), cos, sin).float()
        return x + self.mlp(self.post_attention_layernorm(x)).float()


class Backbone(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size, padding_idx=s.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_hidden_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class ReferenceLM(nn.Module):
    """Causal LM; `checkpoint_layers` recomputes each decoder layer in backward (activation checkpointing)."""

    def __init__(self, s: ModelSpec, checkpoint_layers: bool = False):
        super().__init__()
        self.s = s
        self.checkpoint_layers = checkpoint_layers
        self.model = Backbone(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        if s.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv, self.attention_factor = rope_inv_freq(s)  # YaRN scales cos and sin by its attention factor
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of token cross-entropies (the caller divides by the step's token count)."""
        t = tokens.shape[1]
        freqs = torch.outer(torch.arange(t, device=tokens.device, dtype=torch.float32), self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        x = self.model.embed_tokens(tokens).float()
        for layer in self.model.layers:
            if self.checkpoint_layers and self.training:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
