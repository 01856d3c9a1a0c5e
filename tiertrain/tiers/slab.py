"""Slabs: one flat, 4 KiB-aligned buffer per unit and kind, and the table that names views into it.

The layout is shared by every kind of a unit (weights, master, exp_avg, exp_avg_sq, grad), so one
table turns any of them into named tensors. Tensors of 2+ dims come first and the rest after, so the
optimizer updates each decay group in few contiguous ranges (the 2-D biases of gpt-oss's experts, which take no
decay, sit among the first: the layout stays the one checkpoints hold). Padding stays zero through AdamW (zero
grad, zero moments, zero weight), so ranges may include it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the layout arithmetic is pure Python: the planner uses it without torch
    import torch

PAGE = 4096
TENSOR_ALIGN = 64  # elements: every tensor starts on a 128-byte (bf16) / 256-byte (fp32) boundary
SLAB_ALIGN = 2048  # elements: slab sizes are whole 4 KiB pages in bf16 and in fp32


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    offset: int  # in elements
    numel: int


@dataclass(frozen=True)
class SlabLayout:
    entries: tuple[Entry, ...]  # the tensors of 2+ dims first (the layout checkpoints hold), then the rest
    numel: int  # padded size in elements

    @classmethod
    def build(cls, tensors: list[tuple[str, tuple[int, ...]]]) -> "SlabLayout":
        ordered = [t for t in tensors if len(t[1]) >= 2] + [t for t in tensors if len(t[1]) < 2]
        entries, off = [], 0
        for name, shape in ordered:
            n = 1
            for d in shape:
                n *= d
            entries.append(Entry(name, tuple(shape), off, n))
            off = _round_up(off + n, TENSOR_ALIGN)
        return cls(tuple(entries), max(_round_up(off, SLAB_ALIGN), SLAB_ALIGN))

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries}

    def ranges(self) -> list[tuple[int, int, bool]]:
        """(start, end, decay) ranges that cover the slab, neighbours of one kind merged: the optimizer's groups.
        Weight decay takes the tensors of 2+ dims but biases (gpt-oss's experts' are 2-D), as HF Trainer leaves
        biases out; the padding after an entry goes with it (zero, it stays zero)."""
        out: list[tuple[int, int, bool]] = []
        ends = [e.offset for e in self.entries[1:]] + [self.numel]
        for e, end in zip(self.entries, ends):
            decay = len(e.shape) >= 2 and not e.name.endswith("bias")
            if out and out[-1][2] == decay:
                out[-1] = (out[-1][0], end, decay)
            else:
                out.append((e.offset, end, decay))
        return out


def host_cost(nbytes: int) -> int:
    """Host bytes a slab of nbytes takes: whole pages (alloc_slab maps exactly that); at least one page. Written
    out (no calls): the planner asks it millions of times for a deep model's candidates."""
    return -(-nbytes // PAGE) * PAGE if nbytes > 0 else PAGE


def alloc_slab(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed flat tensor on its own anonymous mapping: page-aligned (direct I/O and fast DMA need it),
    exactly the pages it needs. `pin` page-locks it with cudaHostRegister: torch's pinned allocator would
    round every slab up to a power of two, up to twice the host memory for the same state."""
    import mmap
    import weakref

    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    size = host_cost(nbytes)
    mm = mmap.mmap(-1, size)  # anonymous memory is zero-filled
    view = memoryview(mm)
    raw = torch.frombuffer(view, dtype=torch.uint8)  # holds `view` until the last view of it is gone
    if pin:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(raw.data_ptr(), size, 0)
        if int(err) != 0:
            raise MemoryError(
                f"cudaHostRegister of {size} bytes failed (CUDA error {int(err)}): host memory "
                "cannot be page-locked; lower --host-gb or raise the memlock limit (ulimit -l)"
            )
        # unregistered while still mapped: the finalizer holds `mm`, which unmaps only after it. A finalizer on
        # `mm` runs after mmap's own dealloc has unmapped (and let go of the GIL), so another thread could map
        # the range again and fail to register it: "part or all of the range was already registered"
        weakref.finalize(view, _unpin, cudart, raw.data_ptr(), mm)
    flat = raw[:nbytes].view(dtype)
    assert flat.data_ptr() % PAGE == 0
    return flat


def _unpin(cudart, ptr: int, mm) -> None:
    """Unregister a pinned slab's pages; `mm`, its mapping, is unmapped when this returns (the last reference)."""
    cudart.cudaHostUnregister(ptr)


def shard_numel(numel: int, ranks: int) -> int:
    """Elements of each rank's shard of a slab of `numel`: its 1/ranks, in whole pages (the slab's, for one)."""
    return numel if ranks == 1 else _round_up(-(-numel // ranks), SLAB_ALIGN)


@dataclass(frozen=True)
class Shard:
    """Rank `rank`'s part of a unit's slab when `ranks` ranks share it: elements [start, start + numel) of the
    slab padded to `padded` = ranks x numel (whole pages each); one rank's shard is the whole slab. The optimizer
    updates a shard as it would the slab: `ranges` are the slab's groups, cut to the shard."""

    layout: SlabLayout
    rank: int = 0
    ranks: int = 1

    @property
    def numel(self) -> int:
        return shard_numel(self.layout.numel, self.ranks)

    @property
    def start(self) -> int:
        return self.rank * self.numel

    @property
    def padded(self) -> int:
        return self.numel * self.ranks

    @property
    def stored(self) -> int:
        """Elements of the shard inside the slab (the last ranks' shards are partly or wholly padding)."""
        return max(0, min(self.numel, self.layout.numel - self.start))

    def ranges(self) -> list[tuple[int, int, bool]]:
        a, b = self.start, self.start + self.numel
        return [
            (max(x, a) - a, min(y, b) - a, d) for x, y, d in self.layout.ranges() if max(x, a) < min(y, b)
        ]
