"""Kept attention outputs (train.keep_attention): a block's recompute that replays the attention outputs its forward
pass kept (model/attention.Kept) runs no attention forward and gives the bits of the recompute that runs it; the
plan keeps them where it tiles the blocks and has the room, prices what they save, and refuses what cannot keep
them in one line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import VARIANTS, tiny_config
from tiertrain.config import load_config
from tiertrain.errors import ConfigError
from tiertrain.model import attention as attn
from tiertrain.plan.attention import attention_out_bytes, keeping_blocks, rates
from tiertrain.plan.hardware import REFERENCE
from tiertrain.plan.planner import plan
from tiertrain.plan.resolve import job_of, resolve, search
from tiertrain.plan.values import Budgets, Choice
from tiertrain.plan.workset import KEPT_SLACK
from tiertrain.trainer import Trainer

LONG = ["train.batch_size=1", "train.micro_batch_size=1", "model.max_position_embeddings=1048576"]


def _counted(monkeypatch) -> dict[str, int]:
    """Calls of SDPA (a forward the recompute runs) and of the kept outputs' own forward, counted."""
    n = {"sdpa": 0, "own": 0}
    sdpa, own = F.scaled_dot_product_attention, attn._own_forward

    def counted_sdpa(*a, **k):
        n["sdpa"] += 1
        return sdpa(*a, **k)

    def counted_own(*a, **k):
        n["own"] += 1
        return own(*a, **k)

    monkeypatch.setattr(attn.F, "scaled_dot_product_attention", counted_sdpa)
    monkeypatch.setattr(attn, "_own_forward", counted_own)
    return n


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(
    "sets",
    [
        [],
        ["train.tile_tokens=16"],
        ['train.compute_dtype="bfloat16"', "train.tile_tokens=16"],
        ['tiers.activations="host"', "train.micro_batch_size=4"],
        ['tiers.activation_dtype="bfloat16"', "train.tile_tokens=16"],
    ],
    ids=["untiled", "tiled", "tiled-bf16", "host-checkpoints", "bf16-checkpoints"],
)
def test_kept_outputs_give_the_bits_of_recompute(token_file, variant, sets, monkeypatch):
    """Every block keeps its outputs (3), or the last two, or none: the same losses and weights, bit for bit, and
    a step with all kept runs no SDPA forward at all, the kept blocks' recompute none."""
    base = [*VARIANTS[variant], "train.steps=3", *sets]
    runs = {}
    for keep in (0, 2, 3):
        tr = Trainer(tiny_config(token_file, *base, f"train.keep_attention={keep}"))
        assert tr.run_plan.attention_kept() == frozenset(range(4 - keep, 4))  # the last blocks
        assert tr.run.step.attention_kept == tr.run_plan.attention_kept()
        n = _counted(monkeypatch)
        losses = [tr.train_step()["loss"] for _ in range(3)]
        monkeypatch.undo()
        groups = (
            2 if "train.tile_tokens=16" in sets else 1
        )  # a tiled block calls a key/value head group at a time
        micro = 8 // tr.run_plan.micro_batch
        assert n["own"] == 3 * keep * micro * groups
        assert n["sdpa"] == 3 * 2 * (3 - keep) * micro * groups  # forward and recompute of the others
        assert not tr.run.step.outs  # each block's outputs went with its backward pass
        runs[keep] = losses, tr.state_dict()
        tr.close()
    (la, wa), *others = runs.values()
    for lb, wb in others:
        assert la == lb
        for name in wa:
            assert torch.equal(wa[name], wb[name]), name


def test_an_evaluation_keeps_nothing(token_file):
    """A validation pass runs the forward pass alone: it records no outputs for a backward pass that never comes."""
    tr = Trainer(tiny_config(token_file, "train.keep_attention=3", "data.val_fraction=0.2"))
    tr.train_step()
    tr.evaluate()
    assert not tr.run.step.outs
    tr.close()


def test_a_replay_out_of_order_is_an_error():
    """The recompute replays the calls in the forward pass's order: a call of another shape is a bug, said."""
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    kept = attn.Kept()
    attn.attention(q, k, v, kept=kept)
    with pytest.raises(RuntimeError, match="replayed for"):
        attn.attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], kept=kept.replay())


def test_a_kept_output_is_sdpa_s_and_so_are_its_gradients():
    """On a CPU, torch's choice is its flash kernel: a kept output and its backward are SDPA's, bit for bit, GQA
    included; SDPA's math kernel (named) keeps nothing."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 40, 16, requires_grad=True) for h in (4, 2, 2))
    do = torch.randn(2, 4, 40, 16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = torch.autograd.grad(ref, (q, k, v), do)
    kept = attn.Kept()
    with torch.no_grad():
        out = attn.attention(q, k, v, kept=kept)
    assert torch.equal(out, ref) and kept.nbytes() == out.nbytes + 2 * 4 * 40 * 4
    got = torch.autograd.grad(attn.attention(q, k, v, kept=kept.replay()), (q, k, v), do)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert kept.calls == [None]  # the graph holds the output now
    assert not attn.keeps("math", q, k, v) and attn.keeps("", q, k, v)


def _long(seq: int, *sets: str):
    return load_config("llama3.1-8b", [*LONG, f"train.seq_len={seq}", *sets])


def test_the_plan_keeps_outputs_where_it_tiles_and_prices_them():
    """llama3.1-8b at 131k on the reference H200 with its RAM: every block keeps its outputs, their bytes on the
    GPU, and the backward pass's compute is less by their attention forward at its kernel's rate, exactly; at 4k
    (untiled) the plan keeps none."""
    cfg = _long(131072)
    job = job_of(cfg, "t")
    b = Budgets(host_gb=1500, gpu_gb=141)
    kept = plan(job, b, REFERENCE, Choice(activations="gpu"))
    none = plan(job, b, REFERENCE, Choice(activations="gpu", keep_attention=0))
    spec, L = cfg.model, cfg.model.num_hidden_layers
    assert kept.memory.kept_attention == L and none.memory.kept_attention == 0
    assert kept.memory.gpu.kept_attention == L * KEPT_SLACK * 131072 * attention_out_bytes(spec, "bfloat16")
    assert kept.run_plan.attention_kept() == frozenset(range(1, L + 1))
    fa, _ = rates(kept.run_plan.attention, spec.hd, False, "bfloat16", REFERENCE)
    saved = L * 2 * 2 * spec.num_attention_heads * spec.hd * 131072 * (131072 + 1) / 2 / fa
    t, t0 = kept.prediction.times, none.prediction.times
    assert t["compute bwd"] == pytest.approx(t0["compute bwd"] - saved, rel=1e-9)
    assert t["compute fwd"] == t0["compute fwd"]
    unit = json.loads(json.dumps(kept.run_plan.to_dict()))["units"][L]
    assert unit["attention_kept"] is True and unit["recompute"] is True
    short = plan(job_of(load_config("llama3.1-8b"), "t"), b, REFERENCE)
    assert short.run_plan.tile == 0 and short.memory.kept_attention == 0
    # in the reference's own RAM the GPU holds resident state beside them; no room is kept for GPU updates, which
    # the plan then takes none of (it kept 28 and planned 45.0 s with that room, 43.9 s without)
    tight = plan(job, Budgets(resident_gb="auto"), REFERENCE)
    assert tight.memory.kept_attention == L and tight.run_plan.resident_gb > 0 and not tight.memory.gpu.sets


def test_the_plan_keeps_the_last_blocks_it_can():
    """Outputs kept for as many of the last recomputed blocks as asked, below the kept blocks; a window shorter
    than the rows keeps none (Mistral's, where set), sinks none at all (gpt-oss)."""
    cfg = _long(131072)
    p = plan(job_of(cfg, "t"), Budgets(host_gb=1500, gpu_gb=141), REFERENCE, Choice(keep_attention=5, keep=2))
    L = cfg.model.num_hidden_layers
    assert p.run_plan.kept() == {L - 1, L} and p.run_plan.attention_kept() == frozenset(range(L - 6, L - 1))
    win = load_config("mistral-7b", ["model.sliding_window=4096", "train.seq_len=8192"]).model
    assert keeping_blocks(win, 8192) == [] and keeping_blocks(win, 4096) == list(range(1, 33))
    assert keeping_blocks(load_config("gpt-oss-20b").model, 4096) == []


@pytest.mark.parametrize(
    "sets, words",
    [
        (['train.compute_dtype="float32"'], "torch's own choice"),  # fp32: no fast kernel on a GPU
        (["data.document_mask=true"], "several segments"),
    ],
)
def test_what_cannot_keep_outputs_is_refused_in_one_line(sets, words):
    cfg = _long(131072, "train.keep_attention=4", 'train.device="cuda"', *sets)
    with pytest.raises(ConfigError, match=words) as e:
        search(cfg, REFERENCE, 1500, 141, None, "t")
    assert "\n" not in str(e.value) and "train.keep_attention to 0" in str(e.value)
    auto = _long(131072, 'train.device="cuda"', *sets)
    assert search(auto, REFERENCE, 1500, 141, None, "t").memory.kept_attention == 0  # "auto": none


def test_a_model_with_sinks_refuses_kept_outputs():
    cfg = load_config("gpt-oss-20b", ["train.keep_attention=2"])
    with pytest.raises(ConfigError, match="no block of this model"):
        search(cfg, REFERENCE, 1500, 141, None, "t")


def test_keep_attention_takes_auto_or_a_count():
    with pytest.raises(ConfigError, match="train.keep_attention"):
        load_config("debug", ["train.keep_attention=-1"])


def test_a_forced_count_beyond_the_gpu_is_refused_naming_it():
    cfg = _long(131072, "train.keep_attention=32", 'train.device="cuda"', 'tiers.activations="gpu"')
    small = REFERENCE.__class__(**{**REFERENCE.__dict__, "gpu_mem_gb": 90})
    with pytest.raises(ConfigError, match=r"lower train.keep_attention \(32\)"):
        resolve(cfg, small)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("heads", [(8, 2, 128), (4, 1, 64), (8, 8, 128)])
def test_a_kept_output_is_the_kernel_s_on_a_gpu(kernel, heads):
    """The kernel's own ops against SDPA's autograd on the same kernel, bf16: the output bit for bit, dK and dV
    bit for bit, dQ within bf16's rounding (the kernels' dQ is not deterministic); flash's deterministic backward:
    all three bit for bit."""
    h, kv, hd = heads
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, n, 2048, hd, device="cuda", dtype=torch.bfloat16, generator=g) for n in (h, kv, kv)
    )
    do = torch.randn(2, h, 2048, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    for det in (False, True) if kernel == "flash" else (False,):
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
        ref = attn.attention(ql, kl, vl, kernel, det)
        want = torch.autograd.grad(ref, (ql, kl, vl), do)
        kept = attn.Kept()
        with torch.no_grad():
            out = attn.attention(q, k, v, kernel, det, kept=kept)
        assert torch.equal(out, ref)
        got = torch.autograd.grad(
            attn.attention(ql, kl, vl, kernel, det, kept=kept.replay()), (ql, kl, vl), do
        )
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        if det:
            assert torch.equal(got[0], want[0])
        else:
            torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [0, 64])
def test_kept_outputs_train_the_bits_of_recompute_on_a_gpu(token_file, tile):
    """A deterministic GPU run (flash's deterministic backward) keeping every block's outputs trains the bits of
    the one that recomputes them."""
    sets = [
        'train.device="cuda"',
        'train.compute_dtype="bfloat16"',
        'train.attention="flash"',
        "train.deterministic=true",
        "model.head_dim=16",
        "train.seq_len=128",
        f"train.tile_tokens={tile}",
    ]
    runs = []
    for keep in (0, 3):
        tr = Trainer(tiny_config(token_file, *sets, "train.steps=3", f"train.keep_attention={keep}"))
        assert len(tr.run_plan.attention_kept()) == keep
        runs.append(([tr.train_step()["loss"] for _ in range(3)], tr.state_dict()))
        tr.close()
    (la, wa), (lb, wb) = runs
    assert la == lb
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_what_a_failed_step_kept_goes_with_the_next_evaluation(token_file, monkeypatch):
    """A step that fails after its forward pass leaves its kept outputs on the device; the evaluation after it (or
    the next step) drops them, as it does a kept block's graph."""
    tr = Trainer(tiny_config(token_file, "train.keep_attention=2", "data.val_fraction=0.2"))
    step = tr.run.step

    def fails(*a, **k):
        raise RuntimeError("the head failed")

    monkeypatch.setattr(step, "head", fails)
    with pytest.raises(RuntimeError, match="the head failed"):
        tr.train_step()
    assert step.outs  # left by the failed step
    monkeypatch.undo()
    tr.evaluate()
    assert not step.outs and not step.graphs
    tr.close()


@pytest.mark.parametrize(
    "sets, words",
    [
        (['train.attention="math"'], "on a CPU only torch's own choice"),  # a named kernel: not the own ops
        (["tiers.expert_groups=2", 'model.model_type="qwen3_moe"'], "tiers.expert_groups = 2 is not allowed"),
    ],
)
def test_more_that_keeps_no_outputs_is_refused(token_file, sets, words):
    moe = ["model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32"]
    extra = [*moe, "model.qk_norm=true"] if "qwen3_moe" in str(sets) else []
    with pytest.raises(ConfigError, match=words) as e:
        Trainer(tiny_config(token_file, "train.keep_attention=2", *extra, *sets))
    assert "keep_attention" in str(e.value)


def test_a_head_size_sdpa_pads_keeps_none():
    """On a GPU SDPA pads a head size that is no multiple of 8 before its kernel: the own ops would see other
    shapes, so the plan keeps nothing there and a number asked for is refused."""
    sets = ["model.head_dim=20", "model.num_attention_heads=32", "model.num_key_value_heads=8"]
    cfg = _long(131072, 'train.device="cuda"', *sets)
    assert search(cfg, REFERENCE, 1500, 141, None, "t").memory.kept_attention == 0
    with pytest.raises(ConfigError, match=r"head size \(20\)"):
        search(_long(131072, "train.keep_attention=2", *sets), REFERENCE, 1500, 141, None, "t")


def test_plan_reads_a_packed_file_as_the_run_does(tmp_path):
    """`tiertrain plan` with data.path a file of packed samples (a loss mask) plans no kept outputs, as the run's
    loader says; a plain token file keeps them."""
    import numpy as np
    from click.testing import CliRunner

    from tiertrain.cli import main
    from tiertrain.tokenfile import TokenWriter, masked

    for name, mask in (("packed", True), ("plain", False)):
        w = TokenWriter(tmp_path / f"{name}.bin", 97, samples=mask, masked=mask)
        w.add(np.arange(40) % 97, np.ones(40, np.uint8) if mask else None, start=mask)
        w.close()
    assert masked(tmp_path / "packed.bin") and not masked(tmp_path / "plain.bin")
    assert not masked(tmp_path / "missing.bin")
    args = ["plan", "--config", "llama3.1-8b", "--batch-size", "1", "--seq-len", "131072", "--hardware"]
    args += [
        "reference",
        "--host-gb",
        "1500",
        "--set",
        "model.max_position_embeddings=131072",
        "--format",
        "json",
    ]
    kept = {}
    for name in ("packed", "plain"):
        r = CliRunner().invoke(main, [*args, "--set", f'data.path="{tmp_path / name}.bin"'])
        assert r.exit_code == 0, r.output
        kept[name] = json.loads(r.output)["kept_attention"]
    assert kept == {"packed": 0, "plain": 32}


def test_a_kept_block_from_a_bf16_checkpoint_holds_one_copy_more_as_planned(token_file):
    """A kept block's graph starts from an fp32 copy of its rounded input where the checkpoints are bf16, beside
    the output of the block before, which its graph ends in (with fp32 ones they are one tensor): tokens x H x 4
    bytes more a kept block after the first and a micro-batch; the plan adds that for every kept block."""
    held = {}
    for ck in ("float32", "bfloat16"):
        tr = Trainer(tiny_config(token_file, "train.keep_activations=3", f'tiers.activation_dtype="{ck}"'))
        step = tr.run.step
        step.forward(list(torch.from_numpy(tr.loader.get(0).inputs).long().split(tr.run_plan.micro_batch)))
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for ins, outs, _, _ in step.graphs.values()
            for t in (*ins, *outs)
        }
        held[ck] = sum(storages.values())
        plan = tr.plan.memory.gpu.kept
        step.forget()
        tr.close()
        held[ck + " plan"] = plan
    tokens, H = 8 * 32, 64
    assert held["bfloat16"] - held["float32"] == 2 * tokens * H * 4
    assert held["bfloat16 plan"] - held["float32 plan"] == pytest.approx(3 * KEPT_SLACK * tokens * H * 4)


def test_a_replayed_backward_holds_the_deterministic_mode_alone():
    """The replay's deterministic backward (a GPU's) switches torch's mode as the hooks do: on inside, as it was
    after, an error inside included."""
    with attn._deterministic(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory
    assert (
        not torch.are_deterministic_algorithms_enabled()
        and torch.utils.deterministic.fill_uninitialized_memory
    )
    with pytest.raises(ValueError), attn._deterministic(True):
        raise ValueError
    assert not torch.are_deterministic_algorithms_enabled()
    with attn._deterministic(False):
        assert not torch.are_deterministic_algorithms_enabled()
