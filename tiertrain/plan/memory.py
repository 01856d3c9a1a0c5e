"""A choice's memory on every tier (the planner's first stage): the GPU's parts, where the activation checkpoints
live, what the host holds and what spills to NVMe, and the blocks that keep their activations. Each stage returns
its part, or the Miss of the budget it finds short. Pure Python."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ..model.parts import block_parts
from ..modes import Home
from ..sizes import budget, gb
from ..tiers.placement import (
    ck_disk_bytes,
    ck_ring_bytes,
    disk_bytes,
    host_state_bytes,
    kind_bytes,
    late_gradient_bytes,
    least_host,
    place_within,
    read_ahead_bytes,
    resident_units,
    streamed_kind,
    update_candidates,
)
from ..tiers.slab import SlabLayout, host_cost, shard_numel
from .attention import choose, deterministic_workspace, kv_graph
from .hardware import HardwareSpec
from .kept import kept_attention, kept_blocks
from .runplan import WIDTH, RunPlan
from .values import Budgets, Choice, GpuMemory, Job, Memory, Miss, Short, frozen
from .workset import MLP_SHARE, TILE, WORK_FF, working_set

GPU_RESERVE = 0.95  # plan within this fraction of the GPU memory (allocator fragmentation)


# the budget a miss is short of, by name
TIER = {Short.GPU: "GPU", Short.HOST: "host", Short.RING: "host", Short.COPIES: "host", Short.NVME: "NVMe"}


@dataclass(frozen=True)
class Shape:
    """What one choice of a job settles before its memory is counted: one rank's slabs and budgets, the tile."""

    job: Job
    choice: Choice
    hw: HardwareSpec  # one rank's share of the host's
    given: Budgets  # the host's, as given
    budgets: Budgets  # one rank's
    shards: tuple[int, ...]  # each unit's slab elements, this rank's shard
    resident: tuple[int, ...]  # units whose whole state lives on the GPU
    kb: dict  # bytes per parameter of each kind
    gpu_budget: float  # usable GPU bytes
    host_budget: float  # one rank's host bytes
    run_plan: RunPlan  # the run-wide choices, no units yet

    @functools.cached_property
    def numels(self) -> list[int]:
        """What the host and its links carry of each unit (0: resident)."""
        return [0 if u in self.resident else n for u, n in enumerate(self.shards)]

    @functools.cached_property
    def whole(self) -> list[int]:
        """Each unit's padded slab: what the device's buffers hold (whole shards)."""
        return [n * self.job.gpus for n in self.shards]

    @property
    def tokens(self) -> int:
        """Tokens of one rank's batch."""
        return self.job.rows * self.job.seq_len

    @property
    def ck_unit(self) -> int:
        """Bytes of one block's activation checkpoint of one rank's batch."""
        return self.tokens * self.job.spec.hidden_size * WIDTH[self.job.activation_dtype]

    source: str  # the figures the plan is made with (HardwareSpec.source)

    @property
    def host_given(self) -> float:
        """The host budget in --host-gb's terms: the host's, as given (else its RAM)."""
        given = self.given.host_gb
        return (given if given is not None else self.hw.host_ram_gb * self.job.ranks_per_host) * 1e9

    @property
    def beside(self) -> float:
        """Host bytes --host-gb holds beside what the plan places there: the processes' own (one per rank), and on a
        device that computes in the host's memory its buffers and activations."""
        return self.host_given - self.host_budget * self.job.ranks_per_host

    def miss(
        self, short: Short, why: str, memory: Memory, least: float = 0.0, need: float = 0.0, have: float = 0.0
    ) -> Miss:
        """The Miss of this choice; `need` and `have`: the short budget's bytes needed and held (see Miss)."""
        demand = self.demand(memory) | ({TIER[short]: (need, have)} if need else {})
        n = self.job.ranks_per_host
        return Miss(
            self.job, self.run_plan, short, why, memory, self.source, n, least, need, have, frozen(demand)
        )

    def demand(self, memory: Memory) -> dict[str, tuple[float, float]]:
        """Each budget's (bytes needed as far as `memory` got, bytes it holds): the GPU's (one rank's, its usable
        part), the host's once placed, the disk's where there is an NVMe tier."""
        n, nvme = self.job.ranks_per_host, self.given.nvme_gb
        out = {"GPU": (memory.gpu.total, self.gpu_budget)}
        if memory.process:
            out["host"] = ((memory.host_total - memory.process) * n + self.beside, self.host_given)
        if nvme:
            out["NVMe"] = ((sum(memory.nvme.values()) + memory.nvme_checkpoints) * n, nvme * 1e9)
        return out


def shape(job: Job, choice: Choice, budgets: Budgets, hw: HardwareSpec) -> Shape:
    """The choice's slabs, budgets and tile, for one rank of `job`."""
    spec, per_host = job.spec, job.ranks_per_host
    shards = slab_sizes(spec, job.gpus)
    mine = hw.per_rank(per_host)
    share = replace(
        budgets,
        host_gb=None if budgets.host_gb is None else budgets.host_gb / per_host,
        nvme_gb=budgets.nvme_gb and budgets.nvme_gb / per_host,
    )
    kb = kind_bytes(job.dtype, choice.stream)
    resident = resident_units(shards, kb, share.resident_gb * 1e9)  # a rank's shards of the first units
    tokens = choice.micro * job.seq_len
    gpu_budget = (share.gpu_gb if share.gpu_gb is not None else mine.gpu_mem_gb) * 1e9 * GPU_RESERVE
    # a forward again
    big = tokens > TILE and WORK_FF * spec.mlp_width * tokens > MLP_SHARE * gpu_budget
    tile = (TILE if big else 0) if choice.tile is None else choice.tile
    # --host-gb is the whole process's: its own memory (Python, torch, the CUDA context) comes out of it
    host_budget = ((share.host_gb if share.host_gb is not None else mine.host_ram_gb) - mine.process_gb) * 1e9
    rp = RunPlan(
        choice.micro,
        choice.stream,
        choice.activations,
        share.resident_gb,
        tile=tile,
        activation_dtype=job.activation_dtype,
        gpus=job.gpus,
        compute_dtype=job.dtype,
        numels=tuple(shards),
        rows=job.rows,
        row_numel=job.seq_len * spec.hidden_size,
        attention=choose(choice.attention, choice.deterministic, job.dtype, hw),
        deterministic=choice.deterministic,
        ck_pieces=max(1, hw.ck_pieces),
        expert_groups=choice.groups or 1,
        spill_first=choice.spill or "moments",
    )
    return Shape(
        job,
        choice,
        mine,
        budgets,
        share,
        tuple(shards),
        tuple(resident),
        kb,
        gpu_budget,
        host_budget,
        rp,
        hw.source,
    )


@dataclass(frozen=True)
class Fit:
    """What a choice's memory fit leaves the update search: one rank's slabs, their placement, the budgets."""

    shape: Shape
    where: dict  # (unit, kind) -> home
    in_ram: list[int]  # units with every slab in host RAM (resident ones aside)
    room: float  # host bytes the state, the ring and the host checkpoints leave for speculation's copies

    @property
    def sums(self) -> tuple[int, int]:
        """The parameters that cross PCIe in the forward pass, and again in the backward pass."""
        numels = self.shape.numels
        reloaded = reloaded_units(len(numels))
        again = sum(numels[reloaded.start : reloaded.stop])
        # a block in parts loads its attention part twice in the backward pass; the last two blocks, which the
        # backward pass finds in their slots, reload where a block in parts rotated through both
        parts = block_parts(self.shape.job.spec, self.shape.run_plan.expert_groups)
        again += sum(att for att, _ in parts.values())
        a, b = reloaded.stop, len(numels) - 2
        if b in parts:
            again += sum(numels[max(a, 1) : b + 1])
        elif a in parts:
            again += numels[a]
        return sum(numels), again


def memory_fit(job: Job, choice: Choice, budgets: Budgets, hw: HardwareSpec) -> tuple[Memory, Fit] | Miss:
    """The choice's memory on the GPU, the host and NVMe, and what the update search needs; or the miss of the
    first budget found short (one short of host memory says the least host budget that would do)."""
    s = shape(job, choice, budgets, hw)
    mem = Memory(_gpu_parts(s))
    got = _checkpoint_split(s, mem)
    if isinstance(got, Miss):
        return got
    mem, host_ck = got
    if (
        s.hw.unified
    ):  # the device computes in the host's memory: its buffers and activations come out of --host-gb
        s = replace(s, host_budget=s.host_budget - mem.gpu.total)
    got = _host_and_disk(s, mem, host_ck)
    if isinstance(got, Miss):
        return got
    mem, where = got
    mem = kept_attention(s, kept_blocks(s, mem, where), where)
    if mem.gpu.total > s.gpu_budget:
        return s.miss(
            Short.GPU,
            f"GPU: needs {gb(mem.gpu.total)} of {gb(s.gpu_budget)} usable",
            mem,
            need=mem.gpu.total,
            have=s.gpu_budget,
        )
    room = s.host_budget - sum(mem.host.values()) - mem.ring - host_ck
    in_ram = [u for u in update_candidates(where, s.kb, len(s.shards)) if u not in s.resident]
    return mem, Fit(s, where, in_ram, room)


def _gpu_parts(s: Shape) -> GpuMemory:
    """The GPU's bytes but the activation checkpoints'."""
    job, spec, whole = s.job, s.job.spec, s.whole
    wdt = WIDTH[job.dtype]
    rp, tokens = s.run_plan, s.choice.micro * job.seq_len
    # a block in parts (expert groups) holds a part at a time in a slot and an accumulator
    parts = block_parts(spec, rp.expert_groups)
    blk = max(parts[u][1] if u in parts else whole[u] for u in range(1, len(whole) - 1))
    own = whole[0] + whole[-1]
    widest = max(whole) if not parts else max(whole[0], whole[-1], blk)
    # its routed tokens (h, experts, weights, their order and places) and the groups' sums of their gradients,
    # every micro-batch's, stay on the GPU through its passes (engine/groups.py)
    routed = s.tokens * ((wdt + 4) * spec.hidden_size + 32 * spec.num_experts_per_tok) if parts else 0
    tiled = bool(rp.tile) and tokens > rp.tile
    flash = deterministic_workspace(rp.attention, rp.deterministic, spec, tokens, tiled, s.hw)
    math = kv_graph(rp.attention, rp.deterministic, job.dtype, spec) == "math"
    return GpuMemory(
        resident=sum(s.shards[u] for u in s.resident) * sum(s.kb.values()),
        slots=2 * blk * wdt,
        own=own * wdt,
        staging=widest * 4 if (s.choice.stream == "master" and wdt == 2) else 0,
        grads=(2 * blk + own) * 4,
        activation_grads=s.tokens * spec.hidden_size * 4,
        working=working_set(spec, job.dtype, tokens, rp.tile, job.seq_len if math else 0)
        + flash
        + 3 * (64 << 20)
        + routed
        + (blk * wdt if spec.is_moe else 0),  # autograd's gradients of the experts' whole tensors
    )


def _checkpoint_split(s: Shape, mem: Memory) -> tuple[Memory, float] | Miss:
    """Where the activation checkpoints live (a (tokens x H) tensor per block: on the GPU, the host or NVMe; "split":
    the last blocks' on the GPU as far as it has room, then in the RAM the whole state leaves, the rest on NVMe);
    (the memory with them, the host bytes they take)."""
    spec, acts, ck_unit = s.job.spec, s.choice.activations, s.ck_unit
    nl, nvme_on = spec.num_hidden_layers, bool(s.budgets.nvme_gb)
    if acts == "nvme" and not nvme_on:
        return s.miss(Short.NVME, "NVMe: checkpoints on NVMe need an NVMe tier; pass --nvme-dir", mem)
    # bf16 checkpoints come back as fp32 (ActivationStore.get): room for that before the split counts its own
    cast = s.tokens * spec.hidden_size * 4 if WIDTH[s.job.activation_dtype] == 2 else 0
    gpu_room = s.gpu_budget - mem.gpu.total - cast
    n_gpu = {"gpu": nl, "split": min(nl, max(0, int(gpu_room // ck_unit) - 1))}.get(acts, 0)
    n_host = {"host": nl, "split": nl - n_gpu}.get(acts, 0)
    if acts == "split" and nvme_on and n_host:  # RAM after the whole state, the rest on NVMe
        room = s.host_budget - sum(host_cost(n * b) for n in s.numels for b in s.kb.values())
        n_host = min(n_host, max(0, int(room // host_cost(ck_unit))))
        if n_host < nl - n_gpu:
            n_host = max(0, int((room - ck_ring_bytes(s.run_plan.ck_pieces)) // host_cost(ck_unit)))
    split = {Home.GPU: n_gpu, Home.HOST: n_host, Home.NVME: nl - n_gpu - n_host}
    # the GPU's room for checkpoints: its own and one more, at least two (the backward pass holds the block's and
    # the next one's); the store's reads and writes run ahead within it (engine/activations.py); and the block's,
    # cast back
    on_gpu = (nl if n_gpu == nl else max(n_gpu + 1, min(2, nl))) * ck_unit + cast
    host_ck = n_host * host_cost(ck_unit) + (ck_ring_bytes(s.run_plan.ck_pieces) if split[Home.NVME] else 0)
    return replace(mem, gpu=replace(mem.gpu, checkpoints=on_gpu), checkpoints=frozen(split)), host_ck


def _host_and_disk(s: Shape, mem: Memory, host_ck: float) -> tuple[Memory, dict] | Miss:
    """What the host holds and what spills to NVMe (tiers.placement's policy), within the host and disk budgets;
    (the memory with them, the placement). The messages and least budgets are the host's (--host-gb is the
    host's, for its ranks)."""
    numels, kb, per_host, nvme_on = s.numels, s.kb, s.job.ranks_per_host, bool(s.budgets.nvme_gb)
    where, ring, total = place_within(numels, kb, s.host_budget, host_ck, host_cost, s.run_plan.spill_first)
    short = _host_short(s, mem, total, where is None, host_ck)
    if short is not None:
        return short
    nvme, placement, bwd_reads = _tally(s, where)
    ck_disk = mem.checkpoints[Home.NVME] * ck_disk_bytes(
        s.choice.micro * s.job.seq_len * s.job.spec.hidden_size * WIDTH[s.job.activation_dtype],
        s.job.rows // s.choice.micro,
    )
    mem = replace(
        mem,
        host=frozen(host_state_bytes(numels, kb, where, host_cost, skip=set(s.resident))),
        nvme=frozen(nvme),
        placement=frozen(placement),
        ring=ring,
        host_checkpoints=host_ck,
        process=s.hw.process_gb * 1e9,
        nvme_checkpoints=ck_disk,
        nvme_bwd_reads=bwd_reads,
        nvme_ahead=read_ahead_bytes(numels, kb, where),
        nvme_late=late_gradient_bytes(numels, kb, where, set(s.resident)),
    )
    disk = disk_bytes(numels, kb, where) + ck_disk
    if nvme_on and disk > s.budgets.nvme_gb * 1e9:
        what = (
            "the spilled state and checkpoints take"
            if mem.checkpoints[Home.NVME]
            else "the spilled state takes"
        )
        return s.miss(
            Short.NVME,
            f"NVMe: {what} {gb(disk * per_host)} on disk and --nvme-gb is {s.given.nvme_gb:g}; raise "
            f"--nvme-gb to {budget(disk * per_host)}",
            mem,
            need=disk * per_host,
            have=s.given.nvme_gb * 1e9,
        )
    return mem, where


def _host_short(s: Shape, mem: Memory, total: float, unplaced: bool, host_ck: float) -> Miss | None:
    """The miss of a host that cannot hold the state (`total` bytes, a rank's) with no NVMe tier, or even a spilled
    run's buffers (`unplaced`); in --host-gb's terms: the processes' own memory in it."""
    per_host = s.job.ranks_per_host
    proc = (
        f"the process and the device's working set ({gb(s.beside)}: the device computes in host memory)"
        if s.hw.unified
        else f"the process's own {s.hw.process_gb:g} GB"
        + (f" on each of {per_host} ranks" if per_host > 1 else "")
    )
    if total > s.host_budget and not s.budgets.nvme_gb:
        need = total * per_host + s.beside
        why = (
            f"host: the state needs {gb(need)} with {proc}, and --host-gb is {gb(s.host_given)}; raise "
            f"--host-gb to {budget(need)} or give an NVMe tier (--nvme-gb)"
        )
        return s.miss(Short.HOST, why, mem, need=need, have=s.host_given)
    if unplaced:
        need = least_host(s.numels, s.kb, host_ck, host_cost) * per_host + s.beside
        why = (
            f"host: {gb(s.host_given)} cannot hold even the buffers of a spilled run beside {proc}; raise "
            f"--host-gb to at least {budget(need)}"
        )
        return s.miss(Short.RING, why, mem, need, need=need, have=s.host_given)
    return None


def _tally(s: Shape, where: dict) -> tuple[dict, dict, int]:
    """(bytes on NVMe by kind, {kind: {home: units}}, bytes of streamed weights the backward pass reads from NVMe)
    of a placement; resident units aside."""
    nvme, placement, bwd_reads = {}, {}, 0
    streamed, reloaded = streamed_kind(s.kb), reloaded_units(len(s.numels))
    for (u, k), tier in where.items():
        if u in s.resident:
            continue
        size = s.numels[u] * s.kb[k]
        if tier != Home.HOST:
            nvme[k] = nvme.get(k, 0) + size
        placement.setdefault(k, {Home.HOST: 0, Home.NVME: 0})[tier] += 1
        if tier == Home.NVME and k == streamed and u in reloaded:
            bwd_reads += size
    return nvme, placement, bwd_reads


def least_host_of(job: Job, choice: Choice, budgets: Budgets, hw: HardwareSpec) -> float:
    """The least host budget (the host's) the choice could run in with an NVMe tier: a walk over every placement
    (the report's, not the search's); a miss's own where its memory does not fit."""
    got = memory_fit(job, choice, budgets, hw)
    if isinstance(got, Miss):
        return got.least_host
    mem, fit = got
    s = fit.shape
    return least_host(s.numels, s.kb, mem.host_checkpoints, host_cost) * job.ranks_per_host + s.beside


def reloaded_units(n_units: int) -> range:
    """The units the backward pass copies to the GPU again: all but the embedding, the head and the last
    two blocks, which the forward pass left in their buffers (WeightSlots' two block slots)."""
    return range(1, n_units - 3)


def slab_sizes(spec, gpus: int = 1) -> tuple[int, ...]:
    """Each unit's slab size, or with several GPUs each rank's shard of it (tiers.slab.Shard); kept in the spec,
    which the planner's candidates share."""
    if gpus not in spec._slabs:
        spec._slabs[gpus] = tuple(
            shard_numel(_slab_numel(tuple((t.name, t.shape) for t in u.tensors)), gpus) for u in spec.units()
        )
    return spec._slabs[gpus]


@functools.lru_cache(maxsize=256)  # blocks share their table: a deep model builds one layout, not thousands
def _slab_numel(tensors: tuple[tuple[str, tuple[int, ...]], ...]) -> int:
    return SlabLayout.build(list(tensors)).numel
