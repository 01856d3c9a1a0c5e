"""Hugging Face's mixtures of experts (qwen3_moe, qwen2_moe, mixtral, gpt_oss): their config.json fields, and
their released checkpoints' expert layouts mapped onto the fused tensors tiertrain trains (transformers' in-memory
layout, model/spec.py):
    qwen3_moe, qwen2_moe  mlp.experts.{e}.{gate,up,down}_proj.weight      per expert, F.linear's layout
    mixtral               block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w{1,3,2}.weight
    gpt_oss               fused as in memory, or MXFP4 (*_blocks, *_scales) in its released checkpoints
Import reads either the released or the fused layout; export writes the released one (MXFP4 excepted: gpt-oss is
written fused, in the dtype asked for, as transformers' own save_pretrained writes a dequantized model)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterator

from .spec import ModelSpec

if TYPE_CHECKING:
    import torch

ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
_FUSED = re.compile(r"(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")
# FP4 (E2M1) values of a nibble
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# transformers' defaults (its config classes') of the MoE keys a config.json may leave out: a hand-written one
# then describes the model transformers would build from it ("experts": num_experts or num_local_experts)
DEFAULTS = {
    "qwen3_moe": dict(experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "qwen2_moe": dict(
        experts=60, num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632
    ),
    "mixtral": dict(experts=8, num_experts_per_tok=2),
    "gpt_oss": dict(
        experts=128, num_experts_per_tok=4, attention_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702
    ),
}


# the MoE keys of config.json and the JSON type transformers' config classes take for each (they refuse others)
TYPES = {
    **dict.fromkeys(
        (
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "decoder_sparse_step",
        ),
        "an integer",
    ),
    "shared_expert_intermediate_size": "an integer",
    **dict.fromkeys(
        ("norm_topk_prob", "output_router_logits", "attention_bias", "qkv_bias"), "true or false"
    ),
    **dict.fromkeys(("router_aux_loss_coef", "swiglu_limit", "swiglu_alpha"), "a number"),
}


def mistyped(c: dict) -> list[str]:
    """The MoE keys of config.json `c` whose values are not of their type (a "false" in quotes would read as
    true): "key = value (its type)" each."""

    def ok(v, kind: str) -> bool:
        if kind == "true or false":
            return isinstance(v, bool)
        want = int if kind == "an integer" else (int, float)
        return isinstance(v, want) and not isinstance(v, bool)

    return [
        f"{k} = {c[k]!r} ({kind})" for k, kind in TYPES.items() if c.get(k) is not None and not ok(c[k], kind)
    ]


def spec_fields(c: dict, mt: str) -> dict:
    """ModelSpec's fields of an MoE config.json beyond the dense ones (transformers' defaults where absent)."""
    c = {**DEFAULTS[mt], **c}
    # either name: transformers maps one onto the other
    named = [c[k] for k in ("num_experts", "num_local_experts") if k in c]
    n = next((v for v in named if v), 0) if named else c["experts"]
    qwen = mt in ("qwen3_moe", "qwen2_moe")
    f = dict(
        num_experts=int(n),
        num_experts_per_tok=c["num_experts_per_tok"],
        moe_intermediate_size=c.get("moe_intermediate_size") if qwen else None,
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        decoder_sparse_step=c.get("decoder_sparse_step", 1) if qwen else 1,
        mlp_only_layers=list(c.get("mlp_only_layers") or []) if qwen else [],
        output_router_logits=bool(c.get("output_router_logits", False)),
        router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
        shared_expert_intermediate_size=c.get("shared_expert_intermediate_size", 0)
        if mt == "qwen2_moe"
        else 0,
    )
    bias = bool(c.get("attention_bias", False))
    if mt == "qwen2_moe":  # q, k and v only, always
        f.update(attention_bias=bool(c.get("qkv_bias", True)))
    elif mt in ("qwen3_moe", "gpt_oss"):
        f.update(attention_bias=bias, attention_out_bias=bias)
    f.update(qk_norm=mt == "qwen3_moe")
    if mt == "gpt_oss":
        f.update(
            attention_sinks=True, swiglu_limit=float(c["swiglu_limit"]), swiglu_alpha=float(c["swiglu_alpha"])
        )
    n_layers = c.get("num_hidden_layers", 0)
    if mt == "gpt_oss":
        f.update(layer_types=list(c.get("layer_types") or _alternating(n_layers)))
        f.update(sliding_window=c.get("sliding_window", 128))
    elif mt == "qwen2_moe" and c.get("use_sliding_window"):
        lim = c.get("max_window_layers", 28)
        f.update(sliding_window=c.get("sliding_window", 4096))
        f.update(layer_types=c.get("layer_types") or _alternating(n_layers, lim))
    elif qwen:
        f.update(sliding_window=c.get("sliding_window", 4096) if c.get("use_sliding_window") else None)
    else:
        f.update(sliding_window=c.get("sliding_window"))
    return f


def _alternating(n: int, limit: int | None = None) -> list[str]:
    """transformers' default layer_types: even blocks sliding, odd ones full (qwen2_moe: below max_window_layers)."""
    return [
        "sliding_attention" if (i + 1) % 2 and (limit is None or i < limit) else "full_attention"
        for i in range(n)
    ]


def config_fields(spec: ModelSpec) -> dict:
    """config.json's MoE fields of `spec`, as transformers 5 writes them."""
    mt = spec.model_type
    c = dict(
        num_experts_per_tok=spec.num_experts_per_tok,
        output_router_logits=spec.output_router_logits,
        router_aux_loss_coef=spec.router_aux_loss_coef,
    )
    c["num_experts" if mt.startswith("qwen") else "num_local_experts"] = spec.num_experts
    if mt.startswith("qwen"):
        c.update(
            moe_intermediate_size=spec.expert_size,
            norm_topk_prob=spec.norm_topk_prob,
            decoder_sparse_step=spec.decoder_sparse_step,
            mlp_only_layers=spec.mlp_only_layers,
        )
    if mt == "qwen2_moe":
        c.update(
            shared_expert_intermediate_size=spec.shared_expert_intermediate_size, qkv_bias=spec.attention_bias
        )
    else:
        c.update(attention_bias=spec.attention_bias)
    if mt == "gpt_oss":
        c.update(swiglu_limit=spec.swiglu_limit, swiglu_alpha=spec.swiglu_alpha)
    if mt in ("qwen3_moe", "mixtral"):  # every block alike (qwen2_moe's and gpt-oss's windows: hf.hf_config)
        if mt == "qwen3_moe":
            c.update(use_sliding_window=spec.window(0) is not None)
        c.update(sliding_window=spec.window(0))  # the blocks' one window (layer_types may turn it off)
    return c


def _released_names(mt: str, p: str, what: str) -> tuple[str, tuple[str, ...]]:
    """Block `p`'s fused tensor `what` (qwen's or mixtral's) in the released checkpoints: the name pattern of its
    pieces ({e}: the expert, {w}: the part) and its parts in the fused tensor's row order; the router has one
    piece and no parts."""
    moe = p + ("block_sparse_moe." if mt == "mixtral" else "mlp.")
    if what == "gate.weight":
        return moe + "gate.weight", ()
    gate_up = what == "experts.gate_up_proj"
    if mt == "mixtral":
        return moe + "experts.{e}.{w}.weight", ("w1", "w3") if gate_up else ("w2",)
    return moe + "experts.{e}.{w}.weight", ("gate_proj", "up_proj") if gate_up else ("down_proj",)


class MoEReader:
    """A model directory's tensors by tiertrain's (fused) names, whichever layout the directory holds."""

    def __init__(self, reader, spec: ModelSpec, mxfp4: bool):
        self.reader, self.spec, self.mxfp4 = reader, spec, mxfp4

    def sources(self, name: str) -> list[str]:
        """The checkpoint's names that make tensor `name`."""
        m = _FUSED.match(name)
        if m is None or name in self.reader.where:
            return [name]
        p, what, mt = m.group(1), m.group(2), self.spec.model_type
        if mt == "gpt_oss":
            return [name + "_blocks", name + "_scales"]
        fmt, parts = _released_names(mt, p, what)  # each part's experts in turn
        return [fmt.format(e=e, w=w) for w in parts for e in range(self.spec.num_experts)] if parts else [fmt]

    def check(self, names) -> None:
        self.reader.check(s for n in names for s in self.sources(n))

    def get(self, name: str, shape: tuple[int, ...]) -> "torch.Tensor":
        import torch

        src = self.sources(name)
        if src == [name]:
            return self.reader.get(name, shape)
        if name.endswith("gate.weight"):
            return self.reader.get(src[0], shape)
        e = self.spec.num_experts
        if self.spec.model_type == "gpt_oss":
            return _mxfp4(self.reader, src, shape)
        # per expert, each projection's experts in turn: [gate; up] stacked along the rows of each expert
        per = len(src) // e
        rows = shape[1] // per
        parts = [self.reader.get(s, (rows, shape[2])) for s in src]
        return torch.stack([torch.cat([parts[j * e + x] for j in range(per)]) for x in range(e)])


def _mxfp4(reader, src: list[str], shape: tuple[int, ...]) -> "torch.Tensor":
    """transformers' Mxfp4Dequantize: blocks [E, R, G, 16] of two E2M1 values a byte (the low nibble first) and
    one E8M0 scale [E, R, G] per 32 values along the input; the result [E, in, R] (x @ W)."""
    import torch

    e, n_in, r = shape
    g = n_in // 32
    blocks = reader.get(src[0], (e, r, g, 16)).to(torch.uint8).reshape(-1, 16)
    scales = reader.get(src[1], (e, r, g)).to(torch.int32).reshape(-1, 1) - 127
    lut = torch.tensor(FP4, dtype=torch.float32)
    out = torch.empty(blocks.shape[0], 32, dtype=torch.float32)
    out[:, 0::2] = lut[(blocks & 0x0F).int()]
    out[:, 1::2] = lut[(blocks >> 4).int()]
    out = torch.ldexp(out, scales)
    return out.reshape(e, r, n_in).transpose(1, 2).contiguous()


def released(spec: ModelSpec, tensors: Iterator[tuple[str, "torch.Tensor"]]):
    """The (name, tensor) stream of the fused layout in the released checkpoints' names and layouts."""
    mt = spec.model_type
    for name, t in tensors:
        m = _FUSED.match(name)
        if m is None or mt == "gpt_oss":
            yield name, t
            continue
        fmt, parts = _released_names(mt, m.group(1), m.group(2))
        if not parts:
            yield fmt, t
            continue
        for e in range(t.shape[0]):
            for w, part in zip(parts, t[e].chunk(len(parts), dim=0)):
                yield fmt.format(e=e, w=w), part
