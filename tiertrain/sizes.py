"""Sizes in messages: enough digits to tell two sizes apart, and suggested budgets that themselves work."""

from __future__ import annotations

import math


def gb(nbytes: float) -> str:
    """A size for people: GB (1e9 B) with two decimals, MiB or KiB below (a small size never reads 0.0)."""
    if abs(nbytes) >= 1e9:
        return f"{nbytes / 1e9:,.2f} GB"
    if abs(nbytes) >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB" if abs(nbytes) >= 2**10 else f"{int(nbytes)} B"


def budget(nbytes: float, most: float | None = None) -> str:
    """`nbytes` as a --host-gb / --nvme-gb value, rounded up to three significant digits: passed back as it
    is printed, it is at least `nbytes` (a budget rounded down would be refused again). `most`: bytes the value
    must not pass either where `nbytes` does not (the RAM free), with more digits where three would."""
    x = max(nbytes, 1.0) / 1e9
    digits = max(0, 2 - math.floor(math.log10(x)))
    text = f"{math.ceil(x * 10**digits - 1e-9) / 10**digits:.{digits}f}"
    # float rounding in the line above, or a round-up past `most`
    while float(text) * 1e9 < nbytes or (
        most is not None and nbytes <= most < float(text) * 1e9 and digits < 9
    ):
        digits += 1
        text = f"{math.ceil(x * 10**digits) / 10**digits:.{digits}f}"
    return text


def num(x: float) -> str:
    """A time or a rate for people: three significant digits at least, never in exponent form, thousands separated
    (a small model's step reads 0.00412 s, not 0.00 s; a large one's 1,830 s)."""
    if not math.isfinite(x) or x == 0:
        return f"{x:g}"
    text = f"{x:,.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"
    return f"{x:,.0f}" if abs(float(text.replace(",", ""))) >= 100 else text
