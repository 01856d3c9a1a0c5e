"""TierManager: brings spilled slabs into a staging ring of pinned buffers ahead of their use, and
writes them back behind it. Knows slabs and the order they are needed in, nothing about models.

The optimizer walks units 0..L-1; `start(order)` reads the first `depth` units' spilled slabs,
`acquire(u)` waits for unit u's and reads one unit further ahead, `release(u)` writes u's back. A
ring slot is reused only once its write-back has landed, so at most `slots` buffers per kind exist.

Spilled gradients go the other way first: the backward pass drains unit u's gradient into a ring
buffer (`sink`), which is written to the store once its copy has landed; the optimizer reads it back
after that write, and nothing writes it back after the update (the next backward pass overwrites it).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator

import torch

from .nvme import NvmeStore
from .slab import alloc_slab


class TierManager:
    def __init__(self, store: NvmeStore, where: dict[tuple[int, str], str], dtypes: dict[str, torch.dtype],
                 pin: bool, depth: int = 1):
        self.store, self.depth = store, depth
        self.spilled = {u: [k for (uu, k), t in sorted(where.items()) if uu == u and t == "nvme"]
                        for u in range(len(store.numels))}
        kinds = sorted({k for ks in self.spilled.values() for k in ks})
        slots = depth + 2  # read ahead, in use, writing back
        width = max(store.numels[u] for u, ks in self.spilled.items() if ks)  # the widest spilled slab
        self.free = {k: deque(alloc_slab(width, dtypes[k], pin) for _ in range(slots)) for k in kinds}
        self.busy: dict[str, deque[tuple[Future, torch.Tensor]]] = {k: deque() for k in kinds}
        self.loaded: dict[int, dict[str, tuple[Future, torch.Tensor]]] = {}
        self.order: list[int] = []
        self._lock = threading.Lock()
        self.written: dict[int, Future] = {}  # unit -> the write of its gradient drained this pass
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tiertrain-grad-out")
        self.read_bytes = 0  # totals, and those of the last whole pass (start to start)
        self.write_bytes = 0
        self.last_pass = (0, 0)
        self._pass_start = (0, 0)
        self.last_window_s = 0.0  # first read issued to last write landed, of the last whole pass
        self._t_first: float | None = None
        self._t_last = 0.0

    def ring_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for k in self.free for b in list(self.free[k]) +
                   [t for _, t in self.busy[k]])

    def _timed(self, fut: Future) -> Future:
        """Marks the I/O window of the pass: its first request, its last completion."""
        if self._t_first is None:
            self._t_first = time.perf_counter()

        def landed(_):
            self._t_last = time.perf_counter()

        fut.add_done_callback(landed)
        return fut

    def _slot(self, kind: str) -> torch.Tensor:
        if not self.free[kind]:
            fut, buf = self.busy[kind].popleft()
            fut.result()
            self.free[kind].append(buf)
        return self.free[kind].popleft()

    def _fetch(self, unit: int) -> None:
        """Reads the unit's spilled slabs not yet read; a gradient only once this pass has written it."""
        got = self.loaded.setdefault(unit, {})
        n = self.store.numels[unit]
        for k in self.spilled.get(unit, []):
            if k in got:
                continue
            if k == "grad":
                w = self.written.pop(unit, None)
                if w is None:  # not drained yet: the optimizer's acquire reads it
                    continue
                w.result()
            buf = self._slot(k)
            got[k] = (self._timed(self.store.read(unit, k, buf[:n])), buf)
            self.read_bytes += n * buf.element_size()

    def sink(self, unit: int, kind: str):
        """(buffer, done): a ring buffer for the unit's slab to be filled on a device stream; `done(event)`
        writes it to the store once the event has happened (None: already)."""
        whole = self._slot(kind)
        view = whole[:self.store.numels[unit]]

        def done(event) -> None:
            def job() -> None:
                if event is not None:
                    event.synchronize()
                self.store.write(unit, kind, view).result()

            fut = self._timed(self._writer.submit(job))
            self.busy[kind].append((fut, whole))
            self.written[unit] = fut
            self.write_bytes += view.numel() * view.element_size()

        return view, done

    def start(self, order: list[int]) -> None:
        """A new pass in `order`: the last pass's write-backs land first, then reading ahead begins."""
        self.flush()
        now = (self.read_bytes, self.write_bytes)
        self.last_pass = (now[0] - self._pass_start[0], now[1] - self._pass_start[1])
        self._pass_start = now
        self.last_window_s = self._t_last - self._t_first if self._t_first is not None else 0.0
        self._t_first = None
        self.order = [u for u in order if self.spilled.get(u)]
        for u in self.order[:self.depth]:
            self._fetch(u)

    def acquire(self, unit: int) -> dict[str, torch.Tensor]:
        """The unit's spilled slabs, read into ring buffers (views of the slab's size)."""
        if not self.spilled.get(unit):
            return {}
        self._fetch(unit)
        i = self.order.index(unit) if unit in self.order else len(self.order)
        for u in self.order[i + 1:i + 1 + self.depth]:
            self._fetch(u)
        n = self.store.numels[unit]
        out = {}
        for k, (fut, buf) in self.loaded[unit].items():
            fut.result()
            out[k] = buf[:n]
        return out

    def release(self, unit: int) -> None:
        """Writes the unit's spilled slabs back; their buffers return to the ring once written."""
        n = self.store.numels[unit]
        for k, (_, buf) in self.loaded.pop(unit, {}).items():
            if k == "grad":  # consumed: the next backward pass writes a new one
                self.free[k].append(buf)
                continue
            self.busy[k].append((self._timed(self.store.write(unit, k, buf[:n])), buf))
            self.write_bytes += n * buf.element_size()

    @contextmanager
    def borrowed(self, unit: int, kind: str, read: bool) -> Iterator[torch.Tensor]:
        """A ring buffer (the unit's slab size) outside the schedule, for checkpoints and imports: holds
        the unit's stored slab when `read`; written back to the store on exit when not. Call between
        passes (after flush), from at most `depth + 2` threads per kind."""
        with self._lock:
            whole = self.free[kind].popleft()
        buf = whole[:self.store.numels[unit]]
        try:
            if read:
                self.store.read(unit, kind, buf).result()
            yield buf
            if not read:
                self.store.write(unit, kind, buf).result()
        finally:
            with self._lock:
                self.free[kind].append(whole)

    def flush(self) -> None:
        for k in self.busy:
            while self.busy[k]:
                fut, buf = self.busy[k].popleft()
                fut.result()
                self.free[k].append(buf)
