from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from tiertrain.modes import Kind
from tiertrain.optim.adamw import clip_coefficient, lr_at
from tiertrain.sections import OptimConfig


def test_schedules_by_hand():
    c = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=4, min_lr=0.1)
    assert [lr_at(k, c, 14) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, c, 14) == 1.0
    assert lr_at(14, c, 14) == pytest.approx(0.1)  # min_lr: the step after the last's
    assert lr_at(13, c, 14) > 0.1  # so the last step updates too
    assert lr_at(4 + 10 / 2, c, 14) == pytest.approx(0.55)  # halfway: the mean of lr and min_lr
    c = OptimConfig(lr=0.5, schedule="constant", warmup_steps=0)
    assert {lr_at(k, c, 10) for k in range(10)} == {0.5}


def test_the_cosine_is_transformers_after_the_warmup():
    """After the warmup, the cosine to 0 is transformers' get_cosine_schedule_with_warmup's, step for step (its
    warmup starts at 0, a step that does not move; this one's at lr / W)."""
    transformers = pytest.importorskip("transformers")
    for warmup, steps in ((0, 10), (3, 12), (0, 1)):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=2e-3)
        sched = transformers.get_cosine_schedule_with_warmup(opt, warmup, steps)
        want = []
        for _ in range(steps):
            want.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        c = OptimConfig(lr=2e-3, schedule="cosine", warmup_steps=warmup, min_lr=0.0)
        got = [lr_at(k, c, steps) for k in range(steps)]
        assert got[warmup:] == pytest.approx(want[warmup:], rel=1e-12, abs=0) and min(got) > 0


def test_clip_like_torch():
    grads = [torch.randn(5, 3), torch.randn(7)]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(params, 0.5)
    norm, coef = clip_coefficient([torch.linalg.vector_norm(g) for g in grads], 0.5)
    assert norm == pytest.approx(float(want), rel=1e-6)
    for p, g in zip(params, grads):
        torch.testing.assert_close(g * coef, p.grad)
    assert clip_coefficient([torch.tensor(0.1)], 1.0)[1] == 1.0
    assert clip_coefficient([torch.tensor(5.0)], 0.0) == (5.0, 1.0)  # 0 = off


def test_diverged_training_stops_with_a_message():
    from tiertrain.errors import UserError

    with pytest.raises(UserError, match="diverged.*optim.lr"):
        clip_coefficient([torch.tensor(math.inf)], 1.0)


def _kernel():
    from tiertrain.optim import kernel

    ext = kernel.load()
    if ext is None:
        pytest.skip(f"the one-pass host AdamW did not build here: {kernel.reason()}")
    return ext


@pytest.mark.parametrize("scale", [0.0, 3.0])
# which outputs take streamed stores (kernel.STREAM_*), and a prefetch (16 blocks: the runtime's; 4096: past the end)
@pytest.mark.parametrize("stores", [0, 1, 2, 3, 3 | 16 << 8, 4096 << 8])
@pytest.mark.parametrize("offset,w_offset", [(0, 0), (3, 3), (0, 5)])  # elements off their cache lines
def test_one_pass_kernel_in_place_and_into_copies(scale, stores, offset, w_offset):
    """tiertrain's host AdamW kernel, with and without streamed stores and however its outputs sit in
    their cache lines: into other buffers it leaves the state as it was and writes the bits it writes in
    place; both are torch's fused AdamW to within rounding, the bf16 copy its rounding."""
    ext = _kernel()
    n = (1 << 20) + 77  # a tail after the streamed blocks
    g0 = torch.Generator().manual_seed(1)
    p, g, m, v = (torch.randn(n, generator=g0) for _ in range(4))
    v = v.abs()
    args = (1e-3, 0.9, 0.95, 0.1, 1e-8, 7.0, scale, stores)
    want = [t.clone() for t in (p, m, v)]
    torch._fused_adamw_(
        [want[0]],
        [g.clone()],
        [want[1]],
        [want[2]],
        [],
        [torch.tensor(7.0)],
        lr=1e-3,
        beta1=0.9,
        beta2=0.95,
        weight_decay=0.1,
        eps=1e-8,
        amsgrad=False,
        maximize=False,
        grad_scale=torch.tensor(scale) if scale else None,
    )
    inplace = [t.clone() for t in (p, m, v)]
    w_in = torch.empty(n + w_offset, dtype=torch.bfloat16)[w_offset:]
    ext.adamw(inplace[0], g, inplace[1], inplace[2], *inplace, w_in, *args)
    state = [t.clone() for t in (p, m, v)]
    outs = [torch.empty(n + offset)[offset:] for _ in range(3)]
    w = torch.empty(n + w_offset, dtype=torch.bfloat16)[w_offset:]
    ext.adamw(state[0], g, state[1], state[2], *outs, w, *args)
    assert torch.equal(w_in, inplace[0].to(torch.bfloat16))  # the copy rounded as torch rounds
    assert torch.equal(w, outs[0].to(torch.bfloat16))
    for a, b, s, s0, w in zip(inplace, outs, state, (p, m, v), want):
        assert torch.equal(a, b)
        assert torch.equal(s, s0)
        torch.testing.assert_close(a, w, rtol=2e-6, atol=1e-6)
    assert not torch.equal(inplace[0], p)
    alone = [t.clone() for t in (p, m, v)]  # no copy to write
    ext.adamw(alone[0], g, alone[1], alone[2], *alone, torch.empty(0, dtype=torch.bfloat16), *args)
    assert all(torch.equal(a, b) for a, b in zip(alone, inplace))
    plain = [t.clone() for t in (p, m, v)]  # neither streamed stores nor prefetch change a bit
    ext.adamw(plain[0], g, plain[1], plain[2], *plain, torch.empty(0, dtype=torch.bfloat16), *args[:-1], 0)
    assert all(torch.equal(a, b) for a, b in zip(plain, inplace))


def test_host_kernels_agree_and_copies_match_in_place():
    """HostAdamW with either kernel: an update into copies leaves the state as it was and, swapped in,
    is the in-place update bit for bit; the two kernels agree to within rounding."""
    from tiertrain.optim.adamw import HostAdamW
    from tiertrain.tiers.host import HostStore
    from tiertrain.tiers.slab import SlabLayout

    _kernel()
    lay = SlabLayout.build([("w", (300, 70)), ("b", (70,))])
    kinds = (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ)
    out = {}
    for name in ("tiertrain", "torch"):
        for copies in (False, True):
            host = HostStore([lay], torch.bfloat16, pin=False, compute_copy=True)
            gen = torch.Generator().manual_seed(0)
            for k in (Kind.MASTER, Kind.GRAD, Kind.EXP_AVG, Kind.EXP_AVG_SQ):
                host.slab(0, k).copy_(torch.rand(lay.numel, generator=gen))
            before = {k: host.slab(0, k).clone() for k in kinds}
            if copies:
                host.add_copies([0])
            opt = HostAdamW(host, [lay], OptimConfig(host_kernel=name))
            assert (opt.kernel is not None) == (name == "tiertrain")
            opt.update_unit(0, 3, 1e-2, 1.0, into_copies=copies)
            if copies:
                assert all(torch.equal(host.slab(0, k), before[k]) for k in kinds)
                host.swap(0)
            out[name, copies] = {k: host.slab(0, k).clone() for k in kinds}
            assert torch.equal(host.slab(0, Kind.WEIGHTS), out[name, copies][Kind.MASTER].to(torch.bfloat16))
            assert not torch.equal(out[name, copies][Kind.MASTER], before[Kind.MASTER])
    for k in kinds:
        for name in ("tiertrain", "torch"):
            assert torch.equal(out[name, True][k], out[name, False][k]), (name, k)
        torch.testing.assert_close(out["tiertrain", False][k], out["torch", False][k], rtol=2e-6, atol=1e-7)


def test_host_kernel_option_is_checked():
    from tiertrain.errors import ConfigError

    with pytest.raises(ConfigError, match="host_kernel"):
        OptimConfig(host_kernel="fast").validate()


def test_a_killed_load_s_lock_is_removed_and_the_build_announced(tmp_path, monkeypatch, caplog):
    """torch's extension loader waits forever on a lock a killed load left (each load holds it about 9 ms, the
    cached kernel's too): a run started within ten minutes of such a kill hung without a word (kill review). Loads
    now hold an flock, which dies with its process: a lock file with none held goes at once; a load holding it
    makes the next one wait; a build that has not happened yet is announced."""
    import fcntl
    import logging
    import threading

    from tiertrain.optim import kernel

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    d = Path(_get_build_directory(kernel.NAME, verbose=False))
    (d / "lock").write_text("")  # as a load killed a moment ago left it
    with caplog.at_level(logging.WARNING, logger="tiertrain"):
        with kernel._build_lock():
            assert not (d / "lock").exists()
    assert "removing" in caplog.text and "building the one-pass host AdamW" in caplog.text
    holder = open(d / "tiertrain.flock", "a")  # another process's load, under way
    fcntl.flock(holder, fcntl.LOCK_EX)
    (d / "lock").write_text("")
    t = time.monotonic()  # before the timers start: their 0.5 s counts from here on
    threading.Timer(0.5, holder.close).start()  # it ends, its lock file gone with it
    threading.Timer(0.4, (d / "lock").unlink).start()
    with kernel._build_lock():
        assert time.monotonic() - t >= 0.5


def test_the_gradient_norm_is_exact_over_a_large_unit_on_a_cpu(token_file):
    """The reported norm (and clipping's) against the fp64 norm of the step's own gradients, with a unit of 4 M
    elements (the embedding): a CPU's fp32 sum over the whole slab drifted by 2e-5 there."""
    from conftest import tiny_config
    from tiertrain.trainer import Trainer

    tr = Trainer(tiny_config(token_file, "model.vocab_size=65536", "optim.grad_clip=0", "train.steps=1"))
    try:
        rec = tr.train_step()
        tr._quiesce()
        squares = 0.0
        for unit in tr.units:
            with tr.run.state.slab(unit.index, Kind.GRAD, read=True) as flat:
                squares += float(flat.double().square().sum())
        assert max(lay.numel for lay in tr.layouts) > 4e6
        assert rec["grad_norm"] == pytest.approx(math.sqrt(squares), rel=5e-7)  # fp32 unit norms summed
    finally:
        tr.close()
