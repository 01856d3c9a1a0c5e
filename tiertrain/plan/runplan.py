"""RunPlan: what happens to every unit of a run, as data. The planner writes one entry per unit into its plan
(`tiertrain plan --format json`); the runtime obeys the plan's RunPlan (Plan.run_plan) and writes it to
`<out>/plan.json`. Pure Python.

A unit's `update` says where and when its AdamW runs:
  host             on the host, after the global norm, beside the next forward pass
  host-speculated  on the host, started in the backward pass as if the norm will not clip (kept or redone)
  gpu              on the GPU as its weights load in the next forward pass (its state crosses PCIe)
  gpu-speculated   on the GPU in the backward pass, as its gradient is accumulated (kept or redone)
  resident         on the GPU, where its whole state lives
Its `homes` say where each kind of its state lives: gpu (resident units), host (RAM) or nvme (the disk tier).
Its `recompute` says how its backward pass gets its activations: true, by running its forward pass again from
its checkpoint (the block's input); false, kept on the GPU from the forward pass (a block only).
Its `checkpoint` says where a recomputed block's checkpoint waits for the backward pass: gpu, host (pinned RAM)
or nvme (the disk tier, through a ring of pinned buffers); "" for the embedding, the head and kept blocks.
Its `attention_kept` says whether a recomputed block's attention outputs (and their log-sum-exps) stay on the GPU
from the forward pass, so that the recompute runs no attention (model/attention.Kept).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from ..modes import Activations, Dtype, Home, Kind, SpillFirst, Stream, Update, by_value
from ..tiers.placement import kind_bytes

WIDTH = {"float32": 4, "bfloat16": 2}  # bytes per element of a dtype


@dataclass(frozen=True)
class UnitPlan:
    index: int
    name: str
    update: Update
    homes: tuple[tuple[Kind, Home], ...]  # (kind, home) for every kind of slab the run keeps
    recompute: bool = True  # false: the block's activations are kept on the GPU for its backward pass
    checkpoint: Home | str = ""  # where the block's checkpoint lives; "": it has none
    attention_kept: bool = False  # its attention outputs stay on the GPU for its recompute, which skips them

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "name": self.name,
            "update": self.update,
            "homes": {k.value: h.value for k, h in self.homes},
            "recompute": self.recompute,
            "checkpoint": self.checkpoint.value if self.checkpoint else "",
            "attention_kept": self.attention_kept,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "UnitPlan":
        homes = tuple((Kind(k), Home(h)) for k, h in d["homes"].items())
        return cls(
            d["index"],
            d["name"],
            Update(d["update"]),
            homes,
            d.get("recompute", True),
            Home(d["checkpoint"]) if d.get("checkpoint") else "",
            d.get("attention_kept", False),
        )


@dataclass(frozen=True)
class RunPlan:
    """The run-wide choices and one UnitPlan per unit, in unit order (none in a plan that does not fit)."""

    micro_batch: int
    stream: Stream  # "compute": a compute-dtype copy streams; "master": the fp32 master, cast on the GPU
    activations: Activations  # the checkpoints' home, or "split" (each unit's entry says)
    resident_gb: float  # GPU memory for the whole state of the first units (their update: "resident")
    units: tuple[UnitPlan, ...] = ()
    tile: int = 0  # tokens per tile of a block's token-wise parts (model/tiled.py); 0: untiled
    activation_dtype: Dtype = "float32"  # the activation checkpoints' dtype
    gpus: int = 1  # ranks: each takes batch / gpus rows of every batch and holds 1/gpus of every slab (homes: its shard's)
    compute_dtype: Dtype = "bfloat16"  # the matmuls', and the streamed weights' where a copy streams
    numels: tuple[int, ...] = ()  # elements of each unit's slabs: this rank's shard (tiers.slab.Shard)
    rows: int = 0  # rows of each batch this rank takes
    row_numel: int = 0  # elements of one row's activation checkpoint of a block (seq_len x hidden)
    # the causal attention's kernel (modes.Attention, model/attention.py); "": torch's own choice (a CPU, fp32)
    attention: str = ""
    deterministic: bool = False  # the attention's backward pass runs deterministically (train.deterministic)
    ck_pieces: int = (
        0  # pieces the NVMe checkpoints' writer has in flight: its ring's size, where any are there
    )
    # a block with experts goes to the GPU as its attention part, then this many expert groups (model/parts.py)
    expert_groups: int = 1
    # what spills to NVMe first (tiers.placement.SPILL_ORDERS); the units' homes say where each slab lives
    spill_first: SpillFirst = "moments"

    @property
    def activation_width(self) -> int:
        """Bytes per element of an activation checkpoint."""
        return WIDTH[self.activation_dtype]

    @property
    def compute_width(self) -> int:
        """Bytes per element of the compute dtype."""
        return WIDTH[self.compute_dtype]

    def kind_bytes(self) -> dict[Kind, int]:
        """Bytes per parameter of each kind of slab the run keeps."""
        return kind_bytes(self.compute_dtype, self.stream)

    def checkpoint_bytes(self, rows: int) -> int:
        """Bytes of a block's activation checkpoint for `rows` rows."""
        return rows * self.row_numel * self.activation_width

    def checkpoints(self, home: Home | None = None) -> dict[int, Home]:
        """{block: its checkpoint's home} of the blocks that have one (only those at `home`, if given)."""
        return {u.index: u.checkpoint for u in self.units if u.checkpoint and home in (None, u.checkpoint)}

    def where(self) -> dict[tuple[int, Kind], Home]:
        """{(unit, kind): home}: the placement the tiers obey."""
        return {(u.index, k): home for u in self.units for k, home in u.homes}

    def kept(self) -> frozenset[int]:
        """The blocks whose activations stay on the GPU for the backward pass (not recomputed)."""
        return frozenset(u.index for u in self.units if not u.recompute)

    def attention_kept(self) -> frozenset[int]:
        """The blocks whose recompute replays the attention outputs kept from their forward pass."""
        return frozenset(u.index for u in self.units if u.attention_kept)

    def count(self, *updates: Update) -> int:
        """How many units take one of `updates`."""
        return sum(u.update in updates for u in self.units)

    def updated(self, *updates: str) -> frozenset[int]:
        """The units whose update is one of `updates`."""
        return frozenset(u.index for u in self.units if u.update in updates)

    def with_updates(self, updates: dict[int, Update | str]) -> "RunPlan":
        """This plan with the updates of some units replaced (a test's, or a user's own choice), checked against
        where each unit's state lives: a unit updated on the GPU or speculated on the host has every slab in
        host RAM (and a GPU update makes the weights from the fp32 master: no compute-dtype copy); "resident"
        follows the homes, it is not chosen here; GPU updates speculate all or none."""
        units = list(self.units)
        for i, update in updates.items():
            u = units[i]
            homes = {h for _, h in u.homes}
            ok = update in list(Update) and (update == Update.RESIDENT) == (homes == {Home.GPU})
            if update in (Update.GPU, Update.GPU_SPECULATED, Update.HOST_SPECULATED):
                ok = ok and homes == {Home.HOST}
            if update in (Update.GPU, Update.GPU_SPECULATED):
                ok = ok and Kind.WEIGHTS not in dict(u.homes)
            if update in (Update.GPU, Update.GPU_SPECULATED, Update.RESIDENT):
                ok = ok and self.expert_groups == 1  # a block in parts is updated on the host
            if not ok:
                raise ValueError(
                    f"unit {i} ({u.name}) cannot take update {update!r} with its state in {dict(u.homes)}"
                )
            units[i] = replace(u, update=Update(update))
        if {Update.GPU, Update.GPU_SPECULATED} <= {u.update for u in units}:
            raise ValueError("GPU updates speculate all or none: give every GPU-updated unit the same update")
        return replace(self, units=tuple(units))

    def to_dict(self) -> dict:
        return {
            "micro_batch": self.micro_batch,
            "stream": self.stream,
            "activations": self.activations,
            "resident_gb": self.resident_gb,
            "tile": self.tile,
            "checkpoint_dtype": self.activation_dtype,
            "gpus": self.gpus,
            "compute_dtype": self.compute_dtype,
            "attention": self.attention,
            "deterministic": self.deterministic,
            "checkpoint_pieces": self.ck_pieces,
            "expert_groups": self.expert_groups,
            "spill_first": self.spill_first,
            "units": [u.to_dict() for u in self.units],
        }


def unit_plans(
    names: list[str],
    where: dict[tuple[int, str], str],
    resident: Iterable[int],
    gpu: Iterable[int],
    gpu_speculated: bool,
    host_speculated: Iterable[int],
    kept: Iterable[int] = (),
    checkpoints: dict[int, str] | None = None,
    attention_kept: Iterable[int] = (),
) -> tuple[UnitPlan, ...]:
    """The entries of units `names` from a placement, the sets of units each update mode takes, the blocks
    whose activations are kept, the home of each block's checkpoint and the blocks whose attention outputs are."""
    resident, gpu, early, kept = set(resident), set(gpu), set(host_speculated), set(kept)
    outs = set(attention_kept)
    checkpoints = checkpoints or {}
    kinds_of: dict[int, list[str]] = {}  # by unit, in one pass: a search plans thousands of units many times
    for v, k in where:
        kinds_of.setdefault(v, []).append(k)
    out = []
    for u, name in enumerate(names):
        kinds = by_value(kinds_of.get(u, ()))
        homes = tuple((Kind(k), Home.GPU if u in resident else Home(where[(u, k)])) for k in kinds)
        update = (
            Update.RESIDENT
            if u in resident
            else (Update.GPU_SPECULATED if gpu_speculated else Update.GPU)
            if u in gpu
            else Update.HOST_SPECULATED
            if u in early
            else Update.HOST
        )
        checkpoint = Home(checkpoints[u]) if u in checkpoints else ""
        out.append(UnitPlan(u, name, update, homes, u not in kept, checkpoint, u in outs))
    return tuple(out)
