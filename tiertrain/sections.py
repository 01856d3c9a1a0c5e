"""The run configuration's sections: one dataclass per TOML section ([data], [train], [optim], [tiers],
[checkpoint]; [model] is model.spec.ModelSpec), one comment line per field, modes as Literal types, and each
section's validate(). Every message raised here is one line that names the key and how to fix it."""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, field

from .errors import ConfigError
from .modes import ATTENTION_KERNELS, BF16_ONLY_KERNELS, DETERMINISTIC_KERNELS, Attention, Dtype, SpillFirst

AUTO = "auto"  # the one spelling of "the plan decides"
MOST_GB = 1e7  # 10 PB: a budget beyond it is a typo, and overflows the plan's arithmetic
Auto = typing.Literal["auto"]
Device = typing.Literal["auto", "cpu", "cuda"]
Schedule = typing.Literal["constant", "cosine"]
HostKernel = typing.Literal["auto", "tiertrain", "torch"]
StreamSetting = typing.Literal["auto", "compute", "master"]
Places = typing.Literal["auto", "gpu", "host", "nvme"]
IoBackend = typing.Literal["auto", "posix", "kvikio"]
SavedState = typing.Literal["full", "weights"]
SPILL_FIRSTS = (AUTO, *typing.get_args(SpillFirst))
AttentionSetting = Attention | Auto
ATTENTIONS = (AUTO, *ATTENTION_KERNELS)
DTYPES, DEVICES, SCHEDULES, HOST_KERNELS, STREAMS, PLACES, IO_BACKENDS, SAVED_STATES = (
    typing.get_args(t)
    for t in (Dtype, Device, Schedule, HostKernel, StreamSetting, Places, IoBackend, SavedState)
)


@dataclass
class DataConfig:
    path: str = ""  # token file (.npy or .bin); empty: the built-in corpus
    shuffle: bool = True
    val_path: str = ""  # a held-out token file for the validation loss
    val_fraction: float = (
        0.0  # or this fraction of the training file's rows (its last), held out from training
    )
    # positions restart at each document of a stream (prepare's end-of-text boundaries) and attention stays within
    # it; a file of samples (prepare --chat) always keeps them apart
    document_mask: bool = False

    def validate(self) -> None:  # the files themselves are checked when they are opened
        _need(
            0 <= self.val_fraction < 1, "data", "val_fraction", self, "must be in [0, 1): 0 holds out nothing"
        )
        _need(
            not (self.val_path and self.val_fraction),
            "data",
            "val_fraction",
            self,
            "and data.val_path are two sources of validation data: set one",
        )


@dataclass
class TrainConfig:
    steps: int = 100
    batch_size: int = 16  # sequences per optimizer step
    micro_batch_size: int | Auto = 8  # sequences per forward/backward; "auto": the plan's
    seq_len: int = 256
    compute_dtype: Dtype = "bfloat16"
    seed: int = 0
    device: Device = "auto"
    log_every: int = 10
    loss_chunk_tokens: int | Auto = (
        "auto"  # tokens per cross-entropy chunk; "auto": a chunk's logits near 64 MiB
    )
    overlap: bool = True  # host optimizer overlaps the next forward pass; false: each step waits for it
    init_from: str = (
        ""  # a local Hugging Face model directory: its config.json replaces [model] (but config.LIFTED's --set
        # values: positions, rope, the routers' loss), its weights the init
    )
    eval_every: int = (
        0  # steps between validation losses (with data.val_path or val_fraction); 0: at the end only
    )
    eval_batches: int = 8  # batches of train.batch_size sequences per validation loss (the first, unshuffled)
    tensorboard: bool = (
        False  # also write metrics.jsonl's numbers as TensorBoard scalars under <out>/tensorboard
    )
    # the last N blocks keep their activations on the GPU for the backward pass instead of recomputing their
    # forward pass from a checkpoint; "auto": as many as the GPU memory the plan leaves holds (none on a CPU)
    keep_activations: int | Auto = "auto"
    # the last recomputed blocks whose attention outputs (and log-sum-exps) stay on the GPU from the forward pass, so
    # that their recompute runs no attention (those whose attention is causal over the whole row, with cuDNN's or
    # flash's kernel and rows of one sample); "auto": where the plan tiles the blocks, as many as the GPU memory it
    # leaves holds
    keep_attention: int | Auto = "auto"
    # tokens per tile of a block (model/tiled.py: norms, projections and MLP over tiles of the sequence, the
    # attention a head group at a time); "auto": the plan's (tiles of 8192 tokens where the untiled MLP's working
    # set would take over an eighth of the GPU memory); 0: off
    tile_tokens: int | Auto = "auto"
    # the causal attention's kernel (model/attention.py): "cudnn", "flash", "efficient", "math" (SDPA's backends) or
    # "flash_attn" (the FlashAttention package, where it is installed); "auto": the plan's, the fastest the probe
    # measured of those that run this model here (with no probe file: cuDNN's on Hopper, flash elsewhere)
    attention: AttentionSetting = "auto"
    # true: a GPU run gives the same bits run to run: the attention's backward pass runs deterministically (flash
    # and efficient under torch's deterministic mode; "auto" never takes cuDNN's, whose dQ is not deterministic)
    deterministic: bool = False

    def validate(self) -> None:
        for key in ("steps", "batch_size", "seq_len", "log_every", "eval_batches"):
            _need(getattr(self, key) > 0, "train", key, self, "must be a positive integer")
        _need(self.eval_every >= 0, "train", "eval_every", self, "must be 0 (at the end only) or positive")
        _need(
            _auto_or(self.micro_batch_size, 1),
            "train",
            "micro_batch_size",
            self,
            'must be "auto" (the plan chooses) or a positive integer',
        )
        _need(
            _auto_or(self.loss_chunk_tokens, 1),
            "train",
            "loss_chunk_tokens",
            self,
            'must be "auto" or a positive integer',
        )
        _need(
            _auto_or(self.keep_activations, 0),
            "train",
            "keep_activations",
            self,
            'must be "auto" (the plan chooses), 0 (recompute every block) or a number of blocks',
        )
        _need(
            _auto_or(self.keep_attention, 0),
            "train",
            "keep_attention",
            self,
            'must be "auto" (the plan chooses), 0 (recompute every attention) or a number of blocks',
        )
        _need(
            _auto_or(self.tile_tokens, 0),
            "train",
            "tile_tokens",
            self,
            'must be "auto" (the plan chooses), 0 (no tiling) or a number of tokens',
        )
        _need(self.seed >= 0, "train", "seed", self, "must be a non-negative integer")
        _need(self.compute_dtype in DTYPES, "train", "compute_dtype", self, f"must be one of {_q(DTYPES)}")
        _need(self.device in DEVICES, "train", "device", self, f"must be one of {_q(DEVICES)}")
        _need(self.attention in ATTENTIONS, "train", "attention", self, f"must be one of {_q(ATTENTIONS)}")
        _need(
            not self.deterministic or self.attention in (AUTO, *DETERMINISTIC_KERNELS),
            "train",
            "attention",
            self,
            "has no deterministic backward pass (its dQ is not, and torch refuses it in deterministic mode) and "
            'train.deterministic is true: set train.attention = "auto" or "flash", or train.deterministic = false',
        )
        _need(
            self.compute_dtype == "bfloat16" or self.attention not in BF16_ONLY_KERNELS,
            "train",
            "attention",
            self,
            f"runs bfloat16 only and train.compute_dtype is {self.compute_dtype!r}: set train.attention = "
            '"auto" (or "efficient", "math"), or train.compute_dtype = "bfloat16"',
        )
        _need(
            self.micro_batch_size == AUTO or self.batch_size % self.micro_batch_size == 0,
            "train",
            "batch_size",
            self,
            f"must be a multiple of train.micro_batch_size ({self.micro_batch_size})",
        )


@dataclass
class OptimConfig:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled, on tensors of 2 or more dimensions only
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    schedule: Schedule = "cosine"
    warmup_steps: int = 0
    min_lr: float = 0.0
    # the last N units the host updates from RAM start their update in the backward pass, as soon as their
    # gradient is on the host, as if the global norm will not clip (in place when clipping is off; else into
    # a second copy of their master and moments, 12 B/param more host memory, kept when the norm does not
    # clip and redone when it does); "auto": the plan's number (none on a CPU); 0: none
    speculate_units: int | Auto = "auto"
    # true: the units updated on the GPU (tiers.gpu_update_units) are speculated too, on the GPU in the backward
    # pass as their gradients are accumulated (their state crosses PCIe there instead of in the next forward
    # pass; into host copies of their master and moments when clipping is on); "auto": the plan's choice
    # (false on a CPU); false: they update as their weights load in the forward pass
    speculate_gpu_updates: bool | Auto = "auto"
    # the host AdamW's kernel: "tiertrain" (tiertrain/optim/csrc/adamw.cpp, one pass, also into a speculative
    # update's copies; built on first use: a C++ compiler and ninja), "torch" (torch's fused kernel, in place:
    # an update into copies copies first), "auto" (tiertrain's when it builds)
    host_kernel: HostKernel = "auto"

    def validate(self) -> None:
        _need(self.lr > 0, "optim", "lr", self, "must be positive")
        _need(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optim",
            "betas",
            self,
            "must be two numbers in [0, 1), e.g. [0.9, 0.95]",
        )
        _need(self.eps > 0, "optim", "eps", self, "must be positive")
        _need(self.weight_decay >= 0, "optim", "weight_decay", self, "must be 0 or positive")
        _need(self.grad_clip >= 0, "optim", "grad_clip", self, "must be 0 (off) or positive")
        _need(
            _auto_or(self.speculate_units, 0),
            "optim",
            "speculate_units",
            self,
            'must be "auto" (the plan chooses), 0 (none) or a number of units',
        )
        _need(
            self.host_kernel in HOST_KERNELS,
            "optim",
            "host_kernel",
            self,
            f"must be one of {_q(HOST_KERNELS)}",
        )
        _need(self.schedule in SCHEDULES, "optim", "schedule", self, f"must be one of {_q(SCHEDULES)}")
        _need(self.warmup_steps >= 0, "optim", "warmup_steps", self, "must be 0 or positive")
        _need(
            0 <= self.min_lr <= self.lr,
            "optim",
            "min_lr",
            self,
            f"must be between 0 and optim.lr ({self.lr})",
        )


@dataclass
class TiersConfig:
    # "auto" (both): the plan's choice (on a CPU, whose memory is the host's, checkpoints stay on the "gpu")
    # "compute": host keeps a compute-dtype copy to stream; "master": stream fp32, cast on GPU
    stream: StreamSetting = "auto"
    # where activation checkpoints live: "gpu", "host" (pinned, copied on side streams) or "nvme" (the NVMe tier,
    # through a ring of pinned buffers); "auto": the plan's, split across the three when no one of them holds all
    activations: Places = "auto"
    # the dtype activation checkpoints are kept in: "float32" (the residual stream's own) or "bfloat16" (half the
    # bytes on every tier and link; each block computes from its input rounded, the residual stream kept fp32);
    # either way the recompute repeats the forward pass exactly
    activation_dtype: Dtype = "float32"
    host_gb: float = (
        0.0  # hard budget of host memory for the state and its buffers; 0: the RAM free (GPU runs)
    )
    nvme_dir: str = ""  # directory of the NVMe tier (a Zarr store); empty: no NVMe tier
    nvme_gb: float = 0.0  # most the NVMe tier may use; 0: the free space of nvme_dir
    io: IoBackend = "auto"  # NVMe I/O backend: "kvikio" where it runs, else "posix"
    io_threads: int = 16  # NVMe I/O threads (16 MiB requests each): the disk's queue depth
    # what spills to NVMe first when the host budget is short: "moments" (the Adam moments; the disk reads and
    # writes them after the norm) or "gradients" (written in the backward pass, read after the norm); "auto": the
    # plan's, the faster step
    spill_first: SpillFirst | Auto = "auto"
    # GPU memory for the whole state of the first units (updated there); "auto": what the plan leaves free
    # beside the streaming buffers and activations (none on a CPU); 0: none
    gpu_resident_gb: float | Auto = "auto"
    gpu_update_units: int | Auto = (
        "auto"  # streamed units updated on the GPU as they load; 0: none; "auto": the plan's
    )
    # a block with experts goes to the GPU as its attention part, then this many groups of its experts, each a
    # slot's worth (a divisor of model.num_experts; 1: the block whole); "auto": the plan's, 1 wherever whole
    # blocks fit the GPU
    expert_groups: int | Auto = "auto"

    def validate(self) -> None:
        _need(self.stream in STREAMS, "tiers", "stream", self, f"must be one of {_q(STREAMS)}")
        _need(self.activations in PLACES, "tiers", "activations", self, f"must be one of {_q(PLACES)}")
        _need(
            self.activation_dtype in DTYPES, "tiers", "activation_dtype", self, f"must be one of {_q(DTYPES)}"
        )
        _need(
            0 <= self.host_gb <= MOST_GB,
            "tiers",
            "host_gb",
            self,
            f"must be 0 (no budget) or a number of GB up to {MOST_GB:g}",
        )
        _need(
            0 <= self.nvme_gb <= MOST_GB,
            "tiers",
            "nvme_gb",
            self,
            f"must be 0 (the free space) or a number of GB up to {MOST_GB:g}",
        )
        _need(self.io in IO_BACKENDS, "tiers", "io", self, f"must be one of {_q(IO_BACKENDS)}")
        _need(1 <= self.io_threads <= 256, "tiers", "io_threads", self, "must be between 1 and 256")
        _need(
            self.spill_first in SPILL_FIRSTS,
            "tiers",
            "spill_first",
            self,
            f"must be one of {_q(SPILL_FIRSTS)}",
        )
        _need(
            _auto_or(self.gpu_resident_gb, 0)
            and (self.gpu_resident_gb == AUTO or self.gpu_resident_gb <= MOST_GB),
            "tiers",
            "gpu_resident_gb",
            self,
            f'must be 0 (none), a number of GB up to {MOST_GB:g}, or "auto" (the GPU memory the plan leaves free)',
        )
        _need(
            _auto_or(self.gpu_update_units, 0),
            "tiers",
            "gpu_update_units",
            self,
            'must be "auto" (the plan chooses), 0 (none) or a number of units',
        )
        _need(
            self.gpu_update_units in (AUTO, 0) or self.stream != "compute",
            "tiers",
            "gpu_update_units",
            self,
            'needs tiers.stream = "master" or "auto" (a GPU update makes the weights from the fp32 master that '
            'streams), not "compute"; or set it to 0',
        )
        _need(
            self.expert_groups == AUTO or isinstance(self.expert_groups, int) and self.expert_groups >= 1,
            "tiers",
            "expert_groups",
            self,
            'must be "auto" (the plan chooses) or a number of groups, 1 for whole blocks',
        )


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0: none but the final one
    keep: int = 2  # the newest checkpoints kept; older ones are deleted once a new one is whole
    final: bool = (
        True  # a checkpoint after the last step; false: the run ends without one (signals still save)
    )
    # "full": fp32 master and Adam moments, a bit-identical resume; "weights": the fp32 master only (a third of
    # the bytes), which `export` reads and `--resume` starts a new run from (fresh moments, step 0)
    state: SavedState = "full"
    # a directory (on another disk than --out) in which the run makes its own checkpoint directory; "": --out's
    dir: str = ""

    def validate(self) -> None:
        _need(
            self.every >= 0,
            "checkpoint",
            "every",
            self,
            "must be 0 (only at the end) or a positive step count",
        )
        _need(self.keep >= 1, "checkpoint", "keep", self, "must be at least 1")
        _need(self.state in SAVED_STATES, "checkpoint", "state", self, f"must be one of {_q(SAVED_STATES)}")


@dataclass
class HardwareConfig:
    # a named GPU (`tiertrain plan --help` lists them: h100, a100-80gb, ...) whose published figures a run plans with
    # when no probe file measured the machine; "": the figures of the GPU the run finds (its name's entry)
    gpu: str = ""

    def validate(
        self,
    ) -> None:  # the name is checked against the planner's table where the figures are chosen
        pass


def _auto_or(v: object, least: float) -> bool:
    """`v` is "auto" or a number of at least `least`."""
    return v == AUTO or v >= least


def fixed(v: object) -> object | None:
    """A setting's value, None where it is "auto" (the plan decides)."""
    return None if v == AUTO else v


def _q(options: tuple[str, ...]) -> str:
    return ", ".join(f'"{o}"' for o in options)


def _need(ok: bool, section: str, key: str, obj: object, why: str) -> None:
    if not ok:
        raise ConfigError(
            f"{section}.{key} = {_show(getattr(obj, key))} is not allowed: {why}; "
            f"change it in the config file or with --set {section}.{key}=..."
        )


def _show(v: object) -> str:
    """A value as one line (JSON is close to TOML's literals for what a config holds)."""
    return json.dumps(v) if v is not None else "unset"
