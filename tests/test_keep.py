"""Kept activations (train.keep_activations): a block's backward pass through the graph its forward pass kept
gives the same bits as recomputing it from its checkpoint; the planner prices the graph exactly."""

from __future__ import annotations

import pytest
import torch

from conftest import VARIANTS, tiny_config
from tiertrain.config import load_config
from tiertrain.errors import ConfigError
from tiertrain.model import llama
from tiertrain.model.spec import ModelSpec
from tiertrain.plan.attention import kv_graph, rates
from tiertrain.plan.hardware import REFERENCE
from tiertrain.plan.planner import plan
from tiertrain.plan.resolve import resolve
from tiertrain.plan.values import Budgets, Choice, Job
from tiertrain.plan.workset import kept_bytes_per_token
from tiertrain.trainer import Trainer


def _saved_bytes(spec: ModelSpec, dtype: torch.dtype, t: int, device: str, kernel="", det=False) -> int:
    """What llama.block's autograd graph saves for one sequence of t tokens, weights aside."""
    ctx = llama.Context.build(spec, t, dtype, torch.device(device), attention=kernel, deterministic=det)
    w = {
        x.name: torch.randn(x.shape, dtype=dtype, device=device).requires_grad_()
        for x in spec.units()[1].tensors
    }
    weights = {v.untyped_storage().data_ptr() for v in w.values()}
    seen = {}

    def pack(x):
        if x.untyped_storage().data_ptr() not in weights:
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p):
        llama.block(w, torch.randn(1, t, spec.hidden_size, device=device).requires_grad_(), ctx)
    return sum(seen.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(256, 512, 4, 4), (256, 1024, 4, 2), (512, 768, 8, 8)])
@pytest.mark.parametrize("attention", ["", "deterministic", "efficient", "math"])
def test_the_plan_prices_a_kept_block_as_its_graph_saves(dtype, shape, device, attention):
    """Each kernel's graph as plan.attention.kv_graph says a GPU's holds it: K and V as they are, repeated for every
    query head, or with the math kernel's softmax weights (length squared: a forced keep with fp32 GQA)."""
    H, FF, heads, kv = shape
    spec = ModelSpec(
        hidden_size=H,
        intermediate_size=FF,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=2,
        vocab_size=256,
        max_position_embeddings=512,
    )
    kernel, det = ("", True) if attention == "deterministic" else (attention, False)
    if device == "cpu" and attention in ("deterministic", "efficient"):
        pytest.skip("a CPU runs torch's choice: no deterministic path, no efficient kernel")
    dt = getattr(torch, dtype)
    # constants aside: a sequence of 512 tokens against one of 256
    a, b = (_saved_bytes(spec, dt, t, device, kernel, det) for t in (256, 512))
    # a CPU's choice is its flash kernel, which takes GQA as it is, in fp32 too
    how = kv_graph(kernel, det, dtype, spec) if device == "cuda" or kernel else "native"
    # the plan prices a GPU's graph: on a CPU the composite RMSNorm also saves each norm's x * scale (fp32)
    composite = 8 * H if device == "cpu" else 0
    assert (
        b - a
        == 512 * kept_bytes_per_token(spec, dtype, how, 512)
        - 256 * kept_bytes_per_token(spec, dtype, how, 256)
        + 256 * composite
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(
    "sets",
    [
        ["train.keep_activations=3"],
        ["train.keep_activations=2"],
        ["train.keep_activations=1", 'tiers.activations="host"'],
        ["train.keep_activations=3", 'train.compute_dtype="bfloat16"'],
        ["train.keep_activations=2", 'tiers.activation_dtype="bfloat16"'],
        pytest.param(
            [
                "train.keep_activations=2",
                'train.device="cuda"',
                'train.compute_dtype="bfloat16"',
                'tiers.activations="host"',
                'tiers.stream="master"',
                "tiers.gpu_update_units=1",
                "tiers.gpu_resident_gb=0.0005",
            ],
            marks=pytest.mark.gpu,
        ),
    ],
    ids=["all", "last-two", "host-checkpoints", "bf16", "bf16-checkpoints", "cuda"],
)
def test_kept_activations_give_the_bits_of_recompute(token_file, variant, sets):
    base = [*VARIANTS[variant], "train.steps=4", *[s for s in sets if "keep_activations" not in s]]
    runs = {}
    for keep in ("0", sets[0].split("=")[1]):
        tr = Trainer(tiny_config(token_file, *base, f"train.keep_activations={keep}"))
        assert len(tr.run_plan.kept()) == int(keep) and tr.run.step.kept == tr.run_plan.kept()
        losses = [tr.train_step()["loss"] for _ in range(4)]
        runs[keep] = losses, tr.state_dict()
        tr.close()
    (la, wa), (lb, wb) = runs.values()
    assert la == lb
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_the_plan_keeps_what_the_gpu_holds_and_refuses_more():
    cfg = load_config(
        "llama-3b", ["train.batch_size=4", "train.micro_batch_size=4", "tiers.gpu_resident_gb=0"]
    )
    spec, job = cfg.model, Job(cfg.model, 4, 2048)
    roomy = plan(job, Budgets(host_gb=200, gpu_gb=141), REFERENCE)
    none = plan(job, Budgets(host_gb=200, gpu_gb=141), REFERENCE, Choice(keep=0))
    tight = plan(job, Budgets(host_gb=200, gpu_gb=30), REFERENCE)
    assert roomy.memory.kept == spec.num_hidden_layers and 0 < tight.memory.kept < spec.num_hidden_layers
    assert tight.memory.gpu.total <= 30e9 * 0.95 and roomy.prediction.step_s < none.prediction.step_s
    # kept: the backward pass skips the blocks' forward pass, a third of their matmuls and their attention's forward
    # (at its kernel's rate: plan.attention.rates)
    A = spec.attention_flops_per_token(2048)
    M, L = spec.flops_per_token(2048) - A, spec.num_hidden_layers
    rate = REFERENCE.bf16_tflops * 1e12 * REFERENCE.compute_efficiency
    fa, _ = rates(roomy.run_plan.attention, spec.hd, False, "bfloat16", REFERENCE)
    skipped = 4 * 2048 * ((M - 6 * spec.vocab_size * spec.hidden_size) / 3 / rate + A / 3 / fa)
    assert roomy.prediction.times["compute bwd"] == pytest.approx(
        none.prediction.times["compute bwd"] - skipped * roomy.memory.kept / L, rel=1e-9
    )
    flags = [not u.recompute for u in tight.run_plan.units]  # the last blocks, the head not among them
    assert flags == [False] * (spec.num_hidden_layers + 1 - tight.memory.kept) + [
        True
    ] * tight.memory.kept + [False]
    with pytest.raises(ConfigError, match="lower train.keep_activations"):
        resolve(
            load_config("llama-3b", ["train.keep_activations=26", 'train.device="cuda"']),
            REFERENCE.__class__(**{**REFERENCE.__dict__, "gpu_mem_gb": 30}),
        )
