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


@pytest.mark.parametrize("mode", ["norm", "plain", "gpt_oss"])
@pytest.mark.parametrize(
    "tokens,experts,k,probs",
    [(8192, 128, 8, True), (333, 60, 4, False), (77, 8, 1, True), (100, 60, 3, True), (0, 32, 4, True)],
)
def test_the_router_kernel_routes_as_torchs_ops(mode, tokens, experts, k, probs):
    """model/router_kernel.py against moe._route under autograd, from bf16 logits with many equal values: the
    same chosen sets (equal values in index order), the weights and the softmax to fp32's rounding, and the
    logits' gradient from the weights' and the softmax's; a rerun gives the same bits."""
    from tiertrain.model import moe, router_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(tokens, experts, generator=g, device="cuda") * 2).bfloat16()
    dw = torch.randn(tokens, k, generator=g, device="cuda")
    # the load-balancing loss's gradient of the softmax comes as its column sums' gradient, expanded
    dp = (torch.randn(experts, generator=g, device="cuda") * 0.1).expand(tokens, experts)
    args = (k, mode == "gpt_oss", mode == "norm", probs)

    def run(fn, by=None):
        """fn's outputs and the logits' gradient; `by`: the chosen experts dw's slots stand for (None: fn's)."""
        x = logits.clone().requires_grad_()
        w, c, p = fn(x, *args)
        d = dw if by is None else dw.gather(1, (c[:, :, None] == by[:, None, :]).float().argmax(-1))
        outs = [w] + ([p] if probs else [])
        grads = [d] + ([dp] if probs else [])
        return w, c, p, torch.autograd.grad(outs, x, grads)[0]

    w1, c1, p1, g1 = run(router_kernel.route)
    # where equal values sit in other slots, each expert's weight gets the same gradient
    w0, c0, p0, g0 = run(moe._route, by=c1)
    v = logits.float() if mode == "gpt_oss" else torch.softmax(logits.float(), dim=-1)
    stable = torch.sort(v, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(c1, stable) and torch.equal(c1.sort(1).values, c0.sort(1).values)
    # slots of equal values may hold them in another order: compare by expert
    w0 = w0.gather(1, (c1[:, :, None] == c0[:, None, :]).float().argmax(-1))
    torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-7)
    assert (p1 is None) == (p0 is None) == (not probs)
    if probs:
        torch.testing.assert_close(p1, p0, rtol=1e-5, atol=1e-7)
    assert g1.dtype == torch.bfloat16
    torch.testing.assert_close(g1.float(), g0.float(), rtol=1e-2, atol=1e-4)
    again = run(router_kernel.route)
    assert all(torch.equal(a, b) for a, b in zip((w1, c1, g1), (again[0], again[1], again[3])))
    assert not probs or torch.equal(p1, again[2])


def test_a_nan_logit_routes_to_distinct_experts_that_exist():
    """A router row with a NaN (a diverging run): torch's top k takes NaN as the largest value, so the kernel's k
    picks stay distinct experts below E (60: the softmax's padding columns must never be picked), and the weights
    are NaN as torch's, so the run's loss says it diverged rather than an index out of range."""
    from tiertrain.model import moe, router_kernel

    logits = torch.randn(64, 60, device="cuda").bfloat16()
    logits[5, 7] = float("nan")
    for gpt_oss in (False, True):
        w, c, _ = router_kernel.route(logits, 4, gpt_oss, True, False)
        assert ((c >= 0) & (c < 60)).all() and all(len(set(r.tolist())) == 4 for r in c)
        ref = moe._route(logits, 4, gpt_oss, True, False)
        assert torch.equal(w[5].isnan(), ref[0][5].isnan()) and w[5].isnan().all()
        assert torch.equal(
            c[torch.arange(64) != 5].sort(1).values, ref[1][torch.arange(64) != 5].sort(1).values
        )


@pytest.mark.parametrize(
    "tokens,experts,k",
    [
        (8192, 128, 8),
        (16_384, 128, 8),
        (65_536, 128, 8),
        (16_385, 100, 4),
        (333, 60, 4),
        (5, 8, 2),
        (0, 8, 2),
        (64, 256, 1),
    ],
)
def test_the_pairs_sort_gives_the_argsorts_bits(tokens, experts, k):
    """The counting sort of the pairs by expert, each token's places and each expert's count: the bits of moe's
    torch ops (a stable argsort), in one block of pairs and in many, up to the largest blocks it takes (8,192
    pairs at 65,536 tokens of 8); again on a rerun."""
    from tiertrain.model import moe, route_kernels

    g = torch.Generator(device="cuda").manual_seed(0)
    chosen = torch.rand(tokens, experts, generator=g, device="cuda").topk(k, dim=-1).indices
    skewed = (
        torch.arange(k, device="cuda").flip(0).expand(tokens, k)
    )  # every token the same k, most experts idle
    for c in (chosen, skewed):
        assert route_kernels.sorts(c, experts)
        got, want = route_kernels.pairs(c, experts), moe._pairs(c, experts)
        for name, x, y in zip(("order", "pos", "src", "per", "ends"), got, want, strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        assert all(torch.equal(x, y) for x, y in zip(route_kernels.pairs(c, experts), got))


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
    same chosen sets, the routing weights to fp32's rounding (the router kernel's exp and sums are its own), and
    the experts' output and gradients to bf16's."""
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
    assert torch.equal(c1.sort(1).values, c0.sort(1).values)
    torch.testing.assert_close(w1.sort(1).values, w0.sort(1).values, rtol=1e-5, atol=1e-7)
    # the weights' last bits move roundings of the bf16 rows they scale
    for a, b in zip((y1, *g1), (y0, *g0)):
        assert (a is None) == (b is None)
        if a is not None:
            a, b = a.detach().float(), b.detach().float()
            assert float((a - b).norm() / b.norm()) < 2e-3
