"""Tiny random transformers models of each mixture-of-experts family, saved as Hugging Face directories."""

from __future__ import annotations

import torch

from conftest import COMMON

BASE = {**COMMON, "num_hidden_layers": 3, "output_router_logits": True, "router_aux_loss_coef": 0.05}
MOE = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            head_dim=32,
            mlp_only_layers=[1],
            rope_theta=1e6,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=64
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=12, rope_theta=1e6),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            head_dim=16,
            sliding_window=8,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
}


def moe_model(case: str, seed: int = 0, **config):
    """A random fp32 transformers model of the family (norms, biases and sinks randomized too), eager kernels;
    `config`: fields of its config that replace the case's."""
    import transformers

    cfg_cls, model_cls, extra = MOE[case]
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra, **config})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(cfg).float()
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return hf
