"""Token files and the deterministic resumable loader (`tiertrain prepare` writes them: prepare.py).

Token files are 1-D integer arrays: NumPy `.npy`, or tiertrain's `.bin`:
    bytes 0-7    magic b"TTOKENS\\0"
    bytes 8-11   version, uint32 little-endian (1)
    bytes 12-15  bytes per token, uint32 (2: uint16 tokens, 4: uint32 tokens)
    bytes 16-23  token count, uint64
    bytes 24-31  the vocabulary size of the tokenizer that wrote it, uint64 (0: not recorded)
    bytes 32-    the tokens, little-endian
Row r of a file is tokens[r*S : r*S+S+1] (S = train.seq_len): inputs are its first S, targets its last S.
Sample j of optimizer step k is global sample s = k*B + j (B = train.batch_size); the file is read in
epochs of R rows, sample s is row s mod R of epoch s // R, through a permutation seeded by
(train.seed, epoch) when data.shuffle is on. A batch is a pure function of the step: resumable.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from .errors import DataError
from .sections import DataConfig, TrainConfig

MAGIC = b"TTOKENS\0"
HEADER = struct.Struct("<8sIIQQ")
BYTE_EOS = 256  # the byte-level tokenizer: ids 0-255 are bytes, 256 ends a document
BYTE_VOCAB = 257


def read_tokens(path: str | os.PathLike, key: str = "data.path") -> np.ndarray:
    """The file's tokens as a read-only memory map; `key`: the setting that named it, for the messages."""
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
        return arr
    if p.suffix != ".bin":
        raise DataError(
            f"{p}: unknown token file type {p.suffix!r}; use .npy or .bin (see `tiertrain prepare`)"
        )
    with open(p, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size or head[:8] != MAGIC:
        raise DataError(f"{p} is not a tiertrain token file (bad magic); make one with `tiertrain prepare`")
    _, version, itemsize, count, _ = HEADER.unpack(head)
    if version != 1 or itemsize not in (2, 4):
        raise DataError(
            f"{p}: unsupported token file version {version} / token size {itemsize}; re-run prepare"
        )
    if p.stat().st_size != HEADER.size + count * itemsize:
        raise DataError(
            f"{p} is truncated or padded: header says {count} tokens, file has "
            f"{(p.stat().st_size - HEADER.size) // itemsize}; re-run `tiertrain prepare`"
        )
    return np.memmap(p, dtype="<u2" if itemsize == 2 else "<u4", mode="r", offset=HEADER.size, shape=(count,))


def token_vocab(path: str | os.PathLike) -> int:
    """The vocabulary size a .bin file records (0: none recorded, or a .npy file)."""
    if Path(path).suffix != ".bin":
        return 0
    with open(path, "rb") as f:
        return HEADER.unpack(f.read(HEADER.size))[4]


def write_bin(path: str | os.PathLike, chunks, vocab_size: int) -> int:
    """Writes token chunks (iterables of ints or arrays) as a .bin file, atomically, recording the vocabulary
    size. Returns the count."""
    import tempfile

    itemsize = 2 if vocab_size <= 1 << 16 else 4
    dtype = "<u2" if itemsize == 2 else "<u4"
    path = Path(path)
    # a new file of a name nothing else has, next to the target: never a user's file, and gone on any failure
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep the token file from other users
    count = 0
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(HEADER.pack(MAGIC, 1, itemsize, 0, vocab_size))
            for chunk in chunks:
                arr = np.asarray(chunk, dtype=np.int64)
                if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                    raise DataError(f"token id {int(arr.max())} does not fit the vocabulary of {vocab_size}")
                f.write(arr.astype(dtype).tobytes())
                count += arr.size
            f.seek(0)
            f.write(HEADER.pack(MAGIC, 1, itemsize, count, vocab_size))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return count


def byte_encode(text: str) -> np.ndarray:
    return np.append(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64), BYTE_EOS)


def builtin_tokens() -> np.ndarray:
    """The built-in corpus: CPython's own reference documentation (pydoc_data), byte-tokenized."""
    from pydoc_data.topics import topics

    return np.concatenate([byte_encode(topics[k]) for k in sorted(topics)])


def held_out(tokens: np.ndarray, seq_len: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, validation tokens): the last `fraction` of the rows (at least one) held out. Views,
    not copies: a memory-mapped file stays on disk."""
    rows = (len(tokens) - 1) // seq_len
    keep = rows - max(1, int(np.ceil(rows * fraction)))
    return tokens[: keep * seq_len + 1], tokens[keep * seq_len :]


class Loader:
    """Batches of (inputs, targets) as int64 arrays of shape (B, S), a pure function of the step."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        vocab_size: int,
        shuffle: bool,
        seed: int,
        name: str = "the built-in corpus",
    ):
        self.tokens, self.S, self.B, self.V = tokens, seq_len, batch_size, vocab_size
        self.shuffle, self.seed, self.name = shuffle, seed, name
        self.rows = (len(tokens) - 1) // seq_len if len(tokens) > 0 else 0
        if self.rows < batch_size:
            raise DataError(
                f"{name} holds {len(tokens)} tokens, {self.rows} rows of train.seq_len+1 = "
                f"{seq_len + 1}, fewer than one batch of train.batch_size = {batch_size} rows "
                f"({batch_size * seq_len + 1} tokens); use a longer file or lower those settings"
            )
        self._perm: tuple[int, np.ndarray] | None = None
        self._check_ids()

    def _check_ids(self, block: int = 1 << 26) -> None:
        """Every id of the file in [0, vocab): checked once, a block at a time (a pass over a memory map),
        so a bad id stops the run before anything is allocated, not at the step that reaches it."""
        lo, hi = 0, 0
        for a in range(0, len(self.tokens), block):
            part = np.asarray(self.tokens[a : a + block])
            lo, hi = min(lo, int(part.min())), max(hi, int(part.max()))
        if lo < 0:
            raise DataError(
                f"{self.name} holds a negative token id ({lo}); token ids are 0 to model.vocab_size - 1: "
                "re-tokenize the data"
            )
        if hi >= self.V:
            raise DataError(
                f"{self.name} holds token id {hi}, not below model.vocab_size = {self.V}; raise "
                "model.vocab_size or tokenize with a matching tokenizer"
            )

    def _row(self, sample: int) -> int:
        epoch, r = divmod(sample, self.rows)
        if not self.shuffle:
            return r
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm = (epoch, rng.permutation(self.rows))
        return int(self._perm[1][r])

    def identity(self) -> dict:
        """What tells these tokens from others of the same count: their bytes' size and a CRC32C of their first MiB
        and of 64 KiB at 15 places spread over them (a few MiB read, whatever the file's size)."""
        import google_crc32c

        raw = np.ascontiguousarray(self.tokens).view(np.uint8).reshape(-1)  # no copy of a file's memory map
        crc = 0
        for at in [0, *(len(raw) * k // 16 for k in range(1, 16))]:
            crc = google_crc32c.extend(crc, raw[at : at + (1 << 20 if at == 0 else 1 << 16)].tobytes())
        return {"size": int(len(raw)), "crc32c": int(crc)}

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        S = self.S
        rows = [self._row(step * self.B + j) for j in range(self.B)]
        block = np.stack([np.asarray(self.tokens[r * S : r * S + S + 1], dtype=np.int64) for r in rows])
        return block[:, :-1], block[:, 1:]


def loaders(data: DataConfig, train: TrainConfig, vocab_size: int) -> tuple[Loader, Loader | None]:
    """The training batches (the token file at `path`, else the built-in corpus) and the validation batches (the
    file at `val_path`, or the last `val_fraction` of the training rows; None: neither), the validation ones the
    first batches, unshuffled: every evaluation reads the same ones. A file tokenized with a larger vocabulary
    than the model's is refused (a smaller one is fine: models pad their vocabulary)."""
    path, val_path, val_fraction, shuffle = data.path, data.val_path, data.val_fraction, data.shuffle
    seq_len, batch_size, seed = train.seq_len, train.batch_size, train.seed
    if path:
        tokens, name = read_tokens(path), path
        if token_vocab(name) > vocab_size:
            raise DataError(
                f"{name} was tokenized with a vocabulary of {token_vocab(name):,} and "
                f"model.vocab_size is {vocab_size:,}: tokenize with the model's tokenizer, "
                "or raise model.vocab_size"
            )
    else:
        tokens, name = builtin_tokens(), "the built-in corpus"
    if val_fraction:
        rows = (len(tokens) - 1) // seq_len
        tokens, val = held_out(tokens, seq_len, val_fraction)
        left = (len(tokens) - 1) // seq_len
        if left < batch_size:
            raise DataError(
                f"data.val_fraction = {val_fraction:g} holds out {rows - left} of the {rows} rows of "
                f"{name}, leaving {left} to train on, fewer than one batch of train.batch_size = "
                f"{batch_size}; lower data.val_fraction"
            )
    else:
        val = None
    train = Loader(tokens, seq_len, batch_size, vocab_size, shuffle, seed, name)
    if val_path:
        val, name = read_tokens(val_path, "data.val_path"), val_path
    elif val is not None:
        name = f"the last {val_fraction:g} of {name} (data.val_fraction)"
    return train, Loader(val, seq_len, batch_size, vocab_size, False, 0, name) if val is not None else None
