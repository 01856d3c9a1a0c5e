"""The names the planner and the runtime share: slab kinds and homes as plain enums (a member never equals a
string: a name written as a string where a member belongs is found by the tests; `.value` at the JSON boundary:
plan.json, checkpoints, the NVMe store's arrays), update modes as a string enum, and the config's string modes as
Literal types. Pure Python."""

from __future__ import annotations

from enum import Enum, StrEnum
from typing import Literal, get_args


class Kind(Enum):
    """A kind of slab: one flat buffer per unit and kind (tiers.slab)."""

    WEIGHTS = "weights"  # the compute-dtype copy that streams (tiers.stream = "compute")
    MASTER = "master"  # fp32 master weights
    EXP_AVG = "exp_avg"  # Adam's first moment
    EXP_AVG_SQ = "exp_avg_sq"  # Adam's second moment
    GRAD = "grad"  # the fp32 gradient

    # members are singletons that equal only themselves: identity's hash, in C (Enum's hashes the name in
    # Python, and the planner looks slabs up by kind millions of times a plan)
    __hash__ = object.__hash__


# the optimizer's state: what a checkpoint keeps, a speculative update copies and a GPU update writes back
STATE = (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ)


class Home(Enum):
    """Where a slab or an activation checkpoint lives."""

    GPU = "gpu"
    HOST = "host"  # pinned RAM
    NVME = "nvme"  # the disk tier

    __hash__ = object.__hash__  # as Kind's


class Update(StrEnum):
    """Where and when a unit's AdamW runs (plan.runplan says each)."""

    HOST = "host"
    HOST_SPECULATED = "host-speculated"
    GPU = "gpu"
    GPU_SPECULATED = "gpu-speculated"
    RESIDENT = "resident"


Dtype = Literal["bfloat16", "float32"]
# what carries the weights to the GPU: a compute-dtype copy, or the master
Stream = Literal["compute", "master"]
Activations = Literal["gpu", "host", "nvme", "split"]  # the checkpoints' home; "split": each block's own
# which state spills to NVMe first when the host budget is short (tiers.placement.SPILL_ORDERS): the Adam moments
# (read and written once a step, after the norm), or the gradients (written in the backward pass, read once after it)
SpillFirst = Literal["moments", "gradients"]
# the causal attention's kernel (model/attention.py): SDPA's cuDNN, flash, memory-efficient or math backend, or the
# FlashAttention package's; "" in a RunPlan: torch's own choice (a CPU, or fp32 compute)
Attention = Literal["cudnn", "flash", "efficient", "math", "flash_attn"]
ATTENTION_KERNELS: tuple[str, ...] = get_args(Attention)
# those with a deterministic backward pass (flash and efficient under torch's deterministic mode, FlashAttention's
# deterministic flag; math has no atomics); torch's cuDNN attention has none: torch refuses it in that mode
DETERMINISTIC_KERNELS = frozenset({"flash", "efficient", "math", "flash_attn"})
BF16_ONLY_KERNELS = frozenset({"cudnn", "flash", "flash_attn"})  # no fp32 kernel
# those whose own forward returns the log-sum-exp its own backward takes: a block's attention output can be kept
# from its forward pass for its recompute (model/attention.Kept); on a CPU, torch's choice (its flash kernel) too
KEEPING_KERNELS = frozenset({"cudnn", "flash"})


def by_value(members) -> list:
    """Enum members in the order of their values (plain enums do not sort)."""
    return sorted(members, key=lambda m: m.value)
