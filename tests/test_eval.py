"""The validation loss (data.val_fraction / data.val_path, train.eval_every): the training forward pass's
math, against a plain PyTorch evaluation of the same weights, and the training's bits untouched by it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import DEEP, VARIANTS, budget_for, tiny_config
from tiertrain.config import load_config
from tiertrain.data import Loader, held_out
from tiertrain.errors import ConfigError
from tiertrain.loop import fit
from tiertrain.model.reference import ReferenceLM
from tiertrain.modes import Home
from tiertrain.tokenfile import read_tokens
from tiertrain.trainer import Trainer


def _plain_val_loss(cfg, state: dict, val: np.ndarray, batches: int) -> float:
    """nn.Module evaluation of `state` over the first `batches` unshuffled batches of `val`."""
    ref = ReferenceLM(cfg.model)
    ref.load_state_dict(state, strict=False)  # a tied head shares the embedding
    loader = Loader(val, cfg.train.seq_len, cfg.train.batch_size, cfg.model.vocab_size, False, 0)
    with torch.no_grad():
        losses = [
            float(ref(*(torch.from_numpy(a) for a in loader.batch(k))))
            / (cfg.train.batch_size * cfg.train.seq_len)
            for k in range(batches)
        ]
    return sum(losses) / batches


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_val_loss_equals_a_plain_evaluation(token_file, tmp_path, variant):
    """Held-out rows of the training file, evaluated every 3 steps and at the end: each val_loss in
    metrics.jsonl is the plain PyTorch loss of the weights after that step, over the same held-out rows."""
    sets = [
        *VARIANTS[variant],
        "data.val_fraction=0.1",
        "train.eval_every=3",
        "train.eval_batches=2",
        "train.steps=7",
    ]
    cfg = tiny_config(token_file, *sets)
    tr = Trainer(cfg)
    train_part, val = held_out(read_tokens(token_file), cfg.train.seq_len, 0.1)
    assert tr.loader.rows + tr.val.rows == (len(read_tokens(token_file)) - 1) // cfg.train.seq_len
    got = {}
    for step in range(1, 8):
        tr.train_step()
        if step in (3, 6, 7):
            got[step] = (tr.evaluate(), _plain_val_loss(cfg, tr.state_dict(), val, 2))
    tr.close()
    for step, (mine, plain) in got.items():
        assert mine == pytest.approx(plain, rel=1e-5, abs=1e-6), step
    assert got[3][0] != got[6][0]
    recs = [json.loads(x) for x in _fit(cfg, tmp_path / "run").read_text().splitlines()]
    assert [r["step"] for r in recs if "val_loss" in r] == [3, 6, 7]
    assert [r["val_loss"] for r in recs if "val_loss" in r] == [got[s][0] for s in (3, 6, 7)]


@pytest.mark.parametrize("fraction", [0.004, 0.02])
def test_every_held_out_row_is_evaluated(token_file, fraction):
    """Held-out rows that fill no whole batch (5 rows against a batch of 8), or whose last batch is part-filled
    (25 rows): each is evaluated once, the loss the plain mean over all their targets. Whole batches alone were
    read before: 5 rows were refused, and of packed conversations, the shortest (packed last) never counted."""
    cfg = tiny_config(token_file, f"data.val_fraction={fraction}", "train.eval_batches=100", "train.steps=2")
    tr = Trainer(cfg)
    S, rows = cfg.train.seq_len, tr.val.rows
    assert rows % cfg.train.batch_size
    tr.train_step()
    mine = tr.evaluate()
    state = tr.state_dict()
    tr.close()
    _, val = held_out(read_tokens(token_file), S, fraction)
    assert mine == pytest.approx(_plain_mean(cfg, state, val, rows), rel=1e-5, abs=1e-6)


def _plain_mean(cfg, state: dict, val: np.ndarray, rows: int) -> float:
    """nn.Module evaluation of `state`: the mean loss over every target of the first `rows` rows of `val`."""
    S = cfg.train.seq_len
    x = torch.from_numpy(np.stack([val[r * S : r * S + S + 1] for r in range(rows)]).astype(np.int64))
    ref = ReferenceLM(cfg.model)
    ref.load_state_dict(state, strict=False)
    with torch.no_grad():
        return float(ref(x[:, :-1], x[:, 1:])) / (rows * S)


def _fit(cfg, out):
    lines = []
    fit(Trainer(cfg), out, echo=lines.append)
    assert any("val " in x for x in lines) and "validation loss" in lines[-1]
    return out / "metrics.jsonl"


@pytest.mark.parametrize("spill", ["none", "nvme", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_evaluating_changes_no_training_bit(token_file, tmp_path, spill):
    """Evaluating after steps (which lands the pending update early and leaves the weight slots stale)
    gives the same losses and weights as a run that never evaluates: in RAM with speculation, and with the
    streamed weights and moments spilled to NVMe."""
    sets = ["optim.grad_clip=100", "optim.speculate_units=99"]
    if spill == "cuda":  # GPU updates and a resident unit too: every update path lands before the evaluation
        sets = [
            'train.device="cuda"',
            'train.compute_dtype="bfloat16"',
            'tiers.stream="master"',
            "tiers.gpu_update_units=2",
            "tiers.gpu_resident_gb=0.0005",
            *sets,
        ]
    if spill == "nvme":
        sets = [*DEEP, 'train.compute_dtype="bfloat16"', 'tiers.stream="compute"', 'tiers.io="posix"']
        sets.append(f"tiers.host_gb={budget_for(tiny_config(token_file, *sets))}")

    def run(evaluate: bool, nvme):
        extra = [f'tiers.nvme_dir="{nvme}"'] if spill == "nvme" else []
        tr = Trainer(tiny_config(token_file, *sets, *extra, "data.val_fraction=0.2", "train.eval_batches=1"))
        if spill == "nvme":
            assert Home.NVME in tr.run_plan.where().values()
        losses, vals = [], []
        for _ in range(5):
            losses.append(tr.train_step()["loss"])
            if evaluate:
                vals.append(tr.evaluate())
        sd = tr.state_dict()
        tr.close()
        return losses, sd, vals

    a, b = run(True, tmp_path / "a"), run(False, tmp_path / "b")
    assert a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in b[1])
    assert len(set(a[2])) == 5  # the weights moved between evaluations


def test_a_separate_validation_file(token_file, tmp_path):
    val = tmp_path / "val.npy"
    np.save(val, np.asarray(read_tokens(token_file))[:2000])
    tr = Trainer(tiny_config(token_file, f'data.val_path="{val}"', "train.eval_batches=100"))
    tr.train_step()
    loss = tr.evaluate()  # every row the file holds: 62 of 32 tokens, 7 batches of 8 and one of 6
    plain = _plain_mean(tr.cfg, tr.state_dict(), np.load(val), tr.val.rows)
    tr.close()
    assert tr.val.rows == 62 and loss == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize(
    "sets,words",
    [
        (["train.eval_every=5"], ["train.eval_every", "data.val_path or data.val_fraction"]),
        (['data.val_path="x.npy"', "data.val_fraction=0.1"], ["data.val_fraction", "set one"]),
        (["data.val_fraction=1"], ["data.val_fraction", "[0, 1)"]),
    ],
)
def test_validation_settings_are_checked(sets, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert all(w in str(e.value) for w in words)


def test_tensorboard_scalars_when_asked(token_file, tmp_path):
    """train.tensorboard = true: event files under <out>/tensorboard with metrics.jsonl's numbers; off (the
    default): none, and no tensorboard import needed."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sets = ["train.steps=3", "data.val_fraction=0.1"]
    fit(
        Trainer(tiny_config(token_file, *sets, "train.tensorboard=true")),
        tmp_path / "tb",
        echo=lambda s: None,
    )
    ev = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    ev.Reload()
    recs = [json.loads(x) for x in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert [e.value for e in ev.Scalars("loss")] == pytest.approx([r["loss"] for r in recs])
    assert [e.step for e in ev.Scalars("val_loss")] == [3] and "tokens_per_s" in ev.Tags()["scalars"]
    fit(Trainer(tiny_config(token_file, *sets)), tmp_path / "plain", echo=lambda s: None)
    assert not (tmp_path / "plain" / "tensorboard").exists()


def test_tensorboard_missing_is_refused_before_allocation(token_file, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_tb(name, *a, **k):
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tb)
    with pytest.raises(ConfigError, match=r"tiertrain\[tensorboard\]"):
        Trainer(tiny_config(token_file, "train.tensorboard=true"))


def test_held_out_rows_that_train_nothing_count_nothing(tmp_path):
    """A held-out batch of samples that train nothing adds nothing to the validation loss's count (it added 1:
    4.5614 against the true mean 4.6008); held-out rows that train nothing at all are refused in one line."""
    from tiertrain.errors import DataError
    from tiertrain.rows import IGNORE
    from tiertrain.tokenfile import TokenWriter

    rng = np.random.default_rng(0)
    path = tmp_path / "s.bin"
    w = TokenWriter(path, 97, samples=True, masked=True)
    for n, trains in [(30, 1)] * 64 + [
        (33, 0)
    ] * 4:  # held out last: 4 trained samples, then 4 untrained rows
        w.add(rng.integers(0, 97, n), np.full(n, trains, np.uint8), start=True)
    w.close()
    sets = ["train.batch_size=4", "data.val_fraction=0.1176", "train.eval_batches=10", "train.steps=1"]
    tr = Trainer(tiny_config(path, *sets))
    total = count = 0.0
    for k in range(tr.val.batches):
        b = tr.val.get(k)
        m = int((b.targets != IGNORE).sum())
        if m:
            inp, tgt = (torch.from_numpy(a).split(tr.run_plan.micro_batch) for a in b[:2])
            total += float(tr.run.step.evaluate(list(inp), list(tgt), tr._docs(b.positions), m)) * m
            count += m
    assert tr.val.batches == 2 and count and tr.evaluate() == pytest.approx(total / count, rel=1e-6)
    tr.close()
    w = TokenWriter(tmp_path / "none.bin", 97, samples=True, masked=True)
    for _ in range(4):
        w.add(rng.integers(0, 97, 33), np.zeros(33, np.uint8), start=True)
    w.close()
    with pytest.raises(DataError, match="hold no trained target"):
        Trainer(tiny_config(path, *sets[:-3], f'data.val_path="{tmp_path / "none.bin"}"'))
