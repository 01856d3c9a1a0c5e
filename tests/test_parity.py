"""tiertrain's layer-streaming step trains exactly like plain PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import VARIANTS, reference_train, tiny_config
from tiertrain.trainer import Trainer

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def assert_weights_close(ours: dict, ref: dict) -> None:
    """Final weights: the whole model within 1e-5 relative, every tensor within 1e-4.

    Why not 1e-5 per tensor: where a tensor's true gradient nearly vanishes (k_proj.bias: RoPE almost
    cancels it), Adam divides rounding noise by its own tiny scale, and float summation order alone
    moves that tensor by ~5e-5: the PyTorch reference differs from itself by that much when only its
    micro-batch split changes. A real error (a wrong term in a gradient) is orders above 1e-4.
    """
    names = [n for n in ref if n in ours]
    diff = torch.cat([(ours[n].float().cpu() - ref[n].float().cpu()).flatten() for n in names])
    whole = torch.cat([ref[n].float().cpu().flatten() for n in names])
    assert float(diff.norm() / whole.norm()) < 1e-5
    for n in names:
        assert _rel(ours[n], ref[n]) < 1e-4, (n, _rel(ours[n], ref[n]))


def _train(cfg):
    tr = Trainer(cfg)
    init = tr.state_dict()
    recs = [tr.train_step() for _ in range(cfg.train.steps)]
    return tr, init, recs


ON_DEVICE = {
    "llama-resident": ["tiers.gpu_resident_gb=0.004"],
    "llama-all-resident": ["tiers.gpu_resident_gb=1"],
    "llama-gpu-update": ['tiers.stream="master"', "tiers.gpu_update_units=3"],
    "qwen2-both": [*VARIANTS["qwen2"], "tiers.gpu_resident_gb=0.0005", "tiers.gpu_update_units=2"],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", sorted(VARIANTS) + sorted(ON_DEVICE))
def test_fp32_matches_pytorch(token_file, variant, device):
    """`llama-resident`: the first units' whole state on the device (tiers.gpu_resident_gb), updated
    there (on a GPU, by the CUDA fused AdamW), the rest streamed; `llama-all-resident`: every unit's
    (what tiers.gpu_resident_gb = -1 gives a model that fits the GPU). `llama-gpu-update`: the first three
    units' state stays on the host and is updated on the device as each unit's weights load.
    `qwen2-both`: the resident embedding, then two units updated on the device. The same training."""
    sets = VARIANTS[variant] if variant in VARIANTS else ON_DEVICE[variant]
    cfg = tiny_config(token_file, *sets, f'train.device="{device}"')
    tr, init, recs = _train(cfg)
    losses, norms, ref = reference_train(cfg, init, device, autocast=False)
    assert len(recs) >= 10
    # clipping really happened (else the test would not cover it) and the loss moved
    assert max(norms) > cfg.optim.grad_clip and recs[-1]["loss"] < recs[0]["loss"]
    np.testing.assert_allclose([r["loss"] for r in recs], losses, rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in recs], norms, rtol=1e-5)
    assert_weights_close(tr.state_dict(), ref.state_dict())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bf16_matches_autocast(token_file, variant, device):
    """bf16 compute against the same model under torch.autocast(bfloat16).

    Tolerances: bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3), and the two runs round at
    different places (tiertrain streams bf16-rounded weights, the embedding included, and accumulates
    the LM-head gradient per chunk), so they cannot agree bit for bit. The loss is a mean over 256
    tokens, so its rounding noise is far below 2e-3: we ask for 1e-3 relative. Weights after 12 Adam
    steps carry the noise Adam amplifies (a gradient near zero flips the sign of its update): there we
    ask that tiertrain's bf16 weights be no farther from the exact fp32 run than 3x the distance of
    PyTorch's own autocast run from it, per tensor. That bounds our error by bf16's inherent one.
    """
    cfg = tiny_config(
        token_file, *VARIANTS[variant], f'train.device="{device}"', 'train.compute_dtype="bfloat16"'
    )
    tr, init, recs = _train(cfg)
    auto_losses, _, auto = reference_train(cfg, init, device, autocast=True)
    _, _, exact = reference_train(cfg, init, device, autocast=False)
    np.testing.assert_allclose([r["loss"] for r in recs], auto_losses, rtol=1e-3)
    ours = tr.state_dict()
    for name, p in exact.state_dict().items():
        if name in ours:
            inherent = _rel(auto.state_dict()[name], p)
            assert _rel(ours[name], p) <= 3 * inherent + 1e-6, (name, _rel(ours[name], p), inherent)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("speculated", [False, True])
def test_gpu_updates_change_no_bit(token_file, device, speculated):
    """Units updated on the device give the same bits as the host AdamW on CPU (one kernel, elementwise),
    and bf16 weights cast from the same master, whether they update as they load or, speculated, in the
    backward pass; the bytes moved say where each update ran: 12 bytes per parameter more each way for each
    unit updated on the device (in as they load, the state replaces the master; speculated, the state
    comes in during the backward pass and the kept master streams like the host's)."""
    base = [
        'train.compute_dtype="bfloat16"',
        'tiers.stream="master"',
        f'train.device="{device}"',
        "train.steps=4",
        "optim.grad_clip=100",
        "optim.speculate_units=0",
        f"optim.speculate_gpu_updates={str(speculated).lower()}",
    ]
    runs = []
    for n in (0, 2, 5):
        tr, _, recs = _train(tiny_config(token_file, *base, f"tiers.gpu_update_units={n}"))
        assert tr.run_plan.updated("gpu", "gpu-speculated") == frozenset(
            range(5)[::-1][::2][:n] if speculated and n < 5 else range(n)
        )
        assert tr.run.updates.kept == (4 if speculated and n else 0)
        runs.append((tr, recs, tr.state_dict()))
    (_, r0, s0), (t2, r2, s2), (t5, r5, s5) = runs
    if device == "cpu":
        assert [r["loss"] for r in r2] == [r["loss"] for r in r0] == [r["loss"] for r in r5]
        assert all(torch.equal(s0[k], s2[k]) and torch.equal(s0[k], s5[k]) for k in s0)
    else:  # the CUDA kernel may fuse differently from the CPU one: the parity test bounds it
        np.testing.assert_allclose([r["loss"] for r in r5], [r["loss"] for r in r0], rtol=1e-4)
    numels = [lay.numel for lay in t2.layouts]
    for tr, recs in ((t2, r2), (t5, r5)):
        extra = sum(numels[u] for u in tr.run_plan.updated("gpu", "gpu-speculated")) * 4 / 1e9
        assert recs[-1]["h2d_gb"] == pytest.approx(r0[-1]["h2d_gb"] + 3 * extra, rel=1e-6)
        assert recs[-1]["d2h_gb"] == pytest.approx(r0[-1]["d2h_gb"] + 3 * extra, rel=1e-6)
        # no update before the first step's backward pass
        assert recs[0]["h2d_gb"] == pytest.approx(r0[0]["h2d_gb"] + 3 * extra * speculated)


def test_gpu_updates_need_the_master_streamed(token_file):
    from tiertrain.errors import ConfigError

    with pytest.raises(ConfigError, match='needs tiers.stream = "master"'):
        Trainer(
            tiny_config(
                token_file,
                'train.compute_dtype="bfloat16"',
                'tiers.stream="compute"',
                "tiers.gpu_update_units=1",
            )
        )


def test_micro_batching_does_not_change_the_step(token_file):
    """One optimizer step over 8 sequences is the same whether in 1, 2, 4 or 8 micro-batches."""
    finals = []
    for mb in (8, 4, 2, 1):
        tr, _, recs = _train(tiny_config(token_file, f"train.micro_batch_size={mb}", "train.steps=3"))
        finals.append((recs, tr.state_dict()))
    for recs, sd in finals[1:]:
        np.testing.assert_allclose([r["loss"] for r in recs], [r["loss"] for r in finals[0][0]], rtol=1e-5)
        assert_weights_close(sd, finals[0][1])


def test_loss_chunking_does_not_change_the_step(token_file):
    """The chunked cross-entropy equals the unchunked one."""
    results = []
    for chunk in ("auto", 7, 64):
        tr, _, recs = _train(tiny_config(token_file, f"train.loss_chunk_tokens={chunk}", "train.steps=2"))
        results.append(([r["loss"] for r in recs], tr.state_dict()))
    for losses, sd in results[1:]:
        np.testing.assert_allclose(losses, results[0][0], rtol=1e-6)
        assert_weights_close(sd, results[0][1])


def test_same_seed_same_run_other_seed_other_init(token_file):
    a, _, ra = _train(tiny_config(token_file, "train.steps=2"))
    b, _, rb = _train(tiny_config(token_file, "train.steps=2"))
    c, _, _ = _train(tiny_config(token_file, "train.steps=2", "train.seed=1"))
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])
