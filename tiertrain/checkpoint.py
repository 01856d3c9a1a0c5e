"""Checkpoints: `step_<N>/` in a run's checkpoint directory (rundir.checkpoint_dir), a Zarr v3 group written whole
or not at all.

Layout: arrays `<kind>/<unit>` (kind: master, exp_avg, exp_avg_sq, or the master alone with checkpoint.state =
"weights"; fp32, one chunk each, the unit's slab with its padding) whose chunks carry a CRC32C checksum, and the
group's attributes (JSON): the format, step, resolved config (its paths absolute), the run, data position and the
data's identity, RNG states, optimizer hyperparameters and step count, the units' sizes and tiertrain's version.
Plain `zarr` reads it. Gradients are not saved: a step starts from zero gradients. The compute-dtype copy is not
saved either: it is the master, rounded.

A checkpoint is written under a hidden temporary name (`.step_N.tmp`), every file and directory fsynced,
renamed `.step_N.new` (whole), then `step_N` (a step saved again moves aside as `.step_N.old` first): a crash
at any point leaves the previous checkpoints whole, and recover() finishes a swap it interrupted.
zarr writes the metadata; the chunk files (the slab's bytes, then their CRC32C as 4 little-endian
bytes: what zarr's crc32c codec reads) are written here and read in checkpoint_load.py, straight between the slab
and the disk with direct I/O, checksummed in place: no encode or decode copies.

Several ranks (parallel.Ranks) save and load one checkpoint together, in the same format: rank 0 makes the
group and sizes every chunk file, each rank writes (reads) its shard's byte range of each file, and the
checksums of the ranges combine into the file's CRC32C (crc_combine). So a checkpoint resumes on any number of
ranks. The run directory must then be one every rank sees (a shared filesystem across hosts).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from . import __version__
from .checksum import combined, crc
from .durable import fsync
from .errors import ElsewhereError, UserError, why
from .modes import STATE, Kind

FORMAT = "tiertrain-checkpoint/2"  # /2: the attributes carry their own checksum; /1 is still read
FORMATS = (FORMAT, "tiertrain-checkpoint/1")
OTHER = "use another of the run's checkpoints (checkpoints/step_N)"  # said on a resume and an export alike
KINDS = STATE  # the optimizer's state, whole
WEIGHTS = (STATE[0],)  # the fp32 master alone (checkpoint.state = "weights")
SAVED = {"full": KINDS, "weights": WEIGHTS}  # the kinds each checkpoint.state saves
# names in full (fullmatch): ASCII digits, nothing after them (a "$" would pass a trailing newline)
STEP = re.compile(r"step_([0-9]+)")
LEFT = re.compile(r"\.(step_[0-9]+)\.(tmp|new|old)")  # what a killed save leaves (see save and recover)

# (unit, kind) -> a context manager giving (the element offset of this rank's part of the slab, that part)
Source = Callable[[int, str], AbstractContextManager[tuple[int, torch.Tensor]]]


@contextmanager
def _direct_io(threads: int = 8) -> Iterator:
    """A POSIX direct-I/O pool for one save or load, its owner, shut when that ends."""
    from .tiers.nvme import PosixIO

    io = PosixIO(threads)
    try:
        yield io
    finally:
        io.close()


def _direct(t: torch.Tensor) -> bool:
    from .tiers.slab import PAGE

    return t.data_ptr() % PAGE == 0 and (t.numel() * t.element_size()) % PAGE == 0


def _chunk(root: Path, kind: Kind, unit: int) -> Path:
    return Path(root) / kind.value / str(unit) / "c" / "0"


def kinds_of(meta: dict) -> tuple[Kind, ...]:
    """The kinds a checkpoint (its attributes) holds."""
    return tuple(Kind(k) for k in meta["kinds"])


def whole(meta: dict) -> bool:
    """A checkpoint of the whole optimizer state (a resume continues it), not of the weights alone."""
    return set(kinds_of(meta)) == set(KINDS)


def _body(file: Path, t: torch.Tensor, write: bool, io, at: int = 0) -> None:
    """Moves `t`'s bytes to or from the chunk file at byte `at`: direct I/O when both are page-aligned."""
    from .tiers.slab import PAGE

    if _direct(t) and at % PAGE == 0:
        (io.write if write else io.read)(file, t, at).result()
        return
    with open(file, "r+b" if write else "rb") as f:
        f.seek(at)
        data = t.view(torch.uint8).numpy().data
        if write:
            f.write(data)
        else:
            f.readinto(data)


def _set_crc(file: Path, nbytes: int, crc: int) -> None:
    with open(file, "r+b") as f:
        f.seek(nbytes)
        f.write(np.array([crc], dtype="<u4").tobytes())


class CheckpointError(UserError):
    pass


def checkpoints(d: Path) -> list[Path]:
    """The whole checkpoints in the directory `d`, oldest first (not the temporaries of a save)."""
    found = (
        [(int(m.group(1)), p) for p in d.iterdir() if (m := STEP.fullmatch(p.name)) and p.is_dir()]
        if Path(d).is_dir()
        else []
    )
    return [p for _, p in sorted(found)]


def left_whole(d: Path) -> list[Path]:
    """The whole checkpoints a killed save left in `d` under a temporary name, oldest step first: those recover makes
    step_N (`.step_N.new`, else `.step_N.old` where step_N is gone). Until then they count as saved."""
    d = Path(d)
    left = {
        (m.group(1), m.group(2)): p
        for p in (d.iterdir() if d.is_dir() else ())
        if (m := LEFT.fullmatch(p.name))
    }
    whole = {
        name: p
        for (name, kind), p in left.items()
        if kind == "new" or kind == "old" and (name, "new") not in left and not (d / name).exists()
    }
    return [whole[n] for n in sorted(whole, key=lambda n: int(n[5:]))]


def recover(d: Path) -> None:
    """Finishes what a save killed mid-way left in the checkpoint directory `d` (only the run's own process may call
    this: it deletes a save's temporaries). `.step_N.tmp`: a write that may be partial, deleted (the
    checkpoints before it stand). `.step_N.new`: whole (named so only after its fsync), and the newest of its
    step: it becomes step_N. `.step_N.old`: the step_N a re-save was replacing: deleted once step_N exists,
    else it is step_N again."""
    d = Path(d)
    if not d.is_dir():
        return
    left = sorted(
        (("tmp", "new", "old").index(m.group(2)), m.group(1), p)
        for p in d.iterdir()
        if (m := LEFT.fullmatch(p.name))
    )
    for kind, name, p in left:
        final = d / name
        if kind == 0:  # .tmp
            shutil.rmtree(p)
        elif kind == 1:  # .new
            _swap_in(p, final)  # as the save would have finished
        elif not p.exists():  # .old, deleted above when its step's .new took the name
            continue
        elif final.exists():
            shutil.rmtree(p)
        else:
            os.rename(p, final)
    if left:
        fsync(d)


def _fsync_tree(root: Path) -> None:
    for d, _, files in os.walk(root):
        for name in files:
            fsync(Path(d) / name)
        fsync(Path(d))


def _create(tmp: Path, numels: list[int], kinds: tuple[Kind, ...], attrs: dict) -> None:
    """The group at `tmp`, an array per (kind, unit), and each chunk file at its size (slab and checksum)."""
    import zarr
    from zarr.codecs import Crc32cCodec

    tmp.parent.mkdir(parents=True, exist_ok=True)
    g = zarr.open_group(tmp, mode="w-", attributes=attrs)
    for kind in kinds:
        sub = g.create_group(kind.value)
        for u, n in enumerate(numels):
            # zeros too: whole
            sub.create_array(
                str(u),
                shape=(n,),
                chunks=(n,),
                dtype="float32",
                fill_value=0,
                compressors=[Crc32cCodec()],
                config={"write_empty_chunks": True},
            )
            file = _chunk(tmp, kind, u)
            file.parent.mkdir(parents=True, exist_ok=True)
            with open(file, "wb") as f:
                f.truncate(n * 4 + 4)


def save(
    path: Path,
    numels: list[int],
    source: Source,
    meta: dict,
    ranks=None,
    threads: int = 4,
    kinds: tuple[Kind, ...] = KINDS,
    take: Callable[[int, Kind], Path | None] | None = None,
) -> int:
    """Writes the checkpoint at `path` from `source(unit, kind)` (this rank's part of the unit's fp32 slab) for each
    of `kinds` (KINDS, or the master alone: WEIGHTS); returns the bytes this rank wrote. `threads` slabs are in
    flight at once. `ranks`: the ranks that save together (parallel.Ranks; None: this process alone); rank 0 makes,
    checksums and renames the checkpoint. `take(unit, kind)`: a file that holds the slab at its start, on the
    checkpoint's filesystem, which the save may take (cut to the slab, its checksum appended, renamed into the
    checkpoint) instead of writing its bytes again: the NVMe store's chunk of a spilled slab, at a run's last save
    (one rank)."""
    from .parallel import Ranks

    ranks = ranks or Ranks()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    keys = [(u, k) for k in kinds for u in range(len(numels))]
    taken = {key: f for key in keys if ranks.size == 1 and take and (f := take(*key)) is not None}
    attrs = {
        "format": FORMAT,
        "tiertrain_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "kinds": [k.value for k in kinds],
        "numels": list(numels),
        **meta,
    }
    attrs = json.loads(json.dumps(attrs))  # as read back: the checksum is of the JSON's values
    attrs[ATTRS_CRC] = _attrs_crc(attrs)
    parts: dict = {}
    with ranks.together(OSError) as agreed:
        if ranks.first:
            recover(path.parent)  # a save of this run killed before: finished first
            _create(tmp, numels, kinds, attrs)
    if agreed.failed:
        return _failed(path, tmp, agreed.error, ranks)
    with ranks.together(OSError) as agreed:
        parts = _write_parts(tmp, keys, source, taken, threads)
    if agreed.failed:
        return _failed(path, tmp, agreed.error, ranks)
    crcs = ranks.host_ints([x for key in keys for x in parts[key]])
    with ranks.together(OSError) as agreed, _removed_unless_done(tmp):
        if ranks.first:
            for i, (u, kind) in enumerate(keys):
                _set_crc(_chunk(tmp, kind, u), numels[u] * 4, combined(crcs, i))
            _publish(path)
    if agreed.failed:
        return _failed(path, tmp, agreed.error, ranks)
    return sum(n for key in keys if key not in taken for n in parts[key][1:])


def _write_parts(tmp: Path, keys: list, source: Source, taken: dict, threads: int) -> dict:
    """This rank's part of every (unit, kind) slab into the temporary checkpoint `tmp`, `threads` at a time: written,
    or for a slab in `taken` its file renamed in (after the others: a failure leaves the store whole). Returns
    {key: (CRC32C of the part, its bytes)}."""
    parts = {}
    with _direct_io() as io, ThreadPoolExecutor(threads, thread_name_prefix="tiertrain-ckpt") as pool:

        def write(key: tuple[int, Kind]) -> None:
            with source(*key) as (start, t):
                file = _chunk(tmp, key[1], key[0])
                if t.numel():
                    _body(file, t, True, io, start * 4)
                parts[key] = (crc(t), t.numel() * 4)
                fsync(file)  # this rank's bytes: another host's rank cannot fsync them

        def move(key: tuple[int, Kind]) -> None:  # the slab's bytes are on this disk already: read once
            with source(*key) as (_, t):
                parts[key] = (crc(t), t.numel() * 4)
            os.truncate(taken[key], t.numel() * 4)
            os.rename(taken[key], _chunk(tmp, key[1], key[0]))

        list(pool.map(write, [key for key in keys if key not in taken]))
        list(pool.map(move, list(taken)))
    return parts


def _publish(path: Path) -> None:
    """The whole temporary of a save becomes the checkpoint `path`: fsynced, renamed `.new`, then `path` (a step
    saved again moves the old one aside as `.old` in between): a kill at any moment leaves recover() the rest."""
    tmp, new = (path.with_name(f".{path.name}.{s}") for s in ("tmp", "new"))
    _fsync_tree(tmp)
    os.rename(tmp, new)  # whole from here on
    fsync(path.parent)
    _swap_in(new, path)


def _swap_in(new: Path, path: Path) -> None:
    """The whole `new` becomes `path`. A `path` already there (a resumed run redoing a step it had saved) is moved
    aside as `.old` first, and deleted once `new` has the name. The save's last part, and recover()'s of a `.new`."""
    old = path.with_name(f".{path.name}.old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)  # one a killed swap left beside it
        os.rename(path, old)
    os.rename(new, path)
    fsync(path.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _removed_unless_done(tmp: Path) -> Iterator[None]:
    """`tmp` deleted where the block stops for anything but a disk's error (those every rank learns first)."""
    try:
        yield
    except OSError:
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _failed(path: Path, tmp: Path, failure: OSError | None, ranks) -> int:
    """A save that failed on some rank: its temporary goes, and every rank stops with the failing rank's words."""
    if ranks.first:
        shutil.rmtree(tmp, ignore_errors=True)
    if failure is None:
        raise ElsewhereError(f"writing checkpoint {path} failed on another rank")
    before = checkpoints(path.parent)
    raise CheckpointError(
        f"writing checkpoint {path} failed: {why(failure)}; "
        + (
            f"the previous checkpoint ({before[-1].name}) is intact: free space on its disk and resume with --resume "
            "latest"
            if before
            else "the run has no other checkpoint: free space on its disk, or set checkpoint.dir to "
            "one with room, and start again"
        )
    )


ATTRS_CRC = "attributes_crc32c"


def _attrs_crc(attrs: dict) -> int:
    import google_crc32c

    return google_crc32c.value(json.dumps(attrs, sort_keys=True).encode())
