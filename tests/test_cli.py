"""The command line: a run writes what it promises; bad input fails with one line and no traceback."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import tomllib

from tiertrain.metrics import read_metrics

FAST = ["--set", "train.steps=12", "--set", "train.seq_len=64", "--set", "train.log_every=4"]


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tiertrain", *args], capture_output=True, text=True, cwd=cwd)


def test_run_writes_metrics_and_config(tmp_path):
    r = cli("run", *FAST, "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [x["step"] for x in recs] == list(range(1, 13))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "step_s", "tokens_per_s"):
        assert key in recs[0]
    assert recs[-1]["tokens"] == 12 * 16 * 64
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.0  # the debug model learns the built-in corpus fast
    saved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert saved["train"]["steps"] == 12 and saved["model"]["hidden_size"] == 128
    out = r.stdout
    assert "parameters" in out and "host tier" in out and "step 12/12" in out and "tok/s" in out and "ETA" in out
    again = cli("run", *FAST, "--out", str(tmp_path / "run"))  # never writes over a run
    assert again.returncode != 0 and "already holds a run" in again.stderr


def test_prepare_then_train_on_it(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    r = cli("prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "a.bin"))
    assert r.returncode == 0, r.stderr
    r = cli("run", *FAST, "--set", f'data.path="{tmp_path / "a.bin"}"', "--set", "train.batch_size=8",
            "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("args, words", [
    (["--set", "train.nope=1"], "unknown key train.nope"),
    (["--set", "train.batch_size=-2"], "train.batch_size"),
    (["--set", "train.seq_len=5000"], "max_position_embeddings"),
    (["--config", "missing.toml"], "not found"),
    (["--set", 'data.path="/nonexistent/tokens.bin"'], "tiertrain prepare"),
    (["--set", 'data.path="SHORT"'], "fewer than one batch"),
    (["--set", 'train.device="cuda"'], "no CUDA GPU"),
])
def test_bad_input_is_one_line_without_traceback(tmp_path, args, words):
    np.save(tmp_path / "short.npy", np.arange(100))
    args = [a.replace("SHORT", str(tmp_path / "short.npy")) for a in args]
    if "cuda" in " ".join(args):
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    r = cli("run", *args, "--out", str(tmp_path / "run"))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
