"""Checkpoints: a resumed run is the run that was never stopped, bit for bit; a killed write loses nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import DEEP, VARIANTS, budget_for, cli, least_budget, same_run, tiny_config
from tiertrain import checkpoint as ckpt
from tiertrain import checkpoint_load as ckpt_load
from tiertrain import rundir
from tiertrain.checkpoint_load import read_meta
from tiertrain.loop import fit
from tiertrain.metrics import read_metrics
from tiertrain.trainer import Trainer

STEPS = ["train.steps=8", "checkpoint.every=3", "checkpoint.keep=2"]


def _fit(cfg, out, stop_at=None, resume=None):
    """fit(), with SIGTERM sent to this process during step `stop_at`, as a user's kill would."""
    tr = Trainer(cfg, run_name=out.name, resume=resume)
    if stop_at is not None:
        step = tr.train_step

        def signalled():
            if tr.step + 1 == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
            return step()

        tr.train_step = signalled
    lines = []
    fit(tr, out, echo=lines.append)
    return lines


@pytest.mark.parametrize(
    "spill",
    [
        "none",
        "posix",
        "resident",
        "gpu-update",
        "gpu-speculated",
        "everything",
        "speculated",
        pytest.param("kvikio", marks=pytest.mark.gpu),
    ],
)
def test_resume_is_bit_identical(token_file, tmp_path, spill):
    """`resident`: the first units' state in device memory, the last units' moments on NVMe.
    `gpu-update`: the first two units updated on the device as they load (a checkpoint runs the
    update still pending). `everything`: every slab on NVMe, the bf16 copy that streams included (the
    resume writes it from the restored master). `speculated`: every step's speculative update kept (the
    copies swapped in: the checkpoint must read the current ones); `gpu-speculated`: so are those of two
    GPU-updated units, every other from the last, which run on the device in the backward pass."""
    sets = [*VARIANTS["qwen2"], *STEPS, "data.shuffle=true"]
    if spill == "everything":
        sets += ['train.compute_dtype="bfloat16"', 'tiers.stream="compute"', *DEEP]
        sets += [
            f"tiers.host_gb={least_budget(tiny_config(token_file, *sets))}",
            f'tiers.nvme_dir="{tmp_path / "nvme"}"',
            'tiers.io="posix"',
        ]
        spill = "posix-set"
    if spill == "resident":
        sets.append("tiers.gpu_resident_gb=0.002")
        spill = "posix"
    if spill == "speculated":
        sets += ["optim.grad_clip=100", "optim.speculate_units=99"]
        spill = "none"
    if spill == "gpu-update":
        sets += ["tiers.gpu_update_units=2", "optim.speculate_gpu_updates=false"]
        assert Trainer(tiny_config(token_file, *sets)).run_plan.updated("gpu", "gpu-speculated") == {0, 1}
        spill = "none"
    if spill == "gpu-speculated":
        sets += [
            "tiers.gpu_update_units=2",
            "optim.speculate_gpu_updates=true",
            "optim.grad_clip=100",
            "optim.speculate_units=99",
        ]
        tr = Trainer(tiny_config(token_file, *sets))
        assert tr.run_plan.updated("gpu", "gpu-speculated") == tr.run_plan.updated("gpu-speculated") == {
            2,
            4,
        } and set(tr.run.host.copies) == set(range(5))
        tr.close()
        spill = "none"
    if spill == "kvikio":
        sets.append('train.device="cuda"')
    # Adam moments on NVMe: the checkpoint copies them from the store, the resume writes them back
    if spill not in ("none", "posix-set"):
        gb = budget_for(
            tiny_config(token_file, *DEEP, *sets[-1:] if spill == "kvikio" else []),
            run=tiny_config(token_file, *sets, *DEEP),  # its working set (and resident state) beside
        )
        sets += [*DEEP, f"tiers.host_gb={gb}", f'tiers.nvme_dir="{tmp_path / "nvme"}"', f'tiers.io="{spill}"']
    _fit(tiny_config(token_file, *sets), tmp_path / "whole")
    lines = _fit(tiny_config(token_file, *sets), tmp_path / "cut", stop_at=5)
    assert any("stopped by SIGTERM after step 5" in x for x in lines)
    assert [p.name for p in rundir.checkpoints(tmp_path / "cut")] == ["step_3", "step_5"]
    if spill != "none":
        # the scratch stores went once the state was saved
        assert not list((tmp_path / "nvme").glob("tiertrain-*"))
    latest = rundir.resolve("latest", tmp_path / "cut")
    _fit(tiny_config(token_file, *sets), tmp_path / "cut", resume=latest)
    same_run(tmp_path / "whole", tmp_path / "cut")
    assert [p.name for p in rundir.checkpoints(tmp_path / "cut")] == ["step_6", "step_8"]  # keep = 2


KILL_SCRIPT = r"""
import sys, time
from pathlib import Path
sys.path.insert(0, "tests")
from conftest import tiny_config
import tiertrain.checkpoint as ckpt
from tiertrain.loop import fit
from tiertrain.trainer import Trainer

real = ckpt._fsync_tree
def slow(root):  # the write of step 3: its arrays are on disk, not yet renamed; wait to be killed
    if "step_3" in str(root):
        Path(sys.argv[3]).write_text("writing")
        time.sleep(600)
    real(root)
ckpt._fsync_tree = slow
cfg = tiny_config(sys.argv[1], "train.steps=8", "checkpoint.every=1", "checkpoint.keep=2")
fit(Trainer(cfg), Path(sys.argv[2]), echo=lambda s: None)
"""


def test_sigkill_during_a_checkpoint_write_keeps_the_previous(token_file, tmp_path):
    out, flag = tmp_path / "run", tmp_path / "flag"
    child = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(token_file), str(out), str(flag)])
    deadline = time.time() + 120
    while not flag.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert flag.exists(), "the child never reached its third checkpoint"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (out / "checkpoints" / ".step_3.tmp").is_dir()  # the torn write is there, and ignored
    assert [p.name for p in rundir.checkpoints(out)] == ["step_1", "step_2"]
    r = subprocess.run(
        [sys.executable, "-m", "tiertrain", "run", "--resume", "latest", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "resumed at step 2 of 8" in r.stdout
    assert not (out / "checkpoints" / ".step_3.tmp").exists()
    _fit(tiny_config(token_file, "train.steps=8", "checkpoint.every=1"), tmp_path / "whole")
    same_run(tmp_path / "whole", out)


def test_sigint_saves_and_exits_zero(tmp_path):
    out = tmp_path / "run"
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tiertrain",
            "run",
            "--set",
            "train.steps=100000",
            "--set",
            "train.seq_len=64",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
        assert time.time() < deadline and child.poll() is None
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)
    stdout, _ = child.communicate(timeout=120)
    assert child.returncode == 0
    assert "stopped by SIGINT" in stdout and "--resume latest" in stdout
    last = read_metrics(out / "metrics.jsonl")[-1]["step"]
    assert [p.name for p in rundir.checkpoints(out)] == [f"step_{last}"]


def test_bad_checkpoints_are_refused_with_one_line(token_file, tmp_path):
    out = tmp_path / "run"
    _fit(tiny_config(token_file, "train.steps=2"), out)
    path = out / "checkpoints" / "step_2"
    before = (out / "metrics.jsonl").read_text()

    other = cli(
        "run",
        "--resume",
        str(path),
        "--out",
        str(tmp_path / "x"),
        "--set",
        "model.hidden_size=32",
        "--set",
        "train.steps=3",
    )
    assert other.returncode == 2 and "different model (hidden_size differ)" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1

    chunk = path / "exp_avg" / "1" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    bad = cli("run", "--resume", "latest", "--out", str(out), "--set", "train.steps=3")  # a step to take
    assert bad.returncode == 2 and "corrupt: exp_avg/1 fails its checksum" in bad.stderr

    chunk.unlink()
    gone = cli("run", "--resume", "latest", "--out", str(out))
    assert gone.returncode == 2 and "chunk exp_avg/1 is missing" in gone.stderr
    assert (out / "metrics.jsonl").read_text() == before  # nothing was overwritten
    assert cli("run", "--resume", "latest").returncode == 2  # latest of what: --out is required


def test_a_full_disk_stops_the_run_and_keeps_the_last_checkpoint(token_file, tmp_path, monkeypatch):
    import errno

    real = ckpt._fsync_tree

    def full(root):  # the disk fills up while step 4's checkpoint is written
        if "step_4" in str(root):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(root)

    monkeypatch.setattr(ckpt, "_fsync_tree", full)
    out = tmp_path / "run"
    cfg = tiny_config(token_file, "train.steps=6", "checkpoint.every=2", "checkpoint.keep=3")
    with pytest.raises(
        ckpt.CheckpointError, match=r"the disk is full; the previous checkpoint \(step_2\) is intact"
    ):
        _fit(cfg, out)
    assert [p.name for p in rundir.checkpoints(out)] == ["step_2"]
    assert not list((out / "checkpoints").glob(".*"))  # the partial write is gone
    read_meta(out / "checkpoints" / "step_2")
    monkeypatch.setattr(ckpt, "_fsync_tree", real)
    _fit(
        tiny_config(token_file, "train.steps=6", "checkpoint.every=2"),
        out,
        resume=rundir.resolve("latest", out),
    )
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, 7))


@pytest.mark.parametrize(
    "names",
    [
        ["step_2", ".step_4.new"],
        [".step_4.new", ".step_4.old"],  # killed between a re-save's two renames
        ["step_4", ".step_4.old", ".step_6.tmp"],
        [".step_4.old", "step_2", ".step_9.new", ".step_10.old"],
        ["step_4", ".step_4.new"],  # a re-save killed before it moved the step's earlier save aside
        ["step_3", ".step_3.tmp\n", ".step_٣.new", "step_3\n"],  # not a save's names: left alone
    ],
)
def test_the_temporaries_counted_whole_are_those_recover_keeps(tmp_path, names):
    """rundir.interrupted counts as saved exactly the checkpoints recover makes of a killed save's temporaries."""
    for n in names:
        (tmp_path / n).mkdir()
        (tmp_path / n / "who").write_text(n)
    counted = [p.name for p in ckpt.left_whole(tmp_path)]
    ckpt.recover(tmp_path)
    after = {p.name: (p / "who").read_text() for p in tmp_path.iterdir()}
    made = {n: who for n, who in after.items() if who != n}
    assert made == {n.split(".")[1]: n for n in counted}  # each step recover made, from the temporary counted
    # no temporary of a save is left, and what is not one is untouched
    assert {n for n in after if ckpt.LEFT.fullmatch(n)} == set()
    assert {n for n in names if not ckpt.LEFT.fullmatch(n)} <= set(after)


def test_a_resume_on_the_same_tokens_with_another_loss_mask_is_refused(tmp_path):
    """Conversations prepared again with another template or --train-on-prompt: the same tokens, other targets
    trained. The checkpoint's data identity holds a checksum of the samples and the loss mask too, so such a
    file is refused by name on resume, and the file it trained on is not."""
    import numpy as np

    from tiertrain.errors import DataError
    from tiertrain.tokenfile import TokenWriter

    rng = np.random.default_rng(0)
    tokens = [rng.integers(1, 97, 20) for _ in range(8)]
    for name, trained in (("a", 0.2), ("b", 0.9)):
        w = TokenWriter(tmp_path / f"{name}.bin", 97, samples=True, masked=True)
        for t in tokens:
            w.add(t, (rng.random(20) < trained).astype(np.uint8), start=True)
        w.close()
    tr = Trainer(tiny_config(tmp_path / "a.bin"))
    path, _ = tr.save_checkpoint(tmp_path / "run")
    tr.close()
    other = Trainer(tiny_config(tmp_path / "b.bin"))
    try:
        with pytest.raises(
            DataError, match=r"b\.bin is not the data .*the same tokens, other samples or loss mask"
        ):
            other.restore(path)
    finally:
        other.close()
    same = Trainer(tiny_config(tmp_path / "a.bin"))
    try:
        same.restore(path)
    finally:
        same.close()


def test_pruning_renames_a_checkpoint_away_before_deleting_it(token_file, tmp_path, monkeypatch):
    """A reader of a checkpoint being pruned finds it gone at once (no part-deleted checkpoint with its zarr.json
    still there), and a kill mid-deletion leaves a temporary that the run's next process deletes."""
    import shutil

    tr = Trainer(tiny_config(token_file))
    for _ in range(2):
        tr.save_checkpoint(tmp_path / "run")
        tr.train_step()
    tr.close()
    first, *rest = rundir.checkpoints(tmp_path / "run")
    seen, real = [], shutil.rmtree

    def killed(p, *a, **k):  # the deletion a kill stops: what a reader sees at that moment
        seen.append((p.name, (first / "zarr.json").exists()))
        if p.name == f".{first.name}.tmp" and p.exists():
            raise KeyboardInterrupt
        return real(p, *a, **k)

    monkeypatch.setattr(rundir.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        rundir.prune(tmp_path / "run", 1)
    monkeypatch.undo()
    assert seen[-1] == (f".{first.name}.tmp", False)
    assert rundir.checkpoints(tmp_path / "run") == rest
    ckpt.recover(first.parent)
    assert sorted(p.name for p in first.parent.iterdir()) == sorted(p.name for p in rest)


def test_a_checkpoint_pruned_while_it_is_read_is_one_line(token_file, tmp_path, monkeypatch):
    """A live run prunes its older checkpoints (checkpoint.keep): an export or a resume reading one of them at that
    moment says so, where it said the checkpoint was corrupt or gave a FileNotFoundError traceback."""
    import shutil

    import torch

    from tiertrain.modes import Kind

    tr = Trainer(tiny_config(token_file))
    tr.save_checkpoint(tmp_path / "run")
    tr.close()
    path = rundir.checkpoints(tmp_path / "run")[-1]
    n = read_meta(path)["numels"][1]
    body = ckpt_load._body

    def pruned(*a, **k):  # the run's rmtree lands as the reader opens its first chunk
        shutil.rmtree(path, ignore_errors=True)
        return body(*a, **k)

    monkeypatch.setattr(ckpt_load, "_body", pruned)
    with pytest.raises(ckpt.CheckpointError, match="was deleted while it was read"):
        ckpt_load.load(path, Kind.MASTER, 1, torch.empty(n))
