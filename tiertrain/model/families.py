"""What each model family's transformers class builds and takes for granted: its architecture's name, the
defaults its config.json may leave out, how it windows attention, which attention weights it has; and the fields
of a model of one's own it could not hold (`unlike_family`: `export` refuses those). Pure Python."""

from __future__ import annotations

from . import hf_moe
from .spec import ModelSpec

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **hf_moe.ARCHITECTURES,
}
# what each family's transformers config takes where config.json leaves a field out (transformers 5's classes):
# a hand-written config.json means what transformers would load
_YARN32 = dict(
    rope_type="yarn",
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=4096,
)
_IDS = dict(
    bos_token_id=1, eos_token_id=2
)  # the token ids llama's, mistral's and mixtral's classes default to
# the qwen families' classes alike
_QWEN = dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, sliding_window=4096)
FAMILY_DEFAULTS = {  # num_key_value_heads: where config.json leaves it out (None: the attention heads')
    "llama": dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048, **_IDS),
    # sliding_window: where config.json leaves it out (mistral's always applies; qwen's with use_sliding_window)
    "mistral": dict(
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        sliding_window=4096,
        num_key_value_heads=8,
        **_IDS,
    ),
    "qwen2": dict(**_QWEN, num_key_value_heads=32),
    "qwen3": dict(**_QWEN, head_dim=128, num_key_value_heads=32),
    "qwen2_moe": dict(**_QWEN, num_key_value_heads=16),
    "qwen3_moe": dict(**_QWEN, num_key_value_heads=4),
    "mixtral": dict(
        rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=131072, num_key_value_heads=8, **_IDS
    ),
    # gpt-oss: YaRN x32 unless config.json names another rope, a null one included
    "gpt_oss": dict(
        rope_theta=150000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        head_dim=64,
        rope_scaling=_YARN32,
        num_key_value_heads=8,
    ),
}
# how each family's transformers class windows attention: "per block" (layer_types), "alike" (model.sliding_window
# on every block) or "none" (no window)
WINDOWS = {
    "llama": "none",
    "mistral": "alike",  # with layer_types, per block: transformers reads that as Ministral
    "mixtral": "alike",
    "qwen3_moe": "alike",
    "qwen2": "per block",
    "qwen3": "per block",
    "qwen2_moe": "per block",
    "gpt_oss": "per block",
}


# each family's attention as its transformers class builds it ("attention_bias": as that key says)
ATTENTION = {
    "llama": dict(qk_norm=False, attention_sinks=False, attention_out_bias="attention_bias"),
    "mistral": dict(qk_norm=False, attention_sinks=False, attention_bias=False, attention_out_bias=False),
    "qwen2": dict(qk_norm=False, attention_sinks=False, attention_bias=True, attention_out_bias=False),
    "qwen3": dict(qk_norm=True, attention_sinks=False, attention_out_bias="attention_bias"),
    "qwen3_moe": dict(qk_norm=True, attention_sinks=False, attention_out_bias="attention_bias"),
    "qwen2_moe": dict(qk_norm=False, attention_sinks=False, attention_out_bias=False),
    "mixtral": dict(qk_norm=False, attention_sinks=False, attention_bias=False, attention_out_bias=False),
    "gpt_oss": dict(qk_norm=False, attention_sinks=True, attention_out_bias="attention_bias"),
}


def unlike_family(spec: ModelSpec) -> list[str]:
    """The attention fields that differ from what the family's transformers class builds, each as "model.KEY =
    VALUE (transformers' FAMILY needs WANT)". Such a model of one's own trains; `export` refuses it, since
    transformers would load the export with tensors missing or initialised afresh, or attend otherwise."""
    out = []
    windows = {spec.window(i) for i in range(spec.num_hidden_layers)}
    mt, how = spec.model_type, WINDOWS[spec.model_type]
    if how == "none" and windows != {None}:
        out.append(f"model.sliding_window = {spec.sliding_window} (transformers' {mt} has no sliding window)")
    if mt == "llama" and spec.hidden_size % spec.num_attention_heads:  # its config class refuses to load it
        out.append(
            f"model.hidden_size = {spec.hidden_size} (transformers' llama needs a multiple of "
            f"model.num_attention_heads = {spec.num_attention_heads}, whatever model.head_dim)"
        )
    if how == "alike" and len(windows) > 1 and not (mt == "mistral" and spec.layer_types is not None):
        out.append(
            f"model.layer_types = {spec.layer_types} (transformers' {mt} windows every block alike: leave it "
            "out, or use a family with per-block windows)"
        )
    for key, want in ATTENTION[spec.model_type].items():
        tied = want == "attention_bias"  # an o_proj bias where q, k and v have theirs
        want = spec.attention_bias if tied else want
        if getattr(spec, key) != want:
            out.append(
                f"model.{key} = {str(getattr(spec, key)).lower()} (transformers' {spec.model_type} needs "
                f"{str(want).lower()}{', as model.attention_bias' if tied else ''})"
            )
    return out
