"""The deterministic resumable loader of token files (tokenfile.py: the format; `tiertrain prepare` writes them:
prepare.py; the rows of a batch are cut, document-masked or packed by rows.py).

Row r of a stream is tokens[r*S : r*S+S+1] (S = train.seq_len): inputs are its first S, targets its last S.
Sample j of optimizer step k is global sample s = k*B + j (B = train.batch_size); the file is read in
epochs of R rows, sample s is row s mod R of epoch s // R, through a permutation seeded by
(train.seed, epoch) when data.shuffle is on. A batch is a pure function of the step: resumable.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .errors import DataError
from .rows import IGNORE, Documents, Packed, Plain
from .sections import DataConfig, TrainConfig
from .tokenfile import TokenFile, builtin, open_tokens, token_vocab


def held_out(tokens: np.ndarray, seq_len: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, validation tokens): the last `fraction` of the rows (at least one) held out. Views,
    not copies: a memory-mapped file stays on disk."""
    rows = (len(tokens) - 1) // seq_len
    keep = rows - max(1, int(np.ceil(rows * fraction)))
    return tokens[: keep * seq_len + 1], tokens[keep * seq_len :]


def _held_out(tf: TokenFile, seq_len: int, fraction: float) -> tuple[TokenFile, TokenFile]:
    """held_out of a file: a stream's last rows (its sample starts with them), or a file of samples' last
    `fraction` of its samples (at least one), whole."""
    st = tf.starts
    if tf.mask is not None:
        k = len(st) - max(1, int(np.ceil(len(st) * fraction)))
        cut = int(st[k])
        return (
            TokenFile(tf.tokens[:cut], st[:k], tf.mask[:cut]),
            TokenFile(tf.tokens[cut:], st[k:] - cut, tf.mask[cut:]),
        )
    tokens, val = held_out(tf.tokens, seq_len, fraction)
    if st is None:
        return TokenFile(tokens), TokenFile(val)
    cut = len(tokens) - 1
    return TokenFile(tokens, st[st < len(tokens)]), TokenFile(val, np.union1d([0], st[st >= cut] - cut))


class Batch(NamedTuple):
    """A batch's rows: inputs and targets (-100 where nothing trains), (B, S) int64; positions: each token's place
    in its sample or document, (B, S) int64, where they restart inside rows, -1 on a packed row's padding (None:
    0..S-1 in every row)."""

    inputs: np.ndarray
    targets: np.ndarray
    positions: np.ndarray | None


class Loader:
    """Batches of rows, a pure function of the step: cut from the stream, kept apart by document (`starts` with
    `document_mask`), or samples packed whole (a file with a loss `mask`): rows.py."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        vocab_size: int,
        shuffle: bool,
        seed: int,
        name: str = "the built-in corpus",
        starts: np.ndarray | None = None,
        mask: np.ndarray | None = None,
        document_mask: bool = False,
        validation: bool = False,
    ):
        self.tokens, self.S, self.B, self.V = tokens, seq_len, batch_size, vocab_size
        self.validation = validation  # read in order, each row once: its last batch is filled with empty rows
        self.shuffle, self.seed, self.name = shuffle, seed, name
        self.segmented = mask is not None or document_mask  # rows of several segments, attended to apart
        self.marks = None if mask is None else (starts, mask)  # what a prepared file adds to its tokens
        if mask is not None:
            if starts is None:
                raise DataError(f"{name} has a loss mask but no sample starts; re-run `tiertrain prepare`")
            self.made = Packed(tokens, starts, mask, seq_len, name)
        elif document_mask:
            if starts is None:
                raise DataError(
                    f"data.document_mask = true needs the documents' boundaries, and {name} records none (a .npy "
                    "file, or a .bin of an older prepare); prepare it again, or set data.document_mask = false"
                )
            self.made = Documents(tokens, starts, seq_len)
        else:
            self.made = Plain(tokens, seq_len)
        self.rows = self.made.rows
        self.packed = mask is not None
        if validation and self.rows < 1:
            raise DataError(
                f"{name} holds no whole row of train.seq_len = {seq_len} to validate on; use a longer file or "
                "raise data.val_fraction"
            )
        if self.rows < batch_size and not validation:
            raise DataError(self.made.few(name, batch_size))
        self._perm: tuple[int, np.ndarray] | None = None
        self._check_ids()

    @classmethod
    def of(
        cls,
        tf: TokenFile,
        train: TrainConfig,
        shuffle: bool,
        vocab_size: int,
        name: str,
        docs: bool,
        validation: bool = False,
    ):
        seed = train.seed if shuffle else 0
        return cls(
            tf.tokens,
            train.seq_len,
            train.batch_size,
            vocab_size,
            shuffle,
            seed,
            name,
            tf.starts,
            tf.mask,
            docs,
            validation,
        )

    def describe(self) -> str:
        return f"{self.name} ({self.made.summary()})"

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

    @property
    def host_bytes(self) -> int:
        """Host memory the batches will take beyond what the loader holds now: the shuffled order of the rows, an
        int64 each, made at the first step of an epoch."""
        return 8 * self.rows if self.shuffle else 0

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
        and of 64 KiB at 15 places spread over them (a few MiB read, whatever the file's size); for samples with a
        loss mask, the same of their starts and mask ("marks_crc32c": the same tokens prepared with another
        template or --train-on-prompt train other targets)."""
        raw = np.ascontiguousarray(self.tokens).view(np.uint8).reshape(-1)  # no copy of a file's memory map
        out = {"size": int(len(raw)), "crc32c": _sampled_crc(raw)}
        if self.marks is not None:
            starts, mask = (np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in self.marks)
            out["marks_crc32c"] = _sampled_crc(mask, _sampled_crc(starts))
        return out

    @property
    def batches(self) -> int:
        """Batches that read every row once: of validation rows, the last one part-filled."""
        return -(-self.rows // self.B) if self.validation else self.rows // self.B

    def get(self, step: int) -> Batch:
        if not self.validation:
            return Batch(*self.made.batch([self._row(step * self.B + j) for j in range(self.B)]))
        # validation: each row once; the last batch's missing rows are empty (nothing trains in them, one segment)
        rows = [r for r in range(step * self.B, (step + 1) * self.B) if r < self.rows]
        inp, tgt, pos = self.made.batch(rows)
        n = self.B - len(rows)
        if n:
            inp = np.concatenate([inp, np.zeros((n, self.S), inp.dtype)])
            tgt = np.concatenate([tgt, np.full((n, self.S), IGNORE, tgt.dtype)])
            if pos is not None:
                pos = np.concatenate([pos, np.broadcast_to(np.arange(self.S, dtype=pos.dtype), (n, self.S))])
        return Batch(inp, tgt, pos)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of the step's batch."""
        return self.get(step)[:2]


def _sampled_crc(raw: np.ndarray, crc: int = 0) -> int:
    """CRC32C (continuing `crc`) of bytes `raw`: their first MiB and 64 KiB at 15 places spread over them."""
    import google_crc32c

    for at in [0, *(len(raw) * k // 16 for k in range(1, 16))]:
        crc = google_crc32c.extend(crc, raw[at : at + (1 << 20 if at == 0 else 1 << 16)].tobytes())
    return int(crc)


def loaders(data: DataConfig, train: TrainConfig, vocab_size: int) -> tuple[Loader, Loader | None]:
    """The training batches (the token file at `path`, else the built-in corpus) and the validation batches (the
    file at `val_path`, or the last `val_fraction` of the training rows, or of its samples; None: neither), the
    validation ones the first batches, unshuffled: every evaluation reads the same ones. A file tokenized with a
    larger vocabulary than the model's is refused (a smaller one is fine: models pad their vocabulary)."""
    path, val_path, val_fraction, shuffle = data.path, data.val_path, data.val_fraction, data.shuffle
    seq_len, batch_size = train.seq_len, train.batch_size
    if path:
        tf, name = open_tokens(path), path
        if token_vocab(name) > vocab_size:
            raise DataError(
                f"{name} was tokenized with a vocabulary of {token_vocab(name):,} and "
                f"model.vocab_size is {vocab_size:,}: tokenize with the model's tokenizer, "
                "or raise model.vocab_size"
            )
    else:
        tf, name = builtin(), "the built-in corpus"
    val = None
    if val_fraction:
        if tf.mask is None and (rows := (len(tf.tokens) - 1) // seq_len) < 2:  # one held out, one trained
            raise DataError(
                f"{name} holds {rows} row{'' if rows == 1 else 's'} of train.seq_len = {seq_len} tokens: too few "
                "to hold out data.val_fraction; add data, lower train.seq_len, or set data.val_fraction = 0"
            )
        tf, val = _held_out(tf, seq_len, val_fraction)
        left = (len(tf.tokens) - 1) // seq_len
        if tf.mask is not None and not len(tf.starts):
            raise DataError(
                f"data.val_fraction = {val_fraction:g} holds out every one of the {len(val.starts)} samples of "
                f"{name}; lower data.val_fraction"
            )
        if tf.mask is None and left < batch_size:
            held = (len(val.tokens) - 1) // seq_len
            raise DataError(
                f"data.val_fraction = {val_fraction:g} holds out {held} of the {left + held} rows of {name}, "
                f"leaving {left} to train on, fewer than one batch of train.batch_size = {batch_size}; lower "
                "data.val_fraction"
            )
    docs = data.document_mask
    loader = Loader.of(tf, train, shuffle, vocab_size, name, docs)
    if val_path:
        val, name = open_tokens(val_path, "data.val_path"), val_path
    elif val is not None:
        name = f"the last {val_fraction:g} of {name} (data.val_fraction)"
    held = Loader.of(val, train, False, vocab_size, name, docs, True) if val is not None else None
    evaluated = range(min(train.eval_batches, held.batches)) if held else ()
    if held and not any((held.get(k).targets != IGNORE).any() for k in evaluated):
        raise DataError(
            f"{name}: the rows evaluated hold no trained target (every loss is masked); hold out rows that "
            "train, or leave data.val_fraction and data.val_path unset"
        )
    return loader, held
