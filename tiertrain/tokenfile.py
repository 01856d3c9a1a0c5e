"""The token file: its format, read as memory maps and written atomically (`tiertrain prepare` writes them:
prepare.py, chat.py), and the built-in corpus. The loader that cuts it into batches is data.py.

Token files are 1-D integer arrays: NumPy `.npy`, or tiertrain's `.bin`, in one of two versions (both read):
    bytes 0-7    magic b"TTOKENS\\0"
    bytes 8-11   version, uint32 little-endian (1 or 2)
    bytes 12-15  bytes per token, uint32 (2: uint16 tokens, 4: uint32 tokens)
    bytes 16-23  token count N, uint64
    bytes 24-31  the vocabulary size of the tokenizer that wrote it, uint64 (0: not recorded)
  version 1: bytes 32- the tokens, little-endian.
  version 2 (a 64-byte header):
    bytes 32-39  sample count M, uint64 (0: none recorded, the file is one stream as in version 1)
    bytes 40-47  flags, uint64: bit 0 set: a loss mask follows the sample starts
    bytes 48-63  zero
    bytes 64-    the tokens, little-endian; then zero bytes up to a multiple of 8
    then         the sample starts: M uint64, the first 0, increasing, each below N (sample i is
                 tokens[start i : start i+1], the last ending at N): prepare's documents or conversations
    then         with flag bit 0, the loss mask: N uint8, 1 where the token is trained as a target (predicted
                 from the tokens before it in its sample), 0 where it is not (a prompt's tokens)
A file with a loss mask holds samples that train whole and alone (rows.Packed); without one, a stream (its
sample starts, where recorded, are the documents data.document_mask keeps apart: rows.Documents).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError
from .paths import drop_killed_temps, temp_prefix

MAGIC = b"TTOKENS\0"
HEADER = struct.Struct("<8sIIQQ")  # version 1
HEADER2 = struct.Struct("<8sIIQQQQ16x")  # version 2
MASKED = 1  # version 2's flag: a loss mask follows the sample starts
BYTE_EOS = 256  # the byte-level tokenizer: ids 0-255 are bytes, 256 ends a document
BYTE_VOCAB = 257


@dataclass(frozen=True)
class TokenFile:
    """A token file's arrays: the tokens, the sample starts (None: not recorded) and the loss mask (None: every
    target trains)."""

    tokens: np.ndarray
    starts: np.ndarray | None = None
    mask: np.ndarray | None = None


def _align(n: int) -> int:
    return -(-n // 8) * 8


def read_tokens(path: str | os.PathLike, key: str = "data.path") -> np.ndarray:
    """The file's tokens as a read-only memory map; `key`: the setting that named it, for the messages."""
    return open_tokens(path, key).tokens


def open_tokens(path: str | os.PathLike, key: str = "data.path") -> TokenFile:
    """The file's tokens (a read-only memory map), sample starts and loss mask; `key`: the setting that named it."""
    p = Path(path)
    if not p.is_file():
        empty = ", or leave it empty for the built-in corpus" if key == "data.path" else ", or leave it empty"
        raise DataError(
            f"{key} {str(p)!r} not found; set {key} to an existing .npy or .bin token file (make one "
            f"with `tiertrain prepare`){empty}"
        )
    if p.suffix == ".npy":
        try:
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
        except (ValueError, EOFError, OSError) as e:  # an empty file is an EOFError
            raise DataError(
                f"{p} is not a readable .npy array ({e or 'empty file'}); rewrite it with numpy.save"
            ) from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"{p} holds a {arr.ndim}-D {arr.dtype} array; it must be 1-D integer token ids")
        return TokenFile(arr)
    if p.suffix != ".bin":
        raise DataError(
            f"{p}: unknown token file type {p.suffix!r}; use .npy or .bin (see `tiertrain prepare`)"
        )
    with open(p, "rb") as f:
        head = f.read(HEADER2.size)
    if len(head) < HEADER.size or head[:8] != MAGIC:
        raise DataError(f"{p} is not a tiertrain token file (bad magic); make one with `tiertrain prepare`")
    _, version, itemsize, count, _ = HEADER.unpack(head[: HEADER.size])
    if version not in (1, 2) or itemsize not in (2, 4) or version == 2 and len(head) < HEADER2.size:
        raise DataError(
            f"{p}: unsupported token file version {version} / token size {itemsize}; re-run prepare"
        )
    samples, flags = HEADER2.unpack(head)[5:7] if version == 2 else (0, 0)
    at = HEADER.size if version == 1 else HEADER2.size
    tail = _align(at + count * itemsize) + samples * 8 + (count if flags & MASKED else 0)
    size = p.stat().st_size
    if size != (at + count * itemsize if version == 1 else tail):
        raise DataError(
            f"{p} is truncated or padded: header says {count} tokens"
            + (f" and {samples} samples" if samples else "")
            + f", file has {size:,} bytes; re-run `tiertrain prepare`"
        )
    dtype = "<u2" if itemsize == 2 else "<u4"
    tokens = np.memmap(p, dtype=dtype, mode="r", offset=at, shape=(count,))
    if version == 1:
        return TokenFile(tokens)
    at = _align(at + count * itemsize)
    starts = np.array(np.memmap(p, "<u8", "r", at, (samples,)), dtype=np.int64) if samples else None
    mask = np.memmap(p, np.uint8, "r", at + samples * 8, (count,)) if flags & MASKED else None
    if starts is not None and (starts[0] != 0 or starts[-1] >= max(count, 1) or (np.diff(starts) <= 0).any()):
        raise DataError(f"{p}: its sample starts are not increasing from 0 within its tokens; re-run prepare")
    return TokenFile(tokens, starts, mask)


def masked(path: str | os.PathLike) -> bool:
    """Whether a token file holds samples with a loss mask (a version 2 .bin with the flag: rows of several
    samples, attended to apart), from its header alone; False for any other file, or one that cannot be read
    (opening it says why)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER2.size)
    except OSError:
        return False
    if len(head) < HEADER2.size or head[:8] != MAGIC or HEADER2.unpack(head)[1] != 2:
        return False
    return bool(HEADER2.unpack(head)[6] & MASKED)


def token_vocab(path: str | os.PathLike) -> int:
    """The vocabulary size a .bin file records (0: none recorded, or a .npy file)."""
    if Path(path).suffix != ".bin":
        return 0
    with open(path, "rb") as f:
        return HEADER.unpack(f.read(HEADER.size))[4]


class TokenWriter:
    """Writes a .bin token file, atomically: through a new file of a name nothing else has, next to the target
    (never a user's file, and gone on any failure), renamed over it by close(). Version 1 (tokens only) unless
    `samples` (sample starts recorded: add(..., start=True) begins one) or `masked` (a loss mask per token)."""

    def __init__(self, path: str | os.PathLike, vocab_size: int, samples: bool = False, masked: bool = False):
        self.path, self.vocab, self.masked = Path(path), vocab_size, masked
        self.version = 2 if samples or masked else 1
        self.itemsize = 2 if vocab_size <= 1 << 16 else 4
        drop_killed_temps(self.path)  # a writer of this file killed before its rename left its temporary
        fd, self.tmp = tempfile.mkstemp(prefix=temp_prefix(self.path), dir=self.path.parent)
        self.f = os.fdopen(fd, "wb")
        self.starts = self.mask = None
        self.count = self.samples = 0
        self.pending = False
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep the token file from other users
            # the starts and the mask follow the tokens: they wait in unnamed files, gone with their handles
            self.starts = tempfile.TemporaryFile(dir=self.path.parent) if self.version == 2 else None
            self.mask = tempfile.TemporaryFile(dir=self.path.parent) if masked else None
            self.f.write(self._header())
        except BaseException:  # a full disk: nothing of this writer stays
            self.abort()
            raise

    def _header(self) -> bytes:
        if self.version == 1:
            return HEADER.pack(MAGIC, 1, self.itemsize, self.count, self.vocab)
        flags = MASKED if self.masked else 0
        return HEADER2.pack(MAGIC, 2, self.itemsize, self.count, self.vocab, self.samples, flags)

    def add(self, ids, mask=None, start: bool = False) -> None:
        """Appends tokens (and, in a masked file, their mask: 1 trained); `start`: they begin a sample."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab):
            raise DataError(f"token id {int(arr.max())} does not fit the vocabulary of {self.vocab}")
        self.pending = self.pending or start  # an empty sample begins none: the next tokens begin it
        if self.pending and arr.size and self.starts is not None:
            self.starts.write(np.uint64(self.count).tobytes())
            self.samples += 1
            self.pending = False
        self.f.write(arr.astype("<u2" if self.itemsize == 2 else "<u4").tobytes())
        if self.mask is not None:
            self.mask.write(np.asarray(mask, dtype=np.uint8).tobytes())
        self.count += arr.size

    def close(self) -> int:
        """The file whole under its name; returns the token count."""
        try:
            if self.version == 2:
                self.f.write(bytes(_align(self.f.tell()) - self.f.tell()))
                for side in (self.starts, self.mask):
                    if side is not None:
                        side.seek(0)
                        shutil.copyfileobj(side, self.f)
            self.f.seek(0)
            self.f.write(self._header())
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self._sides_close()
        return self.count

    def abort(self) -> None:
        self.f.close()
        self._sides_close()
        Path(self.tmp).unlink(missing_ok=True)

    def _sides_close(self) -> None:
        for side in (self.starts, self.mask):
            if side is not None:
                side.close()


def write_bin(path: str | os.PathLike, chunks, vocab_size: int) -> int:
    """Writes token chunks (iterables of ints or arrays) as a version-1 .bin file, atomically, recording the
    vocabulary size. Returns the count."""
    w = TokenWriter(path, vocab_size)
    try:
        for chunk in chunks:
            w.add(chunk)
    except BaseException:
        w.abort()
        raise
    return w.close()


def byte_encode(text: str) -> np.ndarray:
    return np.append(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64), BYTE_EOS)


def builtin_tokens() -> np.ndarray:
    """The built-in corpus: CPython's own reference documentation (pydoc_data), byte-tokenized."""
    from pydoc_data.topics import topics

    return np.concatenate([byte_encode(topics[k]) for k in sorted(topics)])


def builtin() -> TokenFile:
    """The built-in corpus with its documents' starts (each ends with BYTE_EOS)."""
    tokens = builtin_tokens()
    ends = np.flatnonzero(tokens == BYTE_EOS) + 1
    return TokenFile(tokens, np.concatenate([[0], ends[ends < len(tokens)]]).astype(np.int64))
