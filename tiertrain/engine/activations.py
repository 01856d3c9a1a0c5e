"""Activation checkpoints: each block's input per micro-batch, kept where the RunPlan puts it (UnitPlan.checkpoint):
on the GPU, in pinned host memory, or on NVMe.

host: a block's inputs go down on the D2H stream as soon as they are computed and come back on the H2D stream one
unit ahead of the backward pass that needs them, so the copies overlap compute.
nvme: the same copies, in pieces through a ring of pinned buffers, and a disk write or read per piece (a
PieceStore). The writer thread copies a block's inputs down piece by piece and starts each piece's disk write as its
copy lands: as many pieces in flight as the ring has buffers (RunPlan.ck_pieces: the fewest with which the
probe's writes reached the disk's rate, tiertrain probe's ck_writer_rate). The reader thread reads a block's pieces,
a few at a time, after that block's writes landed.

The GPU holds at most the checkpoints the plan gave it room for: one per block with its checkpoint on the GPU, and
one more (at least two), the room of the block whose checkpoint comes back from the host or NVMe beside the one
the backward pass is differentiating (plan.memory's checkpoint split). Within that room the disk runs ahead of the
compute: the forward pass waits for a block on its way down only when the blocks saved and those on their way
would not fit (early in the pass, when few GPU checkpoints are saved yet, several blocks may be on their way), and
the backward pass reads the next NVMe checkpoints as soon as the blocks it has finished left room for them. One
block ahead was too little: at 131k tokens on an H100 a block's checkpoint (2.1 GB) takes longer to read beside
the spilled gradients' writes than a block's backward pass (bench/results/2026-11-26-issue42-read-ahead.md).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..errors import close_all
from ..modes import Home
from ..tiers.placement import CK_PIECE_BYTES, CK_RING_PIECES
from ..tiers.ring import Ring
from ..tiers.slab import alloc_slab
from .streams import StallClock, Streams

READ_WINDOW = 4  # pieces the reader has in flight (at most the ring's)


class ActivationStore:
    def __init__(
        self,
        homes: dict[int, str],
        streams: Streams,
        clock: StallClock,
        device: torch.device,
        pin: bool,
        store=None,
        dtype: torch.dtype = torch.float32,
        pieces: int = CK_RING_PIECES,
    ):
        """`homes`: {block: "gpu" | "host" | "nvme"}; `store`: a PieceStore holding the nvme ones; `dtype`: the
        checkpoints' (RunPlan.activation_dtype): a block's fp32 input is cast to it when saved, back when got;
        `pieces`: the ring's buffers, the pieces in flight (RunPlan.ck_pieces)."""
        self.homes, self.s, self.clock, self.device, self.pin, self.store = (
            homes,
            streams,
            clock,
            device,
            pin,
            store,
        )
        self.dtype = dtype
        self.saved: dict[int, list[torch.Tensor]] = {}
        self.ready: dict[int, object] = {}  # block -> its H2D event (host)
        self._host: dict[int, torch.Tensor] = {}
        self._shape: tuple | None = None
        self.h2d_bytes = self.d2h_bytes = 0
        self.disk_bytes = 0  # written and read back, both
        self.wait_s = (
            0.0  # the step's thread waiting on the disk (blocks on their way down, reads not landed)
        )
        self.reads: dict[int, Future] = {}  # block -> its reader job (-> the H2D event of its last piece)
        # per block written: [its first copy's start, its last write's end, bytes] (the I/O threads end them)
        self.writes: list[list[float]] = []
        self._lock = threading.Lock()
        if store is not None:
            # threads: the main thread (save, prefetch, get), one writer and one reader (owned here, shut by
            # close()); the ring is thread-safe; `written` is set by the main thread before the reader reads it
            self.pieces = max(1, pieces)
            self.ring = Ring(self.pieces, CK_PIECE_BYTES // 4, torch.float32, pin)
            self._out = ThreadPoolExecutor(1, thread_name_prefix="tiertrain-ck-out")
            self._in = ThreadPoolExecutor(1, thread_name_prefix="tiertrain-ck-in")
            self.written: dict[int, Future] = {}  # block -> its writer job (-> the disk writes of its pieces)
            self.on_way: deque[Future] = deque()  # writer jobs not seen to end: their blocks' GPU memory
        self.place(homes)

    def place(self, homes: dict[int, str]) -> None:
        """Each block's checkpoint home, and so the GPU's room: the checkpoints it may hold at once, in blocks."""
        self.homes = homes
        self.room = max(sum(h == Home.GPU for h in homes.values()) + 1, 2)
        self.nvme_desc = sorted((u for u, h in homes.items() if h == Home.NVME), reverse=True)

    def close(self) -> None:
        if self.store is not None:
            close_all(
                lambda: self._out.shutdown(wait=True), lambda: self._in.shutdown(wait=True), self.store.close
            )

    def ring_nbytes(self) -> int:
        return self.ring.nbytes if self.store is not None else 0

    # ---- the forward pass --------------------------------------------------------------------
    def save(self, unit: int, xs: list[torch.Tensor]) -> None:
        home = self.homes.get(unit, Home.GPU)
        xs = [x.to(self.dtype) for x in xs]  # no copy in fp32
        shape = (len(xs),) + tuple(xs[0].shape)
        if shape != self._shape:  # a new batch shape: drop the old host buffers
            self._host.clear()
            self._shape = shape
        if home == Home.GPU:
            self._make_room()
            self.saved[unit] = xs
        elif home == Home.HOST:
            self._save_host(unit, xs)
        else:
            self._make_room()
            job = self._out.submit(self._write, unit, xs, self.s.record(self.s.compute))
            self.written[unit] = job
            self.on_way.append(job)
            self.d2h_bytes += sum(x.numel() * x.element_size() for x in xs)

    def _held(self) -> int:
        """The checkpoints holding GPU memory: those saved or read back, and those whose copies down have not ended
        (the writer ends them in order)."""
        if self.store is None:
            return len(self.saved)
        while self.on_way and self.on_way[0].done():
            self.on_way.popleft()
        return len(self.saved) + len(self.on_way)

    def _make_room(self) -> None:
        """Waits for blocks on their way down until one more checkpoint fits the GPU's room."""
        if self.store is None:
            return
        while self._held() + 1 > self.room and self.on_way:
            self._wait(self.on_way.popleft())

    def _save_host(self, unit: int, xs: list[torch.Tensor]) -> None:
        if unit not in self._host:  # page-rounded (torch's pinned allocator rounds up to a power of two)
            self._host[unit] = alloc_slab(len(xs) * xs[0].numel(), xs[0].dtype, self.pin).view(self._shape)
        host = self._host[unit]
        done = self.s.record(self.s.compute)
        with self.s.on(self.s.d2h):
            self.s.wait(self.s.d2h, done)
            for m, x in enumerate(xs):
                host[m].copy_(x, non_blocking=True)
                if self.s.cuda:
                    x.record_stream(self.s.d2h)  # keep x's memory until the copy has read it
        self.d2h_bytes += host.numel() * host.element_size()

    def _pieces(self, xs: list[torch.Tensor]):
        """(micro-batch, piece index in the row, element range) of every piece of a block's inputs."""
        per, n = CK_PIECE_BYTES // xs[0].element_size(), xs[0].numel()
        k = -(-n // per)
        return [(m, m * k + p, p * per, min(n, (p + 1) * per)) for m in range(len(xs)) for p in range(k)]

    def _write(self, unit: int, xs: list[torch.Tensor], done) -> list[Future]:
        """Writer thread: each piece down through a ring buffer, then to disk, its buffer back to the ring once the
        write has landed: as many writes in flight as the ring has buffers. Returns the pieces' disk writes; `xs`
        (their GPU memory) is let go when it returns."""
        log = [time.perf_counter(), 0.0, 0]

        def ended(_):
            with self._lock:
                log[1] = max(log[1], time.perf_counter())

        writes = []
        for m, i, a, b in self._pieces(xs):
            buf = self.ring.take()  # every buffer in flight: the oldest write's lands first
            with self.s.on(self.s.d2h):
                self.s.wait(self.s.d2h, done)
                buf.view(self.dtype)[: b - a].copy_(xs[m].view(-1)[a:b], non_blocking=True)
                copied = self.s.record(self.s.d2h)
            if copied is not None:
                copied.synchronize()
            f = self.store.write(unit, i, buf)
            self.ring.give(buf, after=f)  # free once its write has landed
            f.add_done_callback(ended)
            log[2] += (b - a) * xs[m].element_size()
            writes.append(f)
        with self._lock:
            self.writes.append(log)
        return writes

    def write_rate(self) -> float:
        """GB/s of the checkpoints' writes since the last call: their bytes over the time some were on their way
        (from a block's first copy to its last write's end; the blocks' times overlapping counted once)."""
        with self._lock:
            done = [w for w in self.writes if w[1]]
            self.writes = [w for w in self.writes if not w[1]]
        busy, end = 0.0, 0.0
        for start, stop, _ in sorted(done):
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
        return sum(w[2] for w in done) / busy / 1e9 if busy else 0.0

    # ---- the backward pass -------------------------------------------------------------------
    def prefetch(self, unit: int) -> None:
        """The block's checkpoint on its way back to the GPU, and the next NVMe ones below it as far as the GPU's
        room allows (the blocks the backward pass finished have left theirs)."""
        self._fetch(unit)
        for u in self.nvme_desc:
            if self._held() >= self.room:
                break
            if u < unit and u not in self.saved:
                self._fetch(u)

    def _fetch(self, unit: int) -> None:
        home = self.homes.get(unit, Home.GPU)
        if home == Home.GPU or unit in self.saved:
            return
        if home == Home.HOST:
            host = self._host[unit]
            shape, count = host.shape[1:], host.shape[0]
        else:
            shape, count = self._shape[1:], self._shape[0]
        bufs = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(count)]
        allocated = self.s.record(self.s.compute)  # the memory may have been freed by earlier compute
        self.saved[unit] = bufs
        self.h2d_bytes += count * bufs[0].numel() * bufs[0].element_size()
        if home == Home.NVME:
            self.reads[unit] = self._in.submit(self._read, unit, bufs, allocated, self.written.pop(unit))
            return
        with self.s.on(self.s.h2d):
            self.s.wait(self.s.h2d, allocated)
            for m, b in enumerate(bufs):
                b.copy_(host[m], non_blocking=True)
            self.ready[unit] = self.s.record(self.s.h2d)

    def _read(self, unit: int, bufs: list[torch.Tensor], allocated, written: Future):
        """Reader thread: the block's pieces from disk into ring buffers, a few in flight, each copied up as it
        lands. Returns the event of the last copy."""
        for w in written.result():  # the pieces' writes landed (a failed one raises here, then in get())
            w.result()
        todo = deque(self._pieces(bufs))
        flight: deque = deque()
        last = None
        while todo or flight:
            while todo and len(flight) < min(READ_WINDOW, self.pieces):
                m, i, a, b = todo.popleft()
                buf = self.ring.take()
                flight.append((m, a, b, buf, self.store.read(unit, i, buf)))
            m, a, b, buf, f = flight.popleft()
            f.result()
            self.disk_bytes += 2 * (b - a) * bufs[m].element_size()
            with self.s.on(self.s.h2d):
                self.s.wait(self.s.h2d, allocated)
                bufs[m].view(-1)[a:b].copy_(buf.view(self.dtype)[: b - a], non_blocking=True)
                last = self.s.record(self.s.h2d)
            if last is not None:
                last.synchronize()  # the buffer is free once its copy has read it
            self.ring.give(buf)
        return last

    def get(self, unit: int) -> list[torch.Tensor]:
        self._fetch(unit)
        if unit in self.reads:
            self.ready[unit] = self._wait(self.reads.pop(unit))
        self.clock.wait("h2d_wait", self.ready.pop(unit, None))
        return [x.float() for x in self.saved[unit]]  # no copy in fp32

    def drop(self, unit: int) -> None:
        self.saved.pop(unit, None)

    def _wait(self, f: Future):
        t0 = time.perf_counter()
        out = f.result()
        self.wait_s += time.perf_counter() - t0
        return out
