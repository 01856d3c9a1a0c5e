"""The capacity planner: what fits, where every slab lives, how fast a step runs, what limits it.

Pure Python (no torch): a function of (Job, Budgets, HardwareSpec) and what the config fixes (Choice). It uses
the runtime's own slab layout and spill policy, and the schedule's cost model (plan/times.py,
docs/performance.md):
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
whose norm does not clip. `plan` searches the choices; `evaluate` plans one, in three parts: its memory
(memory_fit), its updates (update_search) and its units (the RunPlan a run obeys: Plan.run_plan).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from itertools import accumulate

from ..modes import Home, Kind
from ..sizes import budget, gb
from ..tiers.placement import (CK_RING_BYTES, alternate_from_last, ck_disk_bytes, copy_bytes, disk_bytes,
                               gpu_updated, host_state_bytes, kind_bytes, least_host, place_within,
                               read_ahead_bytes, resident_units, streamed_kind, update_candidates)
from ..tiers.slab import SlabLayout, host_cost, shard_numel
from .hardware import HardwareSpec
from .runplan import WIDTH, RunPlan, unit_plans
from .times import step_times
from .values import Budgets, Choice, Job, Plan
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
RESIDENT_SHARES = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.45, 0.3, 0.15)  # of the GPU memory left: the resident budgets "auto" tries


def plan(job: Job, budgets: Budgets, hw: HardwareSpec, fixed: Choice = Choice()) -> Plan:
    """The fastest choice that fits (ties: less GPU memory); or a miss, with its reason. `fixed`: what the
    config fixes (None: searched); budgets.resident_gb "auto": part of the GPU memory the rest of the plan
    leaves (kept activations aside), for resident units, the kept activations taking what those leave, in the
    proportion that gives the shortest step. Checkpoints left to the search go to the GPU or the host, or split
    across the GPU, the host and NVMe where neither holds them all. With several GPUs (job.gpus), the plan of
    one rank, holding and updating 1/gpus of the state. A report adds advice.explain's findings."""
    fixed, budgets = settled(fixed, budgets, hw)
    rows = job.rows
    micros = [fixed.micro] if fixed.micro else [m for m in range(1, rows + 1)
                                               if rows % m == 0 and m * job.seq_len <= 65536]
    both = ["compute", "master"] if job.dtype == "bfloat16" else ["master"]
    streams = [fixed.stream] if fixed.stream else both
    places = [fixed.activations] if fixed.activations else ["gpu", "host"]

    def choice(m: int, s: str, a: str) -> Plan:
        """One (micro-batch, stream, checkpoint home), with the resident budget "auto" settled for it."""
        def at(b: Budgets) -> Plan:
            return evaluate(job, replace(fixed, micro=m, stream=s, activations=a), b, hw)
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
    if not fixed.activations and (budgets.nvme_gb or not any(c.fits for c in cands)):
        cands += [choice(m, s, "split") for m in micros or [rows] for s in streams]
    ok = [c for c in cands if c.fits]
    if not ok:  # the miss to report: one the GPU holds, if any, so its reason names the budget to raise;
        # of those short of host memory with an NVMe tier, the one that needs the least
        return min(cands, key=lambda c: (c.why.startswith("GPU"), c.least_host))
    # ties go to the larger micro-batch: compute efficiency was measured with 8k tokens per micro-batch
    # and only falls below that; then to less GPU memory
    return min(ok, key=lambda c: (round(_expected(c), 6), -c.run_plan.micro_batch, c.gpu_total))


def settled(fixed: Choice, budgets: Budgets, hw: HardwareSpec) -> tuple[Choice, Budgets]:
    """What a device whose memory is the host's (HardwareSpec.unified) leaves to the plan: none of the choices."""
    if not hw.unified:
        return fixed, budgets
    fixed = replace(fixed, activations=fixed.activations or "gpu",
                    speculate=0 if fixed.speculate is None else fixed.speculate,
                    keep=0 if fixed.keep is None else fixed.keep,  # the device's memory is the host's
                    gpu_updates=0 if fixed.gpu_updates is None else fixed.gpu_updates,
                    speculate_gpu=bool(fixed.speculate_gpu))
    return fixed, replace(budgets, resident_gb=0.0 if budgets.resident_gb == "auto" else budgets.resident_gb)


def evaluate(job: Job, choice: Choice, budgets: Budgets, hw: HardwareSpec, least: bool = False) -> Plan:
    """The plan of one choice (its micro-batch, stream and checkpoints' home set; "split": the checkpoints of
    the last blocks on the GPU as far as it has room, then in the RAM the whole state leaves, the rest on NVMe).
    `least`: with an NVMe tier, also the least host budget (a walk over every placement: the report's, not the
    search's); a miss for host memory always has it."""
    p, fit = memory_fit(job, choice, budgets, hw, least)
    if fit is None:
        return p
    best = update_search(job, choice, p, fit)
    if best is not None:
        _finish(job, p, fit, best)
    return p


@dataclass(frozen=True)
class Fit:
    """What a choice's memory fit leaves the update search: one rank's slabs, their placement, the budgets."""
    hw: HardwareSpec  # one rank's share of the host's
    numels: list[int]  # each unit's slab elements on the host and its links (0: resident)
    whole: int  # the units' padded sizes summed (what the device's buffers hold)
    kb: dict  # bytes per parameter of each kind
    where: dict  # (unit, kind) -> home
    resident: list[int]  # units whose whole state lives on the GPU
    in_ram: list[int]  # units with every slab in host RAM (resident ones aside)
    host_budget: float  # one rank's host bytes
    room: float  # host bytes the state, the ring and the host checkpoints leave for speculation's copies
    gpu_budget: float  # usable GPU bytes
    ck_bytes: int  # bytes of every block's checkpoint

    @property
    def sums(self) -> tuple[int, int]:
        """The parameters that cross PCIe in the forward pass, and again in the backward pass."""
        reloaded = _reloaded(len(self.numels))
        return sum(self.numels), sum(self.numels[reloaded.start:reloaded.stop])


def memory_fit(job: Job, choice: Choice, budgets: Budgets, hw: HardwareSpec,
               least: bool = False) -> tuple[Plan, Fit | None]:
    """The choice's memory on the GPU, the host and NVMe: the plan so far, and what the update search needs;
    (a miss, None) where some budget is short."""
    spec, micro, stream, activations = job.spec, choice.micro, choice.stream, choice.activations
    shards = _layouts(spec, job.gpus)
    all_numels = [n * job.gpus for n in shards]  # the device's buffers hold a whole unit (padded to whole shards)
    per_host = job.ranks_per_host
    hardware, given = hw.source, budgets
    hw = hw.per_rank(per_host)
    budgets = replace(budgets, host_gb=None if budgets.host_gb is None else budgets.host_gb / per_host,
                      nvme_gb=budgets.nvme_gb and budgets.nvme_gb / per_host)
    H, FF = spec.hidden_size, spec.intermediate_size
    T = job.rows * job.seq_len
    kb = kind_bytes(job.dtype, stream)
    resident = resident_units(shards, kb, budgets.resident_gb * 1e9)  # a rank's shards of the first units
    numels = [0 if u in resident else n for u, n in enumerate(shards)]  # what the host and its links carry
    resident_bytes = sum(shards[u] for u in resident) * sum(kb.values())

    # ---- GPU, the checkpoints aside ----
    wdt = WIDTH[job.dtype]
    blk, own = max(all_numels[1:-1]), all_numels[0] + all_numels[-1]
    tokens = micro * job.seq_len
    gpu_budget = (budgets.gpu_gb if budgets.gpu_gb is not None else hw.gpu_mem_gb) * 1e9 * GPU_RESERVE
    big = tokens > TILE and WORK_FF * FF * tokens > MLP_SHARE * gpu_budget  # tiles cost a forward pass again
    tile = (TILE if big else 0) if choice.tile is None else choice.tile
    tiled = bool(tile) and tokens > tile
    rp = RunPlan(micro, stream, activations, budgets.resident_gb, tile=tile, checkpoint_dtype=job.checkpoint_dtype,
                 gpus=job.gpus, compute_dtype=job.dtype, numels=tuple(shards), rows=job.rows,
                 row_numel=job.seq_len * H)
    p = Plan(job.name, spec.n_params, job.batch, job.seq_len, rp, hardware=hardware, gpus_per_host=per_host)
    p.gpu = {"resident units' state": resident_bytes, "weight slots": 2 * blk * wdt, "embedding + head": own * wdt,
             "fp32 staging": max(all_numels) * 4 if (stream == "master" and wdt == 2) else 0,
             "grad accumulators": (2 * blk + own) * 4,
             "activation grads": T * H * 4,
             "working set": working_set(spec, job.dtype, tokens, tile) + 3 * (64 << 20)}

    # ---- activation checkpoints: a (tokens x H) tensor per block, on the GPU, the host or NVMe ----
    ckw = WIDTH[job.checkpoint_dtype]
    nl, ck_unit = spec.num_hidden_layers, T * H * ckw
    host_budget = (budgets.host_gb if budgets.host_gb is not None else hw.host_ram_gb - PROCESS_GB) * 1e9
    nvme_on = bool(budgets.nvme_gb)
    if activations == "nvme" and not nvme_on:
        p.short_of, p.why = "NVMe", "NVMe: checkpoints on NVMe need an NVMe tier; pass --nvme-dir"
        return p, None
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
        p.short_of, p.why = "host", (f"host: the state needs {gb(total * per_host)} and the budget is "
                                     f"{gb(host_budget * per_host)}; raise --host-gb or give an NVMe tier (--nvme-gb)")
        return p, None
    if where is None:  # the messages and least_host are the host's, for its ranks (--host-gb is the host's)
        p.least_host = least_host(numels, kb, host_ck, host_cost) * per_host
        p.short_of, p.why = "ring", (f"host: {gb(host_budget * per_host)} cannot hold even the buffers of a spilled "
                                     f"run; raise --host-gb to at least {budget(p.least_host)}")
        return p, None
    p.host_bytes = host_state_bytes(numels, kb, where, host_cost, skip=set(resident))
    for (u, k), tier in where.items():
        if u in resident:
            continue
        size = numels[u] * kb[k]
        if tier != Home.HOST:
            p.nvme_bytes[k] = p.nvme_bytes.get(k, 0) + size
        p.placement.setdefault(k, {"host": 0, "nvme": 0})[tier] += 1
        if tier == Home.NVME and k == streamed_kind(kb) and u in _reloaded(len(numels)):
            p.nvme_bwd_reads += size
    p.nvme_ahead = read_ahead_bytes(numels, kb, where)
    p.host_fixed = {"staging ring": ring, "host checkpoints": host_ck, "process": PROCESS_GB * 1e9}
    if nvme_on and least:
        p.least_host = least_host(numels, kb, host_ck, host_cost) * per_host
    p.nvme_checkpoints = p.checkpoints["nvme"] * ck_disk_bytes(micro * job.seq_len * H * ckw, p.rows // micro)
    disk = disk_bytes(numels, kb, where) + p.nvme_checkpoints
    if nvme_on and disk > budgets.nvme_gb * 1e9:
        what = "the spilled state and checkpoints take" if p.checkpoints["nvme"] else "the spilled state takes"
        p.short_of, p.why = "NVMe", (f"NVMe: {what} {gb(disk * per_host)} on disk and --nvme-gb is "
                                     f"{given.nvme_gb:g}; raise --nvme-gb or --host-gb")
        return p, None

    # ---- GPU: the blocks that keep their activations ----
    in_ram = [u for u in update_candidates(where, kb, len(numels)) if u not in resident]
    cands = _candidates(in_ram, kb)
    # kept activations replace a block's checkpoint (where it is on the GPU) with its whole saved graph
    per_kept = KEPT_SLACK * kept_bytes_per_token(spec, job.dtype) * T - (ck_unit if activations == "gpu" else 0)
    keep = choice.keep
    if activations == "split" and keep is None:
        keep = 0  # split: memory is short, and a kept block's graph takes several checkpoints' room
    if keep is None and tiled:
        keep = 0  # a kept block runs untiled: its graph and working set grow with the MLP's width times the length
    if keep is None and job.dtype == "float32" and spec.n_kv_heads != spec.num_attention_heads:
        keep = 0  # SDPA's fp32 GQA runs the math kernel, whose graph saves the attention weights: length squared
    if keep is None:  # room for one GPU update's two sets first: they save more than a block's recompute
        sets = 2 * 16 * max((numels[u] for u in cands), default=0) if choice.gpu_updates != 0 else 0
        keep = int(max(0.0, gpu_budget - p.gpu_total - sets) // per_kept)
    p.kept = min(keep, spec.num_hidden_layers)
    if p.kept:  # shown gross: the blocks kept have no checkpoint
        p.gpu["kept activations"] = p.kept * KEPT_SLACK * kept_bytes_per_token(spec, job.dtype) * T
        p.kept_checkpoints = p.kept * ck_unit if activations == "gpu" else 0
        p.gpu["checkpoints"] -= p.kept_checkpoints
    if p.gpu_total > gpu_budget:
        p.short_of, p.why = "GPU", f"GPU: needs {gb(p.gpu_total)} of {gb(gpu_budget)} usable"
        return p, None
    room = host_budget - sum(p.host_bytes.values()) - ring - host_ck
    return p, Fit(hw, numels, sum(all_numels), kb, where, resident, in_ram, host_budget, room, gpu_budget,
                  nl * ck_unit)


@dataclass(frozen=True)
class Candidate:
    """One way to run the updates, timed: `gpu_updates` units on the GPU (in the backward pass if
    `gpu_speculated`), `speculated` units speculated by the host."""
    gpu_updates: int
    gpu_speculated: bool
    speculated: int
    copies: int  # host bytes of the speculative updates' copies
    sets: int  # GPU bytes of the GPU updates' two state sets
    times: dict  # link -> seconds
    bwd: float  # the backward pass
    fwd: float  # the forward pass, the update beside it

    @property
    def step_s(self) -> float:
        return self.bwd + self.fwd


def update_search(job: Job, choice: Choice, p: Plan, fit: Fit) -> Candidate | None:
    """The fastest way to run the updates that fits the GPU and the host: for each number of units updated on the
    GPU (choice.gpu_updates, or each that fits), speculating on the GPU or not, the number the host speculates
    (choice.speculate, or the best). None: none fits (the plan then says which budget is short)."""
    numels, hw = fit.numels, fit.hw
    cands, sums = _candidates(fit.in_ram, fit.kb), fit.sums
    room, clipping, speculate = fit.room, job.clipping, choice.speculate
    counts = _counts(len(cands)) if choice.gpu_updates is None else [min(choice.gpu_updates, len(cands))]
    best, short, sets = None, None, 0
    spec_gpu = choice.speculate_gpu
    for k, ge in [(k, ge) for k in counts
                  for ge in ((False, True) if k and spec_gpu is None else (bool(k and spec_gpu),))]:
        gpu = gpu_updated(cands, k, ge)
        sets = 2 * 16 * max((numels[u] for u in gpu), default=0)  # two (master, grad, moments) sets
        if p.gpu_total + sets > fit.gpu_budget:
            continue
        # units the host updates from RAM, in the order the speculated ones are taken
        on_gpu_set = set(gpu)
        host = alternate_from_last([u for u in fit.in_ram if u not in on_gpu_set], len(fit.in_ram))
        # copies[n]: host bytes of the copies of the first n, after those of the GPU updates if speculated
        first = sum(copy_bytes(numels[u], host_cost) for u in gpu) if ge and clipping else 0
        copies = [*accumulate((copy_bytes(numels[u], host_cost) if clipping else 0 for u in host), initial=first)]
        params = [0, *accumulate(numels[u] for u in host)]  # params[n]: parameters of the first n
        if copies[0] > room:
            short = copies[0] - room
            continue
        most = max(n for n in range(len(copies)) if copies[n] <= room)
        on_gpu = sum(numels[u] for u in gpu)

        def timed(n: int, k=k, ge=ge, sets=sets, copies=copies, on_gpu=on_gpu) -> tuple[float, Candidate]:
            t, bwd, fwd = step_times(job.spec, p, sums, on_gpu, params[n], clipping, fit.ck_bytes, fit.kb, hw,
                                     gpu_speculated=ge, whole=fit.whole)
            return bwd + fwd, Candidate(k, ge, n, copies[n], sets, t, bwd, fwd)

        if speculate is not None and copies[min(speculate, len(host))] > room:
            short = copies[min(speculate, len(host))] - room
            continue
        for _, c in [timed(min(speculate, len(host)))] if speculate is not None else _least(timed, most):
            if speculate is None and c.speculated:  # a margin: the step is the same, and the host may be faster
                c = timed(next((n for n in range(c.speculated, most + 1)
                                if params[n] >= SPEC_MARGIN * params[c.speculated]), most))[1]
            if best is None or c.bwd + c.fwd < (best.bwd + best.fwd) * (1 - 1e-9):
                best = c
    if best is None and short is not None:
        p.short_of, p.least_host = "copies", (fit.host_budget + short) * job.ranks_per_host
        p.why = (f"host: the copies of the speculative update need {gb(short)} more than the budget; "
                 "raise --host-gb or lower optim.speculate_units")
    elif best is None:
        p.short_of, p.why = "GPU", f"GPU: needs {gb(p.gpu_total + sets)} of {gb(fit.gpu_budget)} usable"
    return best


def _finish(job: Job, p: Plan, fit: Fit, best: Candidate) -> None:
    """The plan of the search's candidate: its times, what limits each phase, and the RunPlan of its units."""
    spec, numels = job.spec, fit.numels
    p.speculated, p.gpu_speculated, p.clipping = best.speculated, best.gpu_speculated, job.clipping
    if best.copies:
        p.host_fixed["update copies"] = best.copies
    p.gpu_updates, t, p.gpu["GPU update sets"] = best.gpu_updates, best.times, best.sets
    p.times, p.step_s = t, best.bwd + best.fwd
    p.clipped_times, p.clipped_step_s = t, p.step_s
    cands = _candidates(fit.in_ram, fit.kb)
    if job.clipping and (p.speculated or p.gpu_speculated):
        on_gpu = sum(numels[u] for u in gpu_updated(cands, p.gpu_updates, p.gpu_speculated))
        ct, cb, cf = step_times(spec, p, fit.sums, on_gpu, 0, job.clipping, fit.ck_bytes, fit.kb, fit.hw,
                                whole=fit.whole)
        p.clipped_times, p.clipped_step_s = ct, cb + cf
    # what limits each phase: the backward pass, then the forward pass with the update beside it
    bwd, fwd = best.bwd, best.fwd
    limits = {"compute": (t["compute bwd"], t["compute fwd"]), "H2D": (t["H2D bwd"], t["H2D fwd"]),
              "D2H": (t["D2H"], t["D2H fwd"]), "PCIe both ways": (None, t["PCIe both fwd"]),
              "host AdamW": (t["host AdamW bwd"], t["host AdamW"]), "host DRAM": (t["host DRAM bwd"], t["host DRAM fwd"]),
              "NVMe": (t["NVMe bwd"], t["NVMe"]), "GPU links": (t["peer bwd"], t["peer fwd"])}
    phase = {name: (bwd if b == bwd else 0) + (fwd if f == fwd else 0) for name, (b, f) in limits.items()}
    p.bottleneck = max(phase, key=phase.get)
    F = spec.flops_per_token(job.seq_len)
    T = job.rows * job.seq_len
    p.tokens_per_s = T * job.gpus / p.step_s  # the whole batch's, over every rank
    p.model_tflops = F * T * job.gpus / p.step_s / 1e12
    p.fits, p.why = True, "fits"
    gpu = gpu_updated(cands, p.gpu_updates, p.gpu_speculated)  # the units of each update mode, as the runtime takes them
    host = alternate_from_last([u for u in fit.in_ram if u not in set(gpu)], len(fit.in_ram))
    nl = spec.num_hidden_layers
    homes = checkpoint_homes(nl - p.kept, p.checkpoints)
    units = unit_plans([u.name for u in spec.units()], fit.where, fit.resident, gpu, p.gpu_speculated,
                       host[:p.speculated], range(nl + 1 - p.kept, nl + 1), homes)
    p.run_plan = replace(p.run_plan, units=units)


def checkpoint_homes(blocks: int, counts: dict[str, int]) -> dict[int, Home]:
    """The home of each recomputed block's checkpoint (blocks 1..`blocks`), `counts` of them per home: NVMe's
    spread evenly from the first block (each write and read then has the blocks between to hide behind; a run of
    first blocks made the forward pass wait for the disk, at most two blocks on their way down at once), then the
    GPU's from the last block back (the first the backward pass needs), the host's for the rest."""
    n = min(counts.get("nvme", 0), blocks)
    nvme = {1 + i * blocks // n for i in range(n)}
    rest = [b for b in range(blocks, 0, -1) if b not in nvme]
    gpu = min(counts.get("gpu", 0), len(rest))
    return {b: Home.NVME for b in nvme} | {b: Home.GPU if i < gpu else Home.HOST for i, b in enumerate(rest)}


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


def _candidates(in_ram: list[int], kb: dict) -> list[int]:
    """The units that may be updated on the GPU: those in RAM, unless a compute-dtype copy streams (a GPU update
    makes the weights from the fp32 master)."""
    return in_ram if Kind.WEIGHTS not in kb else []


def _reloaded(n_units: int) -> range:
    """The units the backward pass copies to the GPU again: all but the embedding, the head and the last
    two blocks, which the forward pass left in their buffers (WeightSlots' two block slots)."""
    return range(1, n_units - 3)


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


def _layouts(spec, gpus: int = 1) -> list[int]:
    """Each unit's slab size, or with several GPUs each rank's shard of it (tiers.slab.Shard)."""
    return [shard_numel(_slab_numel(tuple((t.name, t.shape) for t in u.tensors)), gpus) for u in spec.units()]


@functools.lru_cache(maxsize=256)  # blocks share their table: a deep model builds one layout, not thousands
def _slab_numel(tensors: tuple[tuple[str, tuple[int, ...]], ...]) -> int:
    return SlabLayout.build(list(tensors)).numel
