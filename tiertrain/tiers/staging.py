"""The optimizer's staging: brings the spilled slabs of the units it updates into a ring of pinned buffers per kind
ahead of their update, and writes them back behind it. Knows slabs, the order they are needed in and each kind's
part in it (given), nothing about models.

The optimizer walks units 0..L-1; `start(order)` reads the first `depth` units' spilled slabs, `acquire(u)` waits
for unit u's and reads one unit further ahead, `release(u)` writes u's back. A ring buffer is reused only once its
write-back has landed, so at most `depth + 2` buffers per kind exist.

Two kinds take part otherwise (the caller names them): a `fresh` kind is written whole by the update without being
read first (the compute-dtype copy, rounded from the master); a `drained` kind comes the other way first: the
backward pass drains unit u's into a ring buffer (`sink`), which is written to the store once its copy has landed,
the optimizer reads it back after that write, and nothing writes it back after the update (the next backward pass
overwrites it). `on_write(unit, kind, future)` hears of each write-back (the streamed kind's reader waits for it).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from .nvme import NvmeStore
from .ring import Ring


class Traffic:
    """The bytes a pass moves between the disk and the host, and the window its I/O spans (first request issued to
    last completion): shared by the staging and the streamed kind's reader. Main thread, and I/O callbacks that set
    a float."""

    def __init__(self):
        self.read_bytes = self.write_bytes = 0  # totals
        self.last_pass = (0, 0)  # (read, written) of the last whole pass (start to start)
        self.last_window_s = 0.0
        self._start = (0, 0)
        self._first: float | None = None
        self._last = 0.0

    def timed(self, fut: Future) -> Future:
        """Marks the pass's I/O window: its first request, its last completion."""
        if self._first is None:
            self._first = time.perf_counter()

        def landed(_):
            self._last = time.perf_counter()

        fut.add_done_callback(landed)
        return fut

    def new_pass(self) -> None:
        now = (self.read_bytes, self.write_bytes)
        self.last_pass = (now[0] - self._start[0], now[1] - self._start[1])
        self._start = now
        self.last_window_s = self._last - self._first if self._first is not None else 0.0
        self._first = None


class Staging:
    def __init__(
        self,
        store: NvmeStore,
        spilled: dict[int, list[str]],
        dtypes: dict[str, torch.dtype],
        widths: dict[str, int],
        pin: bool,
        depth: int = 1,
        fresh: frozenset[str] = frozenset(),
        drained: frozenset[str] = frozenset(),
        on_write: Callable[[int, str, Future], None] | None = None,
        traffic: Traffic | None = None,
    ):
        """`spilled`: {unit: its kinds on NVMe}; `widths`: each kind's ring buffers' elements (its widest spilled
        slab); `fresh`, `drained`, `on_write`: the kinds' parts, see the module's doc."""
        self.store, self.spilled, self.depth = store, spilled, depth
        self.fresh, self.drained, self.on_write = fresh, drained, on_write
        self.traffic = traffic or Traffic()
        kinds = {k for ks in spilled.values() for k in ks}
        # ahead, in use, writing back
        self.rings = {k: Ring(depth + 2, widths[k], dtypes[k], pin) for k in kinds}
        self.loaded: dict[int, dict[str, tuple[Future, torch.Tensor]]] = {}
        self.order: list[int] = []
        # threads: the main thread (the step: start, sink), the optimizer's worker (acquire, release), checkpoint
        # threads (borrowed), and the drain writer below (owned here, shut by close()); the rings are thread-safe
        self.written: dict[int, Future] = {}  # unit -> the write of its drained slab this pass
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tiertrain-grad-out")

    def ring_nbytes(self) -> int:
        return sum(r.nbytes for r in self.rings.values())

    def _fetch(self, unit: int) -> None:
        """Reads the unit's spilled slabs not yet read; a drained one only once this pass has written it."""
        got = self.loaded.setdefault(unit, {})
        n = self.store.numels[unit]
        for k in self.spilled.get(unit, []):
            if k in got:
                continue
            if k in self.drained:
                w = self.written.pop(unit, None)
                if w is None:  # not drained yet: the optimizer's acquire reads it
                    continue
                w.result()
            buf = self.rings[k].take()
            if k in self.fresh:  # written whole by the update: nothing to read
                got[k] = (_done(), buf)
                continue
            got[k] = (self.traffic.timed(self.store.read(unit, k, buf[:n])), buf)
            self.traffic.read_bytes += n * buf.element_size()

    def sink(self, unit: int, kind: str):
        """(buffer, done): a ring buffer for the unit's slab of a drained kind, to be filled on a device stream;
        `done(event)` writes it to the store once the event has happened (None: already)."""
        whole = self.rings[kind].take()
        view = whole[: self.store.numels[unit]]

        def done(event) -> None:
            def job() -> None:
                if event is not None:
                    event.synchronize()
                self.store.write(unit, kind, view).result()

            fut = self.traffic.timed(self._writer.submit(job))
            self.rings[kind].give(whole, after=fut)
            self.written[unit] = fut
            self.traffic.write_bytes += view.numel() * view.element_size()

        return view, done

    def start(self, order: list[int]) -> None:
        """A new pass in `order`: the last pass's write-backs land first, then reading ahead begins."""
        self.flush()
        self.traffic.new_pass()
        self.order = [u for u in order if self.spilled.get(u)]
        for u in self.order[: self.depth]:
            self._fetch(u)

    def acquire(self, unit: int) -> dict[str, torch.Tensor]:
        """The unit's spilled slabs, read into ring buffers (views of the slab's size)."""
        if not self.spilled.get(unit):
            return {}
        self._fetch(unit)
        i = self.order.index(unit) if unit in self.order else len(self.order)
        for u in self.order[i + 1 : i + 1 + self.depth]:
            self._fetch(u)
        n = self.store.numels[unit]
        out = {}
        for k, (fut, buf) in self.loaded[unit].items():
            fut.result()
            out[k] = buf[:n]
        return out

    def release(self, unit: int) -> None:
        """Writes the unit's spilled slabs back (a drained one goes: consumed); their buffers return to the ring once
        written."""
        n = self.store.numels[unit]
        for k, (_, buf) in self.loaded.pop(unit, {}).items():
            if k in self.drained:
                self.rings[k].give(buf)
                continue
            fut = self.traffic.timed(self.store.write(unit, k, buf[:n]))
            self.rings[k].give(buf, after=fut)
            self.traffic.write_bytes += n * buf.element_size()
            if self.on_write is not None:
                self.on_write(unit, k, fut)

    @contextmanager
    def borrowed(self, unit: int, kind: str, read: bool) -> Iterator[torch.Tensor]:
        """A ring buffer (the unit's slab size) outside the schedule, for checkpoints and imports: holds the unit's
        stored slab when `read`; written back to the store on exit when not. Call between passes (after flush),
        from at most `depth + 2` threads per kind."""
        whole = self.rings[kind].take()
        buf = whole[: self.store.numels[unit]]
        try:
            if read:
                self.store.read(unit, kind, buf).result()
            yield buf
            if not read:
                self.store.write(unit, kind, buf).result()
        finally:
            self.rings[kind].give(whole)

    def flush(self) -> None:
        """Every write-back has landed (an error of one is raised here)."""
        for ring in self.rings.values():
            ring.settle()

    def drop(self, unit: int) -> None:
        """The unit's buffers back to their rings unwritten (its update failed), each once its read is done."""
        for k, (fut, buf) in self.loaded.pop(unit, {}).items():
            self.rings[k].give(buf, after=fut)

    def close(self) -> None:
        """Every write landed, then the drain writer's thread shut (also where a write failed)."""
        try:
            self.flush()
        finally:
            self._writer.shutdown(wait=True)


def _done() -> Future:
    f: Future = Future()
    f.set_result(0)
    return f
