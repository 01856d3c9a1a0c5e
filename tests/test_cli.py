"""The command line: a run writes what it promises; bad input fails with one line and no traceback."""

from __future__ import annotations

import json
import tomllib

import numpy as np
import pytest

from conftest import cli
from tiertrain.metrics import read_metrics

FAST = ["--set", "train.steps=12", "--set", "train.seq_len=64", "--set", "train.log_every=4"]


def test_run_writes_metrics_and_config(tmp_path):
    # --batch-size and --seq-len as `plan` takes them (its nearest plans name them), over --set: the debug
    # config's micro-batch of 8 does not divide 12, the plan's does
    r = cli("run", *FAST, "--batch-size", "12", "--seq-len", "96", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [x["step"] for x in recs] == list(range(1, 13))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "step_s", "tokens_per_s"):
        assert key in recs[0]
    assert recs[-1]["tokens"] == 12 * 12 * 96
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.0  # the debug model learns the built-in corpus fast
    saved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert saved["train"]["steps"] == 12 and saved["model"]["hidden_size"] == 128
    assert (saved["train"]["batch_size"], saved["train"]["seq_len"]) == (12, 96)
    assert 12 % json.loads((tmp_path / "run" / "plan.json").read_text())["micro_batch"] == 0
    out = r.stdout
    log = (tmp_path / "run" / "train.log").read_text()  # the progress lines, as shown
    assert "step 12/12" in log and log.splitlines() == out.splitlines()
    assert (
        "parameters" in out and "host tier" in out and "step 12/12" in out and "tok/s" in out and "ETA" in out
    )
    again = cli("run", *FAST, "--out", str(tmp_path / "run"))  # never writes over a run
    assert again.returncode != 0 and "already holds a run" in again.stderr
    fixed = ["--set", "train.micro_batch_size=4", "--set", "train.steps=1"]  # a --set names the micro-batch
    r = cli("run", *FAST, "--batch-size", "12", *fixed, "--out", str(tmp_path / "fixed"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "fixed" / "plan.json").read_text())["micro_batch"] == 4


def test_prepare_then_train_on_it(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    r = cli("prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "a.bin"))
    assert r.returncode == 0, r.stderr
    r = cli(
        "run",
        *FAST,
        "--set",
        f'data.path="{tmp_path / "a.bin"}"',
        "--set",
        "train.batch_size=8",
        "--out",
        str(tmp_path / "run"),
    )
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--set", "train.nope=1"], "unknown key train.nope"),
        (["--set", "train.batch_size=-2"], "train.batch_size"),
        (["--set", "train.seq_len=5000"], "max_position_embeddings"),
        (["--config", "missing.toml"], "not found"),
        (["--set", 'data.path="/nonexistent/tokens.bin"'], "tiertrain prepare"),
        (["--set", 'data.path="SHORT"'], "fewer than one batch"),
        (["--set", 'train.device="cuda"'], "no CUDA GPU"),
        (["--hardware", "missing.json"], "tiertrain probe --out"),
        (["--gpu", "v100"], "unknown GPU 'v100'; known GPUs: h100"),
        (["--set", "hardware.gpu=x"], "unknown GPU 'x'"),
        (
            ["--nvme-gb", "5"],
            "needs tiers.nvme_dir (--nvme-dir DIR)",
        ),  # it spilled into the working directory
    ],
)
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


def test_gpus_inside_a_job_of_other_ranks_is_refused(tmp_path):
    """--gpus where WORLD_SIZE is already set (a torchrun rank, or a variable left in the shell) would train on the
    environment's ranks, not on N: refused in one line, nothing made; the same count as the host's ranks is torchrun's
    own and goes on."""
    import os

    env = {**os.environ, "WORLD_SIZE": "1"}
    env.pop("LOCAL_WORLD_SIZE", None)
    r = cli("run", "--gpus", "2", "--out", str(tmp_path / "run"), env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "unset WORLD_SIZE" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()
    r = cli("run", "--gpus", "1", *FAST, "--set", "train.steps=1", "--out", str(tmp_path / "run"), env=env)
    assert r.returncode == 0, r.stderr


def test_short_help_option():
    for args in (["-h"], ["run", "-h"], ["plan", "-h"]):
        r = cli(*args)
        assert r.returncode == 0 and "Usage:" in r.stdout, args


def test_report_summarizes_and_plots(tmp_path):
    """Medians skip step 1 (no overlap yet): by hand, steps 2-4 have step_s 2, 3, 2 -> 2.0 s; predicted 1.6."""
    import json

    recs = [
        {
            "step": k,
            "loss": 5.0 - k,
            "tokens": 1000 * k,
            "step_s": s,
            "tokens_per_s": 1000 / s,
            "model_tflops": 1.0,
            "forward_s": 0.5,
            "backward_s": 1.0,
            "opt_wait_s": s - 1.5,
            "pred_step_s": 1.6,
            "nvme_read_gb": 3.0,
            "nvme_write_gb": 2.0,
            "host_rss_gb": 10.0 + k,
        }
        for k, s in ((1, 9.0), (2, 2.0), (3, 3.0), (4, 2.0))
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = cli("report", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "4 steps (up to step 4), 4,000 tokens; loss 4.0000 -> 1.0000" in r.stdout
    assert "median step 2.000 s: 500 tokens/s" in r.stdout
    assert "measured / predicted step: 2.000 / 1.600 s (+25%)" in r.stdout
    assert "read 3.0 GB, write 2.0 GB" in r.stdout and "host RSS 14.0 GB" in r.stdout
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    bad = cli("report", str(tmp_path / "nothing"))
    assert bad.returncode == 2 and "holds no metrics.jsonl" in bad.stderr


def test_probe_refuses_a_missing_disk_directory(tmp_path):
    r = cli("probe", "--nvme-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "hw.json"))
    assert r.returncode == 2 and "is not a writable directory" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "hw.json").exists()


def test_click_s_own_refusals_are_one_line():
    """A flag's value out of its range, an unknown option or command: one line and exit 2, as tiertrain's own
    refusals, where click printed its usage and "Error:" in three."""
    for args, words in (
        (
            ["run", "--batch-size", "0"],
            "error: Invalid value for '--batch-size': 0 is not in the range x>=1.",
        ),
        (["run", "--bogus"], "error: No such option '--bogus'"),
        (["bogus"], "error: No such command 'bogus'"),
        (["plan", "--config", "debug", "--format", "xml"], "error: Invalid value for '--format'"),
    ):
        r = cli(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(words), (args, r.stderr)


def test_an_empty_path_is_refused_not_taken_for_none(tmp_path):
    """`--out "$OUT"` with OUT unset trained into a new runs/<config>-<time> here; `--init-from ""` trained the
    debug model."""
    for flag in ("--out", "--init-from", "--resume", "--nvme-dir", "--hardware"):
        r = cli("run", flag, "", cwd=tmp_path)
        assert (
            r.returncode == 2
            and r.stderr.strip() == f"error: {flag} is empty; pass a path, or leave {flag} out"
        )
    assert not list(tmp_path.iterdir())


def test_prepare_and_export_give_sigterm_back_as_they_found_it(tmp_path):
    """In-process use (a notebook, a script): `prepare` and `export` take SIGTERM as Ctrl-C while they write their
    temporaries, and give the handler back after, done or refused."""
    import signal

    from click.testing import CliRunner

    from tiertrain.cli import main

    def mine(signum, frame):
        pass

    was = signal.signal(signal.SIGTERM, mine)
    try:
        runner = CliRunner()
        (tmp_path / "a.txt").write_text("some text\n")
        for args in (
            ["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "a.bin")],
            ["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "a.npy")],  # refused
            ["export", str(tmp_path / "none"), "--to", str(tmp_path / "hf")],  # refused
        ):
            runner.invoke(main, args)
            assert signal.getsignal(signal.SIGTERM) is mine, args
        assert (tmp_path / "a.bin").is_file()
    finally:
        signal.signal(signal.SIGTERM, was)
