"""Files written whole or not at all, and made durable: what a crash at any moment must not leave torn."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_json(path: Path, data: dict) -> None:
    write_whole(path, json.dumps(data) + "\n")


def write_whole(path: Path, text: str) -> None:
    """`text` as the file `path`, whole or not at all: a new file beside it (made exclusively: never through a link
    of that name), readable by all as the rest of a run, fsynced, renamed over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{Path(path).name}.", suffix=".tmp", dir=Path(path).parent)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync(path: Path) -> None:
    """fsync of a file or a directory (its entries: a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
