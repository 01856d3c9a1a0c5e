"""What `tiertrain run` may write: its own `--out` directory, marked as a run, and nothing else; one process at a
time; one timeline of checkpoints.

A run directory holds `tiertrain-run.json` (the marker: the format, and where the run's checkpoints live when
`checkpoint.dir` put them on another disk), `tiertrain-run.lock` (held by the live process), `config.toml`,
`plan.json`, `metrics.jsonl`, `train.log`, `checkpoints/step_N` (or the marker's directory) and `abandoned/`
(the checkpoints and metrics of a timeline a resume from an older checkpoint left). A new run takes an `--out`
that does not exist or is empty; a resume writes into the run it resumes, or into a new empty `--out`. A directory
without the marker is a run where a checkpoint in its checkpoints/ names it as its run (one written before the
marker existed); a directory the user copied checkpoints into is not, and a step_N without a checkpoint's
zarr.json (an export there) is neither resumed nor pruned. Every refusal happens before anything large is
allocated, and names what to change. Claiming a directory for the process that writes it (the lock, the marker)
is runclaim.py's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from .checkpoint import FORMATS, STEP, CheckpointError, left_whole, recover, whole
from .checkpoint_load import read_meta
from .durable import fsync, write_json, write_whole
from .errors import DataError, UserError
from .metrics import read_metrics, truncate_metrics
from .paths import existing

MARKER = "tiertrain-run.json"
LOCK = "tiertrain-run.lock"
CUT = "tiertrain-cut.json"  # a cut of the timeline under way (cut_timeline): what it moves, and where
CKPT_MARKER = "tiertrain-checkpoints.json"  # in a checkpoint directory a run made under checkpoint.dir
# the files of a run directory written whole (durable.write_whole), through a `.NAME.*.tmp` beside each
OWN_FILES = (MARKER, CUT, "config.toml", "plan.json", "metrics.jsonl")


# ---- where a run's checkpoints are ---------------------------------------------------------------
def run_marker(run: Path) -> dict:
    """The run's marker (what tiertrain wrote when it made the run: where its checkpoints are), {} where none."""
    try:
        m = json.loads((Path(run) / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return m if isinstance(m, dict) else {}


def checkpoint_dir(run: Path) -> Path:
    """The directory of the run's checkpoints: `<run>/checkpoints`, or the one checkpoint.dir gave it, which must
    carry the mark tiertrain made it with (a marker naming any other directory is refused: the run would write
    and delete there)."""
    ck = run_marker(run).get("checkpoints")
    if not ck:
        return Path(run) / "checkpoints"
    if not isinstance(ck, str) or not (Path(ck) / CKPT_MARKER).is_file():
        raise UserError(
            f"{Path(run) / MARKER} names {ck} as the run's checkpoint directory, and {ck} has no {CKPT_MARKER}: "
            "not the directory tiertrain made for it (moved or not mounted?); put it back, or pass a new --out"
        )
    return Path(ck)


def _cut(run: Path) -> dict | None:
    """The journal of a cut of the timeline under way (cut_timeline), None where there is none; one tiertrain did
    not write (its destination not a plain name of its own) is refused: it would move checkpoints elsewhere."""
    try:
        text = (Path(run) / CUT).read_text()
    except FileNotFoundError:
        return None
    try:
        c = json.loads(text)
    except ValueError:
        c = None
    if not (
        isinstance(c, dict)
        and isinstance(c.get("step"), int)
        # a name in abandoned/, nothing more
        and re.fullmatch(r"resumed-at-step_[0-9]+[\w-]*", str(c.get("to")))
    ):
        raise UserError(
            f"{Path(run) / CUT} is not a journal tiertrain wrote; if no resume of this run is under way, "
            "remove it, then resume"
        )
    return c


def attributes(p: Path) -> dict | None:
    """The attributes of the tiertrain checkpoint `p` as its zarr.json holds them, unchecked; None: `p` is none (a
    directory of the user's named step_N, an export)."""
    try:
        a = json.loads((p / "zarr.json").read_text()).get("attributes")
    except (OSError, ValueError, AttributeError):
        return None
    return a if isinstance(a, dict) and a.get("format") in FORMATS else None


def saved_steps(d: Path) -> list[tuple[int, Path]]:
    """(step, path) of each whole checkpoint in the checkpoint directory d, oldest first, whatever the timeline;
    a directory named step_N that is no checkpoint (no zarr.json: an export) is not one of them, nor pruned."""
    return (
        sorted(
            (int(m.group(1)), p)
            for p in d.iterdir()
            if (m := STEP.fullmatch(p.name)) and (p / "zarr.json").is_file()  # torn, read_meta says so
        )
        if d.is_dir()
        else []
    )


def checkpoints(run: Path) -> list[Path]:
    """The run's whole checkpoints on its current timeline, oldest first (temporaries of an interrupted save,
    and the newer ones a resume from an older checkpoint is moving aside, are not listed)."""
    cut = _cut(run)
    return [p for s, p in saved_steps(checkpoint_dir(run)) if cut is None or s <= cut["step"]]


def interrupted(run: Path) -> list[Path]:
    """Whole checkpoints a save killed mid-way left under a temporary name (checkpoint.left_whole), oldest first:
    the run's next process renames them (heal); until then they count as saved."""
    return left_whole(checkpoint_dir(run))


def step_path(run: Path, step: int) -> Path:
    return checkpoint_dir(run) / f"step_{step}"


def prune(run: Path, keep: int) -> None:
    """Deletes all but the newest `keep` checkpoints, each renamed a save's temporary first: gone at once."""
    for old in checkpoints(run)[:-keep]:
        gone = old.with_name(f".{old.name}.tmp")  # recover() deletes one a kill leaves
        shutil.rmtree(gone, ignore_errors=True)
        os.rename(old, gone)
        shutil.rmtree(gone)


def is_run(d: Path) -> bool:
    """Whether `d` is a run's directory: tiertrain's marker, or (a run written before the marker) a checkpoint in
    its checkpoints/ that names `d` as its run. A directory the user copied checkpoints into is not one."""
    if (d / MARKER).is_file():
        return True
    return any(
        (a := attributes(p)) is not None and isinstance(a.get("run"), str) and same(Path(a["run"]), d)
        for _, p in saved_steps(d / "checkpoints")
    )


def run_of(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint belongs to: `<run>/checkpoints/step_N`, or the run its attributes name whose
    checkpoints live in the checkpoint's directory (checkpoint.dir); None: a checkpoint outside any run."""
    checkpoint = Path(checkpoint)
    if checkpoint.parent.name == "checkpoints" and is_run(checkpoint.parent.parent):
        return checkpoint.parent.parent
    try:
        run = read_meta(checkpoint).get("run")
    except UserError:
        return None
    if run and Path(run).is_dir() and same(checkpoint_dir(Path(run)), checkpoint.parent):
        return Path(run)
    return None


def resolve(arg: str, out: Path | None, what: str = "--resume") -> Path:
    """`latest` (the newest checkpoint of `out`), a checkpoint directory, or a run directory (its newest); `what`:
    the option that named it, for the messages (`--resume`, `export`)."""
    if arg == "latest":
        if out is None:
            raise CheckpointError(f"{what} latest needs --out DIR, the run to continue")
        run = Path(out)
    else:
        p = Path(arg)
        if (p / "zarr.json").is_file():
            return p
        run = p
    if not run.is_dir():
        how = "is a file, not a directory" if run.exists() else "does not exist"
        raise CheckpointError(f"{run} {how}; pass {what} a run directory or a checkpoint")
    found = checkpoints(run)
    if not found and what == "export":  # read only: a whole save the run has not renamed yet will do
        found = interrupted(run)
    if not found:
        if is_run(run) and interrupted(run):
            raise CheckpointError(
                f"{run}'s last save was interrupted before its checkpoint got its name; {what} latest "
                f"--out {run} finishes it"
            )
        if is_run(run):
            raise CheckpointError(
                f"{run} is a run that saved no checkpoint ({_stopped(run)}): there is nothing to "
                f"{'resume' if what == '--resume' else 'export'}; start a new run"
            )
        raise CheckpointError(
            f"{run} is neither a tiertrain run nor a checkpoint; pass {what} the --out directory of "
            "a run or one of its checkpoints/step_N"
        )
    return found[-1]


def _stopped(run: Path) -> str:
    try:
        records = read_metrics(run / "metrics.jsonl")
    except (OSError, ValueError):
        records = []
    steps = [r["step"] for r in records if isinstance(r, dict) and "step" in r]  # not another program's lines
    return f"it stopped after step {steps[-1]}" if steps else "it logged no step"


# ---- new runs and resumes --------------------------------------------------------------------
def empty_run(d: Path) -> bool:
    """A marked run that logged no step and saved no checkpoint (stopped before its first step): reusable."""
    if not (d / MARKER).is_file() or checkpoints(d) or interrupted(d):
        return False
    try:
        return not read_metrics(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else True
    except ValueError:
        return False


# [model] keys that change the loss, not the model
LOSS_ONLY = ("output_router_logits", "router_aux_loss_coef")


def check_checkpoint(
    path: Path, model: dict, numels: list[int], identity: dict, data_name: str, val_fraction: float = 0.0
) -> dict:
    """The attributes of the checkpoint `path`, refused where it was written for another model (`model`: the
    run's [model] section, `numels`: its units' sizes) or, whole, trained on other data (`identity`: the run's
    training rows', named `data_name`, of which data.val_fraction = `val_fraction` was held out)."""
    meta = read_meta(path)
    # the aux loss's switches are the training's, not the model's: a resume may change them
    theirs = {k: v for k, v in meta["config"]["model"].items() if k not in LOSS_ONLY}
    model = {k: v for k, v in model.items() if k not in LOSS_ONLY}
    if model != theirs or meta["numels"] != numels:
        diff = sorted(k for k in set(model) | set(theirs) if model.get(k) != theirs.get(k))
        raise CheckpointError(
            f"{path} was written for a different model ({', '.join(diff) or 'layout'} "
            "differ); resume with the run's own config, or start a new run"
        )
    was_data = meta.get("data", {}).get("identity")
    # the keys both have: a checkpoint from before the loss mask's checksum was kept compares its tokens
    differ = (
        [k for k in sorted(was_data.keys() & identity.keys()) if was_data[k] != identity[k]]
        if was_data
        else []
    )
    held = meta["config"].get("data", {}).get("val_fraction", 0.0)
    if whole(meta) and differ and held != val_fraction:  # the same file, split otherwise
        raise DataError(
            f"data.val_fraction = {val_fraction:g} holds out other rows than the {held:g} {path} trained with: "
            f"resume with data.val_fraction = {held:g}"
        )
    if whole(meta) and differ:
        was = meta["data"].get("path") or "the built-in corpus"
        how = (
            "the same tokens, other samples or loss mask: prepared with another template or --train-on-prompt"
            if differ == ["marks_crc32c"]
            else f"{was_data['size']:,} bytes, another checksum"
        )
        raise DataError(
            f"{data_name} is not the data {path} trained on ({was}: {how}): set data.path to that "
            "file, or export the checkpoint and start a new run from it with --init-from"
        )
    return meta


def _a_lock(p: Path) -> bool:
    """Whether `p` (absent, or a lock file's name) is tiertrain's: empty, or who held it as RunLock writes it."""
    try:
        text = p.read_text() if p.is_file() and not p.is_symlink() else ("" if not p.exists() else "x")
        return not text or {"host", "pid", "started"} <= set(json.loads(text))
    except (OSError, ValueError, TypeError):
        return False


def check_new(out: Path) -> None:
    """`out` may start a run: absent, an empty directory, or a marked run that never took a step."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a directory")
    # a lock file alone: what a refused run of an older tiertrain left in the empty --out it was given
    if (
        not out.is_dir()
        or {p.name for p in out.iterdir() if not left_writing(p)} <= {LOCK}
        and _a_lock(out / LOCK)
        or empty_run(out)
    ):
        return
    if is_run(out) and not checkpoints(out) and not interrupted(out):
        raise UserError(
            f"--out {out} holds a run that saved no checkpoint ({_stopped(out)}): nothing to resume. "
            "Pass a new --out directory (or delete that one to start over in it)"
        )
    if is_run(out):
        raise UserError(
            f"--out {out} already holds a run; continue it with --resume latest --out {out}, "
            "or pass a new --out directory"
        )
    raise UserError(
        f"--out {out} is a directory that is not a tiertrain run and is not empty; tiertrain writes "
        "only into a new or empty --out: pass one"
    )


def check_resume(checkpoint: Path, out: Path | None, new_run: bool = False) -> Path:
    """The run directory a resume from `checkpoint` writes into: the checkpoint's own run, or `out` when that
    is another directory, which must then be new or empty (the resumed run starts there). `new_run`: the
    checkpoint starts a new run (it holds the weights only), which needs a new or empty --out."""
    own = run_of(checkpoint)
    if new_run:
        if out is None or (own is not None and same(own, out)):
            raise UserError(
                f'{checkpoint} holds the weights only (checkpoint.state = "weights"): it starts a new '
                "run, with fresh Adam moments from step 0; pass --out, a new directory for it"
            )
        check_new(out)
        return out
    if out is None:
        if own is None:
            raise UserError(
                f"{checkpoint} is not inside a run's checkpoints/ directory; pass --out, a new "
                "directory for the resumed run"
            )
        return own
    if own is not None and same(own, out):
        return out
    check_fork(out, own or checkpoint)
    return out


def check_fork(out: Path, source: Path) -> None:
    """A resume from `source` (a run, or a checkpoint outside any) into `out`, another directory: new or empty."""
    if out.is_dir() and any(out.iterdir()) and not empty_run(out):
        what = "another run" if is_run(out) else "files that are not a tiertrain run"
        raise UserError(
            f"--out {out} holds {what}; a resume writes only into the run it resumes ({source}) or into "
            "a new empty --out"
        )
    check_new(out)


def check_paths(out: Path, nvme_dir: str, ckpt_parent: str) -> None:
    """The NVMe tier's scratch store (a new directory inside nvme_dir), the run directory and the checkpoint
    directory stay apart."""
    from .tiers.nvme import SCRATCH_MARKER

    o = out.resolve()
    if nvme_dir:
        d = Path(nvme_dir).resolve()
        near = existing(d)
        if not near.is_dir() or not os.access(near, os.W_OK | os.X_OK):
            if not near.is_dir():
                what = "is a file" if near == d else f"is below {near}, a file"
            else:
                what = f"cannot be written ({near} is read-only here)"
            raise UserError(
                f"--nvme-dir {nvme_dir} {what}: the NVMe tier makes its scratch store in that directory; pass a "
                "writable directory on a fast disk"
            )
        if d == o or o in d.parents:
            raise UserError(
                f"--nvme-dir {nvme_dir} is inside --out {out}: the run's scratch store would sit in its "
                "run directory; pass an --nvme-dir outside it"
            )
    for what, path in (
        ("--out", o),
        ("checkpoint.dir", Path(ckpt_parent).resolve() if ckpt_parent else None),
    ):
        for p in (path, *path.parents) if path else ():
            if (p / SCRATCH_MARKER).is_file():
                raise UserError(f"{what} {path} is inside tiertrain's scratch store {p}; pass one outside it")


# ---- one timeline -------------------------------------------------------------------------------
def cut_timeline(run: Path, step: int) -> str | None:
    """The run goes on from its checkpoint of `step`: its newer checkpoints and the metrics logged after that step
    move aside into `abandoned/` (renamed, nothing deleted), so that `latest` and `export` mean the last step of
    the timeline the run is on. A kill at any moment leaves a journal (CUT) that finish_cut() completes, and until
    then the newer checkpoints do not count. Returns the line that reports what moved (None: nothing newer)."""
    newer = [p for s, p in saved_steps(checkpoint_dir(run)) if s > step]
    if not newer:
        # records a killed process logged after its last checkpoint: redone alike
        truncate_metrics(Path(run) / "metrics.jsonl", step)
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    write_json(Path(run) / CUT, {"step": step, "to": f"resumed-at-step_{step}-{stamp}"})
    fsync(Path(run))
    return finish_cut(run)


def finish_cut(run: Path) -> str | None:
    """Completes a cut of the timeline (cut_timeline) where its journal says one is under way; idempotent."""
    run = Path(run)
    cut = _cut(run)
    if cut is None:
        return None
    step, ck = cut["step"], checkpoint_dir(run)
    dest = run / "abandoned" / cut["to"]
    # a rename stays on its disk
    dest_ck = dest if same(ck, run / "checkpoints") else ck / "abandoned" / cut["to"]
    for d in (dest, dest_ck):
        d.mkdir(parents=True, exist_ok=True)
    metrics = run / "metrics.jsonl"
    if metrics.is_file() and not (dest / "metrics.jsonl").exists():  # the tail first, whole, then the cut
        later = "".join(json.dumps(r) + "\n" for r in read_metrics(metrics) if r["step"] > step)
        write_whole(dest / "metrics.jsonl", later)
    truncate_metrics(Path(run) / "metrics.jsonl", step)
    moved = []
    for s, p in saved_steps(ck):
        if s > step:
            os.rename(p, dest_ck / p.name)
            moved.append(p.name)
    fsync(ck)
    (run / CUT).unlink()
    fsync(run)
    return (
        f"resumed from step {step}, before the newest checkpoints of this run: "
        f"{', '.join(moved) or 'its checkpoints'} and the metrics after step {step} moved to {dest_ck}"
        + (f" and {dest}" if dest_ck != dest else "")
    )


def check_metrics(run: Path) -> None:
    """The run's metrics.jsonl readable before anything is allocated: a resume truncates and extends it."""
    try:
        if (run / "metrics.jsonl").is_file():
            read_metrics(run / "metrics.jsonl")
    except ValueError as e:
        raise UserError(
            f"{run / 'metrics.jsonl'}: {e}; was it edited? Restore it or start a new --out"
        ) from None


def heal(run: Path) -> None:
    """What a process killed in the run left half done, finished by the run's next process (which holds the lock):
    a save (checkpoint.recover), then a cut of the timeline."""
    recover(checkpoint_dir(run))
    finish_cut(run)


def disk_free(path: Path) -> tuple[int, int]:
    """(free bytes, device id) of the filesystem `path` is on, or would be made on (its nearest existing parent)."""
    p = existing(path)
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize, os.stat(p).st_dev


def left_writing(p: Path) -> bool:
    """Whether `p` is a temporary a process killed while writing one of a run's own files left
    (durable.write_whole's `.NAME.*.tmp`)."""
    return p.name.startswith(tuple(f".{n}." for n in OWN_FILES)) and p.name.endswith(".tmp") and p.is_file()


def same(a: Path, b: Path) -> bool:
    """Whether two paths name the same directory (False where either cannot be resolved)."""
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False
