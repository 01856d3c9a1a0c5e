"""The planner's values: what is trained (Job), the budgets it is planned within (Budgets), what a plan decides
(Choice), and its answer, frozen: a Plan (the RunPlan a run obeys, the Memory of every tier, the Prediction of
every link, and what a report adds: Report), or a Miss (the budget that falls short, and the memory as far as the
plan got). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from types import MappingProxyType
from typing import Mapping

from ..model.spec import ModelSpec
from ..modes import Activations, Dtype, Home, Kind, Stream, Update
from .runplan import RunPlan

EMPTY: Mapping = MappingProxyType({})


def frozen(d: dict) -> Mapping:
    """A read-only view of `d`, for a frozen value's tables."""
    return MappingProxyType(dict(d))


def _table():
    """A table field, empty by default."""
    return field(default_factory=lambda: EMPTY)


@dataclass(frozen=True)
class Job:
    """What is trained, and on how many ranks: what every choice of a plan shares."""

    spec: ModelSpec
    batch: int  # sequences per step, over every rank
    seq_len: int
    dtype: Dtype = "bfloat16"  # the compute dtype
    activation_dtype: Dtype = "float32"  # the activation checkpoints'
    clipping: bool = True  # the global norm is clipped: a speculative update writes copies
    gpus: int = 1  # ranks, one GPU each: each holds 1/gpus of the state and takes 1/gpus of the batch's rows
    per_host: int = 0  # of them on each host, sharing its RAM, cores, DRAM bandwidth and disk; 0: all on one
    name: str = "model"
    segmented: bool = False  # rows of several segments (documents, packed samples), attended to apart

    @property
    def rows(self) -> int:
        """Rows of each step's batch one rank takes."""
        return self.batch // self.gpus

    @property
    def ranks_per_host(self) -> int:
        return self.per_host or self.gpus


@dataclass(frozen=True)
class Budgets:
    host_gb: float | None = None  # the process's whole host memory, its own included; None: the machine's RAM
    gpu_gb: float | None = None  # None: the GPU's memory
    nvme_gb: float | None = None  # None: no NVMe tier; 0 is also none
    resident_gb: float | str = (
        0.0  # GPU memory for the whole state of the first units; "auto": what the plan leaves
    )


@dataclass(frozen=True)
class Choice:
    """What a plan decides, each fixed (by the config, a test, a report's variant) or None: the search decides."""

    micro: int | None = None  # rows of a rank's batch per forward and backward pass
    stream: Stream | None = None
    activations: Activations | None = None  # None: the GPU or the host, or a split where neither holds them
    gpu_updates: int | None = None  # units updated on the GPU (the first of update_candidates)
    speculate: int | None = None  # units the host updates from RAM in the backward pass
    speculate_gpu: bool | None = None  # the GPU updates run in the backward pass too
    keep: int | None = None  # blocks that keep their activations; None: as many as the GPU memory left holds
    tile: int | None = (
        None  # tokens per tile of a block; None: TILE where the untiled MLP would take too much
    )
    attention: str | None = None  # the attention's kernel; None: the fastest measured (plan.attention.choose)
    deterministic: bool = False  # the attention's backward pass deterministic (train.deterministic)
    groups: int | None = (
        None  # expert groups of a block with experts (model/parts.py); None: 1, or as few as fit
    )
    spill: str | None = None  # what spills first (modes.SpillFirst); None: moments, or gradients where faster
    # blocks whose attention outputs stay on the GPU for their recompute; None: as many as the GPU memory left holds
    keep_attention: int | None = None


class Short(Enum):
    """The budget a miss falls short of."""

    GPU = "GPU"
    HOST = "host"  # the state in RAM, with no NVMe tier to spill to
    RING = "ring"  # host memory, all it can spill spilled: not even a spilled run's buffers fit
    COPIES = "copies"  # host memory for the speculative update's copies
    NVME = "NVMe"


@dataclass(frozen=True)
class GpuMemory:
    """One rank's GPU bytes, part by part (`table`: in a user's words)."""

    resident: float  # the whole state of the resident units
    slots: float  # the blocks' two weight slots
    own: float  # the embedding's and the head's weight buffers
    staging: float  # the fp32 stage an fp32 master streams through, to be cast
    grads: float  # the fp32 gradient accumulators
    activation_grads: float  # the gradient of a block's output, of every micro-batch
    working: float  # a block's working set in its backward pass
    checkpoints: float | None = (
        None  # the activation checkpoints the GPU holds at once (None: not placed yet)
    )
    kept: float | None = None  # the kept blocks' activations (None: none kept)
    sets: float | None = None  # the GPU updates' two state sets (None: not placed yet)
    kept_attention: float | None = None  # the attention outputs kept for the recompute (None: none kept)

    NAMES = {
        "resident": "resident units' state",
        "slots": "weight slots",
        "own": "embedding + head",
        "staging": "fp32 staging",
        "grads": "grad accumulators",
        "activation_grads": "activation grads",
        "working": "working set",
        "checkpoints": "checkpoints",
        "kept": "kept activations",
        "sets": "GPU update sets",
        "kept_attention": "kept attention outputs",
    }

    @property
    def total(self) -> float:
        return sum(v for v in self.table().values())

    def table(self) -> dict[str, float]:
        """{part in a user's words: bytes}, in the order of the report (the parts not placed left out)."""
        return {
            self.NAMES[f.name]: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) is not None
        }


@dataclass(frozen=True)
class Memory:
    """One rank's bytes on every tier, as far as the plan got (a miss stops part way), and the disk traffic its
    placement implies."""

    gpu: GpuMemory
    # home -> blocks whose checkpoint lives there (kept blocks counted)
    checkpoints: Mapping[Home, int] = _table()
    kept: int = 0  # the last blocks, whose activations stay on the GPU for the backward pass (no recompute)
    kept_checkpoints: int = 0  # GPU bytes of the checkpoints the kept blocks do without
    # the last recomputed blocks (of those whose attention is causal over the whole row) whose attention outputs
    # stay on the GPU for the backward pass: their recompute runs no attention
    kept_attention: int = 0
    host: Mapping[Kind, int] = _table()  # kind -> bytes of state slabs in RAM (whole pages)
    nvme: Mapping[Kind, int] = _table()  # kind -> bytes of state slabs on NVMe
    placement: Mapping[Kind, Mapping[Home, int]] = _table()  # kind -> {Home.HOST: units, Home.NVME: units}
    ring: int = 0  # the staging ring
    host_checkpoints: int = 0  # activation checkpoints in RAM, and the ring of those on NVMe
    process: float = (
        0.0  # the process itself (Python, torch, the CUDA context): part of --host-gb; 0: not placed
    )
    copies: int = 0  # the speculative updates' copies of master and moments
    nvme_checkpoints: int = 0  # disk bytes of the activation checkpoints on NVMe
    nvme_bwd_reads: int = 0  # bytes of streamed weights the backward pass reads from NVMe
    nvme_ahead: int = 0  # of the update's disk reads, the bytes read ahead as the backward pass starts
    # a spilled gradient written as the norm comes, then read: the update waits (placement.late_gradient_bytes)
    nvme_late: int = 0

    def host_fixed(self) -> dict[str, float]:
        """The host's bytes beside the state slabs, in a user's words ("update copies" where any; none before the
        host's memory is placed)."""
        if not self.process:
            return {}
        fixed = {
            "staging ring": self.ring,
            "host checkpoints": self.host_checkpoints,
            "process": self.process,
        }
        return fixed | ({"update copies": self.copies} if self.copies else {})

    @property
    def host_total(self) -> float:
        return sum(self.host.values()) + sum(self.host_fixed().values())


@dataclass(frozen=True)
class Prediction:
    """The cost model's step: seconds per link, the step, what limits it, its rates."""

    times: Mapping[str, float]  # link -> seconds
    step_s: float
    clipped_times: Mapping[str, float]  # the same while the global norm clips: nothing speculates
    clipped_step_s: float
    bottleneck: str
    tokens_per_s: float
    model_tflops: float


@dataclass(frozen=True)
class Report:
    """What a capacity report adds to a plan (advice.explain)."""

    advice: tuple[str, ...] = ()
    largest_layers: int = 0
    largest_params: int = 0
    longest_seq_len: int = 0  # the longest sequence (batch 1) that fits these budgets
    # the budgets the next longer one misses: "GPU", "host", "NVMe", comma-separated; or "positions": the model's
    # max_position_embeddings, shorter than what the budgets hold
    longest_bound: str = ""
    least_host: float = 0.0  # with an NVMe tier: the least host budget this choice could run in (bytes)
    longest_budgets: int = (
        0  # the longest sequence (batch 1) the budgets hold, whatever the model's positions
    )


@dataclass(frozen=True)
class Plan:
    """A choice that fits: the RunPlan a run obeys, one rank's memory, the prediction, and what a report adds."""

    job: Job
    run_plan: RunPlan
    memory: Memory
    prediction: Prediction
    hardware: str  # what the figures are (HardwareSpec.source)
    per_host: int = 1  # ranks sharing a host's RAM, cores, DRAM bandwidth and disk; budgets are per host
    report: Report = Report()

    fits = True
    why = "fits"

    @property
    def least_host(self) -> float:
        return self.report.least_host

    def count(self, *updates: Update) -> int:
        return self.run_plan.count(*updates)


@dataclass(frozen=True)
class Near:
    """A plan that fits where one did not: the `tiertrain plan` arguments to add to the same command, in words, and
    its prediction."""

    args: tuple[str, ...]
    what: str
    step_s: float
    tokens_per_s: float


@dataclass(frozen=True)
class Miss:
    """A choice that does not fit: the budget it falls short of and why, by how much (`need` against `have`), the
    least host budget that would do where that is what is short, and the memory as far as the plan got. Host bytes
    are in --host-gb's terms: the process's own included."""

    job: Job
    run_plan: RunPlan  # the choices, no units
    short: Short
    why: str
    memory: Memory
    hardware: str
    per_host: int = 1
    least_host: float = 0.0
    need: float = (
        0.0  # bytes the short budget would have to hold (the host's for host memory); 0: not counted
    )
    have: float = 0.0  # bytes it holds (GPU: its usable part)
    # budget -> (bytes needed as far as the plan got, bytes it holds): "GPU", "host", "NVMe" (where one is given)
    demand: Mapping[str, tuple[float, float]] = _table()
    nearest: tuple[Near, ...] = ()  # the nearest plans that fit (nearest.nearest; the report's)

    fits = False
