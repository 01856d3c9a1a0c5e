"""Device-side buffers: weight slots and fp32 gradient accumulators.

Blocks share two weight slots (each the size of the largest block), filled alternately; the first and
last units (embedding, final norm + LM head) get buffers of their own so a tied LM head can read the
embedding while the blocks rotate through the slots. Gradients accumulate in fp32: one accumulator
the blocks share, one each for the first and last units (a tied embedding collects the head's gradient
first and its own last). On CPU the "device" is host memory and every copy is a plain copy.
"""
from __future__ import annotations

import torch

from ..tiers.host import HostStore
from ..tiers.slab import SlabLayout


class DeviceBuffers:
    def __init__(self, layouts: list[SlabLayout], host: HostStore, device: torch.device, dtype: torch.dtype):
        self.layouts, self.host, self.device, self.dtype = layouts, host, device, dtype
        last = len(layouts) - 1
        self.own = {0, last}
        block_numel = max((lay.numel for i, lay in enumerate(layouts) if i not in self.own), default=0)
        self.slots = [torch.empty(block_numel, dtype=dtype, device=device) for _ in range(2)]
        self.resident = {i: torch.empty(layouts[i].numel, dtype=dtype, device=device) for i in self.own}
        self.block_acc = torch.zeros(block_numel, dtype=torch.float32, device=device)
        self.resident_acc = {i: torch.zeros(layouts[i].numel, dtype=torch.float32, device=device) for i in self.own}
        self._where: dict[int, torch.Tensor] = {}
        self._turn = 0
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def load(self, unit: int) -> torch.Tensor:
        """Copies the unit's streamed weights to the device; returns the flat compute-dtype buffer."""
        n = self.layouts[unit].numel
        if unit in self.own:
            buf = self.resident[unit]
        else:
            buf = self.slots[self._turn][:n]
            self._turn ^= 1
        src = self.host.streamed(unit)
        buf.copy_(src)  # fp32 master streamed for an fp32 run; the compute-dtype copy otherwise
        self.h2d_bytes += src.numel() * src.element_size()
        self._where[unit] = buf
        return buf

    def weights(self, unit: int) -> torch.Tensor:
        """The buffer the unit was last loaded into."""
        return self._where[unit]

    def acc(self, unit: int) -> torch.Tensor:
        n = self.layouts[unit].numel
        return self.resident_acc[unit] if unit in self.own else self.block_acc[:n]

    def drain(self, unit: int) -> torch.Tensor:
        """Moves the unit's accumulated gradient to its host grad slab; returns its L2 norm (on device)."""
        acc = self.acc(unit)
        norm = torch.linalg.vector_norm(acc)
        self.host.slab(unit, "grad").copy_(acc)
        self.d2h_bytes += acc.numel() * 4
        return norm

    def nbytes(self) -> int:
        bufs = self.slots + list(self.resident.values()) + [self.block_acc] + list(self.resident_acc.values())
        return sum(b.numel() * b.element_size() for b in bufs)
