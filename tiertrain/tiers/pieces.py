"""A scratch store of fixed-size rows on NVMe, moved in pieces: the activation checkpoints that the RunPlan puts
on disk. One Zarr v3 array (rows x pieces of CK_PIECE_BYTES, a chunk file per piece), in a scratch directory
of its own (nvme.new_scratch: discard deletes it). Every chunk file is made and its blocks reserved at creation,
so a full disk is found before the run starts, never mid-step; the hot path reads and writes whole pieces in
place through the I/O backend (kvikio or POSIX). Knows rows and bytes, nothing about models.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .nvme import FORMAT, ChunkStore, StoreError
from .placement import CK_PIECE_BYTES


class PieceStore(ChunkStore):
    """Its chunks are keyed (row, piece)."""

    def __init__(self, root: Path, rows: list[int], pieces: int, io):
        """`rows`: the row ids stored (block indices); `pieces`: pieces per row."""
        import zarr

        super().__init__(root, io)
        self.rows, self.pieces = sorted(rows), pieces
        self.check_room(
            len(self.rows) * pieces * CK_PIECE_BYTES,
            "the activation checkpoints the plan puts on NVMe need",
            "free space, or lower --nvme-gb to what is free",
        )
        try:
            g = zarr.open_group(
                self.root, mode="a", attributes={"format": FORMAT, "contents": "activation checkpoints"}
            )
            width = pieces * CK_PIECE_BYTES // 4
            g.create_array(
                "checkpoints",
                shape=(max(self.rows) + 1, width),
                chunks=(1, CK_PIECE_BYTES // 4),
                dtype="float32",
                fill_value=0,
                compressors=None,
            )
            for r in self.rows:
                for p in range(pieces):
                    path = self.file(r, p)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                    try:
                        os.posix_fallocate(fd, 0, CK_PIECE_BYTES)  # the blocks now: no ENOSPC mid-step
                    finally:
                        os.close(fd)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StoreError(
                    f"the disk of --nvme-dir {self.root} filled up while reserving the activation "
                    "checkpoints; free space or lower --nvme-gb"
                ) from None
            raise StoreError(f"cannot create the checkpoint store in {self.root}: {e.strerror}") from None

    def file(self, row: int, piece: int) -> Path:
        return self.root / "checkpoints" / "c" / str(row) / str(piece)
