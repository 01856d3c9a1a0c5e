"""A model of one's own, of each family, exported: transformers loads it as the model tiertrain trains (the same
logits, sliding windows and rope included), or the export is refused by name; a hand-written config.json reads
with the family's defaults, as transformers reads it."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import COMMON
from tiertrain.errors import ConfigError
from tiertrain.model import families, hf, llama
from tiertrain.model.spec import ModelSpec

transformers = pytest.importorskip("transformers")

SHAPE = {**COMMON, "num_hidden_layers": 3}
MOE = dict(num_experts=4, num_experts_per_tok=2)
SLIDE = ["sliding_attention", "full_attention", "sliding_attention"]
FULL = ["full_attention"] * 3
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
    # a window every block's layer_types turns off: none trained, none exported
    "mixtral, a window no block uses": dict(model_type="mixtral", **MOE, sliding_window=8, layer_types=FULL),
    "qwen3_moe, a window no block uses": dict(
        model_type="qwen3_moe", **MOE, qk_norm=True, sliding_window=8, layer_types=FULL
    ),
    "mistral, a window no block uses": dict(model_type="mistral", sliding_window=8, layer_types=FULL),
    # transformers reads mistral with layer_types as Ministral: windows per block
    "mistral, some blocks windowed": dict(model_type="mistral", sliding_window=8, layer_types=SLIDE),
}


def _own(fields: dict):
    """The spec and random weights (unit by unit, under tiertrain's names) of a model of one's own."""
    spec = ModelSpec(**{**SHAPE, **fields})
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
    if any(spec.window(i) for i in range(spec.num_hidden_layers)):
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
        # transformers' llama refuses to load a hidden size its heads do not divide, whatever head_dim says
        (dict(model_type="llama", num_attention_heads=3, num_key_value_heads=1, head_dim=16), "hidden_size"),
    ],
)
def test_what_the_family_cannot_hold_is_refused_at_export(fields, key, tmp_path):
    """A model that trains with windows its family's transformers class would not apply (llama has none; mixtral,
    qwen3_moe and mistral window every block alike), or a shape it would not load, is refused by name, nothing
    written."""
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


LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
HAND_WRITTEN = [  # config.json fields left out, or given as transformers 5 standardizes them, as one may write them
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, rope_scaling=None, rope_theta=1e4)),
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, rope_parameters=None)),
    # an empty table is the default rope (null or absent: the family's YaRN)
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, rope_parameters={})),
    # linear and dynamic (within max_position_embeddings) scalings, legacy key included
    ("llama", dict(rope_scaling={"type": "linear", "factor": 4.0})),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})),
    ("qwen3", {}),
    ("qwen3", dict(head_dim=16)),
    ("llama", {}),
    # rope: rope_parameters without its theta (the top level's), rope_scaling over rope_parameters, the legacy
    # "type", original positions from the top level (Phi-3's), else the table's, else max_position_embeddings
    ("llama", dict(rope_theta=5e5, rope_parameters={"rope_type": "default"})),
    ("llama", dict(rope_theta=5e5, rope_parameters=None)),
    ("llama", dict(rope_scaling={**LLAMA3, "original_max_position_embeddings": 16}, rope_parameters={})),
    ("llama", dict(rope_parameters={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
    (
        "llama",
        dict(
            original_max_position_embeddings=32,
            rope_scaling={**LLAMA3, "original_max_position_embeddings": 16},
        ),
    ),
    ("qwen2", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})),
    # windows where config.json names none: mistral's 4096, and qwen's with use_sliding_window
    ("mistral", {}),
    ("mistral", dict(sliding_window=None)),
    ("qwen2", dict(use_sliding_window=True, max_window_layers=1)),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, use_sliding_window=True)),
    ("mistral", dict(sliding_window=8, layer_types=SLIDE, rope_theta=1e6, head_dim=16)),  # read as Ministral
]


@pytest.mark.parametrize("family,fields", HAND_WRITTEN)
def test_a_hand_written_config_reads_as_transformers_reads_it(family, fields, tmp_path):
    """rope, rms_norm_eps, head_dim and the positions where config.json leaves them out: the family's defaults
    (mixtral's theta 1e6, gpt-oss's YaRN x32 at 150000 even where null, qwen3's head size 128, eps 1e-5)."""
    base = {k: v for k, v in SHAPE.items() if k not in ("max_position_embeddings", "rms_norm_eps")}
    c = {"model_type": family, **base, **fields}
    (tmp_path / "config.json").write_text(json.dumps(c))
    spec = hf.spec_from_hf(tmp_path)
    # the config as the model built from it holds it (building it standardizes the rope again: Phi-3's top level)
    want = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(tmp_path)
    ).config
    rope = dict(want.rope_parameters)
    rope.pop("type", None)  # the legacy key, kept beside rope_type
    assert spec.rope_theta == rope.pop("rope_theta")
    assert (spec.rope_scaling or {"rope_type": "default"}) == rope
    assert spec.rms_norm_eps == want.rms_norm_eps
    assert spec.hd == (getattr(want, "head_dim", None) or want.hidden_size // want.num_attention_heads)
    assert spec.max_position_embeddings == want.max_position_embeddings
    assert (spec.bos_token_id, spec.eos_token_id) == (want.bos_token_id, want.eos_token_id)
    n = want.num_hidden_layers
    if getattr(want, "layer_types", None):  # each block's window, as the class applies it
        wins = [want.sliding_window if want.layer_types[i] == "sliding_attention" else None for i in range(n)]
    else:
        wins = [getattr(want, "sliding_window", None)] * n
    assert [spec.window(i) for i in range(n)] == wins


@pytest.mark.parametrize("family", sorted(families.FAMILY_DEFAULTS))
def test_a_config_without_its_kv_heads_reads_the_family_s_default(family, tmp_path):
    """num_key_value_heads left out: transformers' class default (mistral's 8, qwen2's 32, llama's the attention
    heads), where the import took the attention heads and then refused the weights' shapes."""
    base = {k: v for k, v in SHAPE.items() if k not in ("num_key_value_heads", "num_attention_heads")}
    c = {
        "model_type": family,
        **base,
        "num_attention_heads": 32,
        "head_dim": 4,
        **(MOE if "o" in family else {}),
    }
    c = {
        k.replace("num_experts", "num_local_experts") if family in ("mixtral", "gpt_oss") else k: v
        for k, v in c.items()
    }
    (tmp_path / "config.json").write_text(json.dumps(c))
    want = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf.spec_from_hf(tmp_path).n_kv_heads == want.num_key_value_heads


@pytest.mark.parametrize("layers, refused", [(1, True), (3, False)])
def test_qwen_windows_are_refused_only_where_a_block_windows(layers, refused, tmp_path):
    """use_sliding_window with max_window_layers at or above the blocks: transformers windows none, so a
    sequence longer than the window imports; where a block windows, it is refused as before."""
    base = {k: v for k, v in SHAPE.items() if k != "rms_norm_eps"}
    c = dict(model_type="qwen2", **base, use_sliding_window=True, sliding_window=8, max_window_layers=layers)
    (tmp_path / "config.json").write_text(json.dumps(c))
    if refused:
        with pytest.raises(hf.HFError, match="sliding_window 8 shorter than train.seq_len 32"):
            hf.spec_from_hf(tmp_path, 32)
    else:  # and the run takes it (config.check_model refused the window no block has)
        from tiertrain.config import load_config

        assert {hf.spec_from_hf(tmp_path, 32).window(i) for i in range(3)} == {None}
        load_config(None, ["train.seq_len=32"]).imported(hf.spec_from_hf(tmp_path, 32))


def test_rope_kinds_tiertrain_does_not_implement_are_refused_in_any_spelling(tmp_path):
    """A rope kind under rope_parameters' legacy "type" key was read as no scaling: it is refused, as under
    rope_type."""
    base = {k: v for k, v in SHAPE.items() if k != "rms_norm_eps"}
    for rope in (
        {"rope_parameters": {"type": "longrope", "factor": 4.0}},
        {"rope_scaling": {"rope_type": "su"}},
    ):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **base, **rope}))
        with pytest.raises(hf.HFError, match="rope_type must be one of"):
            hf.spec_from_hf(tmp_path)


def test_a_tied_config_with_its_own_head_imports_untied_as_transformers_loads_it(tmp_path):
    """config.json ties the embeddings but the weights hold an lm_head.weight of their own: transformers 5 loads
    the model untied, and so does the import, to the same logits; a head equal to the embedding stays tied."""
    from safetensors.torch import load_file, save_file

    cfg = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    sd = load_file(f)
    assert "lm_head.weight" not in sd and hf.spec_from_hf(tmp_path / "m").tie_word_embeddings
    save_file({**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}, f, metadata={"format": "pt"})
    assert hf.spec_from_hf(tmp_path / "m").tie_word_embeddings  # the same values: tied as before
    save_file(
        {**sd, "lm_head.weight": torch.randn_like(sd["model.embed_tokens.weight"])},
        f,
        metadata={"format": "pt"},
    )
    spec = hf.spec_from_hf(tmp_path / "m")
    assert not spec.tie_word_embeddings
    r = hf.open_weights(tmp_path / "m", spec)
    weights = [{t.name: r.get(t.hf_name, t.shape).float() for t in u.tensors} for u in spec.units()]
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(_logits(spec, weights, tokens), want(input_ids=tokens).logits)


def test_an_export_keeps_null_token_ids_and_named_chat_templates(tmp_path):
    """Token ids the model has none of are written null (left out, the family's defaults would fill them in);
    the tokenizer's named chat templates (additional_chat_templates/) come out with the export; every file is
    readable by other users."""
    spec, weights = _own(dict(model_type="llama"))
    src = tmp_path / "src"
    (src / "additional_chat_templates").mkdir(parents=True)
    (src / "chat_template.jinja").write_text("{{ 'default' }}")
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'tools' }}")
    tensors = ((t.hf_name, w[t.name]) for u, w in zip(spec.units(), weights) for t in u.tensors)
    hf.write_hf(tmp_path / "out", spec, tensors, "float32", carried=src)
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert c["bos_token_id"] is c["eos_token_id"] is c["pad_token_id"] is None
    got = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert got.bos_token_id is got.eos_token_id is None
    assert (tmp_path / "out" / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ 'tools' }}"
    # readable by other users, the weights too (safetensors writes 0600)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


IGNORED = [  # config.json keys the family's transformers class does not read (no window in llama), or reads alike
    ("llama", dict(use_sliding_window=True, sliding_window=8)),
    ("mistral", dict(attention_bias=True, mlp_bias=True, hidden_dropout=0.1, hidden_act="swish")),
    ("qwen3_moe", dict(router_jitter_noise=0.5, mlp_bias=True, **MOE)),
    ("gpt_oss", dict(hidden_act="gelu", num_local_experts=4, num_experts_per_tok=2)),
]


@pytest.mark.parametrize("family,fields", IGNORED)
def test_what_the_family_does_not_read_is_ignored_as_transformers_ignores_it(family, fields, tmp_path):
    """Imported as transformers loads it: the same logits, where tiertrain windowed llama's blocks or refused
    the keys."""
    base = {k: v for k, v in SHAPE.items() if k != "rms_norm_eps"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family, **base, **fields}))
    torch.manual_seed(0)
    want = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(tmp_path), attn_implementation="eager"
    ).float()
    with torch.no_grad():  # q and k large enough that a window would change the logits
        for n, p in want.named_parameters():
            p.mul_(8.0 if ("q_proj.weight" in n or "k_proj.weight" in n) else 1.0)
    want.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family, **base, **fields}))
    spec = hf.spec_from_hf(tmp_path, 40)
    r = hf.open_weights(tmp_path, spec)
    weights = [{t.name: r.get(t.hf_name, t.shape).float() for t in u.tensors} for u in spec.units()]
    for u, w in zip(spec.units(), weights):
        for name, owner, oname in u.borrows:
            w[name] = weights[owner][oname]
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            _logits(spec, weights, tokens), want.eval()(input_ids=tokens).logits, rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("kind", ["linear", "dynamic"])
def test_a_linear_or_dynamic_rope_lifts_its_positions_alone(kind):
    """A sequence past the positions keeps the model's own scaling (transformers reads the raised positions
    alike: a linear factor whatever the length, a dynamic one only past them): only the positions are raised."""
    from tiertrain.config import load_config, position_lift

    spec = ModelSpec(**{**SHAPE, "rope_scaling": {"rope_type": kind, "factor": 2.0}})
    lift = position_lift(spec, 100)
    assert lift == "--set model.max_position_embeddings=100"
    cfg = load_config(None, ["train.seq_len=100", "model.max_position_embeddings=100"])
    assert cfg.imported(spec).model.rope_scaling == spec.rope_scaling
