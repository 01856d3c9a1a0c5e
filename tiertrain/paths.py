"""Where a path is, or would be made: below the planner, whose disk budgets read it, and the run directory's
checks alike."""

from __future__ import annotations

import os
from pathlib import Path


def existing(path: str | os.PathLike) -> Path:
    """`path`, or its nearest existing parent: where it would be made."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p
