"""Shared helpers: tiny configs, the plain-PyTorch reference training loop, the command line as a user runs it,
checkpoints' arrays, budgets that spill, and tiny Hugging Face models."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from pathlib import Path

# before torch loads OpenMP, which reads it then: the suite runs two workers on CI's two cores, each with as many
# OpenMP threads as cores, and threads that spin while they wait took the cores of the working ones (the suite ran
# 1.5-3x slower). Passive waiting changes no result, only how an idle thread waits; the CLI's runs inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch
import zarr
from forkcli import cli, python_c  # noqa: F401 - the tests' processes, imported from here

from tiertrain import checkpoint as ckpt
from tiertrain.config import Config, load_config
from tiertrain.metrics import read_metrics
from tiertrain.model.reference import ReferenceLM
from tiertrain.modes import Kind
from tiertrain.optim.adamw import lr_at
from tiertrain.plan.hardware import REFERENCE, TORCH_COPIES
from tiertrain.tiers.placement import RING_SLOTS, least_host
from tiertrain.tiers.slab import host_cost

ROOT = Path(__file__).resolve().parent.parent

# the reference H200 as measured before the one-pass host AdamW in pieces: a host whose AdamW is slow and
# half as fast into a speculation's copies; the planner's scenarios that need AdamW to be the bottleneck
# (GPU updates paying off, clipping costing copies) plan on it
SLOW_HOST = dataclasses.replace(
    REFERENCE,
    host_adam_params_per_s=3.78e9,
    host_adam_copy_params_per_s=2.81e9,
    compute_efficiency=0.54,
    host_dram_gbs=120.0,
    adam_contention=1.18,
    source="slow host",
    **TORCH_COPIES,
)

TINY = [
    "model.hidden_size=64",
    "model.intermediate_size=96",
    "model.num_hidden_layers=3",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.vocab_size=97",
    "train.seq_len=32",
    "train.batch_size=8",
    "train.micro_batch_size=2",
    "train.steps=12",
    'train.compute_dtype="float32"',
    'train.device="cpu"',
    "optim.grad_clip=0.3",
    "optim.warmup_steps=3",
    "optim.lr=3e-3",
    "optim.min_lr=3e-4",
    "optim.weight_decay=0.1",
    # where each update runs is pinned (the plan would choose per placement, and the CUDA AdamW rounds
    # differently from the CPU one); the tests of GPU updates set it
    "tiers.gpu_update_units=0",
    # and where checkpoints live: budgets in the NVMe tests leave no room for host checkpoints
    'tiers.activations="gpu"',
    # on a GPU the plan would keep this tiny model whole on the device: the tests of streaming stream
    "tiers.gpu_resident_gb=0",
    "train.keep_activations=0",
]
VARIANTS = {
    "llama": [],  # GQA 4/2, untied, no biases
    "qwen2": ["model.attention_bias=true", "model.tie_word_embeddings=true", 'model.model_type="qwen2"'],
    "qwen3": ["model.qk_norm=true", "model.head_dim=32", 'model.model_type="qwen3"'],
}


@pytest.fixture
def token_file(tmp_path):
    return write_tokens(tmp_path / "tokens.npy")


def write_tokens(path: Path) -> Path:
    """A learnable sequence: each token follows from the last by a fixed rule, a quarter of them noise."""
    rng = np.random.default_rng(0)
    toks = np.empty(40_000, dtype=np.int64)
    toks[0] = 1
    noise = rng.integers(0, 97, toks.size)
    keep = rng.random(toks.size) < 0.75
    for i in range(1, toks.size):
        toks[i] = (toks[i - 1] * 7 + 3) % 97 if keep[i] else noise[i]
    np.save(path, toks)
    return path


def tiny_config(token_file, *sets: str) -> Config:
    return load_config(None, TINY + [f'data.path="{token_file}"', *sets])


def reference_train(
    cfg: Config, init: dict[str, torch.Tensor] | None, device: str, autocast: bool, model=None
):
    """The same training in plain PyTorch: nn.Module, micro-batch accumulation, clip_grad_norm_,
    torch.optim.AdamW with decay on >=2-D tensors only, the same rows. Returns (losses, grad norms, model).
    `model`: a module whose forward(inputs, targets) is the summed token loss; default ReferenceLM(init)."""
    from tiertrain.data import Loader
    from tiertrain.tokenfile import read_tokens

    tc = cfg.train
    ref = model
    if ref is None:
        ref = ReferenceLM(cfg.model).to(device)
        missing, unexpected = ref.load_state_dict({k: v.to(device) for k, v in init.items()}, strict=False)
        # tied: shared with the embedding
        assert not unexpected and all(k == "lm_head.weight" for k in missing)
    # decay on tensors of 2+ dims but biases (HF Trainer's rule leaves biases out)
    decay = {n: p.ndim >= 2 and not n.endswith("bias") for n, p in ref.named_parameters()}
    params = dict(ref.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in params.items() if decay[n]], "weight_decay": cfg.optim.weight_decay},
            {"params": [p for n, p in params.items() if not decay[n]], "weight_decay": 0.0},
        ],
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
    )
    loader = Loader(
        read_tokens(cfg.data.path), tc.seq_len, tc.batch_size, cfg.model.vocab_size, cfg.data.shuffle, tc.seed
    )
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
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), clip)))
        for g in opt.param_groups:
            g["lr"] = lr_at(k, cfg.optim, tc.steps)
        opt.step()
        losses.append(total)
    return losses, norms, ref


# ---- the command line, as a user runs it --------------------------------------------------------
SETS = [a for s in TINY for a in ("--set", s)]
STEPS = ["--set", "train.steps=8", "--set", "checkpoint.every=3", "--set", "checkpoint.keep=5"]


def tiny(token_file, *more):
    return [*SETS, "--set", f'data.path="{token_file}"', *more]


def refused(r, *words):
    """A refusal as the issue asks: exit 2, one line naming what to change, no traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def tree_hash(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def user_files(root: Path) -> dict[str, str]:
    """A directory of a user's own files, and their hashes."""
    (root / "sub").mkdir(parents=True)
    (root / "notes.txt").write_text("my notes\n")
    (root / "sub" / "data.bin").write_bytes(os.urandom(4096))
    return tree_hash(root)


DEEP_ARGS = ["--set", "model.num_hidden_layers=12"]  # DEEP, as command-line arguments


def same_state(a: Path, b: Path) -> bool:
    sa, sb = (state_of(d / "checkpoints" / "step_8") for d in (a, b))
    return all(np.array_equal(sa[k], sb[k]) for k in sa)


def least_gb(token_file) -> str:
    """The least --host-gb of the DEEP tiny model with an NVMe tier: every slab it can spill on disk."""
    cfg = tiny_config(token_file, "model.num_hidden_layers=12")
    from tiertrain.trainer import Trainer

    tr = Trainer(cfg)
    least = least_host([lay.numel for lay in tr.layouts], tr.kind_bytes(), 0, host_cost)
    tr.close()
    # unrounded: the process's memory makes it a GB or so, where rounding up to three digits would leave the tiny
    # state room in RAM
    return f"{least / 1e9 + beside_gb(cfg) + 1e-9:.9f}"


def beside_gb(cfg, ranks: int = 1) -> float:
    """GB that --host-gb holds beside the plan's host bytes: each rank's process, and on a CPU the device's buffers
    and activations (a CPU computes in host memory)."""
    from tiertrain.plan.hardware import HardwareSpec
    from tiertrain.plan.resolve import search

    if cfg.train.device == "cuda":  # the GPU's memory is its own
        return REFERENCE.process_gb * ranks
    hw = HardwareSpec.cpu(1e6, 2)
    p = search(cfg, hw, 1e6, None, None, "tests", advise=False, gpus=ranks)
    return (hw.process_gb + p.memory.gpu.total / 1e9) * ranks


# ---- budgets that spill -----------------------------------------------------------------------------
# deep enough that the Adam moments outweigh the staging ring (4 slots x 2 kinds of the widest unit):
# below that, spilling would cost more host memory than it saves, and the runtime keeps all in RAM
DEEP = ["model.num_hidden_layers=12"]


def budget_for(cfg, keep=(Kind.MASTER, Kind.GRAD), run=None) -> float:
    """Host GB that holds exactly the kinds in `keep` and the staging ring, costed as the runtime does
    (whole pages), beside the process and the device's working set (beside_gb) of the config that runs (`run`,
    default `cfg`)."""
    from tiertrain.trainer import Trainer

    tr = Trainer(cfg)
    cost = host_cost
    width = max(lay.numel for lay in tr.layouts)
    gb = (
        sum(cost(lay.numel * 4) for lay in tr.layouts for _ in keep) + RING_SLOTS * 2 * cost(width * 4)
    ) / 1e9
    tr.close()
    return gb + beside_gb(run or cfg)


def least_budget(cfg) -> float:
    """Host GB with every slab on NVMe: the staging ring, and a kilobyte, beside the process (beside_gb)."""
    from tiertrain.trainer import Trainer

    tr = Trainer(cfg)
    gb = least_host([lay.numel for lay in tr.layouts], tr.kind_bytes(), 0, host_cost) / 1e9 + 1e-6
    tr.close()
    return gb + beside_gb(cfg)


# ---- checkpoints ------------------------------------------------------------------------------------
def state_of(path):
    g = zarr.open_group(path, mode="r")
    return {
        f"{k.value}/{u}": g[k.value][str(u)][:] for k in ckpt.KINDS for u in range(len(g.attrs["numels"]))
    }


def same_run(a, b):
    ra, rb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [r["step"] for r in rb] == list(range(1, 9))  # metrics.jsonl goes on where it stopped
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    assert [r["grad_norm"] for r in ra] == [r["grad_norm"] for r in rb]
    sa, sb = state_of(a / "checkpoints" / "step_8"), state_of(b / "checkpoints" / "step_8")
    for k in sa:  # master weights and both Adam moments
        assert np.array_equal(sa[k], sb[k]), k


def stale_store(parent: Path, run: Path, name: str) -> Path:
    """A scratch store of `run` left by a process that is gone."""
    d = parent / name
    d.mkdir(parents=True)
    (d / "tiertrain-scratch.json").write_text(
        json.dumps(
            {
                "format": "tiertrain-nvme/1",
                "run": str(run.resolve()),
                "host": os.uname().nodename,
                "pid": 2**22 + 7,
            }
        )
    )
    (d / "checkpoints").mkdir()
    return d


# ---- tiny Hugging Face models ----------------------------------------------------------------------
COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
CASES = {
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama2": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1e6, head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=1e6)),
    # a window shorter than the rows (train.seq_len 32): each query sees itself and the 11 keys before it
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=1e6, sliding_window=12)),
    "qwen3-yarn": (  # YaRN scales cos and sin by its attention factor (1.139 at x4)
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(rope_theta=1e6, head_dim=32, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
    ),
    # q, k, v and o biases; a linear rope, transformers' "swish" (its SiLU)
    "llama-bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=1e4,
            attention_bias=True,
            hidden_act="swish",
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "qwen3-bias": (  # a dynamic rope: the default within max_position_embeddings
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            rope_theta=1e6,
            attention_bias=True,
            head_dim=32,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        ),
    ),
    # token 5 is about 1% of write_tokens' data: nn.Embedding(padding_idx=5) gives its row no gradient
    "llama-pad": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_theta=1e4, pad_token_id=5, tie_word_embeddings=True),
    ),
}


def hf_dir(case: str, path, shard: str | None = None):
    """A random transformers model saved as safetensors (sharded when `shard` is a size)."""
    transformers = pytest.importorskip("transformers")
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**COMMON, **extra)).float()
    with torch.no_grad():  # transformers inits norms to one and biases to zero: randomize so they are tested
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return hf


# ---- conversations ----------------------------------------------------------------------------------
def chat_example():
    """examples/tiny_chat_model.py as a module: the README's tiny chat model, its tokenizer and templates."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_chat_model", ROOT / "examples" / "tiny_chat_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def chat_tokenizer_dir(path: Path, template: str) -> Path:
    """A model directory holding only a chat tokenizer (the example's byte-level BPE) with `template`."""
    pytest.importorskip("transformers")
    ex = chat_example()
    ex.chat_tokenizer(ex.conversation_texts(), template).save_pretrained(path)
    return path
