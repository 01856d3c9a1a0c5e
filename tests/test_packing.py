"""Samples packed into rows and documents kept apart: a packed batch trains exactly as its samples one by one in plain
PyTorch (loss and gradients, fp32), whatever the micro-batch, tiling or kept activations; the loss is the mean over
the trained targets of the whole batch; the token file's version 2 (sample starts, loss mask) and version 1."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from conftest import cli, state_of, tiny, tiny_config
from tiertrain.data import Loader
from tiertrain.errors import DataError
from tiertrain.metrics import read_metrics
from tiertrain.model.reference import ReferenceLM
from tiertrain.modes import Kind
from tiertrain.rows import IGNORE, Packed, pack
from tiertrain.tokenfile import HEADER, MAGIC, TokenWriter, open_tokens, read_tokens
from tiertrain.trainer import Trainer

LENGTHS = [9, 17, 5, 24, 12, 3, 22, 8, 33, 2]  # 125 positions: 4 rows of 32 (33 tokens: one row exactly)


def _samples(path, lengths=LENGTHS, seed=0) -> list[tuple[np.ndarray, np.ndarray]]:
    """A token file of samples of random tokens, about half of each trained (its last token always)."""
    rng = np.random.default_rng(seed)
    w, out = TokenWriter(path, 97, samples=True, masked=True), []
    for n in lengths:
        t, m = rng.integers(0, 97, n), (rng.random(n) < 0.5).astype(np.uint8)
        m[-1] = 1
        w.add(t, m, start=True)
        out.append((t, m))
    w.close()
    return out


def _grads(tr: Trainer) -> dict[str, torch.Tensor]:
    """The gradients of the last step, under Hugging Face names (read from the host's gradient slabs)."""
    tr._quiesce()
    out = {}
    for unit, lay in zip(tr.units, tr.layouts):
        with tr.run.state.slab(unit.index, Kind.GRAD, read=True) as flat:
            views = lay.views(flat)
            out.update({t.hf_name: views[t.name].clone() for t in unit.tensors})
    return out


def _alone(cfg, init, pieces) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain PyTorch, each (inputs, targets) piece run alone: the summed loss over every trained target divided by
    their count, and its gradients."""
    ref = ReferenceLM(cfg.model)
    ref.load_state_dict(init, strict=False)
    n = sum(int((t != IGNORE).sum()) for _, t in pieces)
    total = 0.0
    for inp, tgt in pieces:
        loss = ref(torch.as_tensor(inp)[None], torch.as_tensor(tgt)[None]) / n
        loss.backward()
        total += loss.item()
    return total, {k: p.grad for k, p in ref.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _rows(path, seq_len: int) -> int:
    tf = open_tokens(path)
    return Packed(tf.tokens, tf.starts, tf.mask, seq_len, "x").rows


VARIANTS = {
    "micro-batches of 2": [],
    "one row a micro-batch": ["train.micro_batch_size=1"],
    "one micro-batch": ["train.micro_batch_size=4"],
    "tiled": ["train.tile_tokens=16"],
    "kept activations": ["train.keep_activations=2"],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_packed_batch_trains_as_its_samples_one_by_one(tmp_path, variant):
    """Samples of 2 to 33 tokens packed into rows of 32 positions, one step on all of them: the loss and every
    gradient of plain PyTorch running each sample alone, to 1e-6 in fp32."""
    samples = _samples(tmp_path / "s.bin")
    rows = _rows(tmp_path / "s.bin", 32)
    assert rows == 4
    sets = [f"train.batch_size={rows}", "train.micro_batch_size=2", "optim.grad_clip=0", "data.shuffle=false"]
    tr = Trainer(tiny_config(tmp_path / "s.bin", *sets, *VARIANTS[variant]))
    init = tr.state_dict()
    loss = tr.train_step()["loss"]
    got = _grads(tr)
    tr.close()
    pieces = [(t[:-1], np.where(m[1:] != 0, t[1:], IGNORE)) for t, m in samples]
    want, grads = _alone(tr.cfg, init, pieces)
    assert loss == pytest.approx(want, rel=1e-6)
    for name, g in grads.items():
        assert _rel(got[name], g) < 1e-6, name


def test_micro_batching_does_not_change_the_steps(tmp_path):
    """Three shuffled steps of 4 packed rows in micro-batches of 1, 2 and 4: the same losses and weights."""
    _samples(tmp_path / "s.bin", LENGTHS * 3, seed=1)
    runs = []
    for micro in (1, 2, 4):
        tr = Trainer(tiny_config(tmp_path / "s.bin", "train.batch_size=4", f"train.micro_batch_size={micro}"))
        losses = [tr.train_step()["loss"] for _ in range(3)]
        runs.append((losses, tr.state_dict()))
        tr.close()
    for losses, sd in runs[1:]:
        np.testing.assert_allclose(losses, runs[0][0], rtol=1e-6)
        for k, v in sd.items():
            # micro-batches change the order of the gradients' fp32 sums, which AdamW's division by sqrt(v)
            # magnifies where a gradient is near zero: up to 1.3e-6 on an AVX-512 EPYC, under 1e-6 before
            assert _rel(v, runs[0][1][k]) < 1e-5, k


def test_packing_fills_rows_best_fit_and_keeps_every_sample_whole(tmp_path):
    order, bounds = pack(np.array([8, 29, 4, 16, 11, 2, 21, 7]), 32)
    rows = [sorted(order[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:])]
    assert sorted(i for r in rows for i in r) == list(range(8))
    assert rows == [[1, 5], [4, 6], [0, 3, 7], [2]]  # longest first, each into the fullest row it fits
    samples = _samples(tmp_path / "s.bin")
    ld = _loader(tmp_path / "s.bin", 32, 4)
    b = ld.get(0)
    seen = []
    pad = b.positions < 0  # a row's padding: token 0, no target, position -1, after its samples
    assert (b.inputs[pad] == 0).all() and (b.targets[pad] == IGNORE).all() and pad.sum() == 4 * 32 - 125
    assert all(not p.any() or p[np.argmax(p) :].all() for p in pad)
    for inp, tgt, pos in zip(*b):
        cuts = np.append(np.flatnonzero((pos == 0) | ((pos < 0) & np.append(True, pos[:-1] >= 0))), 32)
        for a, e in zip(cuts[:-1], cuts[1:]):
            seen.append((inp[a:e].tolist(), tgt[a:e].tolist()))
    whole = [
        (t[:-1].tolist(), np.where(m[1:] != 0, t[1:], IGNORE).tolist()) for t, m in samples if len(t) > 1
    ]
    assert sorted(x for x in seen if any(v != IGNORE for v in x[1])) == sorted(whole)
    assert ld.describe().startswith("x (4 rows packing its 10 samples")
    with pytest.raises(DataError, match="longer than a row of train.seq_len = 16.*--seq-len 16"):
        _loader(tmp_path / "s.bin", 16, 4)
    with pytest.raises(DataError, match="packs into 4 rows.*lower train.batch_size to 4"):
        _loader(tmp_path / "s.bin", 32, 8)


def _loader(path, seq_len: int, batch_size: int) -> Loader:
    tf = open_tokens(path)
    return Loader(tf.tokens, seq_len, batch_size, 97, False, 0, "x", starts=tf.starts, mask=tf.mask)


def test_documents_of_a_stream_attend_only_to_themselves(tmp_path):
    """data.document_mask: rows cut from the stream as without it, positions restarting at each document, a
    document's first token no target; one step is plain PyTorch running each row's documents alone."""
    rng = np.random.default_rng(2)
    lengths = [7, 40, 3, 25, 1, 18, 30, 9]
    w = TokenWriter(tmp_path / "d.bin", 97, samples=True)
    for n in lengths:
        w.add(rng.integers(0, 97, n), start=True)
    w.close()
    tokens, starts = read_tokens(tmp_path / "d.bin"), open_tokens(tmp_path / "d.bin").starts
    assert starts.tolist() == np.cumsum([0] + lengths[:-1]).tolist()
    plain = Loader(tokens, 32, 4, 97, False, 0, starts=starts)
    docs = Loader(tokens, 32, 4, 97, False, 0, starts=starts, document_mask=True)
    a, b = plain.get(0), docs.get(0)
    assert a.positions is None and (a.inputs == b.inputs).all()
    for r in range(4):
        for p in range(32):
            g = r * 32 + p  # the input's place in the stream
            begun = starts[starts <= g].max()
            assert b.positions[r, p] == g - max(begun, r * 32)
            assert (b.targets[r, p] == IGNORE) == (g + 1 in starts)
    cfg = ["train.batch_size=4", "data.shuffle=false", "optim.grad_clip=0", "data.document_mask=true"]
    tr = Trainer(tiny_config(tmp_path / "d.bin", *cfg))
    init = tr.state_dict()
    loss = tr.train_step()["loss"]
    got = _grads(tr)
    tr.close()
    pieces = []
    for inp, tgt, pos in zip(*b):
        cuts = np.append(np.flatnonzero(pos == 0), 32)
        pieces += [(inp[x:y], tgt[x:y]) for x, y in zip(cuts[:-1], cuts[1:])]
    want, grads = _alone(tr.cfg, init, pieces)
    assert loss == pytest.approx(want, rel=1e-6)
    for name, g in grads.items():
        assert _rel(got[name], g) < 1e-6, name
    with pytest.raises(DataError, match="data.document_mask = true needs the documents' boundaries"):
        Loader(tokens, 32, 4, 97, False, 0, document_mask=True)


def test_validation_counts_the_trained_targets_only(tmp_path):
    """data.val_fraction of a file of samples holds out its last samples whole; the validation loss is the mean
    over their trained targets, as plain PyTorch evaluates them alone."""
    _samples(tmp_path / "s.bin", LENGTHS * 4, seed=3)
    sets = ["train.batch_size=2", "data.val_fraction=0.25", "train.eval_batches=100", "train.steps=1"]
    tr = Trainer(tiny_config(tmp_path / "s.bin", *sets))
    tr.train_step()
    got = tr.evaluate()
    sd, val = tr.state_dict(), tr.val
    tr.close()
    ref = ReferenceLM(tr.cfg.model)
    ref.load_state_dict(sd, strict=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for k in range(val.rows // val.B):
            for inp, tgt, pos in zip(*val.get(k)):
                cuts = np.append(np.flatnonzero(pos == 0), len(pos))
                for x, y in zip(cuts[:-1], cuts[1:]):
                    total += float(ref(torch.as_tensor(inp[x:y])[None], torch.as_tensor(tgt[x:y])[None]))
                    count += int((tgt[x:y] != IGNORE).sum())
    assert val.rows >= 4 and got == pytest.approx(total / count, rel=1e-5)


def test_token_files_of_both_versions(tmp_path):
    """Version 2 keeps the sample starts and the mask; version 1 files (tokens only) still read; a cut or
    inconsistent version 2 file is refused in one line."""
    samples = _samples(tmp_path / "s.bin", [4, 1, 6])
    tf = open_tokens(tmp_path / "s.bin")
    assert tf.tokens.tolist() == [int(x) for t, _ in samples for x in t]
    assert tf.starts.tolist() == [0, 4, 5] and tf.mask.tolist() == [int(x) for _, m in samples for x in m]
    old = tmp_path / "old.bin"  # as tiertrain wrote it before: a 32-byte header and the tokens
    old.write_bytes(HEADER.pack(MAGIC, 1, 2, 3, 97) + np.array([5, 6, 7], "<u2").tobytes())
    assert read_tokens(old).tolist() == [5, 6, 7] and open_tokens(old).starts is None
    data = (tmp_path / "s.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-3])
    with pytest.raises(DataError, match="truncated"):
        open_tokens(tmp_path / "cut.bin")
    at = 64 + 24  # the sample starts: after the 64-byte header and 11 uint16 tokens, aligned to 8
    bad = data[:at] + struct.pack("<QQQ", 0, 5, 4) + data[at + 24 :]
    (tmp_path / "bad.bin").write_bytes(bad)
    with pytest.raises(DataError, match="sample starts are not increasing"):
        open_tokens(tmp_path / "bad.bin")


@pytest.mark.gpu
def test_the_variable_length_kernel_is_attention_within_each_segment():
    """On a GPU in bf16 the segments go through torch's varlen flash attention in one call: its output and input
    gradients are the dense causal kernel's run on each segment alone (GQA, rows of different segments)."""
    from tiertrain.config import load_config
    from tiertrain.model import llama
    from tiertrain.model.docs import Docs, _varlen

    assert _varlen() is not None
    spec = load_config("debug").model
    ctx = llama.Context.build(spec, 64, torch.bfloat16, torch.device("cuda"))
    pos = np.stack([np.r_[np.arange(20), np.arange(30), np.arange(14)], np.r_[np.arange(64)]])
    docs = Docs.build(pos, ctx)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, 64, 32, device="cuda", generator=g, dtype=torch.bfloat16) for h in (4, 2, 2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = docs.attention(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    want = torch.empty_like(out)
    for r, row in enumerate(docs.spans):
        for a, e in row:
            want[r : r + 1, :, a:e] = llama.attention(
                q[r : r + 1, :, a:e], k[r : r + 1, :, a:e], v[r : r + 1, :, a:e]
            )
    wq, wk, wv = torch.autograd.grad(want, (q, k, v), torch.ones_like(want))
    for a, b in ((out, want), (dq, wq), (dk, wk), (dv, wv)):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)


def test_two_ranks_train_packed_samples_as_one_process(tmp_path):
    """`run --gpus 2` (two gloo processes) on packed samples whose rows hold different counts of trained targets:
    the loss divides by the whole batch's count on both ranks, so the losses and weights are the one process's."""
    _samples(tmp_path / "s.bin", LENGTHS * 5, seed=4)
    steps = ["--set", "train.steps=4", "--set", "checkpoint.every=4"]
    for name, gpus in (("one", []), ("two", ["--gpus", "2"])):
        r = cli("run", *gpus, *tiny(tmp_path / "s.bin"), *steps, "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr
    a, b = (read_metrics(tmp_path / n / "metrics.jsonl") for n in ("one", "two"))
    assert len(a) == len(b) == 4
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=1e-5)
    sa, sb = (state_of(tmp_path / n / "checkpoints" / "step_4") for n in ("one", "two"))
    for k in sa:
        assert np.abs(sa[k] - sb[k]).max() <= 1e-5 * np.abs(sa[k]).max(), k


@pytest.mark.parametrize("variant", ["micro-batches of 2", "tiled"])
def test_gpt_oss_packed_keeps_its_windows_and_sinks_per_sample(tmp_path, variant):
    """gpt-oss (attention sinks, a sliding window of 8 in every other block, experts) on samples of 2 to 33 tokens
    packed into rows of 32: each sample's window and sinks as if it were alone, the loss and every gradient those of
    transformers' GptOssForCausalLM run on each sample alone, to 1e-5 in fp32."""
    from moe_cases import moe_model

    hf = moe_model("gpt_oss")
    hf.config.output_router_logits = (
        False  # the load-balancing loss is over a micro-batch's tokens, packed or not
    )
    hf.save_pretrained(tmp_path / "hf")
    samples = _samples(tmp_path / "s.bin")
    sets = [
        f"train.batch_size={_rows(tmp_path / 's.bin', 32)}",
        "train.micro_batch_size=2",
        "optim.grad_clip=0",
    ]
    sets += ["data.shuffle=false", f'train.init_from="{tmp_path / "hf"}"', *VARIANTS[variant]]
    tr = Trainer(tiny_config(tmp_path / "s.bin", *sets))
    loss = tr.train_step()["loss"]
    got = _grads(tr)
    tr.close()
    hf.config._attn_implementation = "eager"
    pieces = [(t[:-1], np.where(m[1:] != 0, t[1:], IGNORE)) for t, m in samples]
    n, want = sum(int((t != IGNORE).sum()) for _, t in pieces), 0.0
    for inp, tgt in pieces:
        logits = hf(input_ids=torch.as_tensor(inp)[None]).logits[0].float()
        part = torch.nn.functional.cross_entropy(
            logits, torch.as_tensor(tgt), ignore_index=IGNORE, reduction="sum"
        )
        (part / n).backward()
        want += part.item() / n
    assert loss == pytest.approx(want, rel=1e-5)
    for name, p in hf.named_parameters():
        assert _rel(got[name], p.grad) < 1e-5, name


@pytest.mark.parametrize("variant", ["micro-batches of 2", "tiled"])
def test_the_routers_loss_leaves_a_packed_rows_padding_out(tmp_path, variant):
    """Qwen3-MoE with its load-balancing loss on samples packed into rows of 32 (4 rows, 3 padding positions): each
    micro-batch's aux loss is transformers' over the router logits of its samples' tokens alone (the padding left
    out, as its attention_mask leaves it out), and the loss and every gradient are transformers' on each sample
    alone plus router_aux_loss_coef times the micro-batches' mean aux loss, to 1e-5 in fp32."""
    from moe_cases import moe_model
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hf = moe_model("qwen3_moe")
    hf.config.output_router_logits, hf.config.router_aux_loss_coef = (
        True,
        4.0,
    )  # weighed up: its share is the test
    hf.save_pretrained(tmp_path / "hf")
    samples = _samples(tmp_path / "s.bin")
    tf = open_tokens(tmp_path / "s.bin")
    packed = Packed(tf.tokens, tf.starts, tf.mask, 32, "x")
    assert packed.rows == 4 and packed.filled < 4 * 32  # some padding to leave out
    sets = ["train.batch_size=4", "train.micro_batch_size=2", "optim.grad_clip=0", "data.shuffle=false"]
    sets += [f'train.init_from="{tmp_path / "hf"}"', *VARIANTS[variant]]
    tr = Trainer(tiny_config(tmp_path / "s.bin", *sets))
    loss = tr.train_step()["loss"]
    got = _grads(tr)
    tr.close()
    pieces = [(t[:-1], np.where(m[1:] != 0, t[1:], IGNORE)) for t, m in samples]
    n = sum(int((t != IGNORE).sum()) for _, t in pieces)
    total, auxes = 0.0, []
    for micro in ((0, 1), (2, 3)):
        ids = [i for r in micro for i in packed.order[packed.bounds[r] : packed.bounds[r + 1]]]
        logits = []
        for i in ids:
            inp, tgt = pieces[i]
            out = hf(input_ids=torch.as_tensor(inp)[None], output_router_logits=True)
            ce = torch.nn.functional.cross_entropy(
                out.logits[0].float(), torch.as_tensor(tgt), ignore_index=IGNORE, reduction="sum"
            )
            total = total + ce / n
            logits.append(out.router_logits)
        layers = tuple(torch.cat([r[b] for r in logits]) for b in range(len(logits[0])))
        auxes.append(load_balancing_loss_func(layers, hf.config.num_experts, hf.config.num_experts_per_tok))
    want = total + hf.config.router_aux_loss_coef * sum(auxes) / len(auxes)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-5)
    for name, p in hf.named_parameters():
        assert _rel(got[name], p.grad) < 1e-5, name


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["micro-batches of 2", "tiled"])
def test_a_packed_mixture_of_experts_trains_on_the_gpu_in_bf16(tmp_path, variant):
    """Qwen3-MoE with its load-balancing loss on packed samples on a GPU in bf16: the varlen kernel, the grouped
    GEMMs and the padding's mask on the device; two steps' losses those of the CPU in fp32 within bf16's rounding."""
    from moe_cases import moe_model

    hf = moe_model("qwen3_moe")
    hf.config.output_router_logits, hf.config.router_aux_loss_coef = True, 4.0
    hf.save_pretrained(tmp_path / "hf")
    _samples(tmp_path / "s.bin")
    sets = ["train.batch_size=4", "train.micro_batch_size=2", "data.shuffle=false", "train.steps=2"]
    sets += [f'train.init_from="{tmp_path / "hf"}"', *VARIANTS[variant]]
    runs = []
    for more in (['train.device="cpu"'], ['train.device="cuda"', 'train.compute_dtype="bfloat16"']):
        tr = Trainer(tiny_config(tmp_path / "s.bin", *sets, *more))
        runs.append([tr.train_step()["loss"] for _ in range(2)])
        tr.close()
    assert runs[1] == pytest.approx(runs[0], rel=2e-2)


@pytest.mark.gpu
def test_packed_attention_under_deterministic_repeats_its_bits():
    """train.deterministic on packed rows: the varlen kernel's backward, whose dQ differs run to run at 8k tokens,
    runs in torch's deterministic mode as the dense kernels' does, and gives the same bits every time."""
    from tiertrain.config import load_config
    from tiertrain.model import llama
    from tiertrain.model.docs import Docs, _varlen

    if _varlen() is None:
        pytest.skip("this torch has no varlen attention")
    S, B, H, KV, D = 8192, 2, 32, 8, 128
    ctx = llama.Context.build(load_config("debug").model, S, torch.bfloat16, torch.device("cuda"))
    docs = Docs.build(np.stack([np.r_[np.arange(6000), np.arange(2192)], np.arange(S)]), ctx)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for h in (H, KV, KV)
    )
    go = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    runs = [torch.autograd.grad(docs.attention(q, k, v, det=True), (q, k, v), go) for _ in range(5)]
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(r, runs[0]))
    assert not torch.are_deterministic_algorithms_enabled()  # as it was, after the backward
