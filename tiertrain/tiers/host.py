"""Host tier: pinned DRAM slabs, one per (unit, kind)."""

from __future__ import annotations

import torch

from ..modes import STATE, Home, Kind
from .slab import SlabLayout, alloc_slab

FP32_KINDS = (*STATE, Kind.GRAD)


class HostStore:
    """Holds every kind of every unit in host memory (or, for resident units, in GPU memory).

    `weights`, the compute-dtype copy streamed to the GPU, exists when `compute_copy` is set and the
    compute dtype is not fp32; otherwise the fp32 master streams (and is cast on the GPU). `version[u]`
    counts the updates of unit u's weights, so device buffers know when their copy is stale.

    `copies[u]`: a second master and moments of unit u (add_copies), which a speculative update fills
    while the current ones stay as they were; `swap(u)` makes them current.
    """

    def __init__(
        self,
        layouts: list[SlabLayout],
        compute_dtype: torch.dtype,
        pin: bool,
        compute_copy: bool = True,
        where: dict[tuple[int, str], str] | None = None,
        device: torch.device | None = None,
    ):
        self.layouts = layouts
        self.compute_dtype = compute_dtype
        self.pin = pin
        self.version = [0] * len(layouts)
        copy = compute_copy and compute_dtype != torch.float32
        self.kinds = FP32_KINDS + ((Kind.WEIGHTS,) if copy else ())
        # the slab that carries the weights to the GPU
        self.streamed_kind = Kind.WEIGHTS if copy else Kind.MASTER
        self.slabs: list[dict[str, torch.Tensor]] = []
        for u, lay in enumerate(layouts):  # slabs placed on NVMe get no memory here; "gpu" ones live there
            tiers = {k: (where or {}).get((u, k), Home.HOST) for k in self.kinds}
            self.slabs.append(
                {
                    k: alloc_slab(lay.numel, self.dtype(k), pin)
                    if t == Home.HOST
                    else torch.zeros(lay.numel, dtype=self.dtype(k), device=device)
                    for k, t in tiers.items()
                    if t in (Home.HOST, Home.GPU)
                }
            )
        self.copies: dict[int, dict[str, torch.Tensor]] = {}

    def add_copies(self, units) -> None:
        for u in units:
            self.copies[u] = {k: alloc_slab(self.layouts[u].numel, torch.float32, self.pin) for k in STATE}

    def swap(self, unit: int) -> None:
        """The unit's speculative update is kept: its copies become the current slabs (and the old ones the
        copies the next speculation writes)."""
        s, c = self.slabs[unit], self.copies[unit]
        for k in STATE:
            s[k], c[k] = c[k], s[k]
        self.version[unit] += 1

    def kept(self, unit: int) -> None:
        """The unit's speculative update is kept: written into its copies (swapped in), or in place."""
        if unit in self.copies:
            self.swap(unit)
        else:
            self.version[unit] += 1

    def dtype(self, kind: str) -> torch.dtype:
        return self.compute_dtype if kind == Kind.WEIGHTS else torch.float32

    def slab(self, unit: int, kind: str) -> torch.Tensor:
        return self.slabs[unit][kind]

    def streamed(self, unit: int) -> torch.Tensor:
        """The slab that carries the unit's weights to the GPU."""
        return self.slabs[unit][self.streamed_kind]

    def updated(self, unit: int, master: torch.Tensor | None = None) -> None:
        """The unit's master changed: round it into the compute-dtype copy, and bump its version.
        `master`: the slab where it is now, when it does not live here (on NVMe, in a ring buffer)."""
        s = self.slabs[unit]
        if Kind.WEIGHTS in s:
            s[Kind.WEIGHTS].copy_(s[Kind.MASTER] if master is None else master)
        self.version[unit] += 1

    def nbytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for slabs in self.slabs:
            for k, t in slabs.items():  # spilled slabs are absent, resident ones are the GPU's
                if not t.is_cuda:
                    out[k] = out.get(k, 0) + t.numel() * t.element_size()
        if self.copies:
            out["update copies"] = sum(t.numel() * 4 for c in self.copies.values() for t in c.values())
        return out
