"""Device buffers: weight slots filled on the H2D stream, fp32 gradient accumulators drained on the D2H stream.

Weights (WeightSlots): the blocks share two slots (each the size of the largest block): a load goes to the
slot that was not used last, after the compute stream has released it. The embedding and the head have a
buffer each, so a tied head reads the embedding while blocks rotate. A buffer remembers which (unit,
version) it holds: a unit still in place (the last block between forward and backward) is not copied
again. Weights spilled to NVMe come through `reader`: `expect(units)` tells it which units the coming loads
will copy (the cache's own arithmetic), `read_for_copy(u)` gives a pinned buffer, `copied(u, event)` takes
it back.

Gradients (Accumulators): two block accumulators alternate, so the D2H of one overlaps the next unit's
backward; the embedding and the head have their own (a tied embedding collects the head's gradient first).

Expert groups (model/parts.py): a block given `parts` loads and drains one part at a time (`part`: its index),
each a few slices of the unit's slab packed in a slot or accumulator of the part's size; its gradient is drained
part by part into the unit's sink, the layout's padding written as zeros. One rank, host updates (the planner's).

Several ranks (parallel.Ranks): the host holds this rank's shard of each slab (tiers.slab.Shard). A load copies
the shard into its place in the buffer and all-gathers the rest from the other ranks, on the H2D stream; a
drain reduce-scatters the accumulator in place, on the D2H stream, and sends down only this rank's part.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..model.parts import Part, gaps
from ..parallel import Ranks
from ..tiers.host import HostStore
from ..tiers.slab import Shard, SlabLayout
from .streams import StallClock, Streams


class _Buf:
    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.t = torch.zeros(numel, dtype=dtype, device=device) if numel else torch.empty(0, device=device)
        self.holds: tuple[int, int] | None = None  # (unit, version)
        self.free = None  # event: the stream that last used the contents is done with them


def _own(shards: list[Shard], parts: dict[int, tuple[Part, ...]]) -> tuple[tuple[int, int], int]:
    """(the units with buffers of their own: the embedding and the head; the largest block's padded numel, or of a
    block in parts its largest part's)."""
    own = (0, len(shards) - 1)
    sizes = [max(p.numel for p in parts[i]) if i in parts else sh.padded for i, sh in enumerate(shards)]
    return own, max((n for i, n in enumerate(sizes) if i not in own), default=0)


def _key(unit: int, part: int | None):
    return unit if part is None else (unit, part)


class WeightSlots:
    def __init__(
        self,
        layouts: list[SlabLayout],
        host: HostStore,
        device: torch.device,
        dtype: torch.dtype,
        streams: Streams,
        clock: StallClock,
        reader=None,
        shards: list[Shard] | None = None,
        ranks: Ranks | None = None,
        parts: dict[int, tuple[Part, ...]] | None = None,
    ):
        """`reader`: the NVMe tier's reader of the streamed kind (tiers.reader.StreamReader), for the units whose
        streamed slab is spilled (its `units`). `shards`: this
        rank's part of each unit's slab, which the host holds (None: the whole slab); `ranks`: who holds the rest.
        `parts`: the blocks loaded in parts (expert groups), each one's parts."""
        self.layouts, self.host, self.s, self.clock = layouts, host, streams, clock
        self.shards, self.ranks = shards or [Shard(lay) for lay in layouts], ranks or Ranks()
        self.parts = parts or {}
        self.own, blk = _own(self.shards, self.parts)
        self.slots = [_Buf(blk, dtype, device) for _ in range(2)]
        self.res = {i: _Buf(self.shards[i].padded, dtype, device) for i in self.own}
        # fp32 master streamed for a bf16 run: copy into an fp32 stage, cast on the H2D stream
        casts = host.dtype(host.streamed_kind) != dtype
        whole = [sh.numel for i, sh in enumerate(self.shards) if i not in self.parts]
        self.stage = torch.empty(max(whole + [blk]) if casts else 0, dtype=torch.float32, device=device)
        self._mru = 1
        self._at: dict = {}  # unit, or (unit, part) -> its buffer
        self.ready: dict = {}  # unit, or (unit, part) -> event: its weights are in its buffer
        self._held: dict[int, torch.Tensor] = {}  # a block in parts: its spilled slab read for this pass
        self.h2d_bytes = 0
        self.reader = reader
        self.spilled = reader.units if reader is not None else set()

    def load(self, unit: int, updated: torch.Tensor | None = None, after=None) -> None:
        """Starts the H2D copy of the unit's weights unless its current version is already in place.
        `updated`: its fp32 master, just updated on the device (cast into the slot there); `after`: an
        event the copy from the host waits for (a GPU update writing the host's slab back)."""
        key = (unit, self.host.version[unit])
        buf, self._mru = self._buffer_for(unit, key, self._mru, lambda b: b.holds)
        sh = self.shards[unit]
        n, part = sh.numel, buf.t[sh.start : sh.start + sh.numel]  # this rank's part of the unit's weights
        self._at[unit] = buf
        if buf.holds == key:
            return
        buf.holds = key
        spilled = unit in self.spilled and updated is None
        src = (
            self.reader.read_for_copy(unit)
            if spilled
            else self.host.streamed(unit)
            if updated is None
            else updated
        )
        with self.s.on(self.s.h2d):
            self.s.wait(self.s.h2d, buf.free)
            self.s.wait(self.s.h2d, after)
            if updated is not None:  # already on the device: cast there
                part.copy_(updated)
            elif len(self.stage):
                self.stage[:n].copy_(src, non_blocking=True)
                part.copy_(self.stage[:n])
            else:
                part.copy_(src, non_blocking=True)
            if updated is None and not src.is_cuda:  # a resident unit's copy is device to device
                self.h2d_bytes += src.numel() * src.element_size()
            self.ranks.all_gather(buf.t[: sh.padded], sh.start, n)  # the other ranks' parts, over NVLink
            self.ready[unit] = self.s.record(self.s.h2d)
        if spilled:
            self.reader.copied(unit, self.ready[unit])

    def load_part(self, unit: int, part: int, last: bool) -> None:
        """Starts the H2D copy of a part of a block in parts (its pieces of the unit's streamed slab); `last`: the
        pass's last load of the unit, after which a spilled slab's buffer goes back to the reader. Host updates
        only: the slab is the host's (or the disk's)."""
        key = (unit, part, self.host.version[unit])
        buf, self._mru = self._buffer_for(unit, key, self._mru, lambda b: b.holds)
        self._at[(unit, part)] = buf
        spilled = unit in self.spilled
        if spilled and unit not in self._held:
            self._held[unit] = self.reader.read_for_copy(unit)
        if buf.holds != key:
            buf.holds = key
            src = self._held[unit] if spilled else self.host.streamed(unit)
            p = self.parts[unit][part]
            with self.s.on(self.s.h2d):
                self.s.wait(self.s.h2d, buf.free)
                to = self.stage if len(self.stage) else buf.t
                for pc in p.pieces:
                    to[pc.dst : pc.dst + pc.numel].copy_(src[pc.src : pc.src + pc.numel], non_blocking=True)
                    self.h2d_bytes += pc.numel * src.element_size()
                if len(self.stage):
                    buf.t[: p.numel].copy_(self.stage[: p.numel])
                self.ready[(unit, part)] = self.s.record(self.s.h2d)
        if last and spilled:
            self.reader.copied(unit, self.s.record(self.s.h2d))
            del self._held[unit]

    def expect(self, units, new: bool = False) -> None:
        """The loads coming next, in order: the spilled ones that will copy are read ahead. `new`: every
        unit's weights will have changed by then (the forward pass after an update)."""
        if not self.spilled:
            return
        held = {id(b): b.holds for b in self.slots + list(self.res.values())}
        mru, copies = self._mru, []
        for u in units:
            if u in self.parts:  # its parts take turns in both slots: it copies, and leaves no unit in place
                copies.append(u)
                held.update({id(b): None for b in self.slots})
                continue
            key = (u, None if new else self.host.version[u])
            b, mru = self._buffer_for(u, key, mru, lambda b: held[id(b)])
            if held[id(b)] != key:
                copies.append(u)
                held[id(b)] = key
        self.reader.stream_pass(copies)

    def _buffer_for(
        self, unit: int, key: tuple, mru: int, holds: Callable[[_Buf], tuple | None]
    ) -> tuple[_Buf, int]:
        """The buffer a load of `key` uses, and the block slot used last after it, when buffer b holds
        `holds(b)`: the unit's own buffer, else the slot that already holds it, else the other slot."""
        if unit in self.res:
            return self.res[unit], mru
        hit = [i for i, b in enumerate(self.slots) if holds(b) == key]
        i = hit[0] if hit else 1 - mru
        return self.slots[i], i

    def forget(self) -> None:
        """Every buffer's contents count as stale (after loads out of the step's order, an evaluation's): the
        next forward pass, which expects every unit to copy, does copy every unit."""
        for b in self.slots + list(self.res.values()):
            b.holds = None

    def use(self, unit: int, part: int | None = None) -> torch.Tensor:
        """The unit's (or its part's) flat weights, once their copy has landed (the compute stream waits for it)."""
        key = _key(unit, part)
        self.clock.wait("h2d_wait", self.ready.pop(key, None))
        n = self.layouts[unit].numel if part is None else self.parts[unit][part].numel
        return self._at[key].t[:n]

    def release(self, *units: int, part: int | None = None) -> None:
        """The compute stream has enqueued its last use of these units' weights (or of one unit's part)."""
        ev = self.s.record(self.s.compute)
        for u in units:
            self._at[_key(u, part)].free = ev

    def nbytes(self) -> int:
        return (
            sum(b.t.numel() * b.t.element_size() for b in self.slots + list(self.res.values()))
            + self.stage.numel() * 4
        )


class Accumulators:
    def __init__(
        self,
        layouts: list[SlabLayout],
        device: torch.device,
        streams: Streams,
        clock: StallClock,
        sink: Callable[[int], tuple[torch.Tensor, Callable | None]],
        shards: list[Shard] | None = None,
        ranks: Ranks | None = None,
        parts: dict[int, tuple[Part, ...]] | None = None,
        pieces: dict[int, tuple[tuple[int, int], ...]] | None = None,
    ):
        """`sink(unit)`: where a unit's gradient goes and what to call with the copy's event (its host slab,
        or for a spilled gradient a staging buffer, then the disk): this rank's shard (`shards`, as WeightSlots);
        `parts`: as WeightSlots'; `pieces`: the blocks whose norm is taken by pieces (model/parts.norm_pieces)."""
        self.layouts, self.s, self.clock, self.sink = layouts, streams, clock, sink
        self.shards, self.ranks = shards or [Shard(lay) for lay in layouts], ranks or Ranks()
        self.parts, self.pieces = parts or {}, pieces or {}
        own, blk = _own(self.shards, self.parts)
        self.blocks = [_Buf(blk, torch.float32, device) for _ in range(2)]
        self.res = {i: _Buf(self.shards[i].padded, torch.float32, device) for i in own}
        self._turn = 0
        self._at: dict = {}  # unit, or (unit, part) -> its accumulator
        self.ready: dict[int, object] = {}  # unit -> event: its gradient has left the accumulator
        self.d2h_bytes = 0
        # a block in parts: its sink, from its first part's drain to its last
        self._sinks: dict[int, tuple] = {}

    def zero_own(self) -> None:
        """The embedding's and the head's accumulators, zeroed for a new step."""
        for u, b in self.res.items():
            self.clock.wait("d2h_wait", b.free)
            b.t.zero_()
            self._at[u] = b

    def begin(self, unit: int, part: int | None = None) -> torch.Tensor:
        """A zeroed fp32 accumulator for a block or a block's part (the embedding and head use theirs, zeroed per
        step)."""
        if unit not in self.res:
            b = self.blocks[self._turn]
            self._turn ^= 1
            self.clock.wait("d2h_wait", b.free)
            b.t[: self.shards[unit].padded if part is None else self.parts[unit][part].numel].zero_()
            self._at[_key(unit, part)] = b
        return self.acc(unit, part)

    def acc(self, unit: int, part: int | None = None) -> torch.Tensor:
        n = self.layouts[unit].numel if part is None else self.parts[unit][part].numel
        return self._at[_key(unit, part)].t[:n]

    def part(self, unit: int) -> torch.Tensor:
        """This rank's part of the unit's accumulator: after its drain, the gradient summed over the ranks."""
        sh = self.shards[unit]
        return self._at[unit].t[sh.start : sh.start + sh.numel]

    def read_until(self, unit: int, event) -> None:
        """Another copy out of the unit's accumulator (a speculated GPU update's) ends at `event`."""
        self._at[unit].free = event

    def drain(self, unit: int) -> torch.Tensor:
        """Sends the unit's gradient (this rank's part of the sum over the ranks) to its home on the D2H stream;
        returns that part's norm (on the device: after norms_ready() on the compute stream)."""
        sh = self.shards[unit]
        done = self.s.record(self.s.compute)
        dst, landed = self.sink(unit)
        with self.s.on(self.s.d2h):
            self.s.wait(self.s.d2h, done)
            part = self.ranks.reduce_scatter(self._at[unit].t[: sh.padded], sh.start, sh.numel)
            norm = _norm(part, self.pieces.get(unit))
            if norm.is_cuda:
                norm.record_stream(self.s.compute)  # read there after norms_ready()
            dst.copy_(part, non_blocking=True)
            self._at[unit].free = self.ready[unit] = self.s.record(self.s.d2h)
        if landed is not None:
            landed(self.ready[unit])
        if not dst.is_cuda:
            self.d2h_bytes += part.numel() * 4
        return norm

    def drain_part(self, unit: int, part: int, last: bool) -> torch.Tensor:
        """drain() of one part of a block in parts: its pieces to their places in the unit's sink (taken at the
        unit's first part, the layout's padding zeroed there; handed on after its `last`); the part's norm."""
        p = self.parts[unit][part]
        done = self.s.record(self.s.compute)
        if unit not in self._sinks:
            dst, landed = self.sink(unit)
            for a, b in gaps(self.layouts[unit].numel, self.parts[unit]):
                dst[a:b].zero_()  # a staging buffer holds another unit's bytes there
            self._sinks[unit] = dst, landed
        dst, landed = self._sinks[unit]
        buf = self._at[(unit, part)]
        with self.s.on(self.s.d2h):
            self.s.wait(self.s.d2h, done)
            norm = _norm(buf.t[: p.numel], p.norm_pieces())
            if norm.is_cuda:
                norm.record_stream(self.s.compute)
            for pc in p.pieces:
                dst[pc.src : pc.src + pc.numel].copy_(buf.t[pc.dst : pc.dst + pc.numel], non_blocking=True)
            buf.free = self.ready[unit] = self.s.record(self.s.d2h)
        if not dst.is_cuda:
            self.d2h_bytes += sum(pc.numel for pc in p.pieces) * 4
        if last:
            del self._sinks[unit]
            if landed is not None:
                landed(self.ready[unit])
        return norm

    def norms_ready(self) -> None:
        """The compute stream waits for the drains, whose norms it reads next."""
        self.s.wait(self.s.compute, self.ready.get(0))

    def nbytes(self) -> int:
        return sum(b.t.numel() * 4 for b in self.blocks + list(self.res.values()))


def _norm(t: torch.Tensor, pieces: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
    """A unit's gradient norm: on a CPU by chunks of 16 Ki elements, their norms combined in fp64, where fp32's one
    sum over a whole slab drifts (2e-5 over 4 M elements; this: 3e-8, at 1.3x fp32's time, an fp64 sum's 6-12x);
    a GPU's reduction is a tree already. With `pieces` ((start, numel) in t): each piece's norm, (n,)."""
    if pieces:
        views = [t[a : a + n] for a, n in pieces]
        if t.is_cuda:
            return torch.stack(torch._foreach_norm(views))
        return torch.stack([_norm(v).float() for v in views])
    if t.is_cuda or t.numel() <= 1 << 14:
        return torch.linalg.vector_norm(t)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(t.split(1 << 14)))).double())
