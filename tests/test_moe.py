"""Mixtures of experts (qwen3_moe, qwen2_moe, mixtral, gpt_oss): the templates, the training and the export
against transformers' own classes and torch.optim.AdamW, the load-balancing loss on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_cases import MOE, moe_model

from conftest import reference_train, tiny_config
from tiertrain.export import export_hf
from tiertrain.trainer import Trainer

transformers = pytest.importorskip("transformers")


def _load(path):
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m.config._attn_implementation = "eager"
    return m.eval()


class MoELoss(torch.nn.Module):
    """forward(inputs, targets): the micro-batch's summed token loss plus its load-balancing loss, scaled so
    that the reference loop's division by the batch's tokens gives transformers' loss per micro-batch."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, inp, tgt):
        out = self.hf(input_ids=inp, output_router_logits=True)
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), tgt.flatten(), reduction="sum")
        return ce + self.hf.config.router_aux_loss_coef * out.aux_loss * tgt.numel()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("case", sorted(MOE))
def test_training_matches_transformers_and_adamw(case, token_file, tmp_path):
    """Several steps with micro-batches, clipping and the aux loss: losses within 1e-5, weights within 1e-4."""
    moe_model(case).save_pretrained(tmp_path / "hf")
    cfg = tiny_config(token_file, f'train.init_from="{tmp_path / "hf"}"', "train.steps=4")
    tr = Trainer(cfg)
    got = [tr.train_step() for _ in range(cfg.train.steps)]
    tr.save_checkpoint(tmp_path / "run")
    tr.close()
    export_hf(str(tmp_path / "run"), str(tmp_path / "out"))
    ours = _load(tmp_path / "out")

    ref = _load(tmp_path / "hf").train()
    losses, norms, _ = reference_train(cfg, None, "cpu", autocast=False, model=MoELoss(ref))
    for a, b in zip([r["loss"] for r in got], losses):
        assert a == pytest.approx(b, rel=1e-5)
    for a, b in zip([r["grad_norm"] for r in got], norms):
        assert a == pytest.approx(b, rel=1e-5)
    want = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert _rel(p.detach(), want[name].detach()) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_grouped_gemm_equals_the_expert_loop(case, tmp_path, monkeypatch):
    """On the GPU in bf16 the experts run as torch's grouped matmul: the same outputs and gradients as the loop
    over experts (to bf16's rounding), an idle expert's gradient exactly zero."""
    from tiertrain.model import llama, moe
    from tiertrain.model.hf import open_weights, spec_from_hf

    assert moe._GROUPED is not None, "this torch has no grouped matmul"
    moe_model(case).save_pretrained(tmp_path / "hf")
    spec = spec_from_hf(tmp_path / "hf", 64)
    r = open_weights(tmp_path / "hf", spec)
    u = spec.units()[1]
    w = {t.name: r.get(t.hf_name, t.shape).cuda().bfloat16().requires_grad_() for t in u.tensors}
    router = "mlp.router" if case == "gpt_oss" else "mlp.gate"
    with torch.no_grad():  # expert 3 idle: its router row far below the others
        w[f"{router}.weight"][3] = -w[f"{router}.weight"][3].sign() * 10
    ctx = llama.Context.build(spec, 64, torch.bfloat16, torch.device("cuda")).of(u.window)
    h = torch.randn(96, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(96, spec.hidden_size, device="cuda")
    outs = {}
    for grouped in (True, False):
        monkeypatch.setattr(moe, "_GROUPED", moe._GROUPED if grouped else None)
        y = moe.experts(w, h, ctx)
        grads = torch.autograd.grad(y, list(w.values()), g, allow_unused=True)
        outs[grouped] = (y, dict(zip(w, grads)))
    (y1, g1), (y0, g0) = outs[True], outs[False]
    torch.testing.assert_close(y1, y0, rtol=2e-2, atol=2e-2)
    for n in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        torch.testing.assert_close(g1[n].float(), g0[n].float(), rtol=5e-2, atol=5e-2)
        assert g1[n][3].abs().max() == 0 and g0[n][3].abs().max() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(MOE))
def test_the_gpu_trains_as_the_cpu(case, token_file, tmp_path):
    """fp32 on the GPU (the loop over experts, SDPA's kernels with sinks and windows): the CPU run's losses."""
    moe_model(case).save_pretrained(tmp_path / "hf")
    runs = []
    for device in ("cpu", "cuda"):
        cfg = tiny_config(
            token_file, f'train.init_from="{tmp_path / "hf"}"', "train.steps=3", f'train.device="{device}"'
        )
        tr = Trainer(cfg)
        runs.append([tr.train_step()["loss"] for _ in range(3)])
        tr.close()
    assert runs[1] == pytest.approx(runs[0], rel=1e-4)
