"""model/route_kernels.py on a GPU against the torch ops model/moe.py runs elsewhere: the same bits."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,width", [(65_538, 2048), (333, 2880), (0, 64)])
def test_the_gather_gives_index_selects_bits(dtype, n, width):
    """Rows gathered and cast to bf16 (the forward's h, the backward's fp32 gradient): index_select's bits, at a
    width that is and one that is not a multiple of the column block, a row count that is not one of the rows a
    program takes."""
    from tiertrain.model import route_kernels

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, width, generator=g, device="cuda").to(dtype)
    idx = torch.randint(0, 4096, (n,), generator=g, device="cuda")
    got = route_kernels.gather(x, idx, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, x.to(torch.bfloat16).index_select(0, idx))


@pytest.mark.parametrize("tokens,experts,k", [(8192, 128, 8), (333, 60, 4), (77, 8, 2), (0, 32, 4)])
def test_the_top_k_gives_torchs_values_and_set_ties_by_index(tokens, experts, k):
    """The router's top k: torch.topk's values (bits) and chosen set in every row, equal values in the order of
    their indices (a stable sort's), on probabilities with many ties (rounded to bf16 first); its gradient is
    torch.topk's."""
    from tiertrain.model import route_kernels

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(tokens, experts, generator=g, device="cuda").bfloat16().float()
    x = torch.softmax(logits, dim=-1).requires_grad_()
    values, indices = route_kernels.topk(x, k)
    want = torch.topk(x, k, dim=-1)
    assert torch.equal(values, want.values)
    assert torch.equal(indices.sort(1).values, want.indices.sort(1).values)
    stable = torch.sort(x.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(indices, stable)
    dv = torch.randn(tokens, k, generator=g, device="cuda")
    (got,) = torch.autograd.grad(values, x, dv)
    (ref,) = torch.autograd.grad(
        torch.topk(x, k, dim=-1).values, x, dv.gather(1, _places(want.indices, indices))
    )
    assert torch.equal(got, ref)


def _places(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """For each row, where each of a's entries stands in b (the same set)."""
    return (a[:, :, None] == b[:, None, :]).float().argmax(-1)


@pytest.mark.parametrize(
    "tokens,experts,k", [(8192, 128, 8), (16_384, 128, 8), (333, 60, 4), (5, 8, 2), (0, 8, 2), (64, 256, 1)]
)
def test_the_pairs_sort_gives_the_argsorts_bits(tokens, experts, k):
    """The counting sort of the pairs by expert, each token's places and each expert's count: the bits of moe's
    torch ops (a stable argsort), in one block of pairs and in many; again on a rerun."""
    from tiertrain.model import moe, route_kernels

    g = torch.Generator(device="cuda").manual_seed(0)
    chosen = torch.rand(tokens, experts, generator=g, device="cuda").topk(k, dim=-1).indices
    assert route_kernels.sorts(chosen, experts)
    got, want = route_kernels.pairs(chosen, experts), moe._pairs(chosen, experts)
    for name, x, y in zip(("order", "pos", "src", "per", "ends"), got, want, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert all(torch.equal(x, y) for x, y in zip(route_kernels.pairs(chosen, experts), got))


def test_what_the_pairs_sort_takes():
    """More experts than its table holds, or more pairs than its blocks, stay with torch's ops."""
    from tiertrain.model import route_kernels as rk

    few = torch.zeros(8, 8, dtype=torch.int64)
    assert rk.sorts(few, rk.MAX_EXPERTS) and not rk.sorts(few, rk.MAX_EXPERTS + 1)
    many = torch.zeros(rk.MAX_BLOCKS * rk.MAX_BLOCK // 8 + 1, 8, dtype=torch.int64)
    assert not rk.sorts(many, 128)


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_routing_with_the_kernels_chooses_and_weights_as_torchs_ops(case, monkeypatch):
    """moe.route and the experts' pass with the route kernels and without (the rest as it runs on a GPU): the
    same chosen sets and routing weights. Where a token's weights tie, the two top k's may put the tied experts
    in other slots (torch's order among equal values is not fixed), and sums over the slots (the weights'
    normalization's gradient, gpt-oss's down-projection biases) add them in another order: the output and
    gradients agree to the rounding; qwen's output, which sums over no slot, to the bit."""
    from tiertrain.model import llama, moe, route_kernels
    from tiertrain.model.spec import ModelSpec

    spec = ModelSpec(
        hidden_size=256, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=8,
        model_type=case, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
    )  # fmt: skip
    dev, dt = torch.device("cuda"), torch.bfloat16
    ctx = llama.Context.build(spec, 8, dt, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    router = "mlp.router" if case == "gpt_oss" else "mlp.gate"
    gu, e, h = spec.moe_intermediate_size * 2, 32, 256
    w = {
        f"{router}.weight": torch.randn(e, h, device=dev, dtype=dt, generator=g) * 0.05,
        "mlp.experts.gate_up_proj": torch.randn(e, gu, h, device=dev, dtype=dt, generator=g) * 0.05,
        "mlp.experts.down_proj": torch.randn(e, h, gu // 2, device=dev, dtype=dt, generator=g) * 0.05,
    }
    if case == "gpt_oss":  # its layout: (in, out), biases
        w["mlp.experts.gate_up_proj"] = w["mlp.experts.gate_up_proj"].transpose(1, 2).contiguous()
        w["mlp.experts.down_proj"] = w["mlp.experts.down_proj"].transpose(1, 2).contiguous()
        w["mlp.router.bias"] = torch.randn(e, device=dev, dtype=dt, generator=g) * 0.05
        w["mlp.experts.gate_up_proj_bias"] = torch.randn(e, gu, device=dev, dtype=dt, generator=g) * 0.05
        w["mlp.experts.down_proj_bias"] = torch.randn(e, h, device=dev, dtype=dt, generator=g) * 0.05
    w = {n: v.requires_grad_() for n, v in w.items()}
    x = torch.randn(2048, h, device=dev, dtype=dt, generator=g)
    dy = torch.randn(2048, h, device=dev, generator=g)

    def run():
        hx = x.clone().requires_grad_()
        chosen, weights = moe.route(w, hx, ctx)
        y = moe.experts(w, hx, ctx)
        return chosen, weights, y, torch.autograd.grad(y, [hx, *w.values()], dy, allow_unused=True)

    with_kernels = run()
    monkeypatch.setattr(route_kernels, "MAX_EXPERTS", 0)  # moe keeps torch's ops
    without = run()
    (c1, w1, y1, g1), (c0, w0, y0, g0) = with_kernels, without
    assert torch.equal(c1.sort(1).values, c0.sort(1).values) and torch.equal(w1, w0)
    assert torch.equal(y1, y0) or case == "gpt_oss"
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g0):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3)
