"""The rows of a batch, three ways (data.Loader picks one per token file):

Plain      rows cut from the token stream: row r is tokens[r*S : r*S+S+1], inputs its first S, targets its last S;
           every target trains, attention runs over the whole row (positions None: 0..S-1)
Documents  the same rows, with the documents kept apart (data.document_mask): positions restart at each
           document that begins inside the row, and a document's first token is not a target (it would be predicted
           from the document before it)
Packed     samples that train whole and alone (a file with a loss mask: prepare --chat), packed into rows of S
           positions best-fit decreasing: a sample of L tokens takes L - 1 positions (inputs its first L - 1, targets
           its last L - 1), its targets -100 where the mask says untrained; positions restart at each sample; the rest
           of a row is padding: token 0, no target, position -1 (no token of any sample: the routers' load-balancing
           statistics leave it out, as transformers' leave out the tokens its attention_mask masks)
A row's segments (a document, a sample, the padding) are where its positions restart at 0 or its padding begins:
model.docs attends within each, so a sample sees only itself and a packed batch trains exactly as its samples would
alone.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

from .errors import DataError

IGNORE = -100  # a target that does not train (torch's cross_entropy ignore_index)


def restart(size: int, cuts: np.ndarray) -> np.ndarray:
    """Positions 0..size-1 restarting at 0 at each of `cuts` (increasing, within 1..size-1)."""
    at = np.zeros(size, dtype=np.int64)
    at[cuts] = cuts
    return np.arange(size, dtype=np.int64) - np.maximum.accumulate(at)


class Plain:
    """Rows cut from the stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.S = tokens, seq_len
        self.rows = (len(tokens) - 1) // seq_len if len(tokens) > 0 else 0

    def batch(self, rows: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        S = self.S
        block = np.stack([np.asarray(self.tokens[r * S : r * S + S + 1], dtype=np.int64) for r in rows])
        return block[:, :-1], block[:, 1:], None

    def few(self, name: str, batch_size: int) -> str:
        return (
            f"{name} holds {len(self.tokens)} tokens, {self.rows} rows of train.seq_len+1 = "
            f"{self.S + 1}, fewer than one batch of train.batch_size = {batch_size} rows "
            f"({batch_size * self.S + 1} tokens); use a longer file or lower those settings"
        )

    def summary(self) -> str:
        return f"{self.rows} rows"


class Documents(Plain):
    """Rows cut from the stream, each document attending only to itself."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, seq_len: int):
        super().__init__(tokens, seq_len)
        self.starts = starts

    def batch(self, rows: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        S = self.S
        inp, tgt, _ = super().batch(rows)
        tgt, pos = tgt.copy(), np.empty_like(inp)
        for j, r in enumerate(rows):
            lo, hi = np.searchsorted(self.starts, [r * S + 1, r * S + S + 1])
            at = self.starts[lo:hi] - r * S  # where documents begin, 1..S within the row's S + 1 tokens
            tgt[j, at - 1] = IGNORE
            pos[j] = restart(S, at[at < S])
        return inp, tgt, pos

    def summary(self) -> str:
        return f"{self.rows} rows, each of its {len(self.starts):,} documents attending only to itself"


def pack(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing: (the items' indices row by row, each row's first place in them; one more at the end).
    Each item, longest first, goes into the fullest row it fits (a new row where none has room); ties keep the
    file's order. A pure function of the lengths: the same rows on every run and rank."""
    rows: list[list[int]] = []
    room: list[int] = []  # the distinct room that rows have left, increasing
    having: dict[int, list[int]] = {}  # room -> the rows with exactly that room
    for i in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[i])
        k = bisect_left(room, need)
        if k == len(room):
            r, left = len(rows), capacity - need
            rows.append([i])
        else:
            free = room[k]
            r, left = having[free].pop(0), free - need
            if not having[free]:
                del having[free], room[k]
            rows[r].append(i)
        if left > 0:
            if left not in having:
                having[left] = []
                insort(room, left)
            insort(having[left], r)
    bounds = np.cumsum([0] + [len(r) for r in rows])
    return np.asarray([i for r in rows for i in r], dtype=np.int64), bounds


class Packed:
    """Samples packed whole into rows, each attending only to itself, trained where the mask says."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, mask: np.ndarray, seq_len: int, name: str):
        self.tokens, self.mask, self.S = tokens, mask, seq_len
        self.starts, self.ends = starts, np.append(starts[1:], len(tokens)).astype(np.int64)
        length = self.ends - starts
        over = length > seq_len + 1
        if over.any():
            raise DataError(
                f"{name} holds {int(over.sum())} samples longer than a row of train.seq_len = {seq_len} holds "
                f"({seq_len + 1} tokens; the longest has {int(length.max())}); raise train.seq_len, or prepare "
                f"it again with --seq-len {seq_len} (--too-long truncate or skip)"
            )
        use = np.flatnonzero(length >= 2)  # a sample of one token has nothing to predict
        order, self.bounds = pack(length[use] - 1, seq_len)
        self.order = use[order]
        self.rows = len(self.bounds) - 1
        self.filled = int((length[use] - 1).sum())

    def batch(self, rows: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        S = self.S
        inp = np.zeros((len(rows), S), dtype=np.int64)
        tgt = np.full((len(rows), S), IGNORE, dtype=np.int64)
        pos = np.empty((len(rows), S), dtype=np.int64)
        for j, r in enumerate(rows):
            at = 0
            for i in self.order[self.bounds[r] : self.bounds[r + 1]]:
                a, e = self.starts[i], self.ends[i]
                n = e - a - 1
                inp[j, at : at + n] = self.tokens[a : e - 1]
                trained = np.asarray(self.mask[a + 1 : e]) != 0
                tgt[j, at : at + n] = np.where(
                    trained, np.asarray(self.tokens[a + 1 : e], dtype=np.int64), IGNORE
                )
                pos[j, at : at + n] = np.arange(n)
                at += n
            pos[j, at:] = -1  # the padding: a segment of its own, nothing trained
        return inp, tgt, pos

    def few(self, name: str, batch_size: int) -> str:
        return (
            f"{name} packs into {self.rows} rows of train.seq_len = {self.S}, fewer than one batch of "
            f"train.batch_size = {batch_size}; lower train.batch_size to {self.rows} or less, or use more samples"
        )

    def summary(self) -> str:
        return (
            f"{self.rows} rows packing its {len(self.order):,} samples, each attending only to itself, "
            f"{self.filled / max(1, self.rows * self.S):.0%} of the positions filled"
        )
