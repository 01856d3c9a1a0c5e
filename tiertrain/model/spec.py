"""Model shape: Hugging Face-compatible fields, streaming units, tensor tables, counts. No torch here."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..errors import ConfigError
from .ropes import rope_problem

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")  # mixtures of experts (model/moe.py)
MODEL_TYPES = DENSE_TYPES + MOE_TYPES
LAYER_TYPES = ("full_attention", "sliding_attention")
MOST_LAYERS = (
    4096  # a deeper model is a typo (the largest released have about 200), and its units take minutes
)


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
    window: int | None = None  # a block's attention window (keys per query, itself included); None: causal

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
    # ---- mixtures of experts (model/moe.py): transformers' fields of qwen3_moe, qwen2_moe, mixtral, gpt_oss
    num_experts: int = 0  # experts of an MoE block (num_experts / num_local_experts); 0: a dense model
    num_experts_per_tok: int = 2  # the experts each token is routed to (top-k)
    moe_intermediate_size: int | None = None  # an expert's intermediate size; None: intermediate_size
    shared_expert_intermediate_size: int = 0  # qwen2_moe: an always-on expert behind a sigmoid gate; 0: none
    norm_topk_prob: bool = False  # the top-k routing weights rescaled to sum to one (mixtral: always)
    decoder_sparse_step: int = 1  # every n-th block has experts, the others a dense MLP (qwen)
    mlp_only_layers: list[int] = field(default_factory=list)  # blocks with a dense MLP (qwen)
    output_router_logits: bool = False  # the load-balancing loss is added to the loss (transformers' switch)
    router_aux_loss_coef: float = 0.001  # its weight
    # ---- gpt_oss's attention and experts
    attention_out_bias: bool = False  # a bias on o_proj too (gpt_oss; qwen3 with attention_bias)
    attention_sinks: bool = False  # a learned logit per head beside the keys in the softmax (gpt_oss)
    layer_types: list[str] | None = None  # per block "sliding_attention" or "full_attention"; None: all alike
    swiglu_limit: float = 7.0  # gpt_oss's clamp of the expert activation's inputs
    swiglu_alpha: float = 1.702  # and its sigmoid's slope
    _units: tuple[UnitSpec, ...] | None = field(default=None, init=False, repr=False, compare=False)
    # with _units
    _counts: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)
    # each block's (attention window, whether it has experts), which the planner reads per candidate
    _blocks: tuple[tuple[int | None, bool], ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # the slabs' sizes of its units, per rank count: plan.memory.slab_sizes, which every candidate plan reads
    _slabs: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    # ---- derived shape ------------------------------------------------------------------------
    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_size(self) -> int:
        """An expert's intermediate size."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def mlp_width(self) -> int:
        """Per token, the elements of the MLP's intermediates: the intermediate size, or a mixture of experts' k
        experts' and the (token, expert) rows it gathers (k x H). The working set scales with it."""
        if not self.is_moe:
            return self.intermediate_size
        k = self.num_experts_per_tok
        moe = k * (self.expert_size + self.hidden_size) + self.shared_expert_intermediate_size
        dense = self.moe_blocks < self.num_hidden_layers
        return max(moe, self.intermediate_size if dense else 0)

    @property
    def moe_blocks(self) -> int:
        """How many blocks are mixtures of experts (has_experts)."""
        return sum(self.has_experts(b) for b in range(self.num_hidden_layers))

    def has_experts(self, layer: int) -> bool:
        """Whether block `layer` is a mixture of experts (qwen's mlp_only_layers and decoder_sparse_step)."""
        return (
            self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    def with_layers(self, n: int) -> "ModelSpec":
        """The same model with n blocks (the planner's what-ifs): per-block lists cut or continued in pattern."""
        lt = self.layer_types
        lt = None if lt is None else [lt[i % len(lt)] for i in range(n)]
        return dataclasses.replace(
            self,
            num_hidden_layers=n,
            layer_types=lt,
            mlp_only_layers=[i for i in self.mlp_only_layers if i < n],
        )

    def window(self, layer: int) -> int | None:
        """Block `layer`'s attention window (transformers' semantics: a query sees itself and the window - 1 keys
        before it); None: the whole causal prefix."""
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None
        return self.sliding_window

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
        self._need(
            self.num_hidden_layers <= MOST_LAYERS, "num_hidden_layers", f"must be at most {MOST_LAYERS}"
        )
        self._need(
            self.head_dim is None or isinstance(self.head_dim, int) and self.head_dim > 0,
            "head_dim",
            "must be a positive integer, or left out (hidden_size / num_attention_heads)",
        )
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
        pad, v = (
            self.pad_token_id,
            self.vocab_size,
        )  # nn.Embedding's padding_idx: a row, negative from the end
        self._need(
            pad is None or type(pad) is int and -v <= pad < v, "pad_token_id", f"must be a token id below {v}"
        )
        # config.json's ids for generation: tokens of the vocabulary
        for key in ("bos_token_id", "eos_token_id"):
            ids = getattr(self, key)
            ids = ids if isinstance(ids, list) else [] if ids is None else [ids]
            self._need(all(type(i) is int and 0 <= i < v for i in ids), key, f"must be a token id below {v}")
        for key in ("rope_theta", "rms_norm_eps", "initializer_range"):
            self._need(_finite(getattr(self, key)), key, "must be a positive finite number")
        self._need(self.model_type in MODEL_TYPES, "model_type", f"must be one of {', '.join(MODEL_TYPES)}")
        if self.rope_scaling is not None:
            why = rope_problem(self.rope_scaling)
            self._need(why is None, "rope_scaling", why)
        self._validate_moe()
        self._validate_layers()

    def _validate_moe(self) -> None:
        moe = self.model_type in MOE_TYPES
        e = self.num_experts
        self._need(isinstance(e, int) and e >= 0, "num_experts", "must be an integer >= 0")
        self._need(
            (e > 0) == moe,
            "num_experts",
            f"must be {'positive for' if moe else '0 for the dense'} model_type {self.model_type!r}"
            + ("" if moe else f" (mixtures of experts: {', '.join(MOE_TYPES)})"),
        )
        if not moe:
            return
        k = self.num_experts_per_tok
        self._need(isinstance(k, int) and 0 < k <= e, "num_experts_per_tok", f"must be 1 to {e}")
        m = self.moe_intermediate_size
        self._need(m is None or isinstance(m, int) and m > 0, "moe_intermediate_size", "must be positive")
        sh = self.shared_expert_intermediate_size
        self._need(
            isinstance(sh, int) and sh >= 0 and (sh == 0 or self.model_type == "qwen2_moe"),
            "shared_expert_intermediate_size",
            "must be an integer >= 0, and 0 outside qwen2_moe",
        )
        self._need(
            isinstance(self.decoder_sparse_step, int) and self.decoder_sparse_step >= 1,
            "decoder_sparse_step",
            "must be a positive integer",
        )
        bad = [
            i for i in self.mlp_only_layers if not (isinstance(i, int) and 0 <= i < self.num_hidden_layers)
        ]
        self._need(not bad, "mlp_only_layers", f"must list blocks 0 to {self.num_hidden_layers - 1}")
        if not self.model_type.startswith(
            "qwen"
        ):  # transformers' mixtral and gpt-oss have experts in every block
            why = f"a qwen MoE field; transformers' {self.model_type} has none (leave it out)"
            self._need(not self.mlp_only_layers, "mlp_only_layers", why)
            self._need(self.decoder_sparse_step == 1, "decoder_sparse_step", why)
            self._need(m in (None, self.intermediate_size), "moe_intermediate_size", why)
        coef = self.router_aux_loss_coef
        self._need(
            _number(coef) and math.isfinite(coef) and coef >= 0, "router_aux_loss_coef", "must be >= 0"
        )
        for key in ("swiglu_limit", "swiglu_alpha"):
            self._need(_finite(getattr(self, key)), key, "must be a positive finite number")

    def _validate_layers(self) -> None:
        w = self.sliding_window
        self._need(w is None or isinstance(w, int) and w > 0, "sliding_window", "must be a positive integer")
        lt = self.layer_types
        if lt is None:
            return
        self._need(
            isinstance(lt, list) and len(lt) == self.num_hidden_layers and all(t in LAYER_TYPES for t in lt),
            "layer_types",
            f"must list {self.num_hidden_layers} of {', '.join(LAYER_TYPES)}",
        )
        self._need(
            w is not None or "sliding_attention" not in lt,
            "layer_types",
            "has sliding_attention layers: set model.sliding_window",
        )

    def _need(self, ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"model.{key} = {getattr(self, key)!r} is not allowed: {why}")

    # ---- units and tensor tables --------------------------------------------------------------
    def units(self) -> tuple[UnitSpec, ...]:
        if self._units is None:
            self._units = self._build_units()
        return self._units

    def _build_units(self) -> tuple[UnitSpec, ...]:
        h, v = self.hidden_size, self.vocab_size
        embed = UnitSpec(
            0, "embed", "embed", (TensorSpec("embed_tokens.weight", (v, h), "model.embed_tokens.weight"),)
        )
        units = [embed]
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            local = self._attention_tensors() + self._mlp_tensors(i)
            units.append(
                UnitSpec(
                    i + 1,
                    "block",
                    f"layers.{i}",
                    tuple(TensorSpec(n, s, p + n) for n, s in local),
                    window=self.window(i),
                )
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

    def _attention_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        h = self.hidden_size
        q_out, kv_out = self.num_attention_heads * self.hd, self.n_kv_heads * self.hd
        local = [
            ("self_attn.q_proj.weight", (q_out, h)),
            ("self_attn.k_proj.weight", (kv_out, h)),
            ("self_attn.v_proj.weight", (kv_out, h)),
            ("self_attn.o_proj.weight", (h, q_out)),
            ("input_layernorm.weight", (h,)),
            ("post_attention_layernorm.weight", (h,)),
        ]
        if self.attention_bias:
            local += [
                ("self_attn.q_proj.bias", (q_out,)),
                ("self_attn.k_proj.bias", (kv_out,)),
                ("self_attn.v_proj.bias", (kv_out,)),
            ]
        if self.attention_out_bias:
            local.append(("self_attn.o_proj.bias", (h,)))
        if self.qk_norm:
            local += [("self_attn.q_norm.weight", (self.hd,)), ("self_attn.k_norm.weight", (self.hd,))]
        if self.attention_sinks:
            local.append(("self_attn.sinks", (self.num_attention_heads,)))
        return local

    def _mlp_tensors(self, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        """A block's MLP in transformers' in-memory layout: the dense one, or the router and the experts' fused
        tensors (model/hf_moe.py maps the released checkpoints' layouts onto them)."""
        h, ff = self.hidden_size, self.intermediate_size
        if not self.has_experts(layer):
            return [
                ("mlp.gate_proj.weight", (ff, h)),
                ("mlp.up_proj.weight", (ff, h)),
                ("mlp.down_proj.weight", (h, ff)),
            ]
        e, i = self.num_experts, self.expert_size
        if self.model_type == "gpt_oss":  # x @ W, gate and up interleaved in the columns, with biases
            return [
                ("mlp.router.weight", (e, h)),
                ("mlp.router.bias", (e,)),
                ("mlp.experts.gate_up_proj", (e, h, 2 * i)),
                ("mlp.experts.gate_up_proj_bias", (e, 2 * i)),
                ("mlp.experts.down_proj", (e, i, h)),
                ("mlp.experts.down_proj_bias", (e, h)),
            ]
        local = [
            ("mlp.gate.weight", (e, h)),
            ("mlp.experts.gate_up_proj", (e, 2 * i, h)),  # F.linear's layout, [gate; up] in the rows
            ("mlp.experts.down_proj", (e, h, i)),
        ]
        sh = self.shared_expert_intermediate_size
        if sh:
            local += [
                ("mlp.shared_expert.gate_proj.weight", (sh, h)),
                ("mlp.shared_expert.up_proj.weight", (sh, h)),
                ("mlp.shared_expert.down_proj.weight", (h, sh)),
                ("mlp.shared_expert_gate.weight", (1, h)),
            ]
        return local

    # ---- counts -------------------------------------------------------------------------------
    def _count(self) -> tuple[int, int]:
        """(n_params, n_matmul_params), counted once: the planner asks for them in every candidate."""
        if self._counts is None or self._units is None:
            units = self.units()
            matmul = sum(u.numel for u in units if u.kind != "embed") - self._idle_experts()
            self._counts = (
                sum(u.numel for u in units),
                matmul + (self.vocab_size * self.hidden_size if self.tie_word_embeddings else 0),
            )
        return self._counts

    def _idle_experts(self) -> int:
        """Parameters of the experts a token is not routed to, over all blocks."""
        if not self.is_moe:
            return 0
        h, i, e, k = self.hidden_size, self.expert_size, self.num_experts, self.num_experts_per_tok
        # an expert's weights, and gpt-oss's biases: gate/up's 2 I, down's H
        per = 3 * h * i + (2 * i + h if self.model_type == "gpt_oss" else 0)
        return (e - k) * per * self.moe_blocks

    @property
    def n_params(self) -> int:
        """Trainable parameters; a tied embedding counts once. Bytes scale with it."""
        return self._count()[0]

    @property
    def n_active_params(self) -> int:
        """Of those, the ones a token uses: all but the experts it is not routed to (MoE: "A3B" of 30B)."""
        return self.n_params - self._idle_experts()

    @property
    def n_matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: all but the embedding lookup and, in a mixture of
        experts, the experts the token is not routed to. FLOPs scale with it."""
        return self._count()[1]

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls with weights, plus causal attention.
        Recomputation is not counted: this is the model's FLOPs, the figure MFU is quoted on."""
        return 6.0 * self.n_matmul_params + self.attention_flops_per_token(seq_len)

    @property
    def expert_flops_per_token(self) -> float:
        """Of those, the routed experts' matmuls (forward + backward): k experts' three projections per MoE block."""
        per = 6 * self.num_experts_per_tok * 3 * self.hidden_size * self.expert_size
        return float(sum(per for _, moe in self._per_block() if moe))

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Of those, causal attention's: QK^T and AV, 2 FLOPs per multiply-add, forward + 2x backward, over the
        keys a query sees on average: (S+1)/2, or about the window where a block has a shorter one."""
        s, per = seq_len, 3 * 2 * 2 * self.num_attention_heads * self.hd
        seen = [w - w * (w - 1) / 2 / s if w and w < s else (s + 1) / 2 for w, _ in self._per_block()]
        return per * sum(seen)

    def _per_block(self) -> tuple[tuple[int | None, bool], ...]:
        if self._blocks is None:
            self._blocks = tuple((self.window(b), self.has_experts(b)) for b in range(self.num_hidden_layers))
        return self._blocks
