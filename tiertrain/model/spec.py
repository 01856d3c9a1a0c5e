"""Model shape: Hugging Face-compatible fields, streaming units, tensor tables, counts. No torch here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ConfigError

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "llama3")


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v: object) -> bool:
    """A positive finite number."""
    return _number(v) and math.isfinite(v) and v > 0


@dataclass(frozen=True)
class TensorSpec:
    name: str  # name inside its unit, the key a template reads
    shape: tuple[int, ...]
    hf_name: str  # name in a Hugging Face checkpoint

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class UnitSpec:
    index: int
    kind: str  # "embed" | "block" | "head"
    name: str
    tensors: tuple[TensorSpec, ...]
    # tied weights: (name in this unit's template, owner unit index, owner's tensor name)
    borrows: tuple[tuple[str, int, str], ...] = ()

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def template(self) -> str:
        return self.kind


@dataclass
class ModelSpec:
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None  # None: same as num_attention_heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    vocab_size: int = 384
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": 8.0, ...} or None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    model_type: str = "llama"
    # kept from an imported model for its export (tiertrain trains within the window: train.seq_len <= it)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    _units: tuple[UnitSpec, ...] | None = field(default=None, init=False, repr=False, compare=False)
    # with _units
    _counts: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)

    # ---- derived shape ------------------------------------------------------------------------
    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        """Each field checked: one line naming the one that is not allowed, and why."""
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
            "max_position_embeddings",
        ):
            v = getattr(self, key)
            self._need(isinstance(v, int) and v > 0, key, "must be a positive integer")
        kv = self.num_key_value_heads
        self._need(kv is None or kv > 0, "num_key_value_heads", "must be a positive integer")
        self._need(
            self.num_attention_heads % self.n_kv_heads == 0,
            "num_key_value_heads",
            f"must divide model.num_attention_heads ({self.num_attention_heads})",
        )
        if self.head_dim is None:
            self._need(
                self.hidden_size % self.num_attention_heads == 0,
                "hidden_size",
                f"must be a multiple of model.num_attention_heads ({self.num_attention_heads}), or set "
                "model.head_dim",
            )
            self._need(
                self.hd % 2 == 0,
                "hidden_size",
                f"/ model.num_attention_heads = {self.hd}, the head size, "
                "must be even (RoPE rotates pairs); change either, or set model.head_dim",
            )
        self._need(
            isinstance(self.hd, int) and self.hd > 0 and self.hd % 2 == 0,
            "head_dim",
            "must be a positive even number (RoPE)",
        )
        for key in ("rope_theta", "rms_norm_eps", "initializer_range"):
            self._need(_finite(getattr(self, key)), key, "must be a positive finite number")
        self._need(self.model_type in MODEL_TYPES, "model_type", f"must be one of {', '.join(MODEL_TYPES)}")
        if self.rope_scaling is not None:
            self._validate_rope(self.rope_scaling)

    def _need(self, ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"model.{key} = {getattr(self, key)!r} is not allowed: {why}")

    def _validate_rope(self, rs: object) -> None:
        self._need(
            isinstance(rs, dict),
            "rope_scaling",
            'must be a table like {rope_type = "llama3", factor = 8.0, ...}',
        )
        kind = rs.get("rope_type", rs.get("type", "default"))
        self._need(kind in ROPE_TYPES, "rope_scaling", f"rope_type must be one of {', '.join(ROPE_TYPES)}")
        self._need(
            "factor" not in rs or _finite(rs["factor"]),
            "rope_scaling",
            "factor must be a positive finite number",
        )
        if kind == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            missing = [k for k in keys if k not in rs]
            self._need(not missing, "rope_scaling", f"llama3 scaling needs {', '.join(missing)}")
            bad = [k for k in keys if not _finite(rs[k])]
            self._need(
                not bad, "rope_scaling", f"{', '.join(bad)} must be positive finite numbers, not strings"
            )
            self._need(
                rs["high_freq_factor"] != rs["low_freq_factor"],
                "rope_scaling",
                "high_freq_factor must differ from low_freq_factor",
            )

    # ---- units and tensor tables --------------------------------------------------------------
    def units(self) -> tuple[UnitSpec, ...]:
        if self._units is None:
            self._units = self._build_units()
        return self._units

    def _build_units(self) -> tuple[UnitSpec, ...]:
        h, v, ff = self.hidden_size, self.vocab_size, self.intermediate_size
        q_out, kv_out = self.num_attention_heads * self.hd, self.n_kv_heads * self.hd
        embed = UnitSpec(
            0, "embed", "embed", (TensorSpec("embed_tokens.weight", (v, h), "model.embed_tokens.weight"),)
        )
        units = [embed]
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            local = [
                ("self_attn.q_proj.weight", (q_out, h)),
                ("self_attn.k_proj.weight", (kv_out, h)),
                ("self_attn.v_proj.weight", (kv_out, h)),
                ("self_attn.o_proj.weight", (h, q_out)),
                ("mlp.gate_proj.weight", (ff, h)),
                ("mlp.up_proj.weight", (ff, h)),
                ("mlp.down_proj.weight", (h, ff)),
                ("input_layernorm.weight", (h,)),
                ("post_attention_layernorm.weight", (h,)),
            ]
            if self.attention_bias:
                local += [
                    ("self_attn.q_proj.bias", (q_out,)),
                    ("self_attn.k_proj.bias", (kv_out,)),
                    ("self_attn.v_proj.bias", (kv_out,)),
                ]
            if self.qk_norm:
                local += [("self_attn.q_norm.weight", (self.hd,)), ("self_attn.k_norm.weight", (self.hd,))]
            units.append(
                UnitSpec(i + 1, "block", f"layers.{i}", tuple(TensorSpec(n, s, p + n) for n, s in local))
            )
        norm = TensorSpec("norm.weight", (h,), "model.norm.weight")
        if self.tie_word_embeddings:
            head = UnitSpec(
                len(units), "head", "head", (norm,), (("lm_head.weight", 0, "embed_tokens.weight"),)
            )
        else:
            head = UnitSpec(
                len(units), "head", "head", (TensorSpec("lm_head.weight", (v, h), "lm_head.weight"), norm)
            )
        units.append(head)
        return tuple(units)

    # ---- counts -------------------------------------------------------------------------------
    def _count(self) -> tuple[int, int]:
        """(n_params, n_matmul_params), counted once: the planner asks for them in every candidate."""
        if self._counts is None or self._units is None:
            units = self.units()
            matmul = sum(u.numel for u in units if u.kind != "embed")
            self._counts = (
                sum(u.numel for u in units),
                matmul + (self.vocab_size * self.hidden_size if self.tie_word_embeddings else 0),
            )
        return self._counts

    @property
    def n_params(self) -> int:
        """Trainable parameters; a tied embedding counts once."""
        return self._count()[0]

    @property
    def n_matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: all but the embedding lookup."""
        return self._count()[1]

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls with weights, plus causal attention.
        Recomputation is not counted: this is the model's FLOPs, the figure MFU is quoted on."""
        return 6.0 * self.n_matmul_params + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Of those, causal attention's: QK^T and AV, 2 FLOPs per multiply-add, forward + 2x backward, average
        context (S+1)/2."""
        return 3 * 2 * 2 * self.num_hidden_layers * self.num_attention_heads * self.hd * (seq_len + 1) / 2
