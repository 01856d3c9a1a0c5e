"""The planner's values: what is trained (Job), the budgets it is planned within (Budgets), what a plan decides
(Choice), and its answer (Plan, which holds the RunPlan a run obeys). Pure Python."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..model.spec import ModelSpec
from ..modes import Activations, Dtype, Stream
from .runplan import RunPlan


@dataclass(frozen=True)
class Job:
    """What is trained, and on how many ranks: what every choice of a plan shares."""
    spec: ModelSpec
    batch: int  # sequences per step, over every rank
    seq_len: int
    dtype: Dtype = "bfloat16"  # the compute dtype
    checkpoint_dtype: Dtype = "float32"  # the activation checkpoints'
    clipping: bool = True  # the global norm is clipped: a speculative update writes copies
    gpus: int = 1  # ranks, one GPU each: each holds 1/gpus of the state and takes 1/gpus of the batch's rows
    per_host: int = 0  # of them on each host, sharing its RAM, cores, DRAM bandwidth and disk; 0: all on one
    name: str = "model"

    @property
    def rows(self) -> int:
        """Rows of each step's batch one rank takes."""
        return self.batch // self.gpus

    @property
    def ranks_per_host(self) -> int:
        return self.per_host or self.gpus


@dataclass
class Budgets:
    host_gb: float | None = None  # None: the machine's RAM less the process
    gpu_gb: float | None = None  # None: the GPU's memory
    nvme_gb: float | None = None  # None: no NVMe tier; 0 is also none
    resident_gb: float | str = 0.0  # GPU memory for the whole state of the first units; "auto": what the plan leaves


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
    tile: int | None = None  # tokens per tile of a block; None: TILE where the untiled MLP would take too much


@dataclass
class Plan:
    """One choice's plan: whether it fits (else why, and the budget it is short of), the memory of every tier,
    the time of every link, and the RunPlan a run obeys (its units once it fits)."""
    model: str
    params: int
    batch: int
    seq_len: int
    run_plan: RunPlan
    gpu_updates: int = 0  # units updated on the GPU as they stream in (the first of update_candidates)
    kept: int = 0  # the last blocks, whose activations stay on the GPU for the backward pass (no recompute)
    kept_checkpoints: int = 0  # GPU bytes of the checkpoints the kept blocks do without
    checkpoints: dict = field(default_factory=dict)  # home -> blocks whose checkpoint lives there
    nvme_ahead: int = 0  # of the update's disk reads, the bytes read ahead as the backward pass starts
    speculated: int = 0  # units the host updates from RAM in the backward pass (alternate_from_last)
    gpu_speculated: bool = False  # the GPU updates run in the backward pass too (speculated, on the GPU)
    clipping: bool = True  # the global norm is clipped: a speculative update writes copies
    fits: bool = False
    why: str = ""
    short_of: str = ""  # a miss's budget: "GPU", "host", "ring" (host, all it can spill spilled), "copies", "NVMe"
    host_bytes: dict = field(default_factory=dict)  # kind -> bytes on the host (as allocated)
    nvme_bytes: dict = field(default_factory=dict)
    nvme_bwd_reads: int = 0  # bytes of streamed weights the backward pass reads from NVMe
    nvme_checkpoints: int = 0  # disk bytes of the activation checkpoints on NVMe
    least_host: float = 0.0  # with an NVMe tier: the least host budget this choice could run in (bytes)
    placement: dict = field(default_factory=dict)  # kind -> {"host": units, "nvme": units}
    host_fixed: dict = field(default_factory=dict)  # ring, host checkpoints, process
    gpu: dict = field(default_factory=dict)  # part -> bytes
    times: dict = field(default_factory=dict)  # link -> seconds
    step_s: float = math.inf
    # the same plan while the global norm clips: nothing speculates (a step after a clipped one does not)
    clipped_times: dict = field(default_factory=dict)
    clipped_step_s: float = math.inf
    bottleneck: str = ""
    tokens_per_s: float = 0.0
    model_tflops: float = 0.0
    advice: list = field(default_factory=list)
    largest_layers: int = 0
    largest_params: int = 0
    longest_seq_len: int = 0  # the longest sequence (batch 1) that fits these budgets (the report's)
    longest_bound: str = ""  # the budgets the next longer one misses: "GPU", "host", "NVMe", comma-separated
    hardware: str = ""
    gpus_per_host: int = 1  # ranks sharing a host's RAM, cores, DRAM bandwidth and disk; budgets are per host

    @property
    def rows(self) -> int:
        """Rows of each step's batch one rank takes."""
        return self.batch // self.run_plan.gpus

    @property
    def host_total(self) -> float:
        return sum(self.host_bytes.values()) + sum(self.host_fixed.values())

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu.values())
