"""What `tiertrain run` may write: its own `--out` directory, marked as a run, and nothing else.

A run directory holds `tiertrain-run.json` (the marker), `config.toml`, `metrics.jsonl` and
`checkpoints/`. A new run takes an `--out` that does not exist or is empty; a resume writes into the
run it resumes, or into a new empty `--out`. Directories of runs written before the marker existed
(metrics.jsonl or checkpoints/ without it) count as runs too. Every refusal happens before anything
large is allocated, and names what to change.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from . import __version__
from .errors import UserError, why
from .metrics import read_metrics

MARKER = "tiertrain-run.json"


def is_run(d: Path) -> bool:
    return (d / MARKER).is_file() or (d / "metrics.jsonl").is_file() or (d / "checkpoints").is_dir()


def _empty_run(d: Path) -> bool:
    """A marked run that logged no step and saved no checkpoint (stopped before its first step): reusable."""
    from .checkpoint import checkpoints

    if not (d / MARKER).is_file() or checkpoints(d):
        return False
    try:
        return not read_metrics(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else True
    except ValueError:
        return False


def check_new(out: Path) -> None:
    """`out` may start a run: absent, an empty directory, or a marked run that never took a step."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a directory")
    if not out.is_dir() or not any(out.iterdir()) or _empty_run(out):
        return
    if is_run(out):
        raise UserError(f"--out {out} already holds a run; continue it with --resume latest --out {out}, "
                        "or pass a new --out directory")
    raise UserError(f"--out {out} is a directory that is not a tiertrain run and is not empty; tiertrain writes "
                    "only into a new or empty --out: pass one")


def check_resume(checkpoint: Path, out: Path | None) -> Path:
    """The run directory a resume from `checkpoint` writes into: the checkpoint's own run, or `out` when that
    is another directory, which must then be new or empty (the resumed run starts there)."""
    own = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    if out is None:
        if own is None:
            raise UserError(f"{checkpoint} is not inside a run's checkpoints/ directory; pass --out, a new "
                            "directory for the resumed run")
        return own
    if own is not None and _same(own, out):
        return out
    if out.is_dir() and any(out.iterdir()) and not _empty_run(out):
        what = "another run" if is_run(out) else "files that are not a tiertrain run"
        raise UserError(f"--out {out} holds {what}; a resume writes only into the run it resumes ({own or checkpoint})"
                        " or into a new empty --out")
    check_new(out)
    return out


def check_nvme(out: Path, nvme_dir: str) -> None:
    """The NVMe tier's scratch store (a new directory inside nvme_dir) and the run directory stay apart."""
    if not nvme_dir:
        return
    d, o = Path(nvme_dir).resolve(), out.resolve()
    if d == o or o in d.parents:
        raise UserError(f"--nvme-dir {nvme_dir} is inside --out {out}: the run's scratch store would sit in its "
                        "run directory; pass an --nvme-dir outside it")
    from .tiers.nvme import SCRATCH_MARKER

    for p in (o, *o.parents):
        if (p / SCRATCH_MARKER).is_file():
            raise UserError(f"--out {out} is inside tiertrain's scratch store {p}; pass an --out outside it")


def claim(out: Path) -> str:
    """Creates `out` (or takes the empty one checked) and marks it as a run; a full or read-only disk is one
    line. Returns what it made, for release(): "dir" (the directory and the marker), "marker", or ""."""
    made = "marker" if out.is_dir() else "dir"
    if (out / MARKER).is_file():
        made = ""
    try:
        out.mkdir(parents=True, exist_ok=True)
        marker = out / MARKER
        if not marker.is_file():
            tmp = out / f".{MARKER}.tmp"
            tmp.write_text(json.dumps({"format": "tiertrain-run/1", "tiertrain_version": __version__,
                                       "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
            os.replace(tmp, marker)
    except OSError as e:
        raise UserError(f"cannot write the run directory {out}: {why(e)}; pass an --out on a disk with room") from None
    return made


def release(out: Path, made: str) -> None:
    """Takes back what claim() made (`made`) for a run refused before its first step."""
    if made:
        (out / MARKER).unlink(missing_ok=True)
    if made == "dir":
        try:
            out.rmdir()  # only if empty: anything else in it stays
        except OSError:
            pass


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False
