"""Reading a checkpoint (checkpoint.py's format): its attributes checked before anything else is read
(read_meta: the format, their own checksum, the fields restore, resume and export read, every chunk present),
then its slabs read straight into their targets with direct I/O, each chunk's CRC32C verified (load one, load_all
every one, by several ranks together). A checkpoint pruned while it is read (a live run's) says so in one line."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .checkpoint import (
    ATTRS_CRC,
    FORMAT,
    FORMATS,
    KINDS,
    OTHER,
    SAVED,
    CheckpointError,
    Source,
    _attrs_crc,
    _body,
    _chunk,
    _direct_io,
    kinds_of,
)
from .checksum import combined, crc
from .errors import UserError, why
from .modes import Kind

_SCHEMA = {  # what restore, resume and export read from the attributes
    "step": lambda v: isinstance(v, int) and v >= 0,
    "config": lambda v: isinstance(v, dict) and isinstance(v.get("model"), dict),
    "kinds": lambda v: (
        isinstance(v, list) and sorted(v) in (sorted(k.value for k in kinds) for kinds in SAVED.values())
    ),
    "numels": lambda v: isinstance(v, list) and bool(v) and all(isinstance(n, int) and n > 0 for n in v),
    "rng": lambda v: isinstance(v, dict) and isinstance(v.get("torch"), str),
    "optimizer": lambda v: isinstance(v, dict) and isinstance(v.get("step_count"), int),
}


def read_meta(path: Path) -> dict:
    """The checkpoint's attributes, after checking it is whole: every array and chunk present."""
    import zarr

    path = Path(path)
    if not (path / "zarr.json").is_file():
        raise CheckpointError(
            f"{path} is not a checkpoint (no zarr.json); pass a checkpoint or run directory"
        )
    try:
        meta = dict(zarr.open_group(path, mode="r").attrs)
    except Exception as e:  # noqa: BLE001 - any unreadable group
        raise CheckpointError(f"{path} is an unreadable checkpoint ({e}); " + OTHER) from None
    if meta.get("format") not in FORMATS:
        raise CheckpointError(
            f"{path} is not a tiertrain checkpoint (format {meta.get('format')!r}); "
            "pass a run directory or one of its checkpoints/step_N"
        )
    if meta["format"] == FORMAT and meta.pop(ATTRS_CRC, None) != _attrs_crc(meta):
        raise CheckpointError(
            f"{path} is corrupt: its attributes (zarr.json) fail their checksum, were they "
            "edited? " + OTHER.capitalize()
        )
    bad = [k for k, ok in _SCHEMA.items() if not ok(meta.get(k))]
    if bad:
        raise CheckpointError(f"{path} is corrupt: attribute {', '.join(bad)} missing or malformed; " + OTHER)
    with _reading(path):
        for kind in kinds_of(meta):
            for u in range(len(meta["numels"])):
                if not _chunk(path, kind, u).is_file():
                    raise CheckpointError(f"{path} is corrupt: chunk {kind.value}/{u} is missing; " + OTHER)
    return meta


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A checkpoint that goes (or is going) while it is read, as a live run prunes its older ones: one line."""
    try:
        yield
    except (OSError, CheckpointError):
        if not (path / "zarr.json").is_file():  # rundir.prune renames it away before deleting it
            raise CheckpointError(
                f"{path} was deleted while it was read: its run is live and keeps only its newest "
                "checkpoints (checkpoint.keep); pass a newer one"
            ) from None
        raise


def load(path: Path, kind: Kind, unit: int, out: torch.Tensor, io=None) -> None:
    """Reads one slab into `out` (contiguous, fp32), its checksum verified; `io`: a direct-I/O pool to use
    (else one made for this read)."""
    if io is None:
        with _direct_io(2) as own:
            return load(path, kind, unit, out, own)
    n = out.numel() * out.element_size()
    with _reading(path):
        _check_size(path, kind, unit, n)
        _body(_chunk(path, kind, unit), out, write=False, io=io)
        _verify(path, kind, unit, n, crc(out))


def _check_size(path: Path, kind: Kind, unit: int, nbytes: int) -> None:
    """The chunk file holds the slab's `nbytes` and its checksum."""
    size = _chunk(path, kind, unit).stat().st_size
    if size != nbytes + 4:
        raise CheckpointError(
            f"{path} is corrupt: {kind.value}/{unit} holds {size - 4} bytes, the model "
            f"needs {nbytes}; " + OTHER
        )


def _verify(path: Path, kind: Kind, unit: int, nbytes: int, computed: int) -> None:
    """The checksum stored after the slab's `nbytes` is `computed`."""
    with open(_chunk(path, kind, unit), "rb") as f:
        f.seek(nbytes)
        stored = int(np.frombuffer(f.read(4), dtype="<u4")[0])
    if stored != computed:
        raise CheckpointError(
            f"{path} is corrupt: {kind.value}/{unit} fails its checksum (stored {stored:#010x}, "
            f"computed {computed:#010x}); " + OTHER
        )


def load_all(
    path: Path,
    numels: list[int],
    target: Source,
    ranks=None,
    threads: int = 4,
    kinds: tuple[Kind, ...] = KINDS,
) -> None:
    """Reads every slab of the checkpoint into `target(unit, kind)` (a context manager giving this rank's part
    of the slab to fill), `threads` at a time, as save writes them; the parts' checksums, combined across
    the ranks (parallel.Ranks; None: this process alone), must give each file's."""
    from .parallel import Ranks

    ranks = ranks or Ranks()
    keys = [(u, k) for u in range(len(numels)) for k in kinds]
    parts = {}

    def one(key: tuple[int, str]) -> None:
        u, kind = key
        try:
            _check_size(path, kind, u, numels[u] * 4)
            with target(*key) as (start, flat):
                if flat.numel():
                    _body(_chunk(path, kind, u), flat, False, io, start * 4)
                parts[key] = (crc(flat), flat.numel() * 4)
        except OSError as e:
            raise CheckpointError(f"{path}: reading {kind.value}/{u} failed ({why(e)}); " + OTHER) from None

    # a rank's failure here reaches every rank before the checksums' collective, which it would never join
    with ranks.together(UserError) as agreed:
        with _direct_io() as io, ThreadPoolExecutor(threads, thread_name_prefix="tiertrain-ckpt") as pool:
            with _reading(path):
                list(pool.map(one, keys))
    agreed.raise_any(ranks.rank)
    crcs = ranks.host_ints([x for key in keys for x in parts[key]])
    for i, (u, kind) in enumerate(keys):
        _verify(path, kind, u, numels[u] * 4, combined(crcs, i))
