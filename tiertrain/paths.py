"""Where a path is, or would be made, and whether a file renames between two directories: below the planner,
whose disk budgets read them, and the run directory's checks alike."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path


def existing(path: str | os.PathLike) -> Path:
    """`path`, or its nearest existing parent: where it would be made."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def renames_between(a: Path, b: Path) -> bool:
    """Whether a file renames from directory `a` into directory `b` (or their nearest existing parents): one
    mount of one filesystem (rename refuses to cross mounts, bind mounts of one filesystem among them, which
    share a device id). Read from this process's mount table: nothing is written to find out."""
    src, dst = existing(a), existing(b)
    if os.stat(src).st_dev != os.stat(dst).st_dev:
        return False
    try:
        table = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:  # no mount table (not Linux): one device is the best answer there is
        return True
    return _mount(table, src) == _mount(table, dst)


def _mount(table: list[str], path: Path) -> str:
    """The id of the mount `path` is on: the last mounted (mount order) of those whose mount point is its
    deepest ancestor."""
    real, best, depth = os.path.realpath(path), "", -1
    for line in table:
        fields = line.split()
        # mountinfo escapes a space, tab, newline and backslash in a path as \ and three octal digits
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= depth:
            best, depth = fields[0], len(point)
    return best


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
