"""CUDA streams and events behind one small interface that is a no-op on CPU.

Three streams: compute, H2D, D2H; and two more for the GPU updates speculated in the backward pass (their
state in, their write-back). Work on one stream waits for another only through events, never a
device-wide synchronization. On CPU every call runs at once, in order, so the same schedule runs there.
"""

from __future__ import annotations

import contextlib
import time

import torch


class Streams:
    NAMES = ("compute", "h2d", "d2h", "speculative", "back")

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
            # speculated GPU updates: their state in and the AdamW kernel, their write-back; their own streams,
            # so that the weights' loads and the gradients' drains never queue behind them
            self.speculative = torch.cuda.Stream(device)
            self.back = torch.cuda.Stream(device)
        else:
            self.compute = self.h2d = self.d2h = self.speculative = self.back = None

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def record(self, stream, timing: bool = False):
        """An event marking all work enqueued so far on `stream` (None on CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(stream)
        return ev

    def wait(self, stream, event) -> None:
        if self.cuda and event is not None:
            stream.wait_event(event)


class StallClock:
    """Measures on the GPU how long the compute stream waits on other streams, and how long it computes.

    Pairs of timing events, read once per step after the compute stream has finished. On CPU, where
    every call runs at once, compute phases are timed by the wall clock and waits are zero."""

    KINDS = ("forward", "backward", "h2d_wait", "d2h_wait")

    def __init__(self, streams: Streams):
        self.s = streams
        self.pairs: dict[str, list] = {k: [] for k in self.KINDS}
        self.cpu: dict[str, float] = {k: 0.0 for k in self.KINDS}

    def wait(self, kind: str, event) -> None:
        if not self.s.cuda or event is None:
            return
        a = self.s.record(self.s.compute, timing=True)
        self.s.compute.wait_event(event)
        self.pairs[kind].append((a, self.s.record(self.s.compute, timing=True)))

    @contextlib.contextmanager
    def computing(self, phase: str):
        """Times the compute work enqueued inside the block as `phase` ("forward" or "backward")."""
        if not self.s.cuda:
            t0 = time.perf_counter()
            yield
            self.cpu[phase] += time.perf_counter() - t0
            return
        a = self.s.record(self.s.compute, timing=True)
        yield
        self.pairs[phase].append((a, self.s.record(self.s.compute, timing=True)))

    def read(self) -> dict[str, float]:
        """Seconds per kind since the last read (the events must have completed)."""
        out = {k: sum(a.elapsed_time(b) for a, b in v) / 1e3 + self.cpu[k] for k, v in self.pairs.items()}
        for k in self.KINDS:
            self.pairs[k].clear()
            self.cpu[k] = 0.0
        return out
