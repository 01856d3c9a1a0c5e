"""Faults a new or careless user meets: tiertrain never empties, overwrites or deletes what it did not create,
a refusal is one line (exit 2, no traceback) before anything is allocated, a suggested budget runs, two runs
with the default threads give the same bits, and a save killed at any moment resumes bit-identically."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    DEEP,
    DEEP_ARGS,
    STEPS,
    cli,
    least_gb,
    python_c,
    refused,
    same_run,
    same_state,
    tiny,
    tree_hash,
    user_files,
    write_tokens,
)
from tiertrain.metrics import read_metrics
from tiertrain.sizes import budget, gb


# ---- data loss and overwrites -------------------------------------------------------------------
def test_nvme_store_is_its_own_new_directory(token_file, tmp_path):
    """--out inside --nvme-dir, an --out whose name a user's directory there shares, another run's store
    there, --out . and --out ..: the run spills through a new marked directory, removed at its end, and
    nothing else under the NVMe directory changes."""
    nvme = tmp_path / "nvme"
    mine = user_files(nvme / "Documents")
    other = nvme / "tiertrain-other-abc"  # a live run's store: its marker names a process that exists
    other.mkdir()
    (other / "tiertrain-scratch.json").write_text(
        json.dumps(
            {"format": "tiertrain-nvme/1", "run": "/x/other", "host": os.uname().nodename, "pid": os.getpid()}
        )
    )
    spill = tiny(token_file, *DEEP_ARGS, "--host-gb", least_gb(token_file), "--nvme-dir", str(nvme))
    r = cli("run", *spill, "--out", str(nvme / "myrun"))
    assert r.returncode == 0, r.stderr
    assert "NVMe tier" in r.stdout and "tiertrain-myrun-" in r.stdout  # it did spill, to its own directory
    assert (nvme / "myrun" / "checkpoints" / "step_12").is_dir() and (
        nvme / "myrun" / "metrics.jsonl"
    ).is_file()
    r = cli("run", *spill, "--out", str(tmp_path / "runs" / "Documents"))
    assert r.returncode == 0, r.stderr
    (tmp_path / "cwd").mkdir()
    r = cli("run", *spill, "--out", ".", cwd=tmp_path / "cwd")
    assert r.returncode == 0, r.stderr
    assert tree_hash(nvme / "Documents") == mine and (other / "tiertrain-scratch.json").is_file()
    assert sorted(p.name for p in nvme.iterdir()) == ["Documents", "myrun", "tiertrain-other-abc"]
    (nvme / "sub").mkdir()
    before = tree_hash(nvme)
    refused(cli("run", *spill, "--out", "..", cwd=nvme / "sub"), "--out ..")
    assert tree_hash(nvme) == before


def test_out_and_nvme_store_stay_apart(token_file, tmp_path):
    spill = tiny(token_file, *DEEP_ARGS, "--host-gb", least_gb(token_file))
    refused(
        cli("run", *spill, "--nvme-dir", str(tmp_path / "run" / "nvme"), "--out", str(tmp_path / "run")),
        "inside --out",
    )
    store = tmp_path / "nvme" / "tiertrain-x-1"
    store.mkdir(parents=True)
    (store / "tiertrain-scratch.json").write_text("{}")
    refused(
        cli("run", *spill, "--nvme-dir", str(tmp_path / "nvme"), "--out", str(store / "run")),
        "inside tiertrain's scratch store",
    )


def test_an_out_that_is_not_a_run_is_never_written(token_file, tmp_path):
    """A hand-written config.toml in --out, and a directory of other files: refused, untouched."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.toml").write_text("# my own notes\n")
    before = tree_hash(out)
    refused(cli("run", *tiny(token_file), "--out", str(out)), "not a tiertrain run")
    assert tree_hash(out) == before
    r = cli("run", *tiny(token_file), "--out", str(tmp_path / "file.txt"))  # missing: made; a file: refused
    assert r.returncode == 0
    (tmp_path / "f").write_text("x")
    refused(cli("run", *tiny(token_file), "--out", str(tmp_path / "f")), "is a file")


def test_a_resume_writes_only_into_its_own_run(token_file, tmp_path):
    """--resume A/checkpoints/step_N --out B, B another run (or a directory of checkpoints without metrics):
    refused, B untouched; into a new empty --out it is a new run from that checkpoint."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(a)).returncode == 0
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(b)).returncode == 0
    before = tree_hash(b)
    refused(cli("run", "--resume", str(a / "checkpoints" / "step_3"), "--out", str(b)), "holds another run")
    assert tree_hash(b) == before
    (b / "metrics.jsonl").unlink()
    (b / "tiertrain-run.json").unlink()  # a run directory written before the marker: checkpoints are enough
    before = tree_hash(b)
    refused(cli("run", "--resume", str(a / "checkpoints" / "step_3"), "--out", str(b)), "holds another run")
    assert tree_hash(b) == before
    fork = tmp_path / "fork"
    r = cli("run", "--resume", str(a / "checkpoints" / "step_3"), "--out", str(fork))
    assert r.returncode == 0, r.stderr
    ra, rf = (read_metrics(d / "metrics.jsonl") for d in (a, fork))
    # the fork logs from step 4, as a did
    assert [(x["step"], x["loss"], x["grad_norm"]) for x in rf] == [
        (x["step"], x["loss"], x["grad_norm"]) for x in ra[3:]
    ]
    assert same_state(a, fork)


def test_checkpoints_copied_into_a_folder_make_no_run_and_step_names_are_not_enough(token_file, tmp_path):
    """A user's folder holding copies of checkpoints in its checkpoints/ (and a config.toml of theirs) is not a
    run: a resume from one is refused, the folder untouched. In a run's own checkpoints/, a directory named step_N
    that is not a checkpoint (an export there) is neither the latest to resume nor pruned."""
    run, mine = tmp_path / "run", tmp_path / "mine"
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(run)).returncode == 0
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "config.toml").write_text("# my notes\n")
    shutil.copytree(run / "checkpoints" / "step_3", mine / "checkpoints" / "step_3")
    before = tree_hash(mine)
    refused(cli("run", "--resume", str(mine / "checkpoints" / "step_3")), "not inside a run")
    refused(cli("run", "--resume", "latest", "--out", str(mine)), "holds no tiertrain run")
    assert tree_hash(mine) == before
    export = run / "checkpoints" / "step_1"
    assert cli("export", str(run), "--to", str(export)).returncode == 0
    more = ["--set", "train.steps=10", "--set", "checkpoint.every=1", "--set", "checkpoint.keep=2"]
    r = cli("run", "--resume", "latest", "--out", str(run), *more)
    assert r.returncode == 0, r.stderr
    assert (export / "config.json").is_file()  # not pruned, where the run kept its last 2 checkpoints
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1", "step_10", "step_9"]


def test_a_run_file_tiertrain_did_not_write_is_one_line(token_file, tmp_path):
    """A line of metrics.jsonl that is not a record (another program's, a list) and a marker naming a number as
    the checkpoint directory: one line each, a resume refused before it builds anything, `report` too."""
    run = tmp_path / "run"
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(run)).returncode == 0
    metrics = (run / "metrics.jsonl").read_text()
    for line in ('{"note": "mine"}', "[1, 2]"):
        (run / "metrics.jsonl").write_text(metrics + line + "\n" + metrics.splitlines()[-1] + "\n")
        refused(cli("run", "--resume", "latest", "--out", str(run)), "line 9 is not a record tiertrain wrote")
        refused(cli("report", str(run)), "line 9 is not a record")
    (run / "metrics.jsonl").write_text(metrics)
    (run / "tiertrain-run.json").write_text('{"checkpoints": 5}')
    refused(cli("run", "--resume", "latest", "--out", str(run)), "tiertrain-run.json names 5")


def test_a_torn_metrics_line_does_not_stop_a_resume(token_file, tmp_path):
    out = tmp_path / "run"
    assert cli("run", *tiny(token_file), *STEPS, "--set", "train.steps=6", "--out", str(out)).returncode == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 2.1')  # a write cut short
    r = cli("run", "--resume", "latest", "--out", str(out), "--set", "train.steps=8")
    assert r.returncode == 0, r.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


def test_a_full_disk_while_logging_leaves_whole_lines(token_file, tmp_path):
    """The metrics file hits the size limit mid-run (checkpoints only at the end): one line, which says that
    the run saved no checkpoint to go on from (it used to advise a --resume that is refused), every line left in
    metrics.jsonl whole."""
    out = tmp_path / "run"
    out.mkdir()
    # config.toml, plan.json (4.2 kB) fit; 12 records (5.2 kB) do not
    r = cli("run", *tiny(token_file), "--out", str(out), fsize=4608)
    line = refused(r, "metrics.jsonl", "file size limit", "it saved no checkpoint", "run it again")
    assert "--resume" not in line
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert lines and all(line.endswith("\n") and json.loads(line) for line in lines)


def test_a_disk_full_at_start_is_one_line(token_file, tmp_path):
    refused(cli("run", *tiny(token_file), "--out", str(tmp_path / "run"), fsize=0), "cannot write", "--out")


# ---- budgets and sizes --------------------------------------------------------------------------
def test_the_least_host_budget_named_runs(token_file, tmp_path):
    r = cli(
        "run",
        *tiny(token_file, *DEEP_ARGS),
        "--host-gb",
        "0.0001",
        "--nvme-dir",
        str(tmp_path / "nvme"),
        "--out",
        str(tmp_path / "a"),
    )
    line = refused(r, "--host-gb", "`tiertrain plan` with the same --config")  # it names the nearest plans
    least = re.search(r"raise --host-gb to at least ([0-9.]+)", line).group(1)
    assert float(least) * 1e9 >= float(least_gb(token_file)) * 1e9 - 1e3
    r = cli(
        "run",
        *tiny(token_file, *DEEP_ARGS),
        "--host-gb",
        least,
        "--nvme-dir",
        str(tmp_path / "nvme"),
        "--out",
        str(tmp_path / "b"),
    )
    assert r.returncode == 0, r.stderr


def test_a_state_larger_than_the_machine_is_refused_before_allocation(tmp_path):
    """llama-3b's state (about 55 GB) and a small batch's working set on a CPU with less RAM: one line naming
    the RAM and a --host-gb that fits with --nvme-dir; llama-70b's under --host-gb 100000 (1.1 TB of state):
    one line naming the RAM. No run directory is left behind."""
    import psutil

    avail = psutil.virtual_memory().available
    if avail > 70e9:
        pytest.skip("this machine holds llama-3b's state")
    out, cpu = tmp_path / "run", ["--set", 'train.device="cpu"']
    small = ["--set", "train.batch_size=2", "--set", "train.micro_batch_size=1"]
    line = refused(
        cli("run", "--config", "llama-3b", *cpu, *small, "--out", str(out)), "RAM available", "--nvme-dir"
    )
    assert not out.exists()
    fit = float(re.search(r"pass --host-gb ([0-9.]+)", line).group(1))
    # the RAM the refusal saw (another test process may have taken or freed some since `avail`)
    have = float(
        re.search(r"this machine has ([0-9.,]+) GB of RAM available", line).group(1).replace(",", "")
    )
    assert 0 < fit < have
    refused(
        cli("run", "--config", "llama-70b", *cpu, "--host-gb", "100000", "--out", str(out)), "RAM available"
    )
    assert not out.exists()


def test_sizes_have_enough_digits_and_budgets_round_up():
    assert gb(5e6) == "4.8 MiB" and gb(12_328_960) == "11.8 MiB" and gb(58.3e9) == "58.30 GB"
    assert gb(1000) == "1000 B" and gb(5000) == "4.9 KiB"
    for n in (12_328_960, 1e9, 58.3e9 + 1, 999.5e9, 7.0):
        assert float(budget(n)) * 1e9 >= n
    assert budget(12_328_960) == "0.0124"


def test_plan_of_the_debug_config_finishes():
    """The largest-model search is bounded (a hang check, not a timing)."""
    r = subprocess.run(
        [sys.executable, "-m", "tiertrain", "plan", "--config", "debug"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Largest model of this shape that fits these budgets: at least 4096 layers" in r.stdout
    # a small model's sizes in M and MiB: not "0.00 B parameters" and every row "0.0 GB"
    assert r.stdout.startswith("# Plan: debug, 0.84 M parameters"), r.stdout[:80]
    assert "| fp32 master weights | 3.2 MiB | 0.0 GB |" in r.stdout
    assert (
        re.search(r"\| weight slots \| [0-9.]+ MiB \|", r.stdout)
        and "| **total** | **0.0 GB** |" not in r.stdout
    )


# ---- the same bits every run ----------------------------------------------------------------------
def test_two_runs_with_the_default_threads_are_bit_identical(tmp_path):
    """The debug model (its embedding gradient is large enough for several OpenMP threads) on the built-in
    corpus, twice, with the default thread count: the same losses and the same checkpoint bytes."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    runs = []
    for name in "ab":
        r = cli("run", "--set", "train.steps=4", "--out", str(tmp_path / name), env=env, fresh=True)
        assert r.returncode == 0, r.stderr
        runs.append(tmp_path / name)
    la, lb = ([json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()] for d in runs)
    assert la == lb
    ha, hb = (tree_hash(d / "checkpoints" / "step_4") for d in runs)
    chunks = [k for k in ha if "/c/" in k]
    assert chunks and all(ha[k] == hb[k] for k in chunks)


@pytest.mark.parametrize(
    "where", ["tiertrain.state.State.init_weights", "tiertrain.trainer.Trainer.describe"]
)
def test_a_sigterm_in_the_setup_leaves_no_scratch_store(where, token_file, tmp_path):
    """A scheduler's SIGTERM while the trainer is built (in its weights' init, after the scratch store was made),
    or after, before the first step: the store goes, as for a Ctrl-C (it was killed, the store left)."""
    module, cls, name = where.rsplit(".", 2)
    script = (
        "import importlib, os, signal, sys\n"
        "from tiertrain.cli import main\n"
        f"owner = getattr(importlib.import_module({module!r}), {cls!r})\n"
        f"was = getattr(owner, {name!r})\n"
        "def stopped(self, *a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return was(self, *a, **k)\n"
        f"setattr(owner, {name!r}, stopped)\n"
        "sys.argv = ['tiertrain', *sys.argv[1:]]\n"
        "main()\n"
    )
    nv = tmp_path / "nv"
    nv.mkdir()
    sets = tiny(token_file, *DEEP_ARGS, "--host-gb", least_gb(token_file))
    r = subprocess.run(
        [sys.executable, "-c", script, "run", *sets, "--nvme-dir", str(nv), "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != -15 and "Traceback" not in r.stderr, r.stderr
    assert not list(nv.iterdir())


# ---- a save killed at any moment -------------------------------------------------------------------
KILLER = r"""
import os, shutil, signal, sys
import tiertrain.checkpoint as ckpt
from tiertrain.cli import main

what, nth, step = sys.argv[1], int(sys.argv[2]), sys.argv[3]
seen = [0]

def hit(path):
    if step in str(path):
        seen[0] += 1
        if seen[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)

if what == "chunk":  # killed before the nth chunk file of the save: a torn .tmp
    body = ckpt._body
    ckpt._body = lambda file, t, write, io, at=0: (write and hit(file), body(file, t, write, io, at))
else:  # "before" / "after" the nth rename of the save, or of the cut of the timeline that moves step_N aside
    import tiertrain.rundir as rundir
    rename = os.rename
    def patched(a, b):
        if what == "before":
            hit(a)
        rename(a, b)
        if what == "after":
            hit(a)
    for mod in (ckpt, rundir):
        mod.os = type(os)("os")
        mod.os.__dict__.update(os.__dict__)
        mod.os.rename = patched
sys.argv = ["tiertrain", *sys.argv[4:]]
main()
"""


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory) -> tuple[Path, Path]:
    """(the token file, the run of 8 steps that never stopped): one for every kill below."""
    d = tmp_path_factory.mktemp("whole")
    tokens = write_tokens(d / "tokens.npy")
    # a fresh interpreter, the resumes forks: string hashes that differ between the two processes
    assert cli("run", *tiny(tokens), *STEPS, "--out", str(d / "whole"), fresh=True).returncode == 0
    return tokens, d / "whole"


@pytest.mark.parametrize(
    "resave, what, nth",
    [
        (False, "chunk", 7),
        (False, "before", 1),
        (False, "before", 2),
        (False, "after", 2),
        (True, "chunk", 7),
        (True, "before", 1),
        (True, "after", 1),
        (True, "before", 2),
        (True, "before", 3),
        (True, "after", 3),
    ],
)
def test_a_save_killed_at_any_moment_resumes_bit_identically(whole_run, tmp_path, resave, what, nth):
    """SIGKILL inside the save of step 6: while its chunks are written, before or after each rename. A resume
    from step 3 of a run that had saved step 6 first moves that step_6 aside (the cut of the timeline: the first
    rename), then saves its own. --resume latest then finishes as the run that never stopped: the same losses,
    master weights and moments, and the abandoned step_6 kept aside."""
    (token_file, whole), cut = whole_run, tmp_path / "cut"
    if resave:  # step 6 saved already: the resumed run from step 3 saves it again
        shutil.copytree(whole, cut)
        shutil.rmtree(cut / "checkpoints" / "step_8")
        args = ["run", "--resume", str(cut / "checkpoints" / "step_3"), "--out", str(cut)]
    else:
        args = ["run", *tiny(token_file), *STEPS, "--out", str(cut)]
    r = python_c(KILLER, what, nth, "step_6", *args)
    assert r.returncode == -9, r.stderr  # killed where asked
    r = cli("run", "--resume", "latest", "--out", str(cut))
    assert r.returncode == 0, r.stderr
    same_run(whole, cut)
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step_3", "step_6", "step_8"]
    if resave:  # the timeline the resume left: its step_6 and the metrics after step 3, whole
        (aside,) = (cut / "abandoned").iterdir()
        assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "step_6"]
        assert [r["step"] for r in read_metrics(aside / "metrics.jsonl")] == list(range(4, 9))


# ---- one line, not a traceback ------------------------------------------------------------------
def hf_dir(tmp_path: Path, config) -> str:
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 97,
}


@pytest.mark.parametrize(
    "case, words",
    [
        ("not-utf8", "not UTF-8"),
        ("rope-string", "model.rope_scaling"),
        ("hf-no-hidden", "has no hidden_size"),
        ("hf-zero-heads", "num_attention_heads = 0"),
        ("hf-list", "holds a JSON list"),
        ("empty-npy", "not a readable .npy"),
        ("negative-id", "negative token id (-5)"),
        ("late-oov", "token id 5000"),
        ("lr-inf", "optim.lr must be a finite number"),
        ("odd-head", "the head size, must be even"),
        ("kvikio", 'pip install "tiertrain[cu'),
    ],
)
def test_bad_input_is_one_line(token_file, tmp_path, case, words):
    out = tmp_path / "run"
    args = tiny(token_file)
    if case == "not-utf8":
        (tmp_path / "c.toml").write_bytes(b"[train]\nsteps = 3 # caf\xe9\n")
        args = ["--config", str(tmp_path / "c.toml")]
    elif case == "rope-string":
        args += [
            "--set",
            'model.rope_scaling={rope_type="llama3",factor="8",low_freq_factor=1,'
            "high_freq_factor=4,original_max_position_embeddings=8192}",
        ]
    elif case.startswith("hf-"):
        cfg = {
            "hf-no-hidden": {k: v for k, v in LLAMA.items() if k != "hidden_size"},
            "hf-zero-heads": {**LLAMA, "num_attention_heads": 0},
            "hf-list": [LLAMA],
        }[case]
        args += ["--init-from", hf_dir(tmp_path, cfg)]
    elif case in ("empty-npy", "negative-id", "late-oov"):
        toks = np.arange(40_000) % 97
        if case == "negative-id":
            toks[30_000] = -5
        if case == "late-oov":
            toks[39_000] = 5000  # far past the first batch
        path = tmp_path / "t.npy"
        path.write_bytes(b"") if case == "empty-npy" else np.save(path, toks)
        args += ["--set", f'data.path="{path}"']
    elif case == "lr-inf":
        args += ["--set", "optim.lr=inf"]
    elif case == "odd-head":
        args += ["--set", "model.hidden_size=100"]  # 4 heads of 25
    elif case == "kvikio":
        try:
            import kvikio  # noqa: F401

            pytest.skip("kvikio is installed here")
        except ImportError:
            pass
        args += [
            *DEEP_ARGS,
            "--host-gb",
            least_gb(token_file),
            "--nvme-dir",
            str(tmp_path / "nvme"),
            "--set",
            'tiers.io="kvikio"',
        ]
    refused(cli("run", *args, "--out", str(out)), words)
    assert not out.exists()


def test_a_tokenizer_that_is_not_json_is_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n")
    (tmp_path / "tok.json").write_text("this is not json")
    refused(
        cli(
            "prepare",
            str(tmp_path / "a.txt"),
            "--out",
            str(tmp_path / "a.bin"),
            "--tokenizer",
            str(tmp_path / "tok.json"),
        ),
        "not a Hugging Face tokenizer.json",
    )


@pytest.mark.parametrize("edit", ["no-rng", "no-kinds", "edited-lr", "torn"])
def test_checkpoint_attributes_are_checked_and_checksummed(token_file, tmp_path, edit):
    out = tmp_path / "run"
    assert cli("run", *tiny(token_file), *STEPS, "--set", "train.steps=3", "--out", str(out)).returncode == 0
    meta_file = out / "checkpoints" / "step_3" / "zarr.json"
    meta = json.loads(meta_file.read_text())
    attrs = meta["attributes"]
    if edit == "torn":  # half written (a disk's fault): the newest checkpoint still, unreadable, not skipped
        meta_file.write_text(meta_file.read_text()[:200])
        refused(cli("run", "--resume", "latest", "--out", str(out)), "step_3 is an unreadable checkpoint")
        return
    if edit == "edited-lr":
        attrs["optimizer"]["lr"] = 1.0
    else:
        del attrs["rng" if edit == "no-rng" else "kinds"]
        # as a checkpoint of the format before the checksum: its keys are checked
        del attrs["attributes_crc32c"]
        attrs["format"] = "tiertrain-checkpoint/1"
    meta_file.write_text(json.dumps(meta))
    words = "fail their checksum" if edit == "edited-lr" else ("rng" if edit == "no-rng" else "kinds")
    refused(cli("run", "--resume", "latest", "--out", str(out), "--set", "train.steps=5"), "corrupt", words)


EIO = r"""
import errno, os, sys, threading
from tiertrain.tiers import nvme
from tiertrain.cli import main

mode, after, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
piece, seen = nvme.PosixIO._piece, [0]

def failing(fd, view, offset, write):  # the disk fails after `after` pieces of this kind into the store
    if write == (mode == "write") and where in os.readlink(f"/proc/self/fd/{fd}"):
        seen[0] += 1
        if seen[0] > after:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
    return piece(fd, view, offset, write)

nvme.PosixIO._piece = staticmethod(failing)
sys.argv = ["tiertrain", *sys.argv[4:]]
try:
    main()
finally:
    left = [t.name for t in threading.enumerate() if t.name.startswith("tiertrain")]
    print("threads left:", left, file=sys.stderr)
"""


@pytest.mark.parametrize("mode, after", [("write", 3), ("write", 40), ("write", 150), ("read", 40)])
def test_a_disk_error_on_the_nvme_tier_stops_the_run_in_one_line(token_file, tmp_path, mode, after):
    """EIO from the NVMe tier in the setup or mid-run: the run stops with that error in one line, every thread of
    the run ended and its store deleted. Where a write-back failed the host update's later units waited forever for ring buffers
    the failed one held, and the run hung with the error unsaid."""
    nv = tmp_path / "nv"
    sets = tiny(token_file, *DEEP_ARGS, "--host-gb", least_gb(token_file), "--set", "train.steps=6")
    sets += ["--set", "checkpoint.every=2"]
    r = subprocess.run(
        [sys.executable, "-c", EIO, mode, str(after), str(nv), "run", *sets, "--nvme-dir", str(nv), "--out"]
        + [str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    saved = sorted((tmp_path / "r" / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
    go = f"its last checkpoint, {saved[-1].name}, is whole" if saved else "it saved no checkpoint"
    assert lines[0].startswith(f"error: the run stopped on a disk error: Input/output error ({nv}/"), r.stderr
    if after < 10:  # in the setup, as the weights are written to the store: nothing of the run to go on from
        assert lines[0].endswith("; once the disk is fixed, run it again") and "checkpoint" not in lines[0]
    else:
        assert go in lines[0]
    assert lines[1:] == ["threads left: []"] and not list(nv.iterdir())


def test_a_run_directory_file_that_cannot_open_leaves_no_file_open(token_file, tmp_path, monkeypatch):
    """train.log refused (a full disk) after metrics.jsonl opened: one line, and metrics.jsonl closed with the
    trainer (it stayed open in the process)."""
    from conftest import tiny_config
    from tiertrain import loop
    from tiertrain.errors import UserError
    from tiertrain.trainer import Trainer

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loop, "TrainLog", full)
    out = tmp_path / "run"
    with pytest.raises(UserError, match="the disk is full"):
        loop.fit(Trainer(tiny_config(token_file)), out)
    opened = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            opened.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # listdir's own
            pass
    assert not [p for p in opened if str(out) in p]


def test_what_closing_meets_after_a_run_ended_well_is_a_warning(token_file, tmp_path, monkeypatch):
    """The run trained and saved its last checkpoint; closing then failed (a write-back the disk refused): a
    warning, the run done; where a refusal stopped the trainer's setup, closing's failure is not said over it
    and the stores go all the same."""
    from conftest import tiny_config
    from tiertrain import loop
    from tiertrain.assemble import Run
    from tiertrain.errors import UserError
    from tiertrain.state import State
    from tiertrain.trainer import Trainer

    close = Run.close

    def failing(self):
        close(self)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(Run, "close", failing)
    said = []
    history = loop.fit(Trainer(tiny_config(token_file, "train.steps=2")), tmp_path / "run", echo=said.append)
    assert len(history) == 2 and (tmp_path / "run" / "checkpoints" / "step_2").is_dir()
    assert "warning: closing the run failed (Input/output error); its checkpoints are whole" in said
    assert said[-1].startswith("done: 2 steps")

    def refused(*a, **k):
        raise UserError("injected refusal")

    monkeypatch.setattr(State, "init_weights", refused)
    nv = tmp_path / "nv"
    cfg = tiny_config(token_file, *DEEP, f'tiers.nvme_dir="{nv}"', 'tiers.activations="nvme"')
    with pytest.raises(UserError, match="injected refusal"):
        Trainer(cfg)
    assert list(nv.iterdir()) == []
