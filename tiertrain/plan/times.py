"""The planner's time model: seconds per link of one step, and the step's phases (docs/performance.md).
Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..modes import Home, Kind
from ..tiers.placement import streamed_kind
from . import attention
from .hardware import HardwareSpec
from .values import Job, Memory

if TYPE_CHECKING:
    from .memory import Fit


def nvme_traffic(kind: str, streamed: str) -> tuple[int, int, int]:
    """A spilled slab's disk traffic per step, in multiples of its size: (reads, writes) beside the
    forward pass (the update's, and the forward pass's read of the streamed weights once the optimizer
    has written them), and writes in the backward pass (its reads of the streamed weights: Plan's
    `nvme_bwd_reads`, units the device still holds excepted)."""
    if kind == streamed:  # a compute-dtype copy is written whole by the optimizer, a master read first
        return (2 if kind == Kind.MASTER else 1), 1, 0
    if kind == Kind.GRAD:  # drained to disk by the backward pass, read by the optimizer
        return 1, 0, 1
    return 1, 1, 0


def disk_time(reads: float, writes: float, hw: HardwareSpec) -> float:
    """Seconds of one disk for these bytes, reads and writes in flight together: each direction at its
    own rate, both within the probed rate of both at once (unknown: one direction after the other)."""
    r, w = reads / (hw.disk_read_gbs * 1e9), writes / (hw.disk_write_gbs * 1e9)
    if not hw.disk_mixed_gbs:
        return r + w
    return max(r, w, (reads + writes) / (hw.disk_mixed_gbs * 1e9))


def step_times(
    job: Job, mem: Memory, fit: Fit, on_gpu: int, speculated: int, gpu_speculated: bool = False
) -> tuple[dict[str, float], float, float]:
    """Seconds per link, and the backward and forward phases (the update beside the forward pass), of the choice
    `fit` holds in memory `mem`, with `on_gpu` parameters updated on the GPU and `speculated` queued for the host
    during the backward pass (into copies where the job clips: at hw.out_of_place the rate, with
    hw.out_of_place_dram_bytes more DRAM traffic), as many as that pass has room for (the rest after the norm:
    "host AdamW" counts them). `gpu_speculated`: the GPU updates run in the backward pass too, their state's
    copies with them. Several GPUs: the sums are this rank's shards (_peers prices the collectives)."""
    return with_updates(links(job, mem, fit, on_gpu, gpu_speculated), speculated)


@dataclass(frozen=True)
class Links:
    """What of step_times does not depend on the speculated updates: the update search asks it once for each way
    of updating on the GPU, then with_updates for each number speculated."""

    job: Job
    hw: HardwareSpec
    t: dict  # seconds per link: compute, collectives, PCIe, disk
    streamed: int  # parameters that stream (Fit.sums)
    on_gpu: int
    bwd_gpu: int  # of those, updated in the backward pass
    bwd: float  # the backward pass before the host's DRAM
    h2d_fwd: float
    d2h_fwd: float
    h2d_bwd: float
    d2h_bwd: float
    adam_rate: float  # host AdamW parameters/s
    adam_bytes: int  # its DRAM bytes per parameter


def links(job: Job, mem: Memory, fit: Fit, on_gpu: int, gpu_speculated: bool = False) -> Links:
    """step_times' seconds per link and backward pass, before the host's updates."""
    s, hw, kb = fit.shape, fit.shape.hw, fit.shape.kb
    sw = 2 if Kind.WEIGHTS in kb else 4  # bytes per parameter that stream
    ck_unit = job.spec.num_hidden_layers * s.ck_unit / job.spec.num_hidden_layers
    # the checkpoints off the GPU cross PCIe each way; those on NVMe are written in the forward pass, read back in
    # the backward pass
    host_ck_io = (mem.checkpoints.get(Home.HOST, 0) + mem.checkpoints.get(Home.NVME, 0)) * ck_unit
    ck_disk = mem.checkpoints.get(Home.NVME, 0) * ck_unit
    adam_rate = hw.host_adam_copy_params_per_s if Kind.WEIGHTS in kb else hw.host_adam_params_per_s
    fwd_gpu, bwd_gpu = (0, on_gpu) if gpu_speculated else (on_gpu, 0)
    streamed, reloaded = fit.sums
    h2d_fwd, d2h_fwd = sw * streamed + 12 * fwd_gpu, 12 * fwd_gpu + host_ck_io
    h2d_bwd = sw * reloaded + host_ck_io + 12 * bwd_gpu
    d2h_bwd = 4 * streamed + 12 * bwd_gpu
    adam_bytes = 28 + 2 * (sw == 2)  # per parameter: master, moments read and written, the gradient read
    spec = hw.spec_copy_efficiency if bwd_gpu else 1.0
    pcie = {
        "H2D fwd": h2d_fwd / (hw.h2d_gbs * 1e9),
        "D2H fwd": d2h_fwd / (hw.d2h_gbs * 1e9),
        "PCIe both fwd": (h2d_fwd + d2h_fwd) / (hw.bidir_gbs * hw.copy_efficiency * 1e9),
        "H2D bwd": h2d_bwd / (hw.h2d_gbs * 1e9),
        "D2H": d2h_bwd / (hw.d2h_gbs * 1e9),
        "PCIe both bwd": (h2d_bwd + d2h_bwd) / (hw.bidir_gbs * hw.copy_efficiency * spec * 1e9),
    }
    t = _compute(job, mem, fit) | _peers(job, fit) | pcie | _disk(mem, kb, ck_disk, hw)
    bwd = max(t["compute bwd"], t["H2D bwd"], t["D2H"], t["NVMe bwd"], t["PCIe both bwd"], t["peer bwd"])
    return Links(
        job, hw, t, streamed, on_gpu, bwd_gpu, bwd, h2d_fwd, d2h_fwd, h2d_bwd, d2h_bwd, adam_rate, adam_bytes
    )


def with_updates(k: Links, speculated: int) -> tuple[dict[str, float], float, float]:
    """step_times from its links, with `speculated` parameters queued for the host in the backward pass."""
    job, hw, bwd = k.job, k.hw, k.bwd
    dram = hw.host_dram_gbs * 1e9
    # of the `speculated` parameters, those the host gets through within the backward pass: at its rate into
    # copies, in the DRAM the pass's copies leave. The runtime starts no speculated update after the norm
    # (Updates.after_norm): those left run after it with the others
    copies = job.clipping
    spec_rate = k.adam_rate * (hw.out_of_place if copies else 1.0) / hw.adam_contention
    spec_bytes = k.adam_bytes + hw.out_of_place_dram_bytes * copies
    room = min(bwd * spec_rate, max(0.0, bwd * dram - k.h2d_bwd - k.d2h_bwd) / spec_bytes)
    queued, speculated = speculated, min(speculated, room)
    on_host = k.streamed - k.on_gpu - speculated
    t = k.t | {
        "host AdamW": on_host / k.adam_rate * hw.adam_contention,
        "host AdamW bwd": speculated / spec_rate,
        # the copies and the host AdamW share the host's DRAM
        "host DRAM fwd": (k.h2d_fwd + k.d2h_fwd + k.adam_bytes * on_host) / dram,
        "host DRAM bwd": (k.h2d_bwd + k.d2h_bwd + spec_bytes * speculated) / dram,
    }
    fwd = max(
        t["compute fwd"],
        t["H2D fwd"],
        t["D2H fwd"],
        t["PCIe both fwd"],
        t["host DRAM fwd"],
        t["peer fwd"],
        t["NVMe checkpoints fwd"],
    )
    if queued or k.bwd_gpu:  # the copies alone may fill the host's DRAM
        bwd = max(bwd, t["host DRAM bwd"])
    update = max(t["host AdamW"], t["NVMe"])
    t["exposed update"] = max(0.0, update - fwd)
    return t, bwd, max(fwd, update)


def compute_work(
    job: Job, kept: int, rp, experts_speed: tuple[float, float], kept_attention: int = 0
) -> dict[str, float]:
    """The GPU's work in one step's forward and backward pass, in FLOPs at each rate: "matmul fwd" / "matmul bwd"
    at the matmuls' (the routed experts' counted at `experts_speed` of it: their own), and causal attention's: its
    forward kernel's in the forward pass and in the backward pass's recompute of the blocks not `kept` and not among
    the `kept_attention` (whose outputs the forward pass kept: causal over the whole row), its backward kernel's.
    dev/compute_fit.py fits the rates' efficiencies on measured runs with it."""
    spec = job.spec
    T, L = job.rows * job.seq_len, spec.num_hidden_layers
    A = spec.attention_flops_per_token(job.seq_len)  # its forward a third, its backward two
    M = spec.flops_per_token(job.seq_len) - A  # the matmuls'
    whole = (
        3 * 2 * 2 * spec.num_attention_heads * spec.hd * (job.seq_len + 1) / 2
    )  # a whole row's block's, as A
    # a kept block's backward pass skips its forward pass again: a third of its share of the matmuls (the head's
    # aside), and its attention's forward
    matmuls = M - kept * (M - 6 * spec.vocab_size * spec.hidden_size) / L / 3
    # a tiled block's q/k/v projections run twice in its backward
    if rp.tile and rp.micro_batch * job.seq_len > rp.tile:
        matmuls += 2 * spec.hidden_size * (spec.num_attention_heads + 2 * spec.n_kv_heads) * spec.hd * L
    ex, (fwd_speed, bwd_speed) = spec.expert_flops_per_token / 3, experts_speed  # routed experts: their own
    ex_fwd, ex_bwd = ex * (1 / fwd_speed - 1), 2 * ex * (1 / bwd_speed - 1)
    # a block in parts runs its attention part's forward twice in the backward pass (engine/groups.py)
    again = 0.0
    if rp.expert_groups > 1:
        matmuls += 2 * spec.moe_blocks * _attention_part_params(spec)
        again = A / 3 * spec.moe_blocks / L
    return {
        "matmul fwd": T * (M / 3 + ex_fwd),
        "matmul bwd": T * (matmuls + ex_fwd * (L - kept) / L + ex_bwd),  # a kept block recomputes no expert
        "attention fwd": T * A / 3,
        "attention recompute": T * (A / 3 * (L - kept) / L + again - kept_attention * whole / 3),
        "attention bwd": T * 2 * A / 3,
    }


# a block in parts (expert groups): each group's passes cost beyond its share of the experts' FLOPs (its sums of
# the routed rows over a (tokens x k, H) buffer, fewer rows in its grouped matmuls): priced per byte of those rows
# in the compute dtype, at this rate, a quarter of it in the forward pass. Fitted by least squares on the 6-block
# Qwen3-30B-A3B cut at 8 x 8,192 tokens on an H200, 2, 4 and 16 groups against whole blocks: 0.08, 0.15 and 0.95 s
# a step beyond what the plan prices (bench/results/2026-11-25-issue40-groups.md)
GROUP_ROWS_GBS = 220.0


def group_seconds(job: Job, rp) -> float:
    """The GPU's seconds a step spends on its blocks in parts' groups beyond their FLOPs (GROUP_ROWS_GBS)."""
    if rp.expert_groups <= 1:
        return 0.0
    spec = job.spec
    rows = job.rows * job.seq_len * spec.num_experts_per_tok * spec.hidden_size * rp.compute_width
    return spec.moe_blocks * rp.expert_groups * rows / (GROUP_ROWS_GBS * 1e9)


def _attention_part_params(spec) -> int:
    """A block's matmul parameters beside its experts: q, k, v, o, the router and any shared expert."""
    q, kv, h = spec.num_attention_heads * spec.hd, spec.n_kv_heads * spec.hd, spec.hidden_size
    return h * (2 * q + 2 * kv) + spec.num_experts * h + 3 * h * spec.shared_expert_intermediate_size


def _compute(job: Job, mem: Memory, fit: Fit) -> dict[str, float]:
    """The GPU's seconds of compute in the forward and the backward pass (recompute included): the matmuls' FLOPs
    over their rate, causal attention's over its kernel's (plan.attention.rates: forward and backward apart)."""
    rp, hw = fit.shape.run_plan, fit.shape.hw
    rate = (
        (hw.bf16_tflops if rp.compute_dtype == "bfloat16" else hw.fp32_tflops) * 1e12 * hw.compute_efficiency
    )
    fa, ba = attention.rates(rp.attention, job.spec.hd, rp.deterministic, rp.compute_dtype, hw)
    fa, ba = fa or rate, ba or rate
    w = compute_work(job, mem.kept, rp, hw.experts_speed, mem.kept_attention)
    groups = group_seconds(job, rp)
    return {
        "compute fwd": w["matmul fwd"] / rate + w["attention fwd"] / fa + groups / 4,
        "compute bwd": w["matmul bwd"] / rate
        + w["attention recompute"] / fa
        + w["attention bwd"] / ba
        + groups * 3 / 4,
    }


def _peers(job: Job, fit: Fit) -> dict[str, float]:
    """Several GPUs: each all-gathers the other ranks' part of every unit it loads, in the compute dtype, and
    reduce-scatters as much of every fp32 gradient, over NVLink (hw.peer_gbs) or the network (hw.network_gbs)."""
    s = fit.shape
    rp, hw, whole = s.run_plan, s.hw, sum(s.whole)
    streamed, reloaded = fit.sums
    others = (rp.gpus - 1) / rp.gpus  # of each unit, the part the other ranks hold
    link = (hw.peer_gbs if rp.gpus <= job.ranks_per_host else hw.network_gbs) * 1e9
    reloaded_whole = whole * reloaded / streamed if streamed else 0
    return {
        "peer fwd": others * rp.compute_width * whole / link,
        "peer bwd": others * (rp.compute_width * reloaded_whole + 4 * whole) / link,
    }


def _disk(mem: Memory, kb: dict, ck_disk: float, hw: HardwareSpec) -> dict[str, float]:
    """The disk's seconds: the update's reads and writes of spilled slabs and the forward pass's checkpoint writes
    beside the forward pass, those writes alone at the checkpoints' writer's rate (hw.ck_write_gbs: the forward
    pass waits for them); the backward pass's reads of spilled weights and checkpoints, writes of gradients."""
    io = {k: (nvme_traffic(k, streamed_kind(kb)), b) for k, b in mem.nvme.items()}
    reads, writes, bwd_writes = (sum(n[i] * b for n, b in io.values()) for i in range(3))
    reads -= mem.nvme_ahead  # read ahead of the optimizer as the backward pass starts (Staging.start)
    writes += ck_disk
    # the first updated unit's spilled gradient, drained last: its write ends after the norm, before its read
    late = mem.nvme_late / (hw.disk_write_gbs * 1e9)
    return {
        "NVMe read": reads / (hw.disk_read_gbs * 1e9),
        "NVMe write": writes / (hw.disk_write_gbs * 1e9),
        "NVMe": disk_time(reads, writes, hw) + late,
        "NVMe bwd": disk_time(mem.nvme_bwd_reads + ck_disk + mem.nvme_ahead, bwd_writes - mem.nvme_late, hw),
        "NVMe checkpoints fwd": ck_disk / ((hw.ck_write_gbs or hw.disk_write_gbs) * 1e9),
    }
