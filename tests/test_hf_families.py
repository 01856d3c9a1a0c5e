"""A model of one's own, of each family, exported: transformers loads it as the model tiertrain trains (the same
logits, sliding windows and rope included), or the export is refused by name; a hand-written config.json reads
with the family's defaults, as transformers reads it."""

from __future__ import annotations

import json

import pytest
import torch

from tiertrain.errors import ConfigError
from tiertrain.model import families, hf, llama
from tiertrain.model.spec import ModelSpec

transformers = pytest.importorskip("transformers")

SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
MOE = dict(num_experts=4, num_experts_per_tok=2)
SLIDE = ["sliding_attention", "full_attention", "sliding_attention"]
OWN = {  # a model of one's own the family's transformers class builds; windows of 8 tokens against 40
    "gpt_oss, no rope, no window": dict(model_type="gpt_oss", **MOE, attention_sinks=True),
    "gpt_oss, every block windowed": dict(
        model_type="gpt_oss", **MOE, attention_sinks=True, sliding_window=8
    ),
    "qwen2_moe, every block windowed": dict(
        model_type="qwen2_moe", **MOE, moe_intermediate_size=48, attention_bias=True, sliding_window=8
    ),
    "qwen2, some blocks windowed": dict(
        model_type="qwen2", attention_bias=True, sliding_window=8, layer_types=SLIDE
    ),
    "qwen3, every block windowed": dict(model_type="qwen3", qk_norm=True, sliding_window=8),
    "qwen3_moe, every block windowed": dict(model_type="qwen3_moe", **MOE, qk_norm=True, sliding_window=8),
    "mixtral, every block windowed": dict(model_type="mixtral", **MOE, sliding_window=8),
    "mistral, every block windowed": dict(model_type="mistral", sliding_window=8),
}


def _own(fields: dict):
    """The spec and random weights (unit by unit, under tiertrain's names) of a model of one's own."""
    spec = ModelSpec(**SHAPE, **fields)
    spec.validate()
    g = torch.Generator().manual_seed(0)
    weights = []
    for u in spec.units():
        # q and k large enough that the windows change the logits; norms about one
        w = {}
        for t in u.tensors:
            scale = 0.6 if ("q_proj" in t.name or "k_proj" in t.name) else 0.1
            w[t.name] = torch.randn(t.shape, generator=g) * scale + (1.0 if "norm" in t.name else 0.0)
        weights.append(w)
    return spec, weights


def _logits(spec: ModelSpec, weights: list[dict], tokens: torch.Tensor) -> torch.Tensor:
    """tiertrain's own forward pass: each block over its own window."""
    units = spec.units()
    ctx = llama.Context.build(spec, tokens.shape[1], torch.float32, torch.device("cpu"))
    x = llama.embed(weights[0], tokens, ctx)
    for u, w in zip(units[1:-1], weights[1:-1]):
        x = llama.block(w, x, ctx.of(u.window))
    return llama.logits(weights[-1], llama.final_norm(weights[-1], x, ctx), ctx)


@pytest.mark.parametrize("case", sorted(OWN))
def test_an_export_loads_as_the_model_trained(case, tmp_path):
    """transformers reads the export's config.json into the same model: the same rope (gpt-oss's null would read as
    its YaRN default), the same blocks windowed (each family's default layer_types differ), the same logits."""
    spec, weights = _own(OWN[case])
    tensors = ((t.hf_name, w[t.name]) for u, w in zip(spec.units(), weights) for t in u.tensors)
    hf.write_hf(tmp_path / "out", spec, tensors, "float32")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    back.config._attn_implementation = "eager"
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _logits(spec, weights, tokens)
        torch.testing.assert_close(back.eval()(input_ids=tokens).logits, want, rtol=1e-4, atol=1e-4)
    # and the windows matter at this length: every block unwindowed gives other logits
    if spec.sliding_window:
        with torch.no_grad():
            whole = _logits(
                ModelSpec(**SHAPE, **{**OWN[case], "sliding_window": None, "layer_types": None}),
                weights,
                tokens,
            )
        assert (whole - want).abs().max() > 1e-2


@pytest.mark.parametrize(
    "fields,key",
    [
        (dict(model_type="llama", sliding_window=8), "sliding_window"),
        (dict(model_type="mixtral", **MOE, sliding_window=8, layer_types=SLIDE), "layer_types"),
        (
            dict(model_type="qwen3_moe", **MOE, qk_norm=True, sliding_window=8, layer_types=SLIDE),
            "layer_types",
        ),
        (dict(model_type="mistral", sliding_window=8, layer_types=SLIDE), "layer_types"),
    ],
)
def test_windows_the_family_cannot_hold_are_refused_at_export(fields, key, tmp_path):
    """A model that trains with windows its family's transformers class would not apply (llama has none; mixtral,
    qwen3_moe and mistral window every block alike) is refused by name, nothing written."""
    spec, _ = _own(fields)
    assert [u.split(" = ")[0] for u in families.unlike_family(spec)] == [f"model.{key}"]
    with pytest.raises(hf.HFError, match=rf"model\.{key} = "):
        hf.write_hf(tmp_path / "x" / "out", spec, iter(()), "float32")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize(
    "key,value", [("mlp_only_layers", [1]), ("decoder_sparse_step", 2), ("moe_intermediate_size", 48)]
)
def test_qwen_moe_fields_are_refused_elsewhere(family, key, value):
    """Fields only qwen's MoE config.json holds: elsewhere the export could not say them, and transformers would
    build experts (of the dense width) in every block."""
    with pytest.raises(ConfigError, match=rf"^model\.{key} = .* a qwen MoE field; transformers' {family}"):
        _own(dict(model_type=family, **MOE, **{key: value}))


HAND_WRITTEN = [  # config.json fields left out, as a hand-written one may
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, rope_scaling=None, rope_theta=1e4)),
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, rope_parameters=None)),
    ("qwen3", {}),
    ("qwen3", dict(head_dim=16)),
    ("llama", {}),
]


@pytest.mark.parametrize("family,fields", HAND_WRITTEN)
def test_a_hand_written_config_reads_as_transformers_reads_it(family, fields, tmp_path):
    """rope, rms_norm_eps, head_dim and the positions where config.json leaves them out: the family's defaults
    (mixtral's theta 1e6, gpt-oss's YaRN x32 at 150000 even where null, qwen3's head size 128, eps 1e-5)."""
    base = {k: v for k, v in SHAPE.items() if k not in ("max_position_embeddings", "rms_norm_eps")}
    c = {"model_type": family, **base, **fields}
    (tmp_path / "config.json").write_text(json.dumps(c))
    spec = hf.spec_from_hf(tmp_path)
    want = transformers.AutoConfig.from_pretrained(tmp_path)
    rope = dict(want.rope_parameters)
    assert spec.rope_theta == rope.pop("rope_theta")
    assert (spec.rope_scaling or {"rope_type": "default"}) == rope
    assert spec.rms_norm_eps == want.rms_norm_eps
    assert spec.hd == (getattr(want, "head_dim", None) or want.hidden_size // want.num_attention_heads)
    assert spec.max_position_embeddings == want.max_position_embeddings
