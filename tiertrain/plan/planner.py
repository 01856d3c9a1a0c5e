"""The capacity planner: what fits, where every slab lives, how fast a step runs, what limits it.

Pure Python (no torch): a function of (model, batch, budgets, hardware). It uses the runtime's own slab
layout and spill policy, and the schedule's cost model (plan/times.py, docs/performance.md):
    forward  = max(compute_fwd, H2D of the weights (+ GPU-updated units' state), D2H of that state,
                   host DRAM traffic of those copies and of the host AdamW)
    backward = max(compute_bwd (recompute included), H2D, D2H, NVMe reads of spilled weights + writes of
                   spilled gradients)
    update   = max(host AdamW x contention, NVMe reads + writes of the update and of the forward pass)
               (needs the global norm: after backward)
    step     = backward + max(forward, update)                     (the update overlaps the next forward)
The units updated on the GPU (tiers.gpu_update_units) move 12 more bytes per parameter each way in the
forward pass and take their parameters off the host AdamW; by default the plan takes the number of
them that gives the shortest step. A speculative update (optim.speculate_units) moves the host AdamW of
units in RAM (every other one from the last first) into the backward pass, at hw.out_of_place its rate
when it writes copies (clipping on), as many as that pass has room for (the runtime runs the others after
the norm): the plan takes SPEC_MARGIN times the number that balances the two phases best, for the steps
whose norm does not clip. The search returns the RunPlan of its choice (Plan.run_plan), which a run obeys.
"""
from __future__ import annotations

import functools

import math
from dataclasses import dataclass, field, replace
from itertools import accumulate

from ..model.spec import ModelSpec
from ..sizes import budget, gb
from ..tiers.placement import (CK_RING_BYTES, alternate_from_last, ck_disk_bytes, copy_bytes, disk_bytes,
                               gpu_updated, host_state_bytes, kind_bytes, least_host, place_within, read_ahead_bytes,
                               resident_units, streamed_kind, update_candidates)
from ..tiers.slab import SlabLayout, host_cost, shard_numel
from .hardware import HardwareSpec
from .runplan import CHECKPOINT_WIDTH, RunPlan, UnitPlan, unit_plans
from .times import step_times
from .workset import KEPT_SLACK, MLP_SHARE, TILE, WORK_FF, kept_bytes_per_token, working_set

PROCESS_GB = 3.0  # host memory of the process itself (Python, torch, the CUDA context): not in budgets
GPU_RESERVE = 0.95  # plan within this fraction of the GPU memory (allocator fragmentation)
# the plan speculates this many times the parameters it finds room for in the backward pass: the host's
# rate varies 10-15% between runs and its DRAM beside the copies is priced low (host_dram_gbs), and the
# runtime runs those it has not started by the norm with the others after it, so more cost only the copies'
# host memory. llama-3b at 8k on H200s, where the plan finds room for 12: 14 and 16 ran 0.4% and 3% faster
# than 12 in one call (bench/results/2026-11-23-H200-llama3b-spec-count-8k.md), and every run with 18-21
# came within 1.14-1.29x its floor, against 1.20-1.50x for 12 (...-floor-host-units.md)
SPEC_MARGIN = 1.5
GPU_UPDATE_COUNTS = 128  # up to this many candidate units the search tries every count of GPU updates
LARGEST_LAYERS = 4096  # the largest-model search stops here: the report then says "at least"
LONGEST_SEQ = 1 << 24  # the longest-sequence search stops here (16M tokens): the report then says "at least"
RESIDENT_SHARES = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.45, 0.3, 0.15)  # of the GPU memory left: the resident budgets "auto" tries


@dataclass
class Budgets:
    host_gb: float | None = None  # None: the machine's RAM less the process
    gpu_gb: float | None = None  # None: the GPU's memory
    nvme_gb: float | None = None  # None: no NVMe tier; 0 is also none
    resident_gb: float | str = 0.0  # GPU memory for the whole state of the first units; "auto": what the plan leaves


@dataclass
class Plan:
    model: str
    params: int
    batch: int
    seq_len: int
    dtype: str
    micro_batch: int = 0
    stream: str = ""
    activations: str = ""
    gpu_updates: int = 0  # units updated on the GPU as they stream in (the first of update_candidates)
    resident_gb: float = 0.0  # GPU memory given to the whole state of the first units
    kept: int = 0  # the last blocks, whose activations stay on the GPU for the backward pass (no recompute)
    kept_checkpoints: int = 0  # GPU bytes of the checkpoints the kept blocks do without
    checkpoints: dict = field(default_factory=dict)  # home -> blocks whose checkpoint lives there
    tile: int = 0  # tokens per tile of a block (model.tiled); 0: untiled
    checkpoint_dtype: str = "float32"  # the activation checkpoints' dtype
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
    gpus: int = 1  # ranks, one GPU each: each holds 1/gpus of the state and takes 1/gpus of the batch's rows
    gpus_per_host: int = 1  # they share a host's RAM, cores, DRAM bandwidth and disk; budgets are per host
    units: list = field(default_factory=list)  # one RunPlan entry per unit (plan.runplan.UnitPlan.to_dict)

    def run_plan(self) -> RunPlan:
        """The RunPlan of this choice: what the runtime obeys."""
        return RunPlan(self.micro_batch, self.stream, self.activations, float(self.resident_gb),
                       tuple(UnitPlan.from_dict(u) for u in self.units), self.tile, self.checkpoint_dtype, self.gpus)

    @property
    def rows(self) -> int:
        """Rows of each step's batch one rank takes."""
        return self.batch // self.gpus

    @property
    def host_total(self) -> float:
        return sum(self.host_bytes.values()) + sum(self.host_fixed.values())

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu.values())


def _layouts(spec: ModelSpec, gpus: int = 1) -> list[int]:
    """Each unit's slab size, or with several GPUs each rank's shard of it (tiers.slab.Shard)."""
    return [shard_numel(_slab_numel(tuple((t.name, t.shape) for t in u.tensors)), gpus) for u in spec.units()]


@functools.lru_cache(maxsize=256)  # blocks share their table: a deep model builds one layout, not thousands
def _slab_numel(tensors: tuple[tuple[str, tuple[int, ...]], ...]) -> int:
    return SlabLayout.build(list(tensors)).numel


def evaluate(spec: ModelSpec, batch: int, seq_len: int, dtype: str, micro: int, stream: str, activations: str,
             budgets: Budgets, hw: HardwareSpec, name: str = "model", gpu_updates: int | str = "auto",
             least: bool = False, speculate: int | None = None, clipping: bool = True,
             speculate_gpu: bool | None = None, keep: int | None = 0, tile: int | None = None,
             gpus: int = 1, per_host: int = 1, ck_dtype: str = "float32") -> Plan:
    """The plan of one choice of (micro-batch, streaming, checkpoint placement); `gpu_updates` units
    updated on the GPU (-1: the best number); `speculate` units speculated (None: the best number the
    host budget holds), with copies when `clipping`; `keep` blocks keep their activations (None: as many as
    the GPU memory left holds, after room for the GPU updates' state); `tile` tokens per tile of a block (None:
    TILE where the untiled MLP's working set would take more than MLP_SHARE of the GPU budget); `activations` "split": the checkpoints of the last
    blocks on the GPU as far as it has room, then in the RAM the whole state leaves, the rest on NVMe. `least`: with an NVMe tier, also the least host budget (a walk
    over every placement: the report's, not the search's); a miss for host memory always has it. `gpus`: the
    plan of one of that many ranks (`per_host` of them on each host, `hw` and the budgets that host's), with
    `micro` rows of its batch / gpus rows at a time. `ck_dtype`: the activation checkpoints' dtype."""
    p = Plan(name, spec.n_params, batch, seq_len, dtype, micro, stream, activations, hardware=hw.source,
             resident_gb=budgets.resident_gb, gpus=gpus, gpus_per_host=per_host, checkpoint_dtype=ck_dtype)
    shards = _layouts(spec, gpus)
    all_numels = [n * gpus for n in shards]  # the device's buffers hold a whole unit (padded to whole shards)
    hw = hw.per_rank(per_host)
    budgets = replace(budgets, host_gb=None if budgets.host_gb is None else budgets.host_gb / per_host,
                      nvme_gb=budgets.nvme_gb and budgets.nvme_gb / per_host)
    H, FF = spec.hidden_size, spec.intermediate_size
    T = p.rows * seq_len
    kb = kind_bytes(dtype, stream)
    resident = resident_units(shards, kb, budgets.resident_gb * 1e9)  # a rank's shards of the first units
    numels = [0 if u in resident else n for u, n in enumerate(shards)]  # what the host and its links carry
    resident_bytes = sum(shards[u] for u in resident) * sum(kb.values())

    # ---- GPU, the checkpoints aside ----
    wdt = 2 if dtype == "bfloat16" else 4
    blk, own = max(all_numels[1:-1]), all_numels[0] + all_numels[-1]
    tokens = micro * seq_len
    gpu_budget = (budgets.gpu_gb if budgets.gpu_gb is not None else hw.gpu_mem_gb) * 1e9 * GPU_RESERVE
    big = tokens > TILE and WORK_FF * FF * tokens > MLP_SHARE * gpu_budget  # tiles cost a forward pass again
    p.tile = (TILE if big else 0) if tile is None else tile
    tiled = bool(p.tile) and tokens > p.tile
    p.gpu = {"resident units' state": resident_bytes, "weight slots": 2 * blk * wdt, "embedding + head": own * wdt,
             "fp32 staging": max(all_numels) * 4 if (stream == "master" and wdt == 2) else 0,
             "grad accumulators": (2 * blk + own) * 4,
             "activation grads": T * H * 4,
             "working set": working_set(spec, dtype, tokens, p.tile) + 3 * (64 << 20)}

    # ---- activation checkpoints: a (tokens x H) tensor per block, on the GPU, the host or NVMe ----
    ckw = CHECKPOINT_WIDTH[ck_dtype]
    nl, ck_unit = spec.num_hidden_layers, T * H * ckw
    ck_bytes = nl * ck_unit
    host_budget = (budgets.host_gb if budgets.host_gb is not None else hw.host_ram_gb - PROCESS_GB) * 1e9
    nvme_on = bool(budgets.nvme_gb)
    if activations == "nvme" and not nvme_on:
        p.short_of, p.why = "NVMe", "NVMe: checkpoints on NVMe need an NVMe tier; pass --nvme-dir"
        return p
    n_gpu = {"gpu": nl, "split": min(nl, max(0, int((gpu_budget - p.gpu_total) // ck_unit) - 1))}.get(activations, 0)
    n_host = {"host": nl, "split": nl - n_gpu}.get(activations, 0)
    if activations == "split" and nvme_on and n_host:  # RAM after the whole state, the rest on NVMe
        room = host_budget - sum(host_cost(n * b) for n in numels for b in kb.values())
        n_host = min(n_host, max(0, int(room // host_cost(ck_unit))))
        if n_host < nl - n_gpu:
            n_host = max(0, int((room - CK_RING_BYTES) // host_cost(ck_unit)))
    p.checkpoints = {"gpu": n_gpu, "host": n_host, "nvme": nl - n_gpu - n_host}
    # the backward pass holds the block's checkpoint and the next one's: of the others, two in flight
    p.gpu["checkpoints"] = (nl if n_gpu == nl else max(n_gpu + 1, min(2, nl))) * ck_unit \
        + (T * H * 4 if ckw == 2 else 0)  # the block's, cast back to fp32 for its backward pass
    host_ck = n_host * host_cost(ck_unit) + (CK_RING_BYTES if p.checkpoints["nvme"] else 0)

    # ---- host and NVMe ----
    where, ring, total = place_within(numels, kb, host_budget, host_ck, host_cost)
    if total > host_budget and not nvme_on:
        p.short_of, p.why = "host", (f"host: the state needs {gb(total)} and the budget is {gb(host_budget)}; "
                                     "raise --host-gb or give an NVMe tier (--nvme-gb)")
        where = None
    elif where is None:
        p.least_host = least_host(numels, kb, host_ck, host_cost)
        p.short_of, p.why = "ring", (f"host: {gb(host_budget)} cannot hold even the buffers of a spilled run; raise --host-gb "
                 f"to at least {budget(p.least_host)}")
    if where is None:
        return p
    p.host_bytes = host_state_bytes(numels, kb, where, host_cost, skip=set(resident))
    for (u, k), tier in where.items():
        if u in resident:
            continue
        size = numels[u] * kb[k]
        if tier != "host":
            p.nvme_bytes[k] = p.nvme_bytes.get(k, 0) + size
        p.placement.setdefault(k, {"host": 0, "nvme": 0})[tier] += 1
        if tier == "nvme" and k == streamed_kind(kb) and u in _reloaded(len(numels)):
            p.nvme_bwd_reads += size
    p.nvme_ahead = read_ahead_bytes(numels, kb, where)
    p.host_fixed = {"staging ring": ring, "host checkpoints": host_ck, "process": PROCESS_GB * 1e9}
    if nvme_on and least:
        p.least_host = least_host(numels, kb, host_ck, host_cost)
    p.nvme_checkpoints = p.checkpoints["nvme"] * ck_disk_bytes(micro * seq_len * H * ckw, p.rows // micro)
    disk = disk_bytes(numels, kb, where) + p.nvme_checkpoints
    if nvme_on and disk > budgets.nvme_gb * 1e9:
        what = "the spilled state and checkpoints take" if p.checkpoints["nvme"] else "the spilled state takes"
        p.short_of, p.why = "NVMe", (f"NVMe: {what} {gb(disk)} on disk and --nvme-gb is {budgets.nvme_gb:g}; "
                                     "raise --nvme-gb or --host-gb")
        return p

    # ---- GPU ----
    gpu_budget = (budgets.gpu_gb if budgets.gpu_gb is not None else hw.gpu_mem_gb) * 1e9 * GPU_RESERVE
    in_ram = [u for u in update_candidates(where, kb, len(numels)) if u not in resident]
    cands = in_ram if "weights" not in kb else []
    # kept activations replace a block's checkpoint (where it is on the GPU) with its whole saved graph
    per_kept = KEPT_SLACK * kept_bytes_per_token(spec, dtype) * T - (ck_unit if activations == "gpu" else 0)
    if activations == "split" and keep is None:
        keep = 0  # split: memory is short, and a kept block's graph takes several checkpoints' room
    if keep is None and tiled:
        keep = 0  # a kept block runs untiled: its graph and working set grow with the MLP's width times the length
    if keep is None and dtype == "float32" and spec.n_kv_heads != spec.num_attention_heads:
        keep = 0  # SDPA's fp32 GQA runs the math kernel, whose graph saves the attention weights: length squared
    if keep is None:  # room for one GPU update's two sets first: they save more than a block's recompute
        sets = 2 * 16 * max((numels[u] for u in cands), default=0) if gpu_updates != 0 else 0
        keep = int(max(0.0, gpu_budget - p.gpu_total - sets) // per_kept)
    p.kept = min(keep, spec.num_hidden_layers)
    if p.kept:  # shown gross: the blocks kept have no checkpoint
        p.gpu["kept activations"] = p.kept * KEPT_SLACK * kept_bytes_per_token(spec, dtype) * T
        p.kept_checkpoints = p.kept * ck_unit if activations == "gpu" else 0
        p.gpu["checkpoints"] -= p.kept_checkpoints
    if p.gpu_total > gpu_budget:
        p.short_of, p.why = "GPU", f"GPU: needs {gb(p.gpu_total)} of {gb(gpu_budget)} usable"
        return p

    # ---- time, for each number of units updated on the GPU that fits, speculating or not ----
    reloaded = _reloaded(len(numels))
    sums = (sum(numels), sum(numels[reloaded.start:reloaded.stop]))  # what crosses PCIe forward, backward
    room = host_budget - sum(p.host_bytes.values()) - ring - host_ck
    best, short = None, None
    for k, ge in [(k, ge) for k in (_counts(len(cands)) if gpu_updates == "auto" else [min(gpu_updates, len(cands))])
                  for ge in ((False, True) if k and speculate_gpu is None else (bool(k and speculate_gpu),))]:
        gpu = gpu_updated(cands, k, ge)
        sets = 2 * 16 * max((numels[u] for u in gpu), default=0)  # two (master, grad, moments) sets
        if p.gpu_total + sets > gpu_budget:
            continue
        # units the host updates from RAM, in the order the speculated ones are taken
        on_gpu_set = set(gpu)
        host = alternate_from_last([u for u in in_ram if u not in on_gpu_set], len(in_ram))
        # copies[n]: host bytes of the copies of the first n, after those of the GPU updates if speculated
        first = sum(copy_bytes(numels[u], host_cost) for u in gpu) if ge and clipping else 0
        copies = [*accumulate((copy_bytes(numels[u], host_cost) if clipping else 0 for u in host), initial=first)]
        params = [0, *accumulate(numels[u] for u in host)]  # params[n]: parameters of the first n
        if copies[0] > room:
            short = copies[0] - room
            continue
        fit = max(n for n in range(len(copies)) if copies[n] <= room)

        on_gpu = sum(numels[u] for u in gpu)

        def step(n: int):
            t, bwd, fwd = step_times(spec, p, sums, on_gpu, params[n], clipping, ck_bytes, kb, hw, gpu_speculated=ge,
                                     whole=sum(all_numels))
            return bwd + fwd, (k, bwd, fwd, t, sets, n, copies[n], ge)

        if speculate is not None and copies[min(speculate, len(host))] > room:
            short = copies[min(speculate, len(host))] - room
            continue
        for _, c in [step(min(speculate, len(host)))] if speculate is not None else _least(step, fit):
            if speculate is None and c[5]:  # a margin: the step is the same, and the host may be faster
                c = step(next((n for n in range(c[5], fit + 1) if params[n] >= SPEC_MARGIN * params[c[5]]), fit))[1]
            if best is None or c[1] + c[2] < (best[1] + best[2]) * (1 - 1e-9):
                best = c
    if best is None and short is not None:
        p.short_of, p.least_host = "copies", host_budget + short
        p.why = (f"host: the copies of the speculative update need {gb(short)} more than the budget; "
                 "raise --host-gb or lower optim.speculate_units")
        return p
    if best is None:
        p.short_of, p.why = "GPU", f"GPU: needs {gb(p.gpu_total + sets)} of {gb(gpu_budget)} usable"
        return p
    p.speculated, copies, p.gpu_speculated, p.clipping = best[5], best[6], best[7], clipping
    if copies:
        p.host_fixed["update copies"] = copies
    best = best[:5]
    p.gpu_updates, bwd, fwd, t, p.gpu["GPU update sets"] = best
    p.times, p.step_s = t, bwd + fwd
    p.clipped_times, p.clipped_step_s = t, p.step_s
    if clipping and (p.speculated or p.gpu_speculated):
        on_gpu = sum(numels[u] for u in gpu_updated(cands, p.gpu_updates, p.gpu_speculated))
        ct, cb, cf = step_times(spec, p, sums, on_gpu, 0, clipping, ck_bytes, kb, hw, whole=sum(all_numels))
        p.clipped_times, p.clipped_step_s = ct, cb + cf
    # what limits each phase: the backward pass, then the forward pass with the update beside it
    limits = {"compute": (t["compute bwd"], t["compute fwd"]), "H2D": (t["H2D bwd"], t["H2D fwd"]),
              "D2H": (t["D2H"], t["D2H fwd"]), "PCIe both ways": (None, t["PCIe both fwd"]),
              "host AdamW": (t["host AdamW bwd"], t["host AdamW"]), "host DRAM": (t["host DRAM bwd"], t["host DRAM fwd"]),
              "NVMe": (t["NVMe bwd"], t["NVMe"]), "GPU links": (t["peer bwd"], t["peer fwd"])}
    phase = {name: (bwd if b == bwd else 0) + (fwd if f == fwd else 0) for name, (b, f) in limits.items()}
    p.bottleneck = max(phase, key=phase.get)
    F = spec.flops_per_token(seq_len)
    p.tokens_per_s = T * gpus / p.step_s  # the whole batch's, over every rank
    p.model_tflops = F * T * gpus / p.step_s / 1e12
    p.fits, p.why = True, "fits"
    gpu = gpu_updated(cands, p.gpu_updates, p.gpu_speculated)  # the units of each update mode, as the runtime takes them
    host = alternate_from_last([u for u in in_ram if u not in set(gpu)], len(in_ram))
    nl = spec.num_hidden_layers
    homes = checkpoint_homes(nl - p.kept, p.checkpoints)
    p.units = [u.to_dict() for u in unit_plans([u.name for u in spec.units()], where, resident, gpu, p.gpu_speculated,
                                               host[:p.speculated], range(nl + 1 - p.kept, nl + 1), homes)]
    return p


def checkpoint_homes(blocks: int, counts: dict[str, int]) -> dict[int, str]:
    """The home of each recomputed block's checkpoint (blocks 1..`blocks`), `counts` of them per home: NVMe's
    spread evenly from the first block (each write and read then has the blocks between to hide behind; a run of
    first blocks made the forward pass wait for the disk, at most two blocks on their way down at once), then the
    GPU's from the last block back (the first the backward pass needs), the host's for the rest."""
    n = min(counts.get("nvme", 0), blocks)
    nvme = {1 + i * blocks // n for i in range(n)}
    rest = [b for b in range(blocks, 0, -1) if b not in nvme]
    gpu = min(counts.get("gpu", 0), len(rest))
    return {b: "nvme" for b in nvme} | {b: "gpu" if i < gpu else "host" for i, b in enumerate(rest)}


def _counts(n: int) -> list[int]:
    """The numbers of GPU-updated units the search tries: each of 0..n up to GPU_UPDATE_COUNTS units, evenly
    spaced counts for deeper models (each try costs O(units): thousands of layers must still plan in seconds)."""
    most = max(16, min(GPU_UPDATE_COUNTS, 50_000 // max(n, 1)))
    return list(range(n + 1)) if n <= GPU_UPDATE_COUNTS else sorted({round(i * n / most) for i in range(most + 1)})


def _least(f, hi: int) -> list:
    """[f(n)] at the n in 0..hi that gives the least f(n)[0], f being convex in n (a ternary search; the
    smallest such n on ties)."""
    lo, memo = 0, {}

    def g(n):
        if n not in memo:
            memo[n] = f(n)
        return memo[n]

    while hi - lo > 2:
        a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if g(a)[0] <= g(b)[0]:
            hi = b
        else:
            lo = a
    return [min((g(n) for n in range(lo, hi + 1)), key=lambda r: r[0])]


def _reloaded(n_units: int) -> range:
    """The units the backward pass copies to the GPU again: all but the embedding, the head and the last
    two blocks, which the forward pass left in their buffers (WeightSlots' two block slots)."""
    return range(1, n_units - 3)


def plan(spec: ModelSpec, batch: int, seq_len: int, dtype: str, budgets: Budgets, hw: HardwareSpec,
         name: str = "model", micro: int | None = None, stream: str | None = None,
         activations: str | None = None, advise: bool = True, gpu_updates: int | str = "auto",
         speculate: int | None = None, clipping: bool = True, speculate_gpu: bool | None = None,
         keep: int | None = None, tile: int | None = None, gpus: int = 1, per_host: int | None = None,
         ck_dtype: str = "float32") -> Plan:
    """The fastest choice that fits (ties: less GPU memory); or a miss, with its reason. `micro`,
    `stream`, `activations`, `speculate`, `keep`: fixed choices (None: searched); budgets.resident_gb "auto":
    part of the GPU memory the rest of the plan leaves (kept activations aside), for resident units, the
    kept activations taking what those leave, in the proportion that gives the shortest step. `clipping`:
    the global norm is clipped (a speculative update then writes copies). `activations` None: the GPU or the
    host, and a split of the checkpoints across the GPU, the host and NVMe where neither holds them all.
    `gpus`: the plan of one of that many ranks (`per_host` on each host, default all on one), each holding and
    updating 1/gpus of the state (its shards: resident, updated on the GPU or the host as for one GPU)."""
    from .advice import explain  # advice plans variants with this module

    if hw.unified:  # see HardwareSpec.unified: what the config leaves to the plan is none of them
        activations, speculate = activations or "gpu", 0 if speculate is None else speculate
        keep = 0 if keep is None else keep  # the device's memory is the host's: keep what the config says
        gpu_updates, speculate_gpu = 0 if gpu_updates == "auto" else gpu_updates, bool(speculate_gpu)
        budgets = replace(budgets, resident_gb=0.0 if budgets.resident_gb == "auto" else budgets.resident_gb)
    per_host = per_host or gpus
    rows = batch // gpus
    micros = [micro] if micro else [m for m in range(1, rows + 1) if rows % m == 0 and m * seq_len <= 65536]
    streams = [stream] if stream else (["compute", "master"] if dtype == "bfloat16" else ["master"])
    places = [activations] if activations else ["gpu", "host"]

    def choice(m: int, s: str, a: str) -> Plan:
        """One (micro-batch, stream, checkpoint home), with the resident budget "auto" settled for it."""
        def at(b: Budgets) -> Plan:
            return evaluate(spec, batch, seq_len, dtype, m, s, a, b, hw, name, gpu_updates, speculate=speculate,
                            clipping=clipping, speculate_gpu=speculate_gpu, keep=keep, tile=tile,
                            gpus=gpus, per_host=per_host, ck_dtype=ck_dtype)
        if budgets.resident_gb != "auto":
            return at(budgets)
        best = at(replace(budgets, resident_gb=0.0))
        spare = resident_room(at, budgets, hw, best)
        tries = [at(replace(budgets, resident_gb=int(spare * f))) for f in RESIDENT_SHARES if int(spare * f) >= 1]
        for q in tries:
            if q.fits and (not best.fits or _expected(q) < _expected(best) * (1 - 1e-9)):
                best = q
        if not best.fits and tries and tries[0].short_of != "GPU":  # the miss with the most on the GPU says
            return tries[0]  # what the host and disk still lack
        return best

    cands = [choice(m, s, a) for m in micros or [rows] for s in streams for a in places]
    # with an NVMe tier, checkpoints there beside the state in RAM: each costs the disk a write beside the forward
    # pass and a read beside the backward one, where a spilled moment costs both after the norm
    if not activations and (budgets.nvme_gb or not any(c.fits for c in cands)):
        cands += [choice(m, s, "split") for m in micros or [rows] for s in streams]
    ok = [c for c in cands if c.fits]
    if not ok:  # the miss to report: one the GPU holds, if any, so its reason names the budget to raise;
        # of those short of host memory with an NVMe tier, the one that needs the least
        cands.sort(key=lambda c: (c.why.startswith("GPU"), c.least_host))
    # ties go to the larger micro-batch: compute efficiency was measured with 8k tokens per micro-batch
    # and only falls below that; then to less GPU memory
    best = min(ok, key=lambda c: (round(_expected(c), 6), -c.micro_batch, c.gpu_total)) if ok else cands[0]
    return explain(spec, best, budgets, hw, gpu_updates, clipping) if advise and best.fits else best


def _expected(p: Plan) -> float:
    """The step a resident budget is chosen by: with clipping on, a step whose norm clips is as likely as not."""
    return (p.step_s + p.clipped_step_s) / 2 if p.clipping else p.step_s


def resident_room(at, budgets: Budgets, hw: HardwareSpec, zero: Plan | None = None) -> float:
    """GPU memory (GB) resident state can take in the choice `at` plans (a function of Budgets): what the
    choice leaves with nothing resident (`zero`, where planned already), or, for a state the host and disk
    cannot hold (which may fit with part of it on the GPU), what it leaves with room on the host."""
    room = zero if zero is not None and (zero.fits or zero.short_of == "GPU") else \
        at(replace(budgets, resident_gb=0.0, host_gb=1e6))
    return spare_gb(room, budgets, hw) if room.fits else 0.0


def spare_gb(p: Plan, budgets: Budgets, hw: HardwareSpec) -> float:
    """GPU memory (GB) the plan leaves unused or gives to what resident state can replace (kept activations,
    GPU updates' state sets), within the usable part of the budget."""
    used = p.gpu_total - p.gpu.get("kept activations", 0) - p.gpu.get("GPU update sets", 0) + p.kept_checkpoints
    return (budgets.gpu_gb if budgets.gpu_gb is not None else hw.gpu_mem_gb) * GPU_RESERVE - used / 1e9
