"""TierManager: brings spilled slabs into a staging ring of pinned buffers ahead of their use, and
writes them back behind it. Knows slabs and the order they are needed in, nothing about models.

The optimizer walks units 0..L-1; `start(order)` reads the first `depth` units' spilled slabs,
`acquire(u)` waits for unit u's and reads one unit further ahead, `release(u)` writes u's back. A
ring slot is reused only once its write-back has landed, so at most `slots` buffers per kind exist.

Spilled gradients go the other way first: the backward pass drains unit u's gradient into a ring
buffer (`sink`), which is written to the store once its copy has landed; the optimizer reads it back
after that write, and nothing writes it back after the update (the next backward pass overwrites it).

The streamed kind (the slab that carries the weights to the GPU) has a second set of buffers: the
forward and the backward pass read it, in the order `stream_pass(units)` gives, `read_for_copy(u)`
hands unit u's over and reads ahead, and `copied(u, event)` takes the buffer back once the H2D copy
has happened. In the forward pass a unit's new weights are read only once the optimizer has written
them (`updating()` marks the units it is about to rewrite). The optimizer writes a compute-dtype copy
without reading it first.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator

import torch

from ..modes import Home
from ..plan.runplan import RunPlan
from .nvme import NvmeStore, discard, make_io, new_scratch
from .placement import READ_AHEAD, ring_widths, spilled_bytes
from .ring import Ring


def nvme_tier(rp: RunPlan, dtypes: dict[str, torch.dtype], streamed: str, pin: bool, parent: str, run_name: str,
              io: str, io_threads: int, meta: dict) -> "TierManager":
    """The run's store of the slabs `rp` spills (`dtypes`: each kind's), in a new scratch directory under
    `parent`, and its manager; `meta`: what the store records (the model)."""
    where, numels = rp.where(), list(rp.numels)
    kinds = sorted(spilled_bytes(numels, rp.kind_bytes(), where))
    # numpy has no bfloat16: the compute-dtype copy is stored as its bits
    bits = {"weights": "bfloat16 bits, as uint16"} if "weights" in kinds else {}
    meta = {**meta, "compute_dtype": rp.compute_dtype, **bits}
    units = {k: [u for (u, kk), tier in where.items() if kk == k and tier == Home.NVME] for k in kinds}
    backend = make_io(io, io_threads)
    root = new_scratch(parent, run_name)
    try:
        store = NvmeStore(root, numels, {k: "uint16" if k == "weights" else "float32" for k in kinds},
                          meta, backend, create=True, units=units)
    except BaseException:
        discard(root)
        raise
    return TierManager(store, where, {k: dtypes[k] for k in kinds}, pin, depth=READ_AHEAD, streamed=streamed)


class TierManager:
    def __init__(self, store: NvmeStore, where: dict[tuple[int, str], str], dtypes: dict[str, torch.dtype],
                 pin: bool, depth: int = 1, streamed: str = "master"):
        self.store, self.depth, self.streamed = store, depth, streamed
        self.spilled = {u: [k for (uu, k), t in sorted(where.items()) if uu == u and t == Home.NVME]
                        for u in range(len(store.numels))}
        kinds = sorted({k for ks in self.spilled.values() for k in ks})
        slots = depth + 2  # read ahead, in use, writing back
        width = ring_widths(store.numels, where)  # each kind's ring as wide as its widest spilled slab
        self.rings = {k: Ring(slots, width[k], dtypes[k], pin) for k in kinds}
        # the streamed kind, read for the device: read ahead, being copied, one spare
        self.s_units = {u for u, ks in self.spilled.items() if streamed in ks}
        self.s_ring = Ring(slots, width[streamed], dtypes[streamed], pin) if self.s_units else None
        self.s_order: deque[int] = deque()
        self.s_loaded: dict[int, tuple[Future, torch.Tensor]] = {}
        self.s_out: dict[int, torch.Tensor] = {}  # handed to the device, not yet copied
        self.stale: set[int] = set()  # units whose streamed slab the optimizer is about to rewrite
        self.rewritten: dict[int, Future] = {}  # unit -> the optimizer's write of its new weights
        self.s_read_bytes = 0
        self._ring_nbytes = sum(r.nbytes for r in [*self.rings.values(), *[self.s_ring] * bool(self.s_ring)])
        self.loaded: dict[int, dict[str, tuple[Future, torch.Tensor]]] = {}
        self.order: list[int] = []
        # threads: the main thread (the step: start, updating, sink, the streamed kind's reads), the optimizer's
        # worker (acquire, release), checkpoint threads (borrowed), and the gradient writer below (owned here,
        # shut by close()), which runs sink's writes; the rings are thread-safe
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
        """Host bytes of every staging buffer (all allocated at construction)."""
        return self._ring_nbytes

    def _timed(self, fut: Future) -> Future:
        """Marks the I/O window of the pass: its first request, its last completion."""
        if self._t_first is None:
            self._t_first = time.perf_counter()

        def landed(_):
            self._t_last = time.perf_counter()

        fut.add_done_callback(landed)
        return fut

    def _slot(self, kind: str) -> torch.Tensor:
        return self.rings[kind].take()

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
            if k == "weights":  # the optimizer writes the compute-dtype copy whole, from the master
                got[k] = (_done(), buf)
                continue
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
            self.rings[kind].give(whole, after=fut)
            self.written[unit] = fut
            self.write_bytes += view.numel() * view.element_size()

        return view, done

    def start(self, order: list[int]) -> None:
        """A new pass in `order`: the last pass's write-backs land first, then reading ahead begins."""
        self.flush()
        now = (self.read_bytes + self.s_read_bytes, self.write_bytes)
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
                self.rings[k].give(buf)
                continue
            fut = self._timed(self.store.write(unit, k, buf[:n]))
            self.rings[k].give(buf, after=fut)
            self.write_bytes += n * buf.element_size()
            if k == self.streamed:
                self.rewritten[unit] = fut  # before leaving `stale`: the reader then finds it
        self.stale.discard(unit)

    @contextmanager
    def borrowed(self, unit: int, kind: str, read: bool) -> Iterator[torch.Tensor]:
        """A ring buffer (the unit's slab size) outside the schedule, for checkpoints and imports: holds
        the unit's stored slab when `read`; written back to the store on exit when not. Call between
        passes (after flush), from at most `depth + 2` threads per kind."""
        whole = self.rings[kind].take()
        buf = whole[:self.store.numels[unit]]
        try:
            if read:
                self.store.read(unit, kind, buf).result()
            yield buf
            if not read:
                self.store.write(unit, kind, buf).result()
        finally:
            self.rings[kind].give(whole)

    # ---- the streamed kind, read for the forward and backward passes --------------------------------
    def updating(self) -> None:
        """The optimizer is about to rewrite every unit's streamed slab: a unit's next read waits for
        its write (release)."""
        self.rewritten.clear()
        self.stale = set(self.s_units)

    def stream_pass(self, units: list[int]) -> None:
        """The units the device will copy next, in order; reading ahead starts."""
        self._drop_reads()
        self.s_order = deque(u for u in units if u in self.s_units)
        self._read_ahead()

    def _drop_reads(self) -> None:
        for u in list(self.s_loaded):  # read ahead but not used (the device found them in place)
            self._drop(u)

    def _drop(self, unit: int) -> None:
        """A read-ahead buffer goes back to the ring once its read has landed."""
        if unit in self.s_loaded:
            fut, buf = self.s_loaded.pop(unit)
            self.s_ring.give(buf, after=fut)

    def _stream_read(self, unit: int) -> None:
        buf = self.s_ring.take()
        view = buf[:self.store.numels[unit]]
        fut = _then(self.rewritten.pop(unit, None), lambda: self.store.read(unit, self.streamed, view))
        self.s_loaded[unit] = (self._timed(fut), buf)
        self.s_read_bytes += view.numel() * view.element_size()

    def _read_ahead(self) -> None:
        for u in list(self.s_order)[:self.depth]:
            if u not in self.s_loaded and u not in self.stale:
                self._stream_read(u)

    def read_for_copy(self, unit: int) -> torch.Tensor:
        """Unit u's streamed slab in a pinned buffer, for the device to copy; hand it back with copied()."""
        while self.s_order and self.s_order[0] != unit:  # the order's units before it were found in place
            self._drop(self.s_order.popleft())
        if self.s_order:
            self.s_order.popleft()
        if unit not in self.s_loaded:
            self._stream_read(unit)
        fut, buf = self.s_loaded.pop(unit)
        self._read_ahead()
        fut.result()
        self.s_out[unit] = buf
        return buf[:self.store.numels[unit]]

    def copied(self, unit: int, event) -> None:
        """The device has enqueued its copy of the unit's buffer (`event`: once it has happened)."""
        self.s_ring.give(self.s_out.pop(unit), after=event)  # free once the copy has happened

    def flush(self) -> None:
        """Every write-back has landed (an error of one is raised here)."""
        for ring in self.rings.values():
            ring.settle()

    def close(self) -> None:
        """Every write landed, then the gradient writer's thread and the store's I/O threads shut."""
        self.flush()
        self._writer.shutdown(wait=True)
        self.store.close()


def _done() -> Future:
    f: Future = Future()
    f.set_result(0)
    return f


def _then(first: Future | None, start) -> Future:
    """`start()`'s future, started once `first` has finished (at once when None); an error of either
    is the result's."""
    if first is None:
        return start()
    out: Future = Future()

    def relay(f: Future) -> None:
        out.set_exception(f.exception()) if f.exception() else out.set_result(f.result())

    def go(f: Future) -> None:
        if f.exception():
            out.set_exception(f.exception())
            return
        try:
            start().add_done_callback(relay)
        except Exception as e:  # noqa: BLE001 - handed to the waiter
            out.set_exception(e)

    first.add_done_callback(go)
    return out
