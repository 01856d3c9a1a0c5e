"""The model's Triton kernels (model/kernels.py): where they run, the eager op where one fails to build, and RoPE's
kernel against its eager ops (the experts' kernels are tested in test_moe.py)."""

import pytest
import torch


def test_the_kernels_run_on_a_gpu_with_triton(monkeypatch):
    """The Triton kernels (activation, slot sums, RoPE) on a GPU with triton, deterministic runs included (fixed
    tiles, sums in a fixed order); elsewhere eager."""
    from types import SimpleNamespace

    from tiertrain.model import kernels

    gpu = SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(kernels, "has_triton", lambda: True)
    assert kernels.on(gpu) and not kernels.on(torch.zeros(1))
    monkeypatch.setattr(kernels, "ENABLED", False)
    assert not kernels.on(gpu)
    monkeypatch.setattr(kernels, "ENABLED", True)
    monkeypatch.setattr(kernels, "has_triton", lambda: False)
    assert not kernels.on(gpu)


@pytest.mark.parametrize("kernel", ["activation", "slot_sum", "rope"])
def test_a_kernel_that_fails_to_build_leaves_its_op_eager(kernel, monkeypatch):
    """A Triton kernel's first call failing (no ptxas, no triton) warns once and leaves that op eager from then
    on: the eager op's value, and no second try."""
    from types import SimpleNamespace

    from tiertrain.model import glu, kernels, llama, moe, rope, slot_sum

    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no ptxas for this GPU")

    monkeypatch.setattr(kernels, "_BUILT", {})
    if kernel == "rope":
        monkeypatch.setattr(rope, "apply", broken)
        x, cos, sin = torch.randn(2, 5, 3, 8).bfloat16(), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
        eager, want = llama._rope_eager, llama._rope_eager(x, cos, sin)
        monkeypatch.setattr(kernels, "on", lambda x: True)
        run = lambda: llama._rope(x, cos, sin)  # noqa: E731
    elif kernel == "slot_sum":
        monkeypatch.setattr(slot_sum, "add_slots", broken)
        y, pos = torch.randn(12, 5), torch.randperm(12).view(4, 3).sort(dim=1).values
        eager, want = moe._add_slots, moe._add_slots(None, y, pos, 0, torch.float32)
        run = lambda: moe.add_slots(True, None, y, pos, 0, torch.float32)  # noqa: E731
    else:
        monkeypatch.setattr(glu, "activation", broken)
        y, ws = torch.randn(6, 8), torch.rand(6, 1)
        spec = SimpleNamespace(model_type="qwen3_moe", swiglu_limit=7.0, swiglu_alpha=1.702)
        eager, want = moe._glu, moe._glu(y, ws, False, 7.0, 1.702)
        run = lambda: moe._act(True, y, ws, spec)  # noqa: E731
    with pytest.warns(UserWarning, match="no ptxas"):
        out = run()
    assert torch.equal(out, want) and torch.equal(run(), out)
    assert len(calls) == 1 and kernels._BUILT[eager] is eager


@pytest.mark.gpu
@pytest.mark.parametrize("heads,hd", [(32, 128), (8, 128), (5, 64), (3, 80)])
@pytest.mark.parametrize("tables", ["positions", "segments"])
def test_the_rope_kernel_gives_the_eager_bits_both_ways(heads, hd, tables):
    """model/rope.py against llama._rope_eager in bf16: the same bits forward and backward, with the tables of
    plain positions (broadcast over the rows) and of packed segments (a row's own, a strided view as docs.rope
    gives them), head counts and head sizes that are and are not powers of two, a non-contiguous gradient."""
    from tiertrain.model import llama, rope

    g = torch.Generator(device="cuda").manual_seed(0)
    b, t, span = 2, 300, 512
    x = torch.randn(b, t, heads, hd, generator=g, device="cuda").bfloat16()
    ang = torch.rand(b, 1, span, hd, generator=g, device="cuda") * 6.3
    if tables == "positions":
        cos, sin = ang[0, 0, 7 : 7 + t].cos()[:, None], ang[0, 0, 7 : 7 + t].sin()[:, None]
    else:  # (B, 1, S, hd)[..., start:start + t, :] transposed to (B, t, 1, hd)
        cos, sin = (f(ang)[:, :, 7 : 7 + t].transpose(1, 2) for f in (torch.cos, torch.sin))
    grad = torch.randn(b, heads, t, hd, generator=g, device="cuda").bfloat16().transpose(1, 2)

    def run(fn):
        x_ = x.clone().requires_grad_()
        y = fn(x_, cos, sin)
        return y, torch.autograd.grad(y, x_, grad)[0]

    (y, dx), (y0, dx0) = run(rope.apply), run(llama._rope_eager)
    assert torch.equal(y, y0) and torch.equal(dx, dx0)
    x[0, 3, 0, 5] = float("nan")  # a NaN stays one where the eager ops make one
    (y, dx), (y0, dx0) = run(rope.apply), run(llama._rope_eager)
    assert torch.equal(y.isnan(), y0.isnan()) and y.isnan().any()
    assert torch.equal(y.nan_to_num(), y0.nan_to_num())
