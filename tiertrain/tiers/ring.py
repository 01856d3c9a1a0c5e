"""Ring: a fixed set of pinned host buffers of one size, allocated at once and reused in turn, through which
slabs and activation checkpoints pass between the disk and the GPU (the staging's and the streamed kind's reader's rings, the NVMe
checkpoints' pieces). Knows buffers and what they wait for, nothing about models."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future

import torch

from .slab import alloc_slab


class Ring:
    """take() hands out a free buffer or, when none is, waits for the one given back longest ago to be done with
    (its pending disk write's Future, whose error is raised there, or its copy's CUDA event), and blocks while
    every buffer is out. give(buf, after) takes one back, free once `after` has happened. Thread-safe: its deques
    are touched under its condition's lock by every thread that takes or gives (the step's, the optimizer's, the
    I/O threads' callbacks); the waits happen outside it."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, pin: bool):
        self._free = deque(alloc_slab(numel, dtype, pin) for _ in range(count))
        # (what it waits for, buffer), oldest first
        self._pending: deque[tuple[object, torch.Tensor]] = deque()
        self._cond = threading.Condition()
        self.nbytes = sum(b.numel() * b.element_size() for b in self._free)

    def take(self) -> torch.Tensor:
        with self._cond:
            self._cond.wait_for(lambda: self._free or self._pending)
            if self._free:
                return self._free.popleft()
            after, buf = self._pending.popleft()
        try:
            _wait(after)
        except BaseException:
            self.give(buf)  # the buffer is free whatever became of its write
            raise
        return buf

    def give(self, buf: torch.Tensor, after: object = None) -> None:
        """`buf` back, free at once (`after` None) or once `after` (a Future or a CUDA event) has happened."""
        with self._cond:
            if after is None:
                self._free.append(buf)
            else:
                self._pending.append((after, buf))
            self._cond.notify()

    def settle(self) -> None:
        """Waits for every pending buffer (an error of its write raised here): all given back are then free."""
        while True:
            with self._cond:
                if not self._pending:
                    return
                after, buf = self._pending.popleft()
            try:
                _wait(after)
            finally:
                self.give(buf)


def _wait(after: object) -> None:
    if isinstance(after, Future):
        after.result()
    elif after is not None:
        after.synchronize()
