"""Where a path is, or would be made, and whether a file renames between two directories: below the planner,
whose disk budgets read them, and the run directory's checks alike."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

# renames_between's trial file is a temporary of this name (temp_prefix), removed at once
RENAME_PROBE = "tiertrain-rename"


def existing(path: str | os.PathLike) -> Path:
    """`path`, or its nearest existing parent: where it would be made."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def renames_between(a: Path, b: Path) -> bool:
    """Whether a file renames from directory `a` into directory `b` (or their nearest existing parents): one
    filesystem, and not two mounts of it (bind mounts share a device id, and rename refuses to cross them).
    Tried with a temporary of its own (temp_prefix), removed at once; those of processes killed meanwhile go."""
    src, dst = existing(a), existing(b)
    if os.stat(src).st_dev != os.stat(dst).st_dev:
        return False
    for d in {src, dst}:
        drop_killed_temps(d / RENAME_PROBE)
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(src / RENAME_PROBE), dir=src)
        os.close(fd)
    except OSError:
        return False
    moved = dst / Path(tmp).name
    try:
        os.rename(tmp, moved)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        return False
    moved.unlink(missing_ok=True)
    return True


def temp_prefix(target: Path) -> str:
    """The name a temporary beside `target` starts with (tempfile's prefix): it holds this process's pid, so that
    a later writer of `target` deletes it once this process is gone (drop_killed_temps)."""
    return f".{target.name}.tmp-{os.getpid()}-"


def drop_killed_temps(target: Path) -> None:
    """Deletes the temporaries beside `target` (temp_prefix's names, file or directory) whose process is gone:
    left by a writer killed before it renamed one over `target`. Never a link, never another process's."""
    import glob
    import shutil

    import psutil

    for p in target.parent.glob(f".{glob.escape(target.name)}.tmp-*-*"):
        pid = p.name[len(target.name) + 6 :].split("-")[0]
        if p.is_symlink() or not pid.isdigit() or psutil.pid_exists(int(pid)):
            continue
        with contextlib.suppress(OSError):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
