"""Activation checkpoints: each block's input per micro-batch, kept on the GPU or in pinned host memory.

On the host, a block's inputs go down on the D2H stream as soon as they are computed and come back on
the H2D stream one unit ahead of the backward pass that needs them, so the copies overlap compute.
"""
from __future__ import annotations

import torch

from .streams import StallClock, Streams


class Checkpoints:
    def __init__(self, where: str, streams: Streams, clock: StallClock, device: torch.device, pin: bool):
        assert where in ("gpu", "host")
        self.where, self.s, self.clock, self.device, self.pin = where, streams, clock, device, pin
        self.saved: dict[int, list[torch.Tensor]] = {}
        self.ready: dict[int, object] = {}
        self._host: dict[int, torch.Tensor] = {}
        self._shape: tuple | None = None
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def _host_buf(self, unit: int, xs: list[torch.Tensor]) -> torch.Tensor:
        shape = (len(xs),) + tuple(xs[0].shape)
        if shape != self._shape:  # a new batch shape: drop the old buffers
            self._host.clear()
            self._shape = shape
            release = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
            if self.pin and release is not None:
                release()  # torch caches freed pinned blocks: give them back to the OS
        if unit not in self._host:
            self._host[unit] = torch.empty(shape, dtype=xs[0].dtype, pin_memory=self.pin)
        return self._host[unit]

    def save(self, unit: int, xs: list[torch.Tensor]) -> None:
        if self.where == "gpu":
            self.saved[unit] = xs
            return
        host = self._host_buf(unit, xs)
        done = self.s.record(self.s.compute)
        with self.s.on(self.s.d2h):
            self.s.wait(self.s.d2h, done)
            for m, x in enumerate(xs):
                host[m].copy_(x, non_blocking=True)
                if self.s.cuda:
                    x.record_stream(self.s.d2h)  # keep x's memory until the copy has read it
        self.d2h_bytes += host.numel() * host.element_size()

    def prefetch(self, unit: int) -> None:
        if self.where == "gpu" or unit in self.saved:
            return
        host = self._host[unit]
        bufs = [torch.empty(host.shape[1:], dtype=host.dtype, device=self.device) for _ in range(host.shape[0])]
        allocated = self.s.record(self.s.compute)  # the memory may have been freed by earlier compute
        with self.s.on(self.s.h2d):
            self.s.wait(self.s.h2d, allocated)
            for m, b in enumerate(bufs):
                b.copy_(host[m], non_blocking=True)
            self.ready[unit] = self.s.record(self.s.h2d)
        self.saved[unit] = bufs
        self.h2d_bytes += host.numel() * host.element_size()

    def get(self, unit: int) -> list[torch.Tensor]:
        self.prefetch(unit)
        self.clock.wait("h2d_wait", self.ready.pop(unit, None))
        return self.saved[unit]

    def drop(self, unit: int) -> None:
        self.saved.pop(unit, None)
