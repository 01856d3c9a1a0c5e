"""The run's training state where its RunPlan put it: each unit's slab of each kind in host RAM, on the GPU
(a resident unit's) or on NVMe (through the staging ring); this rank's part of a slab; a unit's whole master,
gathered from the ranks. What reads or sets the state outside the step goes through here: the init, a
Hugging Face import, checkpoints, state_dict. Main thread only, between steps (the caller quiesces first)."""

from __future__ import annotations

import base64
import zlib
from contextlib import contextmanager
from typing import Iterator

import torch

from .model.spec import UnitSpec
from .modes import Home, Kind
from .parallel import Ranks
from .tiers.host import HostStore
from .tiers.slab import Shard, SlabLayout


class State:
    def __init__(
        self,
        units: tuple[UnitSpec, ...],
        layouts: list[SlabLayout],
        shards: list[Shard],
        ranks: Ranks,
        host: HostStore,
        staging,
        where: dict[tuple[int, str], str],
    ):
        """`staging`: the NVMe tier's staging (tiers.staging.Staging; None: nothing spilled); `where`: each
        (unit, kind)'s home."""
        self.units, self.layouts, self.shards, self.ranks = units, layouts, shards, ranks
        self.host, self.staging, self.where = host, staging, where

    @contextmanager
    def slab(self, unit: int, kind: str, read: bool) -> Iterator[torch.Tensor]:
        """This rank's slab (its shard) wherever it lives: the host's, or an NVMe one through a staging-ring
        buffer (read from the store first when `read`, written back after when not)."""
        tier = self.where[(unit, kind)]
        if tier == Home.HOST:
            yield self.host.slab(unit, kind)
        elif tier == Home.GPU:  # a resident unit's: through a host copy
            dev = self.host.slab(unit, kind)
            flat = dev.cpu()  # its current contents: writers may fill only the tensors, not the padding
            yield flat
            if not read:
                dev.copy_(flat)
        else:
            with self.staging.borrowed(unit, kind, read) as buf:
                if not read:  # a ring buffer holds another slab's bytes: a writer that sets only the tensors
                    buf.zero_()  # leaves the padding zero, as AdamW keeps it
                yield buf

    @contextmanager
    def part(self, unit: int, kind: str, read: bool) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset, this rank's part of the unit's slab inside the slab): what checkpoints write and read; one
        rank's is (0, the slab). Set (not `read`): the shard's padding beyond the slab is zeroed, and a master
        set updates the compute-dtype copy."""
        sh = self.shards[unit]
        with self.slab(unit, kind, read) as flat:
            if not read:
                flat[sh.stored :].zero_()
            yield sh.start, flat[: sh.stored]
            if not read and kind == Kind.MASTER:
                self.master_set(unit, flat)

    @contextmanager
    def whole(self, unit: int, read: bool) -> Iterator[torch.Tensor]:
        """The unit's whole fp32 master, every rank's part: gathered from the ranks when `read`; when not, set
        from it on exit (each rank keeps its part, the compute-dtype copy follows). One rank: the slab itself."""
        if self.ranks.size == 1:
            with self.slab(unit, Kind.MASTER, read) as flat:
                yield flat
                if not read:
                    self.master_set(unit, flat)
            return
        sh = self.shards[unit]
        whole = torch.zeros(sh.padded, dtype=torch.float32)
        if read:
            with self.slab(unit, Kind.MASTER, read=True) as part:
                self.ranks.host_gather(part, whole)
        yield whole[: sh.layout.numel]
        if not read:
            with self.slab(unit, Kind.MASTER, read=False) as part:
                part.copy_(whole[sh.start : sh.start + sh.numel])
                self.master_set(unit, part)

    def master_set(self, unit: int, master: torch.Tensor) -> None:
        """The unit's master was set outside the optimizer (init, import, restore): the compute-dtype copy
        follows, on the host or on NVMe."""
        if self.where.get((unit, Kind.WEIGHTS)) == Home.NVME:
            with self.staging.borrowed(unit, Kind.WEIGHTS, read=False) as w:
                w.copy_(master)
        self.host.updated(unit, master)

    def grad_sink(self, unit: int):
        """Where the backward pass drains the unit's gradient (engine.buffers.Accumulators' sink)."""
        if self.where[(unit, Kind.GRAD)] == Home.NVME:
            return self.staging.sink(unit, Kind.GRAD)
        return self.host.slab(unit, Kind.GRAD), None

    # ---- the weights as tensors ------------------------------------------------------------------
    def init_weights(self, std: float, seed: int, pad: int | None = None) -> None:
        """transformers' init: normal(0, std) matrices, unit norms, zero biases (the experts' 2-D ones too), but
        gpt-oss's sinks and router bias normal; the `pad` token's embedding row zero. Each tensor draws from its own
        generator, seeded by (seed, its name): the init does not depend on placement, order, device or ranks."""
        for unit, lay in zip(self.units, self.layouts):
            with self.whole(unit.index, read=False) as flat:
                views = lay.views(flat)
                for t in unit.tensors:
                    v, bias = views[t.name], t.name.endswith("bias")
                    if (len(t.shape) >= 2 and not bias) or t.name.endswith(("sinks", "router.bias")):
                        # the 64 bits manual_seed takes (a seed of 2^64 / 1,000,003 or more wraps around)
                        key = (seed * 1_000_003 + zlib.crc32(t.hf_name.encode())) % 2**64
                        v.normal_(0.0, std, generator=torch.Generator().manual_seed(key))
                    elif bias:
                        v.zero_()
                    else:
                        v.fill_(1.0)
                    if t.name == "embed_tokens.weight" and pad is not None:
                        v[pad % v.shape[0]].zero_()

    def to_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under Hugging Face names (copies)."""
        out = {}
        for unit, lay in zip(self.units, self.layouts):
            with self.whole(unit.index, read=True) as flat:
                views = lay.views(flat)
                out.update({t.hf_name: views[t.name].clone() for t in unit.tensors})
        return out

    def load(self, get) -> None:
        """Sets the master weights, each tensor to `get(hf_name, shape)`: a state dict's, a Hugging Face model's
        (model.hf_read.HFReader.get: streamed tensor by tensor)."""
        for unit, lay in zip(self.units, self.layouts):
            with self.whole(unit.index, read=False) as flat:
                views = lay.views(flat)
                for t in unit.tensors:
                    views[t.name].copy_(get(t.hf_name, t.shape))


def rng_state(device: torch.device) -> dict:
    """torch's generator states (base64): nothing in a step draws random numbers today, but a resumed
    run must continue any that does."""

    def enc(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    out = {"torch": enc(torch.get_rng_state())}
    if device.type == "cuda":
        out["cuda"] = enc(torch.cuda.get_rng_state(device))
    return out


def set_rng_state(state: dict, device: torch.device) -> None:
    def dec(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    torch.set_rng_state(dec(state["torch"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(dec(state["cuda"]), device)
