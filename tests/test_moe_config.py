"""The families' config.json as transformers reads it: a key the file leaves out takes transformers' default,
gpt-oss's swiglu_alpha goes both ways, and a model whose attention its family's transformers class does not build
trains but is not exported (one line), each family's attention checked against its transformers class."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import transformers
from moe_cases import BASE, MOE

from conftest import tiny_config
from tiertrain.model import families, hf
from tiertrain.model.hf import HFError

# a config.json key the importer reads, and the spec field it becomes
KEYS = {
    "num_experts": "num_experts",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "shared_expert_intermediate_size": "shared_expert_intermediate_size",
    "attention_bias": "attention_bias",
    "qkv_bias": "attention_bias",
    "swiglu_limit": "swiglu_limit",
    "swiglu_alpha": "swiglu_alpha",
    "router_aux_loss_coef": "router_aux_loss_coef",
    "norm_topk_prob": "norm_topk_prob",
}


def _spec(c: dict, d):
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(c))
    return hf.spec_from_hf(d)


@pytest.mark.parametrize("case", sorted(MOE))
def test_a_key_left_out_takes_transformers_default(case, tmp_path):
    """Each MoE key, left out of a family's config.json, is read as transformers' config class reads it."""
    cfg_cls, _, extra = MOE[case]
    full = getattr(transformers, cfg_cls)(**{**BASE, **extra}).to_dict()
    for key in ("num_experts", "num_local_experts"):  # as many as any default top k takes
        if key in full:
            full[key] = 128
    default = getattr(transformers, cfg_cls)()
    tried = 0
    for key, field in KEYS.items():
        if key not in full:
            continue
        c = {k: v for k, v in full.items() if k != key}
        spec = _spec(c, tmp_path / key)
        want = getattr(default, key)
        assert getattr(spec, field) == want, f"{case}: {key} left out"
        tried += 1
    assert tried >= 3  # mixtral has three of them
    if case in ("qwen3_moe", "gpt_oss"):  # the o_proj bias goes with q/k/v's there
        spec = _spec({k: v for k, v in full.items() if k != "attention_bias"}, tmp_path / "out")
        assert spec.attention_out_bias == default.attention_bias


def test_gpt_oss_swiglu_alpha_is_imported_and_exported(tmp_path):
    """gpt-oss's activation constant: read from config.json, written back on export, as transformers reads it."""
    cfg_cls, _, extra = MOE["gpt_oss"]
    c = getattr(transformers, cfg_cls)(**{**BASE, **extra}, swiglu_alpha=1.5, swiglu_limit=5.0).to_dict()
    spec = _spec(c, tmp_path / "in")
    assert (spec.swiglu_alpha, spec.swiglu_limit) == (1.5, 5.0)
    out = hf.hf_config(spec, "float32")
    back = getattr(transformers, cfg_cls)(**out)
    assert (back.swiglu_alpha, back.swiglu_limit) == (1.5, 5.0)


QWEN3_MOE = ['model.model_type="qwen3_moe"', "model.num_experts=4", "model.num_experts_per_tok=2"]
GPT_OSS = ['model.model_type="gpt_oss"', "model.num_experts=4", "model.num_experts_per_tok=2"]


@pytest.mark.parametrize(
    "sets,key",
    [
        (QWEN3_MOE, "qk_norm"),  # Qwen3MoeAttention always has q_norm and k_norm
        (GPT_OSS, "attention_sinks"),  # GptOssAttention always has sinks
        (GPT_OSS + ["model.attention_sinks=true", "model.attention_bias=true"], "attention_out_bias"),
        (
            ['model.model_type="mixtral"', "model.num_experts=4", "model.attention_bias=true"],
            "attention_bias",
        ),
        (
            ['model.model_type="qwen2_moe"', "model.num_experts=4", "model.attention_sinks=true"],
            "attention_sinks",
        ),
    ],
)
def test_a_model_its_family_cannot_hold_trains_but_is_not_exported(token_file, tmp_path, sets, key):
    """Attention the family's transformers class does not build validates (a model of one's own may train), but
    its export, which would load without it or with it initialised afresh, is refused by name in one line,
    before anything is written."""
    spec = tiny_config(token_file, *sets).model
    assert [u.split(" = ")[0] for u in families.unlike_family(spec)] == [f"model.{key}"]
    out = tmp_path / "export" / "hf"
    with pytest.raises(HFError, match=rf"model\.{key} = \S+ \(transformers' {spec.model_type} needs"):
        hf.write_hf(out, spec, iter(()), "float32")
    assert not out.parent.exists()


def test_the_families_attention_as_transformers_builds_it_is_theirs(token_file):
    for sets in (
        [*QWEN3_MOE, "model.qk_norm=true"],
        [*GPT_OSS, "model.attention_sinks=true"],
        [
            *GPT_OSS,
            "model.attention_sinks=true",
            "model.attention_bias=true",
            "model.attention_out_bias=true",
        ],
    ):
        assert families.unlike_family(tiny_config(token_file, *sets).model) == []


@pytest.mark.parametrize("family", sorted(families.ATTENTION))
@pytest.mark.parametrize("bias", [False, True])
def test_each_family_s_attention_is_what_its_transformers_class_builds(family, bias):
    """families.ATTENTION against the attention module each family's transformers class builds, with and without
    attention_bias: a spec of that structure passes unlike_family, and each of its fields turned over does not
    (but the q/k/v biases where the family's config.json says them)."""
    arch = getattr(transformers, families.ARCHITECTURES[family])
    extra = MOE[family][2] if family in MOE else {}
    # qwen2_moe's q/k/v biases go by qkv_bias
    cfg = arch.config_class(
        **{**BASE, **extra, "num_hidden_layers": 1, "attention_bias": bias, "qkv_bias": bias}
    )
    attn = arch(cfg).model.layers[0].self_attn
    built = dict(
        qk_norm=hasattr(attn, "q_norm"),
        attention_sinks=hasattr(attn, "sinks"),
        attention_bias=attn.q_proj.bias is not None,
        attention_out_bias=attn.o_proj.bias is not None,
    )
    # no window, so that only the attention's fields are tested here (windows: test_hf_families.py)
    spec = SimpleNamespace(
        model_type=family,
        num_hidden_layers=1,
        window=lambda i: None,
        hidden_size=64,
        num_attention_heads=4,
        **built,
    )
    assert families.unlike_family(spec) == []
    free = (
        "attention_bias" not in families.ATTENTION[family]
    )  # a config key says it, and the export writes it
    assert built["attention_bias"] == bias or not free
    for key in [k for k in built if not (free and k == "attention_bias")]:
        turned = SimpleNamespace(**{**vars(spec), key: not built[key]})
        assert families.unlike_family(turned), f"{family}: {key} = {not built[key]} passes"


@pytest.mark.parametrize("case", sorted(MOE))
def test_active_parameters_leave_out_exactly_the_idle_experts(case, tmp_path):
    """n_active_params (the FLOPs, model TFLOP/s and the plan's figures): every tensor but the experts a token is
    not routed to, counted from the tensors themselves (gpt-oss's biases: gate/up's 2 I and down's H an expert)."""
    cfg_cls, _, extra = MOE[case]
    spec = _spec(getattr(transformers, cfg_cls)(**{**BASE, **extra}).to_dict(), tmp_path)
    e, k = spec.num_experts, spec.num_experts_per_tok
    idle = sum(
        t.numel // e * (e - k) for u in spec.units() for t in u.tensors if t.name.startswith("mlp.experts.")
    )
    assert spec.n_params - spec.n_active_params == idle > 0


@pytest.mark.parametrize(
    "case,key,value",
    [
        ("qwen3_moe", "norm_topk_prob", "false"),  # read as true before
        ("qwen3_moe", "output_router_logits", "false"),
        ("mixtral", "num_local_experts", "4"),
        ("gpt_oss", "num_experts_per_tok", True),  # read as k = 1 before
        ("qwen2_moe", "router_aux_loss_coef", "0.5"),
    ],
)
def test_a_moe_key_of_the_wrong_type_is_refused(case, key, value, tmp_path):
    """A config.json MoE value of another JSON type, which transformers' config class refuses, is refused by name
    (it was coerced: a quoted "false" read as true)."""
    cfg_cls, _, extra = MOE[case]
    c = {**getattr(transformers, cfg_cls)(**{**BASE, **extra}).to_dict(), key: value}
    with pytest.raises(HFError, match=f"{key} = {value!r}"):
        _spec(c, tmp_path)
