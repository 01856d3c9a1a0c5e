"""The templates compute what transformers' Llama / Qwen2 / Qwen3 models compute (fp32 logits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import CASES, COMMON
from tiertrain.model import llama
from tiertrain.model.reference import ReferenceLM
from tiertrain.model.spec import ModelSpec

transformers = pytest.importorskip("transformers")


def _pair(case: str):
    cfg_cls, model_cls, extra = CASES[case]
    hf_cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(hf_cfg).float().eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: randomize so they are tested
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    family = "llama" if case.startswith("llama") else case.split("-")[0]
    spec = ModelSpec(
        **COMMON,
        model_type=family,
        rope_theta=extra["rope_theta"],
        rope_scaling=extra.get("rope_scaling"),
        tie_word_embeddings=extra.get("tie_word_embeddings", False),
        attention_bias=family == "qwen2" or extra.get("attention_bias", False),
        attention_out_bias=extra.get("attention_bias", False),  # llama's and qwen3's: on o too
        qk_norm=family == "qwen3",
        pad_token_id=extra.get("pad_token_id"),
        head_dim=extra.get("head_dim"),
        sliding_window=extra.get("sliding_window"),
    )
    spec.validate()
    return hf, spec


def template_logits(spec: ModelSpec, sd: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    ctx = llama.Context.build(spec, tokens.shape[1], torch.float32, torch.device("cpu"))
    units = spec.units()

    def weights(u):
        w = {t.name: sd[t.hf_name] for t in u.tensors}
        for name, owner, owner_name in u.borrows:
            w[name] = next(sd[t.hf_name] for t in units[owner].tensors if t.name == owner_name)
        return w

    x = llama.embed(weights(units[0]), tokens, ctx)
    for u in units[1:-1]:
        x = llama.block(weights(u), x, ctx.of(u.window))
    return llama.logits(weights(units[-1]), llama.final_norm(weights(units[-1]), x, ctx), ctx)


@pytest.mark.parametrize("case", sorted(CASES))
def test_templates_equal_transformers(case):
    hf, spec = _pair(case)
    sd = dict(hf.state_dict())
    names = {t.hf_name for u in spec.units() for t in u.tensors}
    hf_names = set(sd) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    assert names == hf_names  # the tensor tables name every HF tensor, and nothing else
    tokens = torch.randint(0, spec.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=tokens).logits.float()
        got = template_logits(spec, sd, tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(c for c in CASES if "sliding_window" not in CASES[c][2]))
def test_reference_module_equals_transformers(case):
    """The parity tests' oracle is itself the transformers math, gradients included (of the models without a
    window shorter than their rows: the oracle attends to the whole prefix; test_hf checks a windowed import
    against transformers itself)."""
    hf, spec = _pair(case)
    ref = ReferenceLM(spec)
    ref.load_state_dict(hf.state_dict(), strict=not spec.tie_word_embeddings)
    tokens = torch.randint(0, spec.vocab_size, (2, 33), generator=torch.Generator().manual_seed(2))
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    ours = ref(inp, tgt) / tgt.numel()
    theirs = F.cross_entropy(hf(input_ids=inp).logits.float().flatten(0, 1), tgt.flatten())
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    ours.backward()
    theirs.backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[name].grad, rtol=1e-4, atol=1e-6)
