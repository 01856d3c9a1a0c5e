"""What a process killed at a narrow moment leaves (the kill review, 2026-11-27): each leftover is taken back by
the next command that meets it, or never stops one; the kill windows themselves are too narrow for a timed kill,
so each test builds what the kill left."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

from conftest import cli, stale_store, tiny
from tiertrain import rundir
from tiertrain.loop import _ending
from tiertrain.tiers.nvme import discard_stale, new_scratch


def _old(p: Path) -> Path:
    t = time.time() - 120
    os.utime(p, (t, t))
    return p


def test_a_run_directory_a_kill_left_half_written_is_taken(token_file, tmp_path):
    """A kill while the run marker was written left its temporary beside the lock: --out was called "not a
    tiertrain run" by a run and a resume alike. A kill while a resume rewrote metrics.jsonl left its temporary in
    the run for good."""
    out = tmp_path / "run"
    out.mkdir()
    (out / rundir.LOCK).write_text("")
    (out / f".{rundir.MARKER}.k2j4.tmp").write_text('{"format": "tiert')
    r = cli("run", *tiny(token_file), "--set", "train.steps=2", "--save-every", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert not list(out.glob(".*.tmp"))
    (out / ".metrics.jsonl.q1x.tmp").write_text('{"step": 1}\n')
    (out / ".notes.tmp").write_text("a user's file")  # not a name a run writes: stays
    r = cli("run", "--resume", "latest", "--set", "train.steps=3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert [p.name for p in out.glob(".*.tmp")] == [".notes.tmp"]


def test_the_stores_killed_processes_left_go_whatever_their_run(tmp_path):
    """A killed run's store stayed where its --out was then refused (a resume with no step left) or never used
    again (a new --out, as a run stopped before its first checkpoint is told); an empty directory of a store's name
    stayed where a kill came before its marker."""
    other = stale_store(tmp_path, tmp_path / "another-run", "tiertrain-a-xyz")
    mine = new_scratch(tmp_path, "this-run")  # a live process's: stays
    unmarked = tmp_path / "tiertrain-b-k3j2x_9q"  # mkdtemp's name
    unmarked.mkdir()
    _old(unmarked)
    named = tmp_path / "tiertrain-mine"  # a user's empty directory: not a name new_scratch gives
    named.mkdir()
    _old(named)
    young = tmp_path / "tiertrain-c-q9w1ab3z"  # a process may be about to mark it
    young.mkdir()
    users = tmp_path / "tiertrain-notes"  # not empty, no marker: not one new_scratch left
    users.mkdir()
    (users / "x").write_text("keep")
    _old(users)
    assert sorted(discard_stale(tmp_path)) == sorted([other, unmarked])
    assert mine.is_dir() and young.is_dir() and named.is_dir() and (users / "x").read_text() == "keep"


def test_an_export_a_kill_left_half_written_is_taken_back(token_file, tmp_path):
    """An export killed before it was whole left `.NAME.tmp-*` beside --to for good; one killed after it removed an
    empty --to, before its own took the name, left no --to at all."""
    run = tmp_path / "run"
    assert cli("run", *tiny(token_file), "--set", "train.steps=1", "--out", str(run)).returncode == 0
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)
    dead = tmp_path / f".hf.tmp-{gone}-abc"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half")
    live = tmp_path / f".hf.tmp-{os.getpid()}-def"  # an export under way
    live.mkdir()
    (tmp_path / "hf").mkdir()  # an empty --to: taken in one rename
    r = cli("export", str(run), "--to", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    assert not dead.exists() and live.is_dir() and (tmp_path / "hf" / "config.json").is_file()


def test_a_stop_in_the_last_step_says_the_run_is_done(tmp_path):
    """SIGTERM in the last step told the user to continue with --resume latest, which then has no step to take."""
    tr = SimpleNamespace(step=5, cfg=SimpleNamespace(train=SimpleNamespace(steps=5)))
    line = _ending(tr, tmp_path, "SIGTERM", [], 1.0)
    assert "the run is done" in line and "--resume" not in line
    tr.step, tr.cfg.checkpoint = 4, SimpleNamespace(state="full")
    assert "continue with: tiertrain run --resume latest" in _ending(tr, tmp_path, "SIGTERM", [], 1.0)
