"""Shared helpers: tiny configs and the plain-PyTorch reference training loop."""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from tiertrain.config import Config, load_config
from tiertrain.model.reference import ReferenceLM
from tiertrain.optim.adamw import lr_at
from tiertrain.plan.hardware import REFERENCE, TORCH_COPIES

# the reference H200 as measured before the one-pass host AdamW in pieces: a host whose AdamW is slow and
# half as fast into a speculation's copies; the planner's scenarios that need AdamW to be the bottleneck
# (GPU updates paying off, clipping costing copies) plan on it
SLOW_HOST = dataclasses.replace(REFERENCE, host_adam_params_per_s=3.78e9, host_adam_copy_params_per_s=2.81e9,
                                compute_efficiency=0.54, host_dram_gbs=120.0, adam_contention=1.18, source="slow host",
                                **TORCH_COPIES)

TINY = ["model.hidden_size=64", "model.intermediate_size=96", "model.num_hidden_layers=3",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=97",
        "train.seq_len=32", "train.batch_size=8", "train.micro_batch_size=2", "train.steps=12",
        'train.compute_dtype="float32"', 'train.device="cpu"', "optim.grad_clip=0.3", "optim.warmup_steps=3", "optim.lr=3e-3",
        "optim.min_lr=3e-4", "optim.weight_decay=0.1",
        # where each update runs is pinned (the plan would choose per placement, and the CUDA AdamW rounds
        # differently from the CPU one); the tests of GPU updates set it
        "tiers.gpu_update_units=0",
        # and where checkpoints live: budgets in the NVMe tests leave no room for host checkpoints
        'tiers.activations="gpu"',
        # on a GPU the plan would keep this tiny model whole on the device: the tests of streaming stream
        "tiers.gpu_resident_gb=0", "train.keep_activations=0"]
VARIANTS = {
    "llama": [],  # GQA 4/2, untied, no biases
    "qwen2": ["model.attention_bias=true", "model.tie_word_embeddings=true", 'model.model_type="qwen2"'],
    "qwen3": ["model.qk_norm=true", "model.head_dim=32", 'model.model_type="qwen3"'],
}


@pytest.fixture
def token_file(tmp_path):
    """A learnable sequence: each token follows from the last by a fixed rule, a quarter of them noise."""
    rng = np.random.default_rng(0)
    toks = np.empty(40_000, dtype=np.int64)
    toks[0] = 1
    noise = rng.integers(0, 97, toks.size)
    keep = rng.random(toks.size) < 0.75
    for i in range(1, toks.size):
        toks[i] = (toks[i - 1] * 7 + 3) % 97 if keep[i] else noise[i]
    path = tmp_path / "tokens.npy"
    np.save(path, toks)
    return path


def tiny_config(token_file, *sets: str) -> Config:
    return load_config(None, TINY + [f'data.path="{token_file}"', *sets])


def reference_train(cfg: Config, init: dict[str, torch.Tensor] | None, device: str, autocast: bool, model=None):
    """The same training in plain PyTorch: nn.Module, micro-batch accumulation, clip_grad_norm_,
    torch.optim.AdamW with decay on >=2-D tensors only, the same rows. Returns (losses, grad norms, model).
    `model`: a module whose forward(inputs, targets) is the summed token loss; default ReferenceLM(init)."""
    from tiertrain.data import Loader, read_tokens

    tc = cfg.train
    ref = model
    if ref is None:
        ref = ReferenceLM(cfg.model).to(device)
        missing, unexpected = ref.load_state_dict({k: v.to(device) for k, v in init.items()}, strict=False)
        assert not unexpected and all(k == "lm_head.weight" for k in missing)  # tied: shared with the embedding
    params = list(ref.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)
    loader = Loader(read_tokens(cfg.data.path), tc.seq_len, tc.batch_size, cfg.model.vocab_size,
                    cfg.data.shuffle, tc.seed)
    losses, norms = [], []
    for k in range(tc.steps):
        inp, tgt = (torch.from_numpy(a).to(device) for a in loader.batch(k))
        opt.zero_grad()
        total = 0.0
        for a in range(0, tc.batch_size, tc.micro_batch_size):
            b = a + tc.micro_batch_size
            ctx = torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with ctx:
                loss = ref(inp[a:b], tgt[a:b]) / tgt.numel()
            loss.backward()
            total += loss.item()
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        for g in opt.param_groups:
            g["lr"] = lr_at(k, cfg.optim, tc.steps)
        opt.step()
        losses.append(total)
    return losses, norms, ref
