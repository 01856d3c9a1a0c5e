"""Device buffers: weight slots and fp32 gradient accumulators, filled and drained on their own streams.

Weights: the blocks share two slots (each the size of the largest block): a load goes to the slot
that was not used last, after the compute stream has released it. The embedding and the head have a
buffer each, so a tied head reads the embedding while blocks rotate. A buffer remembers which (unit,
version) it holds: a unit still in place (the last block between forward and backward) is not copied
again. Before a unit is copied, `host_ready(unit)` waits until the host optimizer has finished it.
Weights spilled to NVMe come through `reader`: `expect(units)` tells it which units the coming loads
will copy (the cache's own arithmetic), `read(u)` gives a pinned buffer, `copied(u, event)` takes it back.

Gradients: two block accumulators alternate, so the D2H of one overlaps the next unit's backward; the
embedding and the head have their own (a tied embedding collects the head's gradient first).

Updates on the GPU: a unit whose update was deferred to the GPU (`take_update(unit)` hands over its
step, lr and clip) has its fp32 master, gradient and moments copied into one of two state sets on the
H2D stream when its weights are loaded next; the AdamW kernel runs there, the slot gets the updated
master cast to the compute dtype, and master and moments go back to the host slabs on the D2H stream.
The host optimizer meanwhile updates the other units: the two share the next forward pass.
Speculated (`speculation(unit)` hands over step, lr and where the result goes), the update runs in the
backward pass instead: the gradient is copied into a state set on the D2H stream behind its own D2H
copy; master and moments come in and the kernel runs on a stream of their own, and the result goes back
on another (into the host's copies, or the slabs in place): the weights' loads and later gradients do
not queue behind them.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..tiers.host import HostStore
from ..tiers.slab import SlabLayout
from .streams import StallClock, Streams

UPDATED = ("master", "exp_avg", "exp_avg_sq")  # what a GPU update writes back to the host slabs


class _Buf:
    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.t = torch.zeros(numel, dtype=dtype, device=device) if numel else torch.empty(0, device=device)
        self.holds: tuple[int, int] | None = None  # (unit, version)
        self.free = None  # event: the compute stream is done with the contents


class _State:
    """fp32 master, gradient and moments of one unit being updated on the GPU."""

    def __init__(self, numel: int, device: torch.device):
        self.t = {k: torch.empty(numel, dtype=torch.float32, device=device) for k in UPDATED + ("grad",)}
        self.free = None  # event: their write-back to the host has been read out


class DeviceBuffers:
    def __init__(self, layouts: list[SlabLayout], host: HostStore, device: torch.device, dtype: torch.dtype,
                 streams: Streams, clock: StallClock, host_ready: Callable[[int], None] = lambda u: None,
                 grad_sink: Callable[[int], tuple[torch.Tensor, Callable | None]] | None = None,
                 deferred: frozenset[int] = frozenset(), take_update: Callable[[int], tuple | None] = lambda u: None,
                 apply: Callable | None = None, reader=None,
                 speculation: Callable[[int], tuple | None] = lambda u: None):
        """`grad_sink(unit)`: where a unit's gradient goes and what to call with the copy's event (a
        spilled gradient: a staging buffer, then the disk); default its host slab. `deferred`: units
        updated here, by `apply` (HostAdamW.apply), with the job `take_update(unit)` hands over.
        `reader`: the NVMe tier, for units whose streamed slab is spilled (its `s_units`)."""
        self.layouts, self.host, self.dtype, self.s, self.clock = layouts, host, dtype, streams, clock
        self.host_ready = host_ready
        self.grad_sink = grad_sink or (lambda u: (host.slab(u, "grad"), None))
        last = len(layouts) - 1
        self.own = (0, last)
        blk = max((lay.numel for i, lay in enumerate(layouts) if i not in self.own), default=0)
        self.slots = [_Buf(blk, dtype, device) for _ in range(2)]
        self.res = {i: _Buf(layouts[i].numel, dtype, device) for i in self.own}
        # fp32 master streamed for a bf16 run: copy into an fp32 stage, cast on the H2D stream
        casts = host.dtype(host.streamed_kind) != dtype
        self.stage = torch.empty(max(lay.numel for lay in layouts) if casts else 0, dtype=torch.float32, device=device)
        self.accs = [_Buf(blk, torch.float32, device) for _ in range(2)]
        self.res_acc = {i: _Buf(layouts[i].numel, torch.float32, device) for i in self.own}
        self._mru = 1
        self._acc_turn = 0
        self._at: dict[int, _Buf] = {}
        self._acc_at: dict[int, _Buf] = {}
        self.ready: dict[int, object] = {}
        self.grad_ready: dict[int, object] = {}
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.deferred, self.take_update, self.apply, self.speculation = deferred, take_update, apply, speculation
        big = max((layouts[u].numel for u in deferred), default=0)
        self.sets = [_State(big, device) for _ in range(2 if deferred else 0)]
        self._set_turn = 0
        self.written: dict[int, object] = {}  # unit -> event: its GPU update is back in the host slabs
        self.reader = reader
        self.spilled = reader.s_units if reader is not None else set()

    # ---- weights ------------------------------------------------------------------------------
    def load(self, unit: int) -> None:
        """Starts the H2D copy of the unit's weights unless its current version is already in place; a
        deferred update of the unit runs first, and the slot is filled from its result."""
        self.host_ready(unit)
        job = self.take_update(unit)
        master = self._update(unit, *job) if job else None
        key = (unit, self.host.version[unit])
        buf, self._mru = self._buffer_for(unit, key, self._mru, lambda b: b.holds)
        n = self.layouts[unit].numel
        self._at[unit] = buf
        if buf.holds == key:
            return
        buf.holds = key
        spilled = unit in self.spilled and master is None
        src = self.reader.read_for_copy(unit) if spilled else self.host.streamed(unit) if master is None else None
        with self.s.on(self.s.h2d):
            self.s.wait(self.s.h2d, buf.free)
            if master is not None:  # already on the device: cast there
                buf.t[:n].copy_(master)
            else:
                self.s.wait(self.s.h2d, self.written.get(unit))
                if len(self.stage):
                    self.stage[:n].copy_(src, non_blocking=True)
                    buf.t[:n].copy_(self.stage[:n])
                else:
                    buf.t[:n].copy_(src, non_blocking=True)
                if not src.is_cuda:  # a resident unit's copy is device to device
                    self.h2d_bytes += src.numel() * src.element_size()
            self.ready[unit] = self.s.record(self.s.h2d)
        if spilled:
            self.reader.copied(unit, self.ready[unit])

    def expect(self, units, new: bool = False) -> None:
        """The loads coming next, in order: the spilled ones that will copy are read ahead. `new`: every
        unit's weights will have changed by then (the forward pass after an update)."""
        if not self.spilled:
            return
        held = {id(b): b.holds for b in self.slots + list(self.res.values())}
        mru, copies = self._mru, []
        for u in units:
            key = (u, None if new else self.host.version[u])
            b, mru = self._buffer_for(u, key, mru, lambda b: held[id(b)])
            if held[id(b)] != key:
                copies.append(u)
                held[id(b)] = key
        self.reader.stream_pass(copies)

    def _buffer_for(self, unit: int, key: tuple, mru: int, holds: Callable[[_Buf], tuple | None]) -> tuple[_Buf, int]:
        """The buffer a load of `key` uses, and the block slot used last after it, when buffer b holds
        `holds(b)`: the unit's own buffer, else the slot that already holds it, else the other slot."""
        if unit in self.res:
            return self.res[unit], mru
        hit = [i for i, b in enumerate(self.slots) if holds(b) == key]
        i = hit[0] if hit else 1 - mru
        return self.slots[i], i

    def _update(self, unit: int, step: int, lr: float, clip: float) -> torch.Tensor:
        """The unit's AdamW on the GPU (H2D stream), its master and moments written back behind it (D2H
        stream); returns the updated fp32 master, on the device."""
        st = self._next_set()
        t = self._in_set(unit, st, UPDATED + ("grad",), (st.free, self.grad_ready.get(unit), self.written.get(unit)),
                         (self.s.h2d, self.s.d2h), step, lr, clip, self.host.slabs[unit])
        self.host.version[unit] += 1
        return t["master"]

    def _next_set(self) -> _State:
        """The state set a GPU update uses next: the two take turns."""
        st = self.sets[self._set_turn]
        self._set_turn ^= 1
        return st

    def _speculate(self, unit: int, st: _State, grad_in, step: int, lr: float, into: dict | None) -> None:
        """The unit's AdamW on the GPU as if the norm will not clip, from the gradient copied into `st`
        (`grad_in`: its event), master and moments written to `into` (None: the host slabs)."""
        self._in_set(unit, st, UPDATED, (grad_in, self.written.get(unit)), (self.s.spec, self.s.back), step, lr, 1.0,
                     into or self.host.slabs[unit])

    def _in_set(self, unit: int, st: _State, kinds: tuple[str, ...], waits, streams, step: int, lr: float,
                clip: float, dst: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The AdamW of a unit in state set `st`: on the first of `streams`, after `waits`, the unit's
        `kinds` copied in from its host slabs and the kernel run; on the second, master and moments
        written to `dst`. Returns the set's views."""
        n = self.layouts[unit].numel
        t = {k: v[:n] for k, v in st.t.items()}
        s_in, s_out = streams
        with self.s.on(s_in):
            for ev in waits:
                self.s.wait(s_in, ev)
            for k in kinds:
                t[k].copy_(self.host.slab(unit, k), non_blocking=True)
            self.apply(unit, t["master"], t["grad"], t["exp_avg"], t["exp_avg_sq"], None, step, lr, clip)
            done = self.s.record(s_in)
        with self.s.on(s_out):
            self.s.wait(s_out, done)
            for k in UPDATED:
                dst[k].copy_(t[k], non_blocking=True)
            st.free = self.written[unit] = self.s.record(s_out)
        self.h2d_bytes += len(kinds) * n * 4
        self.d2h_bytes += len(UPDATED) * n * 4
        return t

    def settle(self) -> None:
        """Runs the deferred updates not yet taken and waits until every GPU update is back on the host."""
        for u in sorted(self.deferred):
            job = self.take_update(u)
            if job:
                self._update(u, *job)
        if self.s.cuda:
            for stream in (self.s.h2d, self.s.d2h, self.s.spec, self.s.back):
                stream.synchronize()

    def use(self, unit: int) -> torch.Tensor:
        """The unit's flat weights, once their copy has landed (the compute stream waits for it)."""
        self.clock.wait("h2d_wait", self.ready.pop(unit, None))
        return self._at[unit].t[:self.layouts[unit].numel]

    def release(self, *units: int) -> None:
        """The compute stream has enqueued its last use of these units' weights."""
        ev = self.s.record(self.s.compute)
        for u in units:
            self._at[u].free = ev

    # ---- gradients ----------------------------------------------------------------------------
    def zero_own_grads(self) -> None:
        for u, b in self.res_acc.items():
            self.clock.wait("d2h_wait", b.free)
            b.t.zero_()
            self._acc_at[u] = b

    def grad_begin(self, unit: int) -> torch.Tensor:
        """A zeroed fp32 accumulator for a block (the embedding and head use theirs, zeroed per step)."""
        if unit not in self.res_acc:
            b = self.accs[self._acc_turn]
            self._acc_turn ^= 1
            self.clock.wait("d2h_wait", b.free)
            b.t[:self.layouts[unit].numel].zero_()
            self._acc_at[unit] = b
        return self.acc(unit)

    def acc(self, unit: int) -> torch.Tensor:
        return self._acc_at[unit].t[:self.layouts[unit].numel]

    def drain(self, unit: int) -> torch.Tensor:
        """Sends the unit's gradient to its host grad slab on the D2H stream; returns its norm (on device)."""
        acc = self.acc(unit)
        norm = torch.linalg.vector_norm(acc)
        done = self.s.record(self.s.compute)
        dst, landed = self.grad_sink(unit)
        job = self.speculation(unit)
        st = self._next_set() if job else None
        with self.s.on(self.s.d2h):
            self.s.wait(self.s.d2h, done)
            dst.copy_(acc, non_blocking=True)
            if st is not None:
                self.s.wait(self.s.d2h, st.free)
                st.t["grad"][:acc.numel()].copy_(acc)
            self._acc_at[unit].free = self.grad_ready[unit] = self.s.record(self.s.d2h)
        if landed is not None:
            landed(self.grad_ready[unit])
        if st is not None:
            self._speculate(unit, st, self.grad_ready[unit], *job)
        if not dst.is_cuda:
            self.d2h_bytes += acc.numel() * 4
        return norm

    def nbytes(self) -> int:
        bufs = self.slots + list(self.res.values()) + self.accs + list(self.res_acc.values())
        sets = sum(t.numel() * 4 for st in self.sets for t in st.t.values())
        return sum(b.t.numel() * b.t.element_size() for b in bufs) + self.stage.numel() * 4 + sets
