"""The streamed kind's reader: the slab that carries the weights to the GPU, where it is spilled, read from NVMe for
the forward and the backward pass through a ring of pinned buffers of its own. Knows slabs and the order the device
copies them in, nothing about models.

`stream_pass(units)` gives the order the device will copy units in and starts reading ahead; `read_for_copy(u)`
hands unit u's over and reads further ahead; `copied(u, event)` takes the buffer back once the H2D copy has
happened. In the forward pass a unit's new weights are read only once the optimizer has written them:
`updating()` marks every unit about to be rewritten, and `written(u, kind, future)` (the staging's on_write) says
when each unit's write has been issued.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import torch

from .nvme import NvmeStore
from .ring import Ring
from .staging import Traffic


class StreamReader:
    def __init__(
        self,
        store: NvmeStore,
        kind: str,
        units: set[int],
        dtype: torch.dtype,
        width: int,
        pin: bool,
        depth: int = 1,
        traffic: Traffic | None = None,
    ):
        """`units`: those whose `kind` slab is spilled; `width`: the ring buffers' elements (the widest)."""
        self.store, self.kind, self.units, self.depth = store, kind, units, depth
        self.traffic = traffic or Traffic()
        self.ring = Ring(depth + 2, width, dtype, pin)  # read ahead, being copied, one spare
        self.order: deque[int] = deque()
        self.loaded: dict[int, tuple[Future, torch.Tensor]] = {}
        self.out: dict[int, torch.Tensor] = {}  # handed to the device, not yet copied
        self.stale: set[int] = set()  # units whose slab the optimizer is about to rewrite
        self.rewritten: dict[int, Future] = {}  # unit -> the optimizer's write of its new weights

    def ring_nbytes(self) -> int:
        return self.ring.nbytes

    def updating(self) -> None:
        """The optimizer is about to rewrite every unit's slab: a unit's next read waits for its write."""
        self.rewritten.clear()
        self.stale = set(self.units)

    def written(self, unit: int, kind: str, fut: Future) -> None:
        """A write-back of the unit's `kind` slab has been issued (Staging's on_write): the next read follows it."""
        if kind == self.kind:
            self.rewritten[unit] = fut  # before leaving `stale`: the reader then finds it
            self.stale.discard(unit)

    def stream_pass(self, units: list[int]) -> None:
        """The units the device will copy next, in order; reading ahead starts."""
        for u in list(self.loaded):  # read ahead but not used (the device found them in place)
            self._drop(u)
        self.order = deque(u for u in units if u in self.units)
        self._read_ahead()

    def _drop(self, unit: int) -> None:
        """A read-ahead buffer goes back to the ring once its read has landed."""
        if unit in self.loaded:
            fut, buf = self.loaded.pop(unit)
            self.ring.give(buf, after=fut)

    def _read(self, unit: int) -> None:
        buf = self.ring.take()
        view = buf[: self.store.numels[unit]]
        fut = _then(self.rewritten.pop(unit, None), lambda: self.store.read(unit, self.kind, view))
        self.loaded[unit] = (self.traffic.timed(fut), buf)
        self.traffic.read_bytes += view.numel() * view.element_size()

    def _read_ahead(self) -> None:
        for u in list(self.order)[: self.depth]:
            if u not in self.loaded and u not in self.stale:
                self._read(u)

    def read_for_copy(self, unit: int) -> torch.Tensor:
        """Unit u's slab in a pinned buffer, for the device to copy; hand it back with copied()."""
        while self.order and self.order[0] != unit:  # the order's units before it were found in place
            self._drop(self.order.popleft())
        if self.order:
            self.order.popleft()
        if unit not in self.loaded:
            self._read(unit)
        fut, buf = self.loaded.pop(unit)
        self._read_ahead()
        fut.result()
        self.out[unit] = buf
        return buf[: self.store.numels[unit]]

    def copied(self, unit: int, event) -> None:
        """The device has enqueued its copy of the unit's buffer (`event`: once it has happened)."""
        self.ring.give(self.out.pop(unit), after=event)  # free once the copy has happened


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
