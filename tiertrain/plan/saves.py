"""What a run's checkpoints take on disk, and whether the disk they go to has it: counted before anything is
allocated, from the slabs' sizes, the checkpoint settings and the free space the caller measured. Pure Python.

A checkpoint (checkpoint.py) holds an fp32 chunk per unit and saved kind (the master and both moments, or the
master alone), each with a 4-byte checksum and its array's metadata. While a run saves, its `keep` newest
checkpoints stand beside the one being written (the oldest is deleted once the new one is whole); the NVMe
tier's stores on the same disk hold their bytes all the while, and a run's last save takes their chunks of
spilled master and moments by rename instead of writing them again.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..sizes import gb

BLOCK = 4096  # a file takes whole blocks
ARRAY_META = 2 * BLOCK  # an array's zarr.json and its chunk's directory
KINDS = {"full": 3, "weights": 1}  # fp32 slabs saved per unit: master and moments, or the master


def checkpoint_bytes(numels: list[int], state: str = "full") -> int:
    """Disk bytes of one checkpoint of units of `numels` elements (whole slabs, padding included)."""
    per_kind = sum(-(-(n * 4 + 4) // BLOCK) * BLOCK + ARRAY_META for n in numels)
    return KINDS[state] * per_kind + 4 * BLOCK  # the group's and its kinds' metadata


def saves(start: int, steps: int, every: int, final: bool) -> int:
    """Checkpoints a run from step `start` to `steps` writes (a signal's save aside)."""
    periodic = len(range(every * (start // every + 1), steps, every)) if every else 0
    return periodic + (final and start < steps)


@dataclass(frozen=True)
class Saves:
    """A run's checkpoints on their disk."""

    each: int  # bytes of one checkpoint
    last: int  # bytes the last save writes anew (less where it takes the NVMe store's chunks by rename)
    count: int  # checkpoints the run writes
    existing: int  # checkpoints of the run's timeline already on that disk
    keep: int  # checkpoint.keep

    @property
    def at_once(self) -> int:
        """New checkpoints on the disk at the busiest moment: up to `keep` beside the one being written, the
        existing ones counting towards `keep`; at least the first one, written beside every existing one (a run
        prunes only once a save is whole, so existing ones beyond `keep` are still there then)."""
        if not self.count:
            return 0
        return max(1, min(self.existing + self.count - 1, self.keep) + 1 - self.existing)

    @property
    def need(self) -> int:
        """Disk bytes the run's checkpoints add at their peak."""
        if self.count == 1 and self.at_once == 1:
            return self.last
        return self.at_once * self.each

    @property
    def elsewhere(self) -> int:
        """The same on another disk than the NVMe tier's: the last save writes every byte."""
        return self.at_once * self.each


def check_disk(
    saves: dict[str, Saves], free: int, store: int, where: str, state: str, resumed: bool = False
) -> None:
    """Refuses, in one line naming what would fit, a run whose checkpoints (`saves`: by checkpoint.state, the run's
    under `state`) and NVMe stores on the same disk (`store` bytes) need more than the `free` bytes of `where`;
    a `resumed` run's checkpoints stay where its run keeps them (a new --out moves them, not checkpoint.dir)."""
    s = saves[state]
    need = s.need + store
    if need <= free:
        return
    beside = f" beside the NVMe tier's {gb(store)} on the same disk" if store else ""
    fits = []
    if state == "full" and saves["weights"].need + store <= free:
        fits.append(
            f'checkpoint.state = "weights" (the fp32 master alone, {gb(saves["weights"].each)} each; a '
            "resume from it starts a new run with fresh Adam moments)"
        )
    if s.keep > 1 and Saves(s.each, s.last, s.count, s.existing, 1).need + store <= free:
        fits.append("checkpoint.keep = 1")
    fits.append(
        f"--out a new directory on a disk with {gb(s.elsewhere)} free (the run resumed into it)"
        if resumed
        else f"checkpoint.dir = a directory on a disk with {gb(s.elsewhere)} free"
    )
    taken = (
        f", the last taking {gb(s.each - s.last)} of it from the NVMe store by rename"
        if s.last < s.each
        else ""
    )
    raise ConfigError(
        f"the checkpoints need {gb(need)} on {where}: {s.at_once} of {gb(s.each)} at once "
        f"({state} state, checkpoint.keep = {s.keep}, one being written{taken}){beside}, and it has "
        f"{gb(free)} free; " + ("pass " if resumed and len(fits) == 1 else "set ") + ", or ".join(fits)
    )
