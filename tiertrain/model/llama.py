"""Stateless templates of the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) and of the mixtures of experts
built on the same block (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss: model/moe.py for their MLP).

A template is a function of (weight views, activations). Weights arrive in the compute dtype; the
residual stream, norms, softmax and the loss stay in fp32, and matmul inputs are cast to the compute
dtype: in bf16 this is the arithmetic of torch.autocast over an fp32 model. The math follows
transformers' LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM (rotate-half RoPE).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernels, moe, rope
from .attention import attention as causal
from .spec import ModelSpec

_SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """(RoPE's inverse frequencies, the factor on cos and sin): transformers' default, linear, dynamic, llama3
    and yarn."""
    d = spec.hd
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = spec.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "yarn":
        return _yarn(spec, rs)
    if kind == "linear":
        return inv / rs["factor"], 1.0
    if kind != "llama3":  # dynamic: the default up to max_position_embeddings, which train.seq_len is within
        return inv, 1.0
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn(spec: ModelSpec, rs: dict) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters (gpt-oss: factor 32 over 4,096 positions, truncate false)."""
    d, base, factor = spec.hd, spec.rope_theta, rs["factor"]
    old = rs["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = rs.get("attention_factor")
    if att is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_of(rot: float) -> float:
        return (d * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(rs.get("beta_fast") or 32), dim_of(rs.get("beta_slow") or 1)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    pos = base ** (torch.arange(0, d, 2).float() / d)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra, float(att)


@dataclass
class Context:
    """What every template call of a run shares: the shape, the compute dtype, the RoPE tables."""

    spec: ModelSpec
    dtype: torch.dtype
    cos: torch.Tensor  # (S, head_dim) fp32
    sin: torch.Tensor
    tile: int = 0  # tokens per tile of a block (RunPlan.tile); 0: a block runs on all its tokens at once
    attention: str = ""  # the attention's kernel (RunPlan.attention; model/attention.py); "": torch's choice
    deterministic: bool = False  # its backward pass deterministic (RunPlan.deterministic)
    window: int | None = None  # the block's attention window (UnitSpec.window); None: the causal prefix
    router: moe.RouterLog | None = None  # the step's load-balancing loss, where the model has one
    docs: object | None = None  # the micro-batch's segments (model.docs.Docs); None: each row is one
    # where an attention part alone (model/parts.py) hands over its (h, chosen experts, routing weights)
    routed: list | None = None
    # the block's attention outputs of the micro-batch, kept from its forward pass for its recompute (model/
    # attention.Kept: the forward pass records, the recompute replays); None: none kept
    kept: object | None = None

    def of(self, window: int | None) -> "Context":
        """The context of a block with this attention window (the tables and the router log shared)."""
        return self if window == self.window else dataclasses.replace(self, window=window)

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        seq_len: int,
        dtype: torch.dtype,
        device: torch.device,
        tile: int = 0,
        attention: str = "",
        deterministic: bool = False,
    ) -> "Context":
        pos = torch.arange(seq_len, dtype=torch.float32)
        inv, scale = rope_inv_freq(spec)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)
        return cls(spec, dtype, cos, sin, tile, attention, deterministic)

    def tiled(self, x: torch.Tensor) -> bool:
        """Whether a block runs over tiles of the sequence on this micro-batch (model.tiled)."""
        return bool(self.tile) and x.shape[0] * x.shape[1] > self.tile


# torch's fused RMSNorm kernel (torch 2.8+): the plan prices what its graph saves (plan.workset)
_FUSED_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 (transformers' arithmetic); on a GPU torch's fused kernel, one pass each way where the
    composite took six."""
    x = x.float()
    if x.is_cuda and _FUSED_RMS_NORM:
        return F.rms_norm(x, x.shape[-1:], w.float(), eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x (B, t, heads, hd) in bf16 on a GPU, the tables (t, 1, hd) or (B, t, 1, hd): model/rope.py's kernel,
    one pass each way with the eager ops' bits (they took five passes and a cat), or those ops where it fails."""
    return kernels.run(True, _rope_eager, rope.apply, x, cos, sin)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    kernel: str = "",
    deterministic: bool = False,
    kept=None,
) -> torch.Tensor:
    """Causal attention over (B, heads, T, head_dim); k and v may have fewer heads (GQA): through the plan's
    kernel (model/attention.py), its output kept or replayed where `kept` is given (Context.kept). A window limits
    each query to itself and the window - 1 keys before it; sinks (heads,) add a learned logit per head to the
    softmax's denominator (gpt-oss): those take SDPA's masked kernels, and keep nothing."""
    t = q.shape[2]
    if sinks is not None:
        return _with_sinks(q, k, v, window, sinks)
    if window is None or window >= t:
        return causal(q, k, v, kernel, deterministic, kept)
    return _windowed(q, k, v, window, lambda q, k, v, mask: _sdpa(q, k, v, attn_mask=mask))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    if _SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), **kw)


def _windowed(q, k, v, window: int, attend) -> torch.Tensor:
    """Sliding-window attention a chunk of queries at a time against the keys their windows reach: masks of
    (chunk, chunk + window) booleans, never (T, T)."""
    t, dev = q.shape[2], q.device
    n = max(window, 1024)
    out = []
    for a in range(0, t, n):
        e, ks = min(t, a + n), max(0, a - window + 1)
        qi = torch.arange(a, e, device=dev)[:, None]
        ki = torch.arange(ks, e, device=dev)[None, :]
        mask = (ki <= qi) & (ki > qi - window)
        out.append(attend(q[:, :, a:e], k[:, :, ks:e], v[:, :, ks:e], mask))
    return torch.cat(out, dim=2)


def _with_sinks(q, k, v, window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head as one more key that every query sees and whose value is zero: q and
    k gain head dimensions (padded to a multiple of 8 for the fused kernels), the sink key is a one where q holds
    sink / scale, so its score is the sink logit itself; the scale stays head_dim ** -0.5."""
    b, h, t, d = q.shape
    scale, pad = d**-0.5, 8
    col = (sinks.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, t, 1)
    q = torch.cat([q, col, q.new_zeros(b, h, t, pad - 1)], dim=-1)
    sink_k = k.new_zeros(b, k.shape[1], 1, d + pad)
    sink_k[..., d] = 1
    k = torch.cat([sink_k, F.pad(k, (0, pad))], dim=2)
    v = F.pad(v, (0, pad, 1, 0))

    if window is not None and window < t:
        o = _windowed(q, k[:, :, 1:], v[:, :, 1:], window, _sinked(sink_k, scale))
    else:
        from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: a second, so here

        o = _sdpa(q, k, v, attn_mask=causal_lower_right(t, t + 1), scale=scale)
    return o[..., :d]


def _sinked(sink_k: torch.Tensor, scale: float):
    """A windowed chunk's attention with the sink key prepended to its keys (and a zero value)."""

    def attend(q, k, v, mask):
        k = torch.cat([sink_k, k], dim=2)
        v = F.pad(v, (0, 0, 1, 0))
        return _sdpa(q, k, v, attn_mask=F.pad(mask, (1, 0), value=True), scale=scale)

    return attend


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
SINKS = "self_attn.sinks"  # used by the attention itself (gpt-oss)


def qkv(w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Context, start: int = 0):
    """The attention's inputs for the positions start.. of x (B, t, H): q (B, heads, t, hd), k and v
    (B, kv heads, t, hd), in the compute dtype, RoPE applied."""
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
    if ctx.docs is not None:  # positions restart at each segment: (B, 1, t, hd)
        cos, sin = ctx.docs.rope(start, t)
    else:
        cos, sin = ctx.cos[start : start + t], ctx.sin[start : start + t]
    if q.dtype == torch.bfloat16 and kernels.on(q):
        # model/rope.py's kernel over (B, t, heads, hd) as the projections lay it out, the tables over the heads
        cos, sin = (c.transpose(1, 2) if c.dim() == 4 else c[:, None] for c in (cos, sin))
        return _rope(q, cos, sin).transpose(1, 2), _rope(k, cos, sin).transpose(1, 2), v
    # eager over the transposed view, as before: its sums (the q/k norms' weight gradients) in the same order
    return _rope_eager(q.transpose(1, 2), cos, sin), _rope_eager(k.transpose(1, 2), cos, sin), v


def block_out(
    w: dict[str, torch.Tensor], x: torch.Tensor, o: torch.Tensor, ctx: Context, start: int = 0
) -> torch.Tensor:
    """The block after its attention, on the slice of tokens at positions start..start+t of every row: x (B, t, H)
    and the attention's output o (B, t, heads x hd) give x1 = x + o_proj(o), then x1 + MLP(norm(x1)); the MLP a
    mixture of experts where the block has them (its routers' statistics over the slice's samples' tokens)."""
    # fp32 + bf16 adds in fp32 in one pass: the value of adding .float()'s copy (x is fp32: .float() is x)
    x = x.float() + F.linear(o, w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))
    h = rms_norm(x, w["post_attention_layernorm.weight"], ctx.spec.rms_norm_eps).to(ctx.dtype)
    # a mixture of experts, or its attention part alone (model/parts.py): the router is there
    if moe.ROUTER in w or moe.GPT_OSS_ROUTER in w:
        valid = None if ctx.docs is None else ctx.docs.valid_at(start, x.shape[1])
        # the experts add to the residual in their own order (moe.experts: blocks whole or in parts alike)
        return moe.experts(w, h.reshape(-1, h.shape[-1]), ctx, valid, x.view(-1, x.shape[-1])).view_as(x)
    m = F.silu(F.linear(h, w["mlp.gate_proj.weight"])) * F.linear(h, w["mlp.up_proj.weight"])
    return x + F.linear(m, w["mlp.down_proj.weight"])


def attend(q, k, v, ctx: Context, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The block's attention over q, k, v of all its tokens, (B, heads, T, hd) (or a head group's, with its
    sinks): within each segment of the rows where the micro-batch has them, with the block's window and sinks."""
    if ctx.docs is not None:  # rows of segments keep no output: the plan keeps none for them (Job.segmented)
        return ctx.docs.attention(q, k, v, ctx.window, sinks, ctx.attention, ctx.deterministic)
    return attention(q, k, v, ctx.window, sinks, ctx.attention, ctx.deterministic, ctx.kept)


def block(w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Context) -> torch.Tensor:
    """A decoder block on all its tokens at once (model.tiled runs it over tiles of the sequence)."""
    b, t, _ = x.shape
    q, k, v = qkv(w, x, ctx)
    o = attend(q, k, v, ctx, w.get(SINKS)).transpose(1, 2).reshape(b, t, q.shape[1] * q.shape[3])
    return block_out(w, x, o, ctx)


def final_norm(w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Context) -> torch.Tensor:
    """The head's first half: final RMSNorm, cast for the LM-head matmul."""
    return rms_norm(x, w["norm.weight"], ctx.spec.rms_norm_eps).to(ctx.dtype)


def logits(w: dict[str, torch.Tensor], h: torch.Tensor, ctx: Context) -> torch.Tensor:
    """The head's second half, applied to a chunk of tokens at a time: fp32 logits."""
    return F.linear(h, w["lm_head.weight"]).float()
