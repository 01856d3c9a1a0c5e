"""Mixtures of experts (qwen3_moe, qwen2_moe, mixtral, gpt_oss): the templates, the training and the export
against transformers' own classes and torch.optim.AdamW, the load-balancing loss on."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from moe_cases import MOE, moe_model
from test_hf import trains_as_transformers

from conftest import tiny_config
from tiertrain.export import export_hf
from tiertrain.modes import Home
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


@pytest.mark.parametrize("case", sorted(MOE))
def test_training_matches_transformers_and_adamw(case, token_file, tmp_path):
    """Several steps with micro-batches, clipping and the aux loss: losses within 1e-5, weights within 1e-4."""
    moe_model(case).save_pretrained(tmp_path / "hf")
    cfg = tiny_config(token_file, f'train.init_from="{tmp_path / "hf"}"', "train.steps=4")
    trains_as_transformers(cfg, tmp_path, _load, MoELoss)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_grouped_gemm_equals_the_expert_loop(case, tmp_path, monkeypatch):
    """On the GPU in bf16 the experts run as torch's grouped matmul with the Triton activation: the same outputs
    and gradients as the loop over experts with the eager one (to bf16's rounding), an idle expert's gradient
    exactly zero."""
    from tiertrain.model import kernels, llama, moe
    from tiertrain.model.hf import open_weights, spec_from_hf

    assert moe._GROUPED is not None, "this torch has no grouped matmul"
    moe_model(case).save_pretrained(tmp_path / "hf")
    spec = spec_from_hf(tmp_path / "hf", 64)
    r = open_weights(tmp_path / "hf", spec)
    u = spec.units()[1]
    w = {t.name: r.get(t.hf_name, t.shape).cuda().bfloat16().requires_grad_() for t in u.tensors}
    router = "mlp.router" if case == "gpt_oss" else "mlp.gate"
    with torch.no_grad():  # expert 3 idle: positive tokens against a router row of -1s
        w[f"{router}.weight"][3] = -1
    ctx = llama.Context.build(spec, 64, torch.bfloat16, torch.device("cuda")).of(u.window)
    h = torch.randn(96, spec.hidden_size, device="cuda", dtype=torch.bfloat16).abs()
    g = torch.randn(96, spec.hidden_size, device="cuda")
    outs = {}
    for grouped in (True, False):
        monkeypatch.setattr(moe, "_GROUPED", moe._GROUPED if grouped else None)
        monkeypatch.setattr(kernels, "ENABLED", grouped)
        y = moe.experts(w, h, ctx)
        grads = torch.autograd.grad(y, list(w.values()), g, allow_unused=True)
        outs[grouped] = (y, dict(zip(w, grads)))
    (y1, g1), (y0, g0) = outs[True], outs[False]
    torch.testing.assert_close(y1, y0, rtol=2e-2, atol=2e-2)
    for n in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        torch.testing.assert_close(g1[n].float(), g0[n].float(), rtol=5e-2, atol=5e-2)
        assert g1[n][3].abs().max() == 0 and g0[n][3].abs().max() == 0


@pytest.mark.gpu
def test_expert_sizes_the_grouped_matmul_refuses_take_the_loop(token_file):
    """An expert size that is not a multiple of 8 (36): torch's grouped matmul refuses rows not 16-byte aligned,
    so on Hopper in bf16 those experts run as the loop over experts, whole blocks and in groups, and train."""
    sets = [
        'model.model_type="qwen3_moe"',
        "model.num_experts=4",
        "model.num_experts_per_tok=2",
        "model.moe_intermediate_size=36",
        "train.steps=2",
        'train.device="cuda"',
        'train.compute_dtype="bfloat16"',
    ]
    runs = []
    for groups in (1, 2):
        tr = Trainer(tiny_config(token_file, *sets, f"tiers.expert_groups={groups}"))
        runs.append([tr.train_step()["loss"] for _ in range(2)])
        tr.close()
    assert all(math.isfinite(x) for x in runs[0]) and runs[0] == pytest.approx(runs[1], rel=2e-2)


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


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(MOE))
def test_blocks_in_parts_train_on_the_gpu_the_bits_of_whole_blocks(case, token_file, tmp_path):
    """bf16 on the GPU (grouped matmuls, the Triton activation and sums, the norms by pieces): blocks in parts
    train the bits of whole blocks."""
    _groups_train_alike(case, token_file, tmp_path, 'train.device="cuda"', 'train.compute_dtype="bfloat16"')


# gpt-oss's shape in TOML keys: sinks, windows, biases, the aux loss (a model of tiertrain's own init)
GPT_OSS = [
    'model.model_type="gpt_oss"',
    "model.num_experts=4",
    "model.num_experts_per_tok=2",
    "model.attention_bias=true",
    "model.attention_out_bias=true",
    "model.attention_sinks=true",
    "model.sliding_window=8",
    'model.layer_types=["sliding_attention", "full_attention", "sliding_attention"]',
    "model.output_router_logits=true",
    "model.router_aux_loss_coef=0.1",
]


@pytest.mark.parametrize("groups", [1, 2])
def test_resume_and_spill_are_bit_identical(groups, token_file, tmp_path):
    """A mixture of experts stopped and resumed, and one with its moments and gradients on NVMe, train the
    bits of the run in RAM without a stop; its blocks whole or in parts (expert groups)."""
    from test_checkpoint import _fit

    from conftest import STEPS, budget_for, same_run
    from tiertrain import rundir

    sets = [*GPT_OSS, *STEPS[1::2], "data.shuffle=true", f"tiers.expert_groups={groups}"]
    _fit(tiny_config(token_file, *sets), tmp_path / "whole")
    _fit(tiny_config(token_file, *sets), tmp_path / "cut", stop_at=5)
    _fit(tiny_config(token_file, *sets), tmp_path / "cut", resume=rundir.resolve("latest", tmp_path / "cut"))
    same_run(tmp_path / "whole", tmp_path / "cut")
    gb = budget_for(tiny_config(token_file, *sets))
    spill = [f"tiers.host_gb={gb}", f'tiers.nvme_dir="{tmp_path / "nvme"}"', 'tiers.io="posix"']
    _fit(tiny_config(token_file, *sets, *spill), tmp_path / "spilled")
    same_run(tmp_path / "whole", tmp_path / "spilled")


def test_blocks_in_parts_spilled_whole_train_the_same_bits(token_file, tmp_path):
    """Every slab on NVMe, the bf16 copy that streams included (a block's read once for all its parts in a
    pass, its gradient drained part by part through the staging ring): the bits of the run in RAM."""
    from test_checkpoint import _fit

    from conftest import DEEP, STEPS, least_budget, same_run

    sets = [*(s for s in GPT_OSS if "layer_types" not in s), *DEEP, *STEPS[1::2], "tiers.expert_groups=2"]
    sets += ['train.compute_dtype="bfloat16"', 'tiers.stream="compute"']
    _fit(tiny_config(token_file, *sets), tmp_path / "ram")
    least = least_budget(tiny_config(token_file, *sets))
    spill = [f"tiers.host_gb={least}", f'tiers.nvme_dir="{tmp_path / "nvme"}"', 'tiers.io="posix"']
    tr = Trainer(tiny_config(token_file, *sets, *spill))
    assert set(tr.run_plan.where().values()) == {Home.NVME} and len(tr.run.step.parts) == 12
    tr.close()
    _fit(tiny_config(token_file, *sets, *spill), tmp_path / "all")
    same_run(tmp_path / "ram", tmp_path / "all")


def test_an_idle_expert_takes_adamw_decay_and_no_gradient(token_file, tmp_path):
    """An expert no token reaches (its router bias far below): a zero gradient, and the update torch's AdamW
    gives such a slice (decay; moments that stay zero), while the run matches transformers + AdamW."""
    hf = moe_model("gpt_oss")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.router.bias[3] = -1e4
            layer.mlp.experts.down_proj_bias[3] = 0.5  # transformers' init is zero: decay would not show
    hf.save_pretrained(tmp_path / "hf")
    before = hf.model.layers[0].mlp.experts.down_proj[3].detach().clone()
    bias = hf.model.layers[0].mlp.experts.down_proj_bias[3].detach().clone()
    cfg = tiny_config(token_file, f'train.init_from="{tmp_path / "hf"}"', "train.steps=2")
    tr = Trainer(cfg)
    for _ in range(2):
        tr.train_step()
    tr.save_checkpoint(tmp_path / "run")
    tr.close()
    export_hf(str(tmp_path / "run"), str(tmp_path / "out"))
    back = _load(tmp_path / "out").model.layers[0].mlp.experts
    after = back.down_proj[3].detach()
    # its bias (2-D, all the experts') takes no decay, as HF Trainer leaves biases out: it stays as it was
    assert torch.equal(back.down_proj_bias[3].detach(), bias)
    from tiertrain.optim.adamw import lr_at

    decay = 1.0
    for k in range(2):
        decay *= 1 - lr_at(k, cfg.optim, cfg.train.steps) * cfg.optim.weight_decay
    torch.testing.assert_close(after, before * decay, rtol=1e-6, atol=0)


def test_a_fresh_gpt_oss_is_initialised_as_transformers(token_file):
    """transformers' GptOssPreTrainedModel: the experts' biases zero, the router's bias and the sinks normal."""
    tr = Trainer(tiny_config(token_file, *GPT_OSS))
    w = tr.run.state.to_dict()
    tr.close()
    std = tr.cfg.model.initializer_range
    for name in ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"):
        assert not w[f"model.layers.0.{name}"].any(), name
    for name in ("mlp.router.bias", "self_attn.sinks", "mlp.experts.down_proj"):
        assert 0.5 * std < float(w[f"model.layers.0.{name}"].std()) < 2 * std, name


def test_mxfp4_experts_are_dequantized_on_import(tmp_path):
    """A tiny gpt-oss checkpoint in the released layout (MXFP4 expert blocks and scales): tiertrain's weights
    are transformers' own dequantization of it (Mxfp4Config(dequantize=True))."""
    import json

    from safetensors.torch import load_file, save_file

    from tiertrain.model.hf import open_weights, spec_from_hf

    hf = moe_model("gpt_oss")
    hf.save_pretrained(tmp_path / "plain")
    sd = load_file(tmp_path / "plain" / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, n_in, rows = sd.pop(name).shape  # x @ W: rows are the outputs
        sd[name + "_blocks"] = torch.randint(
            0, 256, (e, rows, n_in // 32, 16), dtype=torch.uint8, generator=g
        )
        sd[name + "_scales"] = torch.randint(124, 130, (e, rows, n_in // 32), dtype=torch.uint8, generator=g)
    (tmp_path / "q").mkdir()
    save_file(sd, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((tmp_path / "plain" / "config.json").read_text())
    conf["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (tmp_path / "q" / "config.json").write_text(json.dumps(conf))
    want = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path / "q", quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).state_dict()
    spec = spec_from_hf(tmp_path / "q", 32)
    r = open_weights(tmp_path / "q", spec)
    for u in spec.units():
        for t in u.tensors:
            assert torch.equal(r.get(t.hf_name, t.shape).float(), want[t.hf_name].float()), t.hf_name


@pytest.mark.parametrize("case", ["qwen2_moe", "mixtral"])
def test_export_writes_the_released_layout(case, token_file, tmp_path):
    """Per-expert tensors under the released names (mixtral's block_sparse_moe.experts.{e}.w1), read back by
    transformers to the logits of the model imported."""
    from safetensors import safe_open

    hf = moe_model(case).eval()
    hf.save_pretrained(tmp_path / "hf")
    tr = Trainer(tiny_config(token_file, f'train.init_from="{tmp_path / "hf"}"'))
    tr.save_checkpoint(tmp_path / "run")
    tr.close()
    export_hf(str(tmp_path / "run"), str(tmp_path / "out"))
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert names == set(f.keys())  # what transformers itself writes
    assert any(".experts.3." in n for n in names)
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(
            _load(tmp_path / "out")(input_ids=tokens).logits, hf(input_ids=tokens).logits
        )


def test_a_kept_block_recomputes_no_expert():
    """The planner's compute: keeping every block spares the backward pass its recompute, the routed experts' at
    their own rate included."""
    from types import SimpleNamespace

    from tiertrain.config import load_config
    from tiertrain.plan.resolve import job_of
    from tiertrain.plan.times import compute_work

    L = 4
    job = job_of(load_config("qwen3-30b-a3b", [f"model.num_hidden_layers={L}", "train.seq_len=1024"]), "kept")
    rp = SimpleNamespace(tile=0, micro_batch=1, expert_groups=1)

    def spared(speed):
        return compute_work(job, 0, rp, speed)["matmul bwd"] - compute_work(job, L, rp, speed)["matmul bwd"]

    experts_fwd = job.rows * job.seq_len * job.spec.expert_flops_per_token / 3
    assert spared((0.5, 0.25)) - spared((1.0, 1.0)) == pytest.approx(experts_fwd * (1 / 0.5 - 1))


def test_the_pairs_spread_and_combine_as_indexing_does():
    """_Spread (tokens to their (token, expert) pairs sorted by expert) and _Combine (the pairs added to their
    tokens' rows of the residual): the values and gradients of plain indexing, each the other's adjoint."""
    from tiertrain.model import moe

    g = torch.Generator().manual_seed(0)
    T, k, E, D = 13, 3, 5, 4
    chosen = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    order = torch.argsort(chosen.reshape(-1), stable=True)
    pos, src = moe.positions(order, k), order // k
    h = torch.randn(T, D, generator=g, requires_grad=True)
    y = torch.randn(T * k, D, generator=g, requires_grad=True)
    acc = torch.randn(T, D, generator=g, requires_grad=True)
    spread = moe._Spread.apply(h, src, pos, False)
    combined = moe._Combine.apply(acc, y, src, pos, False)
    plain_spread = h.repeat_interleave(k, 0)[order]  # pair p = (token p // k, its slot) in expert order
    plain_combined = acc.index_add(0, src, y)
    torch.testing.assert_close(spread, plain_spread, rtol=0, atol=0)
    torch.testing.assert_close(combined, plain_combined)
    gs, gc = torch.randn(T * k, D, generator=g), torch.randn(T, D, generator=g)
    for mine, plain, leaves, grad in (
        (spread, plain_spread, [h], gs),
        (combined, plain_combined, [acc, y], gc),
    ):
        for a, b in zip(torch.autograd.grad(mine, leaves, grad), torch.autograd.grad(plain, leaves, grad)):
            torch.testing.assert_close(a, b)
    with torch.no_grad():
        torch.testing.assert_close((spread * y).sum(), (h * (combined - acc)).sum())


def _slots_in_expert_order(acc, y, chosen, order, dtype):
    """Each token's pair rows added to its row of acc one at a time in fp32, its experts ascending: a plain loop."""
    T, k = chosen.shape
    place = {int(p): i for i, p in enumerate(order)}  # a (token, slot) id's place among the sorted rows
    out = torch.zeros(T, y.shape[-1]) if acc is None else acc.clone()
    for t in range(T):
        for j in sorted(range(k), key=lambda j: int(chosen[t, j])):
            out[t] = out[t] + y[place[t * k + j]].float()
    return out.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [False, True])
def test_slots_added_a_group_at_a_time_give_the_bits_of_all_at_once(dtype, start):
    """moe.add_slots adds each token's rows in expert order: called on all the sorted rows at once (a whole
    block) or on consecutive ranges of experts going on from the last call's sum (expert groups), the same bits,
    and those of a plain loop in that order."""
    from tiertrain.model import moe

    g = torch.Generator().manual_seed(1)
    T, k, E, D = 17, 3, 8, 5
    chosen = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    order = moe.sort_pairs(chosen, E)
    pos = moe.positions(order, k)
    y = (torch.randn(T * k, D, generator=g) * torch.logspace(-3, 3, D)).to(dtype)  # rounding shows in sums
    acc = torch.randn(T, D, generator=g) * 10 if start else None
    whole = moe.add_slots(False, acc, y, pos, 0, torch.float32)
    assert torch.equal(whole, _slots_in_expert_order(acc, y, chosen, order, torch.float32))
    starts = [0, *moe._counts(chosen, E).cumsum(0).tolist()]
    for groups in (2, 4, 8):
        out, n = acc, E // groups
        for a, b in zip(starts[::n], starts[n::n]):
            out = moe.add_slots(False, out, y[a:b], pos, a, torch.float32)
        assert torch.equal(out, whole), groups
    assert torch.equal(moe.add_slots(False, acc, y, pos, 0, dtype), whole.to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "gpt_oss,rows,inter", [(False, 4096, 768), (False, 77, 2500), (True, 333, 2880), (True, 0, 64)]
)
def test_the_activation_kernels_give_the_eager_values_and_gradients(dtype, gpt_oss, rows, inter):
    """model/glu.py's kernels against moe._glu under autograd: the activation, the gate/up gradient and the routing
    weights' gradient, at an intermediate size of one block and two that take several (the last partial);
    gpt-oss's clamps cut some gradients to zero; a rerun gives the same bits."""
    from tiertrain.model import glu, moe

    g = torch.Generator(device="cuda").manual_seed(0)
    y = (torch.randn(rows, 2 * inter, generator=g, device="cuda") * 4).to(
        dtype
    )  # some beyond gpt-oss's limit
    ws = torch.rand(rows, 1, generator=g, device="cuda")
    da = torch.randn(rows, inter, generator=g, device="cuda").to(dtype)

    def run(fn):
        y_, ws_ = y.clone().requires_grad_(), ws.clone().requires_grad_()
        a = fn(y_, ws_, gpt_oss, 7.0, 1.702)
        return (a, *torch.autograd.grad(a, [y_, ws_], da))

    got, want = run(glu.activation), run(moe._glu)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for x, z in zip(got[:2], want[:2]):
        assert x.dtype == z.dtype
        torch.testing.assert_close(x, z, **tol)
    # the weights' gradient sums I products of up to about 100 each, in another order than eager's
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=2e-3)
    if gpt_oss and rows:  # the clamps' zero gradients (about 6% of the gate/up gradient here)
        assert (got[1] == 0).float().mean() > 0.03 and torch.equal(got[1] == 0, want[1] == 0)
    assert all(torch.equal(x, z) for x, z in zip(run(glu.activation), got))
    if rows:  # a NaN in a row stays one, through the clamps too
        y[1, 3] = float("nan")
        got, want = run(glu.activation), run(moe._glu)
        assert torch.equal(got[0].isnan(), want[0].isnan()) and got[0].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,k,width", [(4096, 8, 2048), (333, 4, 2880), (0, 2, 64)])
def test_the_slot_sum_kernel_adds_the_slots_in_expert_order(dtype, tokens, k, width):
    """model/slot_sum.py's kernel: each token's rows added in fp32 in expert order to its running sum (or zero),
    then rounded once (or not): the bits of the eager op on the GPU, all rows at once and a range of experts at a
    time, at a hidden size that is and one that is not a multiple of its column block; and again on a rerun."""
    from tiertrain.model import moe, slot_sum

    g = torch.Generator(device="cuda").manual_seed(0)
    E = 64
    chosen = torch.rand(tokens, E, generator=g, device="cuda").topk(k, dim=-1).indices
    order = moe.sort_pairs(chosen, E)
    pos = moe.positions(order, k)
    y = torch.randn(tokens * k, width, generator=g, device="cuda").to(dtype)
    acc = torch.randn(tokens, width, generator=g, device="cuda")
    starts = [0, *moe._counts(chosen, E).cumsum(0).tolist()]
    for start in (None, acc):
        for out in (dtype, torch.float32):  # a gradient in the rows' dtype, the residual's share in fp32
            got = slot_sum.add_slots(start, y, pos, 0, out)
            assert got.dtype == out and torch.equal(got, moe._add_slots(start, y, pos, 0, out))
            assert torch.equal(slot_sum.add_slots(start, y, pos, 0, out), got)
        run = start
        for a, b in zip(starts[::16], starts[16::16]):  # four groups of 16 experts
            run = slot_sum.add_slots(run, y[a:b], pos, a, torch.float32)
        assert torch.equal(run, slot_sum.add_slots(start, y, pos, 0, torch.float32))


@pytest.mark.parametrize("case", sorted(MOE))
def test_expert_groups_train_the_bits_of_whole_blocks(case, token_file, tmp_path):
    """Blocks in parts (any expert groups) train the bits of whole blocks: the losses, the gradient norms (so the
    clipping), the masters and both moments; with micro-batches, clipping and the aux loss on. A spilled run may
    take other groups than the run in RAM (the planner's choice), so this is what keeps spill bit-identical."""
    _groups_train_alike(case, token_file, tmp_path)


def _groups_train_alike(case, token_file, tmp_path, *more):
    """Three steps of the family's model whole and in groups: the same metrics and checkpointed state, bit for bit.
    The experts' size is not a multiple of 32, where a CPU's vectorized exp leaves a row's last elements to a
    scalar one that rounds otherwise: the same rows must take the same path in groups as whole; and micro-batches
    of 256 tokens, where a CPU's index backward (gpt-oss's gate/up bias) accumulated in no fixed order."""
    from test_checkpoint import _fit

    from conftest import read_metrics, state_of

    size = "intermediate_size" if case in ("mixtral", "gpt_oss") else "moe_intermediate_size"
    moe_model(case, **{size: 40}).save_pretrained(tmp_path / "hf")
    runs = []
    for groups in (1, 2, 3) if case == "qwen3_moe" else (1, 2, 4):
        sets = [f'train.init_from="{tmp_path / "hf"}"', "train.steps=3", "checkpoint.every=3", *more]
        sets += ["train.seq_len=64", "train.micro_batch_size=4"]
        out = tmp_path / f"g{groups}"
        _fit(tiny_config(token_file, *sets, f"tiers.expert_groups={groups}"), out)
        rows = read_metrics(out / "metrics.jsonl")
        runs.append(([(r["loss"], r["grad_norm"]) for r in rows], state_of(out / "checkpoints" / "step_3")))
    (metrics, state), *others = runs
    assert all(norm > 0.3 for _, norm in metrics)  # optim.grad_clip: every step clipped
    for m, st in others:
        assert m == metrics and st.keys() == state.keys()
        assert all(np.array_equal(st[k], state[k]) for k in state)


@pytest.mark.parametrize("case", sorted(MOE))
def test_expert_groups_train_as_transformers(case, token_file, tmp_path):
    """Blocks in parts (the attention part, then the experts in groups: tiers.expert_groups) train as
    transformers + AdamW do, as whole blocks do."""
    moe_model(case).save_pretrained(tmp_path / "hf")
    groups = 3 if case == "qwen3_moe" else 2
    sets = [f'train.init_from="{tmp_path / "hf"}"', "train.steps=4", f"tiers.expert_groups={groups}"]
    trains_as_transformers(tiny_config(token_file, *sets), tmp_path, _load, MoELoss)
    tr = Trainer(tiny_config(token_file, *sets))
    parts, spec = tr.run.step.parts, tr.cfg.model
    # the slots and accumulators are a part's size (or a dense block's, where one is larger)
    whole = [lay.numel for u, lay in enumerate(tr.layouts[1:-1], 1) if u not in parts]
    size = max([p.numel for ps in parts.values() for p in ps] + whole)
    assert size < max(lay.numel for lay in tr.layouts[1:-1])
    assert {b.t.numel() for b in tr.run.slots.slots + tr.run.grads.blocks} == {size}
    tr.close()
    assert sorted(parts) == [b + 1 for b in range(spec.num_hidden_layers) if spec.has_experts(b)]
    assert all(len(p) == groups + 1 and p[0].experts == 0 for p in parts.values())


def test_set_model_keys_with_init_from_are_not_checked_against_the_placeholder(tmp_path):
    """A new run importing a mixture of experts with --set model.num_experts (even the model's own value) and
    another MoE key: config.json gives [model], so they go unused (recorded for the run's warning), where they
    were laid over the placeholder dense [model] and refused as a dense llama's. LIFTED keys still apply, and a
    config without init_from (or a checkpoint's, a resume's) still checks them."""
    from tiertrain.config import config_from_dict, load_config
    from tiertrain.errors import ConfigError
    from tiertrain.model.hf import spec_from_hf

    moe_model("qwen3_moe").save_pretrained(tmp_path / "hf")
    sets = [f'train.init_from="{tmp_path / "hf"}"', "model.num_experts=6", "model.num_experts_per_tok=3"]
    cfg = load_config("finetune", [*sets, "model.router_aux_loss_coef=0.5", "train.seq_len=32"])
    assert cfg.model_sets == {"num_experts": 6, "num_experts_per_tok": 3, "router_aux_loss_coef": 0.5}
    spec = spec_from_hf(tmp_path / "hf", cfg.train.seq_len)
    got = cfg.imported(spec).model
    assert (got.num_experts, got.num_experts_per_tok) == (spec.num_experts, spec.num_experts_per_tok)
    assert got.router_aux_loss_coef == 0.5
    with pytest.raises(ConfigError, match="model.num_experts = 6 is not allowed"):
        load_config("debug", ["model.num_experts=6"])
    with pytest.raises(ConfigError, match="model.num_experts = 6 is not allowed"):
        config_from_dict(load_config("debug").to_dict(), sets, legacy=True)
    with pytest.raises(ConfigError, match="model.num_experts = 6 is not allowed"):  # a resume with a --config
        load_config("finetune", [*sets, "train.seq_len=32"], new=False)
