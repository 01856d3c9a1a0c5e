"""A run's directory is its own: its checkpoints planned against their disk before training, one timeline, one
writer, paths that resume where they were, scratch stores cleaned, and the fault review's cases in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import DEEP, STEPS, cli, least_budget, refused, stale_store, tiny, tree_hash
from tiertrain import checkpoint as ckpt
from tiertrain import paths, runclaim, rundir
from tiertrain.checkpoint_load import read_meta
from tiertrain.durable import write_json
from tiertrain.errors import UserError
from tiertrain.metrics import read_metrics
from tiertrain.modes import Home, Kind
from tiertrain.tiers.nvme import new_scratch

# about 25 M parameters (a 40k vocabulary, untied): 300 MB of full checkpoint, 100 MB of weights
WIDE = [
    "--set",
    "model.vocab_size=40000",
    "--set",
    "model.hidden_size=256",
    "--set",
    "model.intermediate_size=512",
    "--set",
    "model.num_hidden_layers=4",
    "--set",
    "model.num_attention_heads=4",
    "--set",
    "model.num_key_value_heads=4",
]


def _steps(run: Path) -> list[str]:
    return [p.name for p in rundir.checkpoints(run)]


# ---- checkpoints in the plan --------------------------------------------------------------------
def _mounted_tmpfs(path: Path, mb: int) -> list[str]:
    """The command prefix that runs a command with a `mb` MB tmpfs at `path` (root: in a mount namespace of its
    own; else in a user namespace), or skips where neither can mount."""
    path.mkdir(parents=True, exist_ok=True)
    prefix = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    probe = subprocess.run(
        [*prefix, "sh", "-c", f"mount -t tmpfs -o size={mb}m tmpfs {path}"], capture_output=True
    )
    if shutil.which("unshare") is None or probe.returncode:
        pytest.skip("no tmpfs can be mounted here (needs root or user namespaces)")
    return [*prefix, "sh", "-c", f'mount -t tmpfs -o size={mb}m tmpfs {path} && exec "$@"', "sh"]


def test_checkpoints_that_cannot_fit_their_disk_are_refused_before_training(token_file, tmp_path):
    """A 25 M-parameter run whose --out is a 40 MB tmpfs: refused before its first step in one line naming the
    checkpoint; with the checkpoints on another disk (checkpoint.dir) it trains, and `latest` and `export` find
    them there."""
    disk = tmp_path / "small"
    prefix = _mounted_tmpfs(disk, 40)
    args = [*tiny(token_file), *WIDE, "--set", "train.steps=1"]
    r = subprocess.run(
        [*prefix, sys.executable, "-m", "tiertrain", "run", *args, "--out", str(disk / "run")],
        capture_output=True,
        text=True,
    )
    line = refused(r, "checkpoints need", "checkpoint.dir")
    assert "metrics" not in r.stdout and "step 1/1" not in r.stdout
    assert "checkpoint.state" not in line  # 100 MB of weights do not fit either: not offered
    big = tmp_path / "big"
    r = subprocess.run(
        [
            *prefix,
            sys.executable,
            "-m",
            "tiertrain",
            "run",
            *args,
            "--set",
            f'checkpoint.dir="{big}"',
            "--out",
            str(disk / "run"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    (made,) = big.iterdir()  # the run's own directory there, marked
    assert (made / "tiertrain-checkpoints.json").is_file() and (made / "step_1").is_dir()


def test_the_disk_check_counts_kept_checkpoints_and_offers_what_fits(token_file, tmp_path, monkeypatch):
    """With checkpoints kept, the one in flight counts too; weights-only checkpoints are offered where they fit,
    and fit; a run without a final checkpoint needs none."""
    from conftest import tiny_config
    from tiertrain.errors import ConfigError
    from tiertrain.plan.saves import checkpoint_bytes
    from tiertrain.trainer import Trainer

    cfg = tiny_config(token_file, "train.steps=6", "checkpoint.every=2", "checkpoint.keep=2")
    numels = [u.numel for u in cfg.model.units()]  # about: the slabs are a little larger
    full = checkpoint_bytes([n + 4096 for n in numels], "full")
    # 3 at once (2 kept + 1) do not fit
    monkeypatch.setattr(rundir, "disk_free", lambda p: (int(2.5 * full), 1))
    with pytest.raises(ConfigError, match=r"3 of .* at once.*checkpoint.keep = 1") as e:
        Trainer(cfg, out=tmp_path / "run")
    assert 'checkpoint.state = "weights"' in str(e.value)
    for ok in ('checkpoint.state="weights"', "checkpoint.keep=1"):
        Trainer(
            tiny_config(token_file, "train.steps=6", "checkpoint.every=2", ok), out=tmp_path / "run"
        ).close()
    monkeypatch.setattr(rundir, "disk_free", lambda p: (1000, 1))
    Trainer(tiny_config(token_file, "checkpoint.final=false"), out=tmp_path / "run").close()


def test_a_weights_checkpoint_exports_and_starts_a_new_run(token_file, tmp_path):
    """checkpoint.state = "weights": the master alone (a third of the bytes), which `export` reads; --resume from
    it starts a new run (step 0, fresh moments) into a new --out, and is refused into its own run."""
    a = tmp_path / "a"
    assert (
        cli("run", *tiny(token_file), "--set", 'checkpoint.state="weights"', "--out", str(a)).returncode == 0
    )
    (last,) = rundir.checkpoints(a)
    meta = read_meta(last)
    assert meta["kinds"] == ["master"] and not (last / "exp_avg").exists()
    refused(cli("run", "--resume", "latest", "--out", str(a)), "weights only", "--out")
    b = tmp_path / "b"
    r = cli("run", "--resume", str(last), "--out", str(b), "--set", "train.steps=2")
    assert r.returncode == 0, r.stderr
    assert [x["step"] for x in read_metrics(b / "metrics.jsonl")] == [1, 2]  # a new run, from its weights
    from conftest import tiny_config
    from tiertrain.trainer import Trainer

    tr = Trainer(tiny_config(token_file), resume=last)  # the weights, step 0, moments zero
    try:
        assert tr.step == 0 and tr.run.updates.opt.step_count == 0
        assert np.array_equal(
            tr.run.host.slab(1, Kind.MASTER).numpy()[: meta["numels"][1]], _arrays(last)["master/1"]
        )
        assert not tr.run.host.slab(1, Kind.EXP_AVG).any()
    finally:
        tr.close()
    pytest.importorskip("transformers")
    from tiertrain.export import export_hf

    assert export_hf(str(a), str(tmp_path / "hf"))


def _arrays(path: Path) -> dict:
    import zarr

    g = zarr.open_group(path, mode="r")
    return {f"{k}/{u}": g[k][str(u)][:] for k in g.attrs["kinds"] for u in range(len(g.attrs["numels"]))}


def test_a_run_can_end_without_a_final_checkpoint(token_file, tmp_path):
    r = cli("run", *tiny(token_file), "--set", "checkpoint.final=false", "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    assert _steps(tmp_path / "a") == [] and "checkpoint " not in r.stdout
    line = refused(cli("run", *tiny(token_file), "--out", str(tmp_path / "a")), "saved no checkpoint")
    assert "--resume" not in line  # it does not send the user to a resume that finds nothing
    refused(cli("run", "--resume", "latest", "--out", str(tmp_path / "a")), "saved no checkpoint", "new run")


def test_a_spilled_runs_last_checkpoint_takes_the_stores_chunks(token_file, tmp_path):
    """The NVMe store and the checkpoints on one filesystem: the last save renames the spilled slabs' chunk files
    into the checkpoint (the same file: no second copy of their bytes), and holds what a run without spill saves,
    padding included."""
    from conftest import tiny_config
    from tiertrain.trainer import Trainer

    def trained(*sets) -> Trainer:
        tr = Trainer(tiny_config(token_file, *DEEP, "train.steps=2", *sets))
        for _ in range(2):
            tr.train_step()
        return tr

    spill = trained(
        f"tiers.host_gb={least_budget(tiny_config(token_file, *DEEP))}",
        f'tiers.nvme_dir="{tmp_path / "nvme"}"',
    )
    spilled = [(u, k) for (u, k), h in spill.run_plan.where().items() if h == Home.NVME and k in ckpt.KINDS]
    inodes = {uk: spill.run.nvme.store.path(uk[1], uk[0]).stat().st_ino for uk in spilled}
    path, _ = spill.save_checkpoint(tmp_path / "spill", last=True)
    spill.close()
    assert spilled and all(
        (path / k.value / str(u) / "c" / "0").stat().st_ino == i for (u, k), i in inodes.items()
    )
    ram = trained()
    other, _ = ram.save_checkpoint(tmp_path / "ram")
    ram.close()
    a, b = _arrays(path), _arrays(other)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ---- one timeline -------------------------------------------------------------------------------------
def test_a_resume_from_an_older_checkpoint_starts_the_runs_one_timeline(token_file, tmp_path):
    """--resume r/checkpoints/step_3 --out r, where r went on to step 5: the newer checkpoints and metrics move aside
    (renamed, reported), `latest` and `export` then mean the step the run reached on its new timeline."""
    r_ = tmp_path / "r"
    keep = ["--set", "checkpoint.every=1", "--set", "checkpoint.keep=10"]
    assert cli("run", *tiny(token_file), *keep, "--set", "train.steps=5", "--out", str(r_)).returncode == 0
    old5 = _arrays(r_ / "checkpoints" / "step_5")
    r = cli(
        "run",
        "--resume",
        str(r_ / "checkpoints" / "step_3"),
        "--out",
        str(r_),
        "--set",
        "train.steps=4",
        "--set",
        "optim.lr=5e-4",
        "--set",
        "optim.min_lr=1e-4",
    )
    assert r.returncode == 0, r.stderr
    assert "moved to" in r.stdout and "step_4, step_5" in r.stdout
    assert _steps(r_) == ["step_1", "step_2", "step_3", "step_4"]
    assert rundir.resolve("latest", r_) == r_ / "checkpoints" / "step_4"
    recs = read_metrics(r_ / "metrics.jsonl")
    assert [x["step"] for x in recs] == [1, 2, 3, 4] and recs[3]["lr"] < 5e-4 + 1e-12
    (aside,) = (r_ / "abandoned").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "step_4", "step_5"]
    assert [x["step"] for x in read_metrics(aside / "metrics.jsonl")] == [4, 5]
    assert np.array_equal(_arrays(aside / "step_5")["master/1"], old5["master/1"])  # kept whole, not deleted


def test_a_cut_killed_midway_is_finished_by_the_next_process(token_file, tmp_path):
    """The journal of a cut written, nothing moved yet (a kill right after it): `latest` and `export` already skip
    the newer checkpoints, and the next run of the directory finishes the cut."""
    r_ = tmp_path / "r"
    keep = ["--set", "checkpoint.every=1", "--set", "checkpoint.keep=10"]
    assert cli("run", *tiny(token_file), *keep, "--set", "train.steps=4", "--out", str(r_)).returncode == 0
    write_json(r_ / rundir.CUT, {"step": 2, "to": "resumed-at-step_2-x"})
    assert rundir.resolve("latest", r_).name == "step_2" and _steps(r_) == ["step_1", "step_2"]
    # metrics.jsonl that tiertrain did not write: refused before the cut reads it, nothing moved
    metrics = r_ / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text(good + "[1, 2]\n" + good)
    refused(cli("run", "--resume", "latest", "--out", str(r_), "--set", "train.steps=3"), "was it edited?")
    assert (r_ / rundir.CUT).exists() and not (r_ / "abandoned").exists() and metrics.read_text() != good
    metrics.write_text(good)
    r = cli("run", "--resume", "latest", "--out", str(r_), "--set", "train.steps=3")
    assert r.returncode == 0, r.stderr
    assert not (r_ / rundir.CUT).exists() and _steps(r_) == ["step_1", "step_2", "step_3"]
    assert sorted(p.name for p in (r_ / "abandoned" / "resumed-at-step_2-x").iterdir()) == [
        "metrics.jsonl",
        "step_3",
        "step_4",
    ]


# ---- one writer ---------------------------------------------------------------------------------
def test_a_live_run_directory_is_refused_to_a_second_process(token_file, tmp_path):
    """While a process holds the run's lock: a resume, a new run on the same --out, and a new run into an --out
    another process has just claimed are refused in one line, and nothing of the run changes (not even a killed
    save's temporaries, which only the run's own next process may finish). A lock whose process is gone is free."""
    out = tmp_path / "run"
    assert cli("run", *tiny(token_file), *STEPS, "--set", "train.steps=3", "--out", str(out)).returncode == 0
    (out / "checkpoints" / ".step_9.tmp").mkdir()  # as a live save leaves it mid-way
    before = tree_hash(out)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from tiertrain.runclaim import RunLock; RunLock(Path(sys.argv[1])).acquire(); "
            "print('locked', flush=True); time.sleep(60)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        holding = tree_hash(out)
        refused(
            cli("run", "--resume", "latest", "--out", str(out)),
            "in use by a live run",
            f"process {holder.pid}",
        )
        # a new run there names the live process too (of a run with no checkpoint yet it said "stopped")
        refused(
            cli("run", *tiny(token_file), "--out", str(out)), "in use by a live run", f"process {holder.pid}"
        )
        assert tree_hash(out) == holding
        fresh = tmp_path / "fresh"
        runclaim.claim(fresh)  # another process's new run: its lock taken, its marker written
        refused(cli("run", *tiny(token_file), "--out", str(fresh)), "in use by a live run")
    finally:
        holder.kill()
        holder.wait()
    assert {k: v for k, v in tree_hash(out).items() if k != rundir.LOCK} == {
        k: v for k, v in before.items() if k != rundir.LOCK
    }
    # the killed holder's lock
    r = cli("run", "--resume", "latest", "--out", str(out), "--set", "train.steps=4")
    assert r.returncode == 0, r.stderr
    assert not (out / "checkpoints" / ".step_9.tmp").exists()  # the run's own next process finished it


# ---- paths that resume where they were ------------------------------------------------------------
def test_a_resume_from_another_directory_reads_the_same_data(tmp_path):
    """A relative data.path is recorded absolute: a resume from another working directory, where a file of the same
    name and length holds other tokens, trains on the first; a data file whose tokens changed is refused."""
    here, there = tmp_path / "here", tmp_path / "there"
    for d, seed in ((here, 0), (there, 1)):
        d.mkdir()
        np.save(d / "tokens.npy", np.random.default_rng(seed).integers(0, 97, 40_000))
    from conftest import TINY

    sets = [a for s in TINY for a in ("--set", s)] + ["--set", 'data.path="tokens.npy"']
    assert (
        cli("run", *sets, *STEPS, "--set", "train.steps=4", "--out", str(tmp_path / "a"), cwd=here).returncode
        == 0
    )
    assert (
        cli("run", *sets, *STEPS, "--set", "train.steps=6", "--out", str(tmp_path / "b"), cwd=here).returncode
        == 0
    )
    r = cli("run", "--resume", "latest", "--out", str(tmp_path / "a"), "--set", "train.steps=6", cwd=there)
    assert r.returncode == 0, r.stderr
    a, b = (read_metrics(tmp_path / d / "metrics.jsonl") for d in "ab")
    assert [x["loss"] for x in a] == [x["loss"] for x in b]  # as if it had never stopped
    # same length, other tokens
    np.save(here / "tokens.npy", np.random.default_rng(2).integers(0, 97, 40_000))
    refused(
        cli("run", "--resume", "latest", "--out", str(tmp_path / "a"), "--set", "train.steps=8"),
        "is not the data",
        "--init-from",
    )


# ---- scratch stores ---------------------------------------------------------------------------------
def test_every_stale_scratch_store_of_the_run_goes_and_links_are_not_followed(token_file, tmp_path):
    """A run's stale stores (the state's and the activation checkpoints') go when it starts again, and another
    run's a killed process left (never read again: a run restores from a checkpoint); a symbolic link named like
    one, pointing at a user's directory, is neither followed nor deleted; a live process's store stays."""
    nvme, out = tmp_path / "nvme", tmp_path / "run"
    out.mkdir()
    stale = [stale_store(nvme, out, "tiertrain-run-aaaa"), stale_store(nvme, out, "tiertrain-run-bbbb")]
    stale.append(stale_store(nvme, tmp_path / "other", "tiertrain-other-cccc"))
    other = new_scratch(nvme, str(tmp_path / "other"))  # this process's: live
    mine = tmp_path / "mine"
    stale_store(tmp_path, out, "mine")  # a user's directory that even carries a stale marker of this run
    (nvme / "tiertrain-run-link").symlink_to(mine)
    r = cli("run", *tiny(token_file), "--set", "train.steps=2", "--nvme-dir", str(nvme), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert not any(d.exists() for d in stale) and other.is_dir() and mine.is_dir()
    assert (nvme / "tiertrain-run-link").is_symlink()


def test_a_killed_runs_store_goes_though_its_out_is_refused(token_file, tmp_path):
    """A run killed before its first checkpoint (its steps logged, a scratch store left): a new run into its --out
    is refused, and the dead process's store goes then, so following the refusal's advice (a new --out) leaves
    no store on the disk for good."""
    nvme, out = tmp_path / "nvme", tmp_path / "run"
    lock, _ = runclaim.claim(out)
    lock.release()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.5}\n')
    stale = stale_store(nvme, out, "tiertrain-run-aaaa")
    other = new_scratch(nvme, str(tmp_path / "other"))  # a live process's
    r = cli("run", *tiny(token_file), "--nvme-dir", str(nvme), "--out", str(out))
    refused(r, "saved no checkpoint")
    assert not stale.exists() and other.is_dir()
    # a resume refused (no step left) takes them too, where a kill came after the final checkpoint
    done = tmp_path / "done"
    assert cli("run", *tiny(token_file), "--set", "train.steps=1", "--out", str(done)).returncode == 0
    stale = stale_store(nvme, done, "tiertrain-done-aaaa")
    refused(cli("run", "--resume", "latest", "--nvme-dir", str(nvme), "--out", str(done)), "no step to take")
    assert not stale.exists() and other.is_dir()


def test_links_at_the_old_temporary_names_are_not_written_through(token_file, tmp_path):
    """The files a run rewrites whole go through a new temporary file each time: a link the user left at a name
    a temporary once had (metrics.jsonl.tmp, .tiertrain-cut.json.tmp) is neither written through nor renamed in."""
    run, victim = tmp_path / "run", tmp_path / "victim.txt"
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(run)).returncode == 0
    victim.write_text("precious")
    for name in (
        "metrics.jsonl.tmp",
        ".metrics.jsonl.tmp",
        ".tiertrain-cut.json.tmp",
        ".tiertrain-run.json.tmp",
    ):
        (run / name).symlink_to(victim)
    r = cli("run", "--resume", str(run / "checkpoints" / "step_3"), "--set", "train.steps=4")
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "precious" and not (run / "metrics.jsonl").is_symlink()
    assert [x["step"] for x in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]


# ---- the data-safety review's cases (2026-11-26) ---------------------------------------------------
def test_links_in_a_run_are_refused_and_their_targets_untouched(token_file, tmp_path):
    """A file tiertrain writes in --out replaced by a link to a file elsewhere: the resume is refused in one line
    and the file elsewhere keeps its bytes (the lock, the plan and the config would have been written through)."""
    run, precious = tmp_path / "a", tmp_path / "precious.txt"
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(run)).returncode == 0
    precious.write_text("mine\n")
    for name in ("plan.json", "tiertrain-run.lock"):
        (run / name).unlink()
        (run / name).symlink_to(precious)
        refused(cli("run", "--resume", "latest", "--out", str(run)), name, "symbolic link")
        assert precious.read_text() == "mine\n"
        (run / name).unlink()


def test_a_marker_naming_a_directory_tiertrain_did_not_make_is_refused(token_file, tmp_path):
    """A run marker whose checkpoint directory carries no mark of tiertrain's: refused in one line, and nothing in
    that directory is written or deleted (a save would have cleaned its temporaries there)."""
    out, elsewhere = tmp_path / "f", tmp_path / "elsewhere"
    (elsewhere / ".step_7.tmp").mkdir(parents=True)
    (elsewhere / ".step_7.tmp" / "userfile").write_text("mine\n")
    out.mkdir()
    write_json(out / rundir.MARKER, {"format": "tiertrain-run/1", "checkpoints": str(elsewhere)})
    before = tree_hash(elsewhere)
    refused(cli("run", *tiny(token_file), *STEPS, "--out", str(out)), rundir.CKPT_MARKER)
    assert tree_hash(elsewhere) == before


def test_a_run_killed_before_its_first_step_is_started_afresh(token_file, tmp_path, monkeypatch):
    """A run with checkpoint.dir killed before its first step leaves a marker naming its directory there; a new
    run into that --out without checkpoint.dir saves into its own checkpoints/, and the empty directory goes. The
    directory checkpoint.dir made is absolute, so the marker means the same from any working directory."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r"
    lock, _ = runclaim.claim(out, "ck")  # relative to the working directory
    lock.release()  # as a kill leaves it
    made = Path(rundir.run_marker(out)["checkpoints"])
    assert made.is_absolute() and made.parent == tmp_path / "ck"
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(out)).returncode == 0
    assert rundir.checkpoint_dir(out) == out / "checkpoints" and _steps(out)
    assert not made.exists()


def test_a_refused_retry_leaves_a_run_killed_before_its_first_step_reusable(token_file, tmp_path):
    """A retry refused in an --out a run killed before its first step left (its config.toml, plan.json) gives back
    what it claimed but keeps the directory marked, so the next run still starts in it; a refused checkpoint.dir
    leaves an --out it created gone, and an empty one the user gave empty."""
    out = tmp_path / "r"
    lock, _ = runclaim.claim(out)
    lock.release()  # as a kill leaves it
    (out / "config.toml").write_text("# the killed run's\n")
    refused(cli("run", *tiny(token_file), *STEPS, "--host-gb", "0.01", "--out", str(out)), "--host-gb")
    assert rundir.empty_run(out)
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(out)).returncode == 0
    (tmp_path / "afile").write_text("x")
    (tmp_path / "mine").mkdir()
    for d in ("new", "mine"):
        sets = ["--set", f'checkpoint.dir="{tmp_path / "afile"}"']
        refused(cli("run", *tiny(token_file), *STEPS, *sets, "--out", str(tmp_path / d)), "checkpoint.dir")
    assert not (tmp_path / "new").exists() and not list((tmp_path / "mine").iterdir())


def test_the_disk_check_counts_the_first_save_beside_more_than_keep():
    """Existing checkpoints beyond checkpoint.keep stay until a save is whole: the first one still needs room."""
    from tiertrain.plan.saves import Saves

    assert Saves(10, 10, 3, existing=2, keep=1).at_once == 1
    assert Saves(10, 10, 3, existing=2, keep=1).need == 10
    assert Saves(10, 10, 3, existing=1, keep=2).at_once == 2  # as before where the existing fit keep
    assert Saves(10, 10, 0, existing=2, keep=1).at_once == 0


def test_an_export_it_cannot_write_is_one_line(token_file, tmp_path):
    """`export --to` under a file, or a link to an empty directory, or on a disk that fills: one line each, the
    link's target untouched, nothing left of the export."""
    run = tmp_path / "a"
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(run)).returncode == 0
    (tmp_path / "afile").write_text("x")
    refused(cli("export", str(run), "--to", str(tmp_path / "afile" / "sub")), "cannot write")
    target, link = tmp_path / "empty", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    refused(cli("export", str(run), "--to", str(link)), "symbolic link")
    assert target.is_dir() and not any(target.iterdir())
    # a disk that fills (a file size limit of 64 KiB: the weights' shard does not fit): one line, nothing left
    refused(cli("export", str(run), "--to", str(tmp_path / "full"), fsize=1 << 16), "cannot write the export")
    assert not [p for p in tmp_path.iterdir() if "full" in p.name]


def test_an_export_that_cannot_fit_its_disk_is_refused_first(token_file, tmp_path, monkeypatch):
    """The export's weights (4 B a parameter, 2 in bf16) against the free space of --to's disk: refused in one
    line before anything is written, bf16 offered where it fits; with room for exactly the weights it writes."""
    from tiertrain import export
    from tiertrain.config import config_from_dict

    run = tmp_path / "a"
    assert cli("run", *tiny(token_file), "--set", "train.steps=1", "--out", str(run)).returncode == 0
    n = config_from_dict(read_meta(rundir.checkpoints(run)[-1])["config"]).model.n_params
    free = {"bytes": 4 * n - 1}
    monkeypatch.setattr(export, "disk_free", lambda p: (free["bytes"], 0))
    with pytest.raises(UserError, match=r"weights need .* GB in float32 .*, or --dtype bfloat16"):
        export.export_hf(str(run), str(tmp_path / "hf"))
    free["bytes"] = 2 * n - 1
    with pytest.raises(UserError, match=r"in bfloat16 .* with room$"):
        export.export_hf(str(run), str(tmp_path / "hf"), "bfloat16")
    assert not [p for p in tmp_path.iterdir() if "hf" in p.name]
    free["bytes"] = 4 * n
    assert export.export_hf(str(run), str(tmp_path / "hf")) and (tmp_path / "hf" / "config.json").is_file()


def test_a_save_killed_between_its_renames_still_counts(token_file, tmp_path):
    """A run whose newest checkpoint is whole but still `.step_N.new` (a kill between a save's two renames): a new
    run into it is told to resume, not to delete it; `export` writes it; the resume finishes the rename."""
    run = tmp_path / "a"
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(run)).returncode == 0
    steps = rundir.checkpoints(run)
    for p in steps[:-1]:
        shutil.rmtree(p)
    last = steps[-1]
    os.rename(last, last.with_name(f".{last.name}.new"))
    line = refused(cli("run", *tiny(token_file), *STEPS, "--out", str(run)), "--resume latest")
    assert "saved no checkpoint" not in line
    r = cli("export", str(run), "--to", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    r = cli("run", "--resume", "latest", "--out", str(run), "--set", "train.steps=9")
    assert r.returncode == 0, r.stderr
    assert last.is_dir()


@pytest.mark.parametrize("journal", ['{"step": 1}', '{"step": 1, "to": "/tmp/elsewhere"}', "{"])
def test_a_cut_journal_tiertrain_did_not_write_is_refused(token_file, tmp_path, journal):
    """A timeline-cut journal without its destination, with one outside the run, or torn: one line, nothing
    moved."""
    run = tmp_path / "a"
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(run)).returncode == 0
    (run / rundir.CUT).write_text(journal)
    before = tree_hash(run)
    refused(cli("run", "--resume", "latest", "--out", str(run), "--set", "train.steps=9"), rundir.CUT)
    after = tree_hash(run)
    for h in (before, after):  # the lock says who held it last: the refused process did
        h.pop(rundir.LOCK)
    assert after == before


def test_an_empty_out_a_refused_run_was_given_is_left_empty(token_file, tmp_path):
    """A run refused after it claimed an --out that existed empty (its data missing) takes back its marker and
    its lock file: the directory is as empty as it came, and the next run starts in it. A lock file alone, as an
    older tiertrain left it, counts as empty; a user's file of that name, or a metrics.jsonl of another program,
    is refused in one line and left as it was."""
    out = tmp_path / "out"
    out.mkdir()
    refused(
        cli("run", *tiny(token_file), "--set", 'data.path="missing.bin"', "--out", str(out)), "missing.bin"
    )
    assert not list(out.iterdir())
    (out / rundir.LOCK).touch()
    r = cli("run", *tiny(token_file), *STEPS, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert rundir.is_run(out) and rundir.checkpoints(out)
    # a file of that name that is not a lock tiertrain wrote, or a metrics.jsonl of another program: refused, kept
    for name, text in ((rundir.LOCK, "mine"), ("metrics.jsonl", '{"mine": 1}\n')):
        other = tmp_path / name.replace(".", "-")
        other.mkdir()
        (other / name).write_text(text)
        refused(cli("run", *tiny(token_file), "--out", str(other)), f"--out {other}")
        assert [p.name for p in other.iterdir()] == [name] and (other / name).read_text() == text


def test_the_rename_credit_is_the_final_saves_and_only_where_a_rename_works(
    token_file, tmp_path, monkeypatch
):
    """The disk check lets the last save take the spilled slabs' store chunks by rename (their bytes already on
    the disk) only for the final save (a run without one writes every periodic save whole), and only where a
    file does rename from the store's directory into the checkpoints' (two bind mounts of one filesystem share a
    device id, and rename refuses to cross them)."""
    from conftest import tiny_config
    from tiertrain import assemble
    from tiertrain.trainer import Trainer

    seen = {}
    monkeypatch.setattr(assemble, "check_disk", lambda saves, *a: seen.update(saves))
    base = [*DEEP, "train.steps=2", f'tiers.nvme_dir="{tmp_path / "nvme"}"']
    spill = f"tiers.host_gb={least_budget(tiny_config(token_file, *DEEP))}"

    def full(*sets):
        Trainer(tiny_config(token_file, *base, spill, *sets), out=tmp_path / "run").close()
        return seen["full"]

    s = full()  # the final save, on the disk the store is on
    assert s.count == 1 and 0 < s.last < s.each
    s = full("checkpoint.final=false", "checkpoint.every=1")  # one periodic save: written whole
    assert s.count == 1 and s.last == s.each == s.need
    monkeypatch.setattr(paths, "renames_between", lambda a, b: False)
    s = full()
    assert s.count == 1 and s.last == s.each


def test_a_rename_between_two_mounts_of_one_filesystem_is_found_not_to_work(tmp_path):
    """renames_between: True within a filesystem, False between a directory and a bind mount of another
    directory of the same filesystem (one device id), as a rename finds; it writes nothing to find out."""
    disk = tmp_path / "disk"
    prefix = _mounted_tmpfs(disk, 4)
    code = (
        "import os, sys\nfrom pathlib import Path\nfrom tiertrain.paths import renames_between\n"
        "d = Path(sys.argv[1])\nsaid = [renames_between(d / 'a', d / x) for x in 'bc']\n"
        "made = sorted(p.name for p in d.rglob('*'))\n"
        "def moves(x):\n"
        "    f = d / 'a' / 'f'\n    f.write_text('')\n"
        "    try:\n        os.rename(f, d / x / 'f')\n    except OSError:\n        f.unlink()\n        return False\n"
        "    (d / x / 'f').unlink()\n    return True\n"
        "print(said, [moves(x) for x in 'bc'], made)\n"
    )
    script = f'mkdir -p {disk}/a {disk}/b {disk}/c && mount --bind {disk}/b {disk}/c && exec "$@"'
    r = subprocess.run(
        [*prefix[:-4], "sh", "-c", f"mount -t tmpfs -o size=4m tmpfs {disk} && {script}", "sh"]
        + [sys.executable, "-c", code, str(disk)],
        capture_output=True,
        text=True,
        cwd=str(Path(__file__).parent.parent),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[True, False] [True, False] ['a', 'b', 'c']\n"


def test_bad_nvme_dirs_and_another_models_checkpoint_are_refused_before_allocating(
    token_file, tmp_path, monkeypatch
):
    """An --nvme-dir that is a file, below a file or not writable, and a resume from another model's checkpoint:
    one line each, before the host state is allocated (nothing was made to be refused later)."""
    from conftest import tiny_config
    from tiertrain.checkpoint import CheckpointError
    from tiertrain.trainer import Trainer

    (tmp_path / "afile").write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    for nvme, words in (
        (tmp_path / "afile", "is a file"),
        (tmp_path / "afile" / "sub", "a file"),
        (locked / "sub", "cannot be written"),
    ):
        if "written" in words and os.access(locked, os.W_OK):  # root writes anywhere
            continue
        refused(cli("run", *tiny(token_file), "--nvme-dir", str(nvme), "--out", str(tmp_path / "r")), words)
        assert not (tmp_path / "r").exists()
    tr = Trainer(tiny_config(token_file))
    path, _ = tr.save_checkpoint(tmp_path / "run")
    tr.close()

    def allocating(*a, **k):
        raise AssertionError("allocated before the refusal")

    monkeypatch.setattr("tiertrain.trainer.assemble", allocating)
    with pytest.raises(CheckpointError, match="different model .*hidden_size"):
        Trainer(tiny_config(token_file, "model.hidden_size=128"), resume=path)


def test_a_resume_may_change_the_aux_loss_settings(token_file, tmp_path):
    """model.output_router_logits and model.router_aux_loss_coef change the loss, not the model: a resume that
    changes them resumes (it was refused as "a different model"), and the loss it trains on is the new one."""
    from conftest import tiny_config
    from tiertrain.trainer import Trainer

    moe = ['model.model_type="qwen3_moe"', "model.num_experts=4", "model.num_experts_per_tok=2"]
    tr = Trainer(
        tiny_config(token_file, *moe, "model.output_router_logits=true", "model.router_aux_loss_coef=0.1")
    )
    tr.train_step()
    path, _ = tr.save_checkpoint(tmp_path / "run")
    tr.close()
    for sets in (["model.output_router_logits=true", "model.router_aux_loss_coef=0.5"], []):
        tr = Trainer(tiny_config(token_file, *moe, *sets), resume=path)
        m = tr.cfg.model
        assert tr.step == 1 and (m.output_router_logits, m.router_aux_loss_coef) == (
            (True, 0.5) if sets else (False, 0.001)
        )
        tr.close()


def test_a_resume_with_another_val_fraction_names_it(token_file, tmp_path):
    """Another data.val_fraction splits the same file into other training rows: the refusal names that setting
    and the value to resume with, not data.path (which is the same file)."""
    run = tmp_path / "a"
    one = ["--set", "train.steps=1", "--set", "data.val_fraction=0.1"]
    assert cli("run", *tiny(token_file), *one, "--out", str(run)).returncode == 0
    r = cli(
        "run",
        "--resume",
        "latest",
        "--out",
        str(run),
        "--set",
        "data.val_fraction=0.2",
        "--set",
        "train.steps=2",
    )
    line = refused(r, "data.val_fraction = 0.2 holds out other rows than the 0.1", "data.val_fraction = 0.1")
    assert "data.path" not in line


def test_a_resume_keeps_its_checkpoint_dir(token_file, tmp_path):
    """checkpoint.dir changed on --resume (the run's marker names where its checkpoints live, and a disk check that
    finds them short offers a new --out, not checkpoint.dir): refused in one line."""
    run = tmp_path / "a"
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(run)).returncode == 0
    other = f'checkpoint.dir="{tmp_path / "big"}"'
    line = refused(cli("run", "--resume", "latest", "--out", str(run), "--set", other), "checkpoint.dir")
    assert "keeps its checkpoints where they were (in its --out)" in line and not (tmp_path / "big").exists()


def test_a_resume_into_a_new_out_saves_where_its_config_says(token_file, tmp_path):
    """A resume into a new --out is a new run: checkpoint.dir set there (the disk check's advice) takes its
    checkpoints to a directory of its own in it, the config.toml it records says so, and `latest` finds them; the
    source run's own checkpoint.dir carries over where it is not set."""
    run, fork, again = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert cli("run", *tiny(token_file), *STEPS, "--out", str(run)).returncode == 0
    big = tmp_path / "big"
    more = ["--set", "train.steps=10", "--set", f'checkpoint.dir="{big}"']
    r = cli("run", "--resume", str(run / "checkpoints" / "step_6"), "--out", str(fork), *more)
    assert r.returncode == 0, r.stderr
    (made,) = big.iterdir()
    assert rundir.checkpoint_dir(fork) == made.resolve() and not (fork / "checkpoints").exists()
    assert [p.name for p in rundir.checkpoints(fork)] == ["step_9", "step_10"]
    assert f'dir = "{big}"' in (fork / "config.toml").read_text()
    assert _steps(run) == ["step_3", "step_6", "step_8"]  # the source run is as it was
    r = cli("run", "--resume", str(fork), "--out", str(again), "--set", "train.steps=11")
    assert r.returncode == 0, r.stderr
    assert len(list(big.iterdir())) == 2 and _steps(again) == ["step_11"]


def test_an_interrupt_while_a_run_is_claimed_gives_its_out_back(tmp_path, monkeypatch):
    """A Ctrl-C while claim() writes the marker: the --out as it came (a new one gone) and its lock released, so
    the next claim in this process takes it; release() unlocks where giving back failed (a full disk)."""

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(runclaim, "write_json", interrupted)
        with pytest.raises(KeyboardInterrupt):
            runclaim.claim(out)
    assert not out.exists()
    lock, made = runclaim.claim(out)
    assert made == "dir"

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(runclaim, "write_json", full)
        with pytest.raises(OSError):  # a new marker for a run that never stepped: the disk is full
            runclaim.release(out, "reused", lock)
    lock, _ = runclaim.claim(out)  # unlocked all the same
    lock.release()
