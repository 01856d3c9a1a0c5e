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

from dataclasses import dataclass, replace
from itertools import accumulate

from ..model.parts import group_options
from ..modes import Home, Kind
from ..sizes import budget, gb
from ..tiers.placement import alternate_from_last, copy_bytes, gpu_updated
from ..tiers.slab import host_cost
from .hardware import HardwareSpec
from .kept import attention_blocks, gpu_candidates
from .memory import GPU_RESERVE, Fit, memory_fit
from .runplan import unit_plans
from .times import links, step_times, with_updates
from .values import Budgets, Choice, Job, Memory, Miss, Plan, Prediction, Short, frozen

# the plan speculates this many times the parameters it finds room for in the backward pass: the host's
# rate varies 10-15% between runs and its DRAM beside the copies is priced low (host_dram_gbs), and the
# runtime runs those it has not started by the norm with the others after it, so more cost only the copies'
# host memory. llama-3b at 8k on H200s, where the plan finds room for 12: 14 and 16 ran 0.4% and 3% faster
# than 12 in one call (bench/results/2026-11-23-H200-llama3b-spec-count-8k.md), and every run with 18-21
# came within 1.14-1.29x its floor, against 1.20-1.50x for 12 (...-floor-host-units.md)
SPEC_MARGIN = 1.5
GPU_UPDATE_COUNTS = 128  # up to this many candidate units the search tries every count of GPU updates
# more expert groups free GPU memory (smaller slots) for the activations and cost time each (times.group_seconds,
# fitted on three runs of one shape): of those within this of the fastest step, the plan takes the fewest
GROUPS_MARGIN = 1.05
# host and disk budgets with room for any state: what the GPU alone decides
AMPLE_GB = 1e7
# of the GPU memory left: the resident budgets "auto" tries
RESIDENT_SHARES = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.45, 0.3, 0.15)


def plan(
    job: Job, budgets: Budgets, hw: HardwareSpec, fixed: Choice = Choice(), any_fit: bool = False
) -> Plan | Miss:
    """The fastest choice that fits (ties: less GPU memory); or a miss, with its reason (`any_fit`: the first
    choice found to fit, not the fastest: whether the budgets hold the job at all). `fixed`: what the
    config fixes (None: searched); budgets.resident_gb "auto": part of the GPU memory the rest of the plan
    leaves (kept activations aside), for resident units, the kept activations taking what those leave, in the
    proportion that gives the shortest step. Checkpoints left to the search go to the GPU or the host, or split
    across the GPU, the host and NVMe where neither holds them all. With several GPUs (job.gpus), the plan of
    one rank, holding and updating 1/gpus of the state. A report adds advice.explain's findings.
    A mixture of experts whose whole blocks crowd the GPU goes in expert groups (model/parts.py), where the config
    leaves them to the plan: the fewest whose step is within GROUPS_MARGIN of the shortest."""
    if fixed.groups is None and groupable(job, fixed, budgets):
        first = plan(job, budgets, hw, replace(fixed, groups=1))
        if first.fits:
            return first
        # groups free GPU memory, for checkpoints too: they may also make up for host or disk
        options = group_options(job.spec.num_experts)
        tried = [first] + [plan(job, budgets, hw, replace(fixed, groups=g)) for g in options[1:]]
        ok = [p for p in tried if p.fits]
        if not ok:  # the miss to report: of those the GPU holds with host and disk to spare, the least short
            # (each _held is a search: in that order, the first held; sorted keeps ties in order, as min does)
            order = sorted(zip(tried, options), key=lambda qg: _miss_order(qg[0]))
            return next(
                (q for q, g in order if q.short != Short.GPU and _held(job, budgets, hw, fixed, g)), first
            )
        best = min(_expected(p) for p in ok)
        return next(p for p in ok if _expected(p) <= best * GROUPS_MARGIN)
    fixed, budgets = settled(fixed, budgets, hw)
    fixed, budgets = in_parts(fixed, budgets)
    rows = job.rows
    # "auto": the divisors of the rows up to 64 Ki tokens a micro-batch; a row longer than that, one row at a time
    micros = (
        [fixed.micro]
        if fixed.micro
        else [m for m in range(1, min(rows, 65536 // job.seq_len) + 1) if rows % m == 0] or [1]
    )
    both = ["compute", "master"] if job.dtype == "bfloat16" else ["master"]
    streams = [fixed.stream] if fixed.stream else both
    places = [fixed.activations] if fixed.activations else ["gpu", "host"]

    def choice(m: int, s: str, a: str) -> Plan | Miss:
        """One (micro-batch, stream, checkpoint home), with the resident budget "auto" settled for it."""

        def at(b: Budgets) -> Plan | Miss:
            return evaluate(job, replace(fixed, micro=m, stream=s, activations=a), b, hw)

        if budgets.resident_gb != "auto":
            return at(budgets)
        best = at(replace(budgets, resident_gb=0.0))
        if any_fit and best.fits:
            return best
        spare = resident_room(at, budgets, hw, best)
        tries = []
        for f in (f for f in RESIDENT_SHARES if int(spare * f) >= 1):
            tries.append(at(replace(budgets, resident_gb=int(spare * f))))
            if any_fit and tries[-1].fits:
                return tries[-1]
        for q in tries:
            if q.fits and (not best.fits or _expected(q) < _expected(best) * (1 - 1e-9)):
                best = q
        if not best.fits and tries and tries[0].short != Short.GPU:  # the miss with the most on the GPU says
            return tries[0]  # what the host and disk still lack
        return best

    cands: list[Plan | Miss] = []

    def added(homes: list[str]) -> bool:
        """The choices of these checkpoint homes added to cands; whether one fits, where any_fit stops there."""
        for m, s, a in ((m, s, a) for m in micros for s in streams for a in homes):
            cands.append(choice(m, s, a))
            if any_fit and cands[-1].fits:
                return True
        return False

    if added(places):
        return cands[-1]
    # with an NVMe tier, checkpoints there beside the state in RAM: each costs the disk a write beside the forward
    # pass and a read beside the backward one, where a spilled moment costs both after the norm
    if not fixed.activations and (budgets.nvme_gb or not any(c.fits for c in cands)) and added(["split"]):
        return cands[-1]
    ok = [c for c in cands if c.fits]
    if (
        not ok
    ):  # the miss to report: one short of the fewest budgets (as far as it got), and of those one the GPU
        # holds, if any, so its reason names the budget to raise; of those short of host memory with an NVMe tier,
        # the one that needs the least; then the one least short
        return min(cands, key=_miss_order)
    # ties go to the larger micro-batch: compute efficiency was measured with 8k tokens per micro-batch
    # and only falls below that; then to less GPU memory
    return min(ok, key=lambda c: (round(_expected(c), 6), -c.run_plan.micro_batch, c.memory.gpu.total))


def groupable(job: Job, fixed: Choice, budgets: Budgets) -> bool:
    """Whether the job's blocks may go in expert groups: a mixture of experts on one GPU, and none of what blocks in
    parts do without (tiles, kept blocks, GPU updates, resident units) asked for by the config."""
    asked = (
        fixed.tile,
        fixed.keep,
        fixed.keep_attention,
        fixed.gpu_updates,
        budgets.resident_gb if budgets.resident_gb != "auto" else 0,
    )
    return job.spec.is_moe and job.gpus == 1 and not any(asked)


def in_parts(fixed: Choice, budgets: Budgets) -> tuple[Choice, Budgets]:
    """What a block in parts (expert groups) does without: GPU updates, resident units, kept blocks and tiles."""
    if (fixed.groups or 1) == 1:
        return fixed, budgets
    fixed = replace(fixed, gpu_updates=0, speculate_gpu=False, keep=0, tile=0, keep_attention=0)
    return fixed, replace(budgets, resident_gb=0.0)


def _held(job: Job, budgets: Budgets, hw: HardwareSpec, fixed: Choice, groups: int) -> bool:
    """Whether blocks in these expert groups fit the GPU with host and disk to spare: where they do not, a miss
    short of host or disk would miss the GPU once those were raised."""
    ample = replace(budgets, host_gb=AMPLE_GB, nvme_gb=AMPLE_GB if budgets.nvme_gb else budgets.nvme_gb)
    return plan(job, ample, hw, replace(fixed, groups=groups), any_fit=True).fits


def _miss_order(m: Miss) -> tuple:
    """Misses in the order a report prefers them (see plan)."""
    return (_shorts(m), m.short == Short.GPU, m.least_host, m.need - m.have)


def _shorts(m: Miss) -> int:
    """How many budgets a miss needs more of, as far as it got."""
    return sum(need > have for need, have in m.demand.values())


def settled(fixed: Choice, budgets: Budgets, hw: HardwareSpec) -> tuple[Choice, Budgets]:
    """What a device whose memory is the host's (HardwareSpec.unified) leaves to the plan: none of the choices."""
    if not hw.unified:
        return fixed, budgets
    fixed = replace(
        fixed,
        activations=fixed.activations or "gpu",
        speculate=0 if fixed.speculate is None else fixed.speculate,
        keep=0 if fixed.keep is None else fixed.keep,  # the device's memory is the host's
        keep_attention=fixed.keep_attention or 0,
        gpu_updates=0 if fixed.gpu_updates is None else fixed.gpu_updates,
        speculate_gpu=bool(fixed.speculate_gpu),
    )
    return fixed, replace(budgets, resident_gb=0.0 if budgets.resident_gb == "auto" else budgets.resident_gb)


def evaluate(job: Job, choice: Choice, budgets: Budgets, hw: HardwareSpec) -> Plan | Miss:
    """The plan of one choice (its micro-batch, stream and checkpoints' home set; "split": the checkpoints of
    the last blocks on the GPU as far as it has room, then in the RAM the whole state leaves, the rest on NVMe),
    in three stages, each a value or the miss that ends it: its memory (memory.memory_fit), its updates
    (update_search) and the plan (planned: the RunPlan a run obeys, and its prediction). Where the order of the
    spill is left to the plan and Adam moments spill, the gradients spilled first instead where that is faster:
    the same bytes on the disk, but half of them in the backward pass rather than beside the next forward one."""
    first = _evaluate(job, choice, budgets, hw)
    if choice.spill is not None or not first.fits or Kind.EXP_AVG not in first.memory.nvme:
        return first
    other = _evaluate(job, replace(choice, spill="gradients"), budgets, hw)
    return other if other.fits and _expected(other) < _expected(first) * (1 - 1e-9) else first


def _evaluate(job: Job, choice: Choice, budgets: Budgets, hw: HardwareSpec) -> Plan | Miss:
    """evaluate, in the choice's spill order (moments first where it leaves it open)."""
    got = memory_fit(job, choice, budgets, hw)
    if isinstance(got, Miss):
        return got
    mem, fit = got
    best = update_search(job, choice, mem, fit)
    if isinstance(best, Miss):
        return best
    return planned(job, mem, fit, best)


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


def update_search(job: Job, choice: Choice, mem: Memory, fit: Fit) -> Candidate | Miss:
    """The fastest way to run the updates that fits the GPU and the host: for each number of units updated on the
    GPU (choice.gpu_updates, or each that fits), speculating on the GPU or not, the number the host speculates
    (choice.speculate, or the best); or the miss of the budget none fits."""
    s = fit.shape
    numels, cands = s.numels, gpu_candidates(fit.in_ram, s.kb)
    counts = _counts(len(cands)) if choice.gpu_updates is None else [min(choice.gpu_updates, len(cands))]
    best, short, sets = None, None, 0
    spec_gpu = choice.speculate_gpu
    for k, ge in [
        (k, ge)
        for k in counts
        for ge in ((False, True) if k and spec_gpu is None else (bool(k and spec_gpu),))
    ]:
        gpu = gpu_updated(cands, k, ge)
        sets = 2 * 16 * max((numels[u] for u in gpu), default=0)  # two (master, grad, moments) sets
        if mem.gpu.total + sets > s.gpu_budget:
            continue
        tried = _speculation(job, choice, mem, fit, gpu, k, ge, sets)
        if isinstance(tried, float):
            short = tried
        elif tried is not None and (best is None or tried.step_s < best.step_s * (1 - 1e-9)):
            best = tried
    if best is not None:
        return best
    if short is not None:
        need = (s.host_budget + short) * job.ranks_per_host + s.beside
        return s.miss(
            Short.COPIES,
            f"host: the copies of the speculative update need {gb(short * job.ranks_per_host)} more than "
            f"--host-gb holds; raise --host-gb to {budget(need)} or lower optim.speculate_units",
            mem,
            need,
            need=need,
            have=s.host_given,
        )
    need = mem.gpu.total + sets
    return s.miss(
        Short.GPU, f"GPU: needs {gb(need)} of {gb(s.gpu_budget)} usable", mem, need=need, have=s.gpu_budget
    )


def _speculation(
    job: Job, choice: Choice, mem: Memory, fit: Fit, gpu: list[int], k: int, ge: bool, sets: int
) -> Candidate | float | None:
    """With these GPU updates, the number of units the host speculates (the choice's, or the best, with
    SPEC_MARGIN): the candidate, or the host bytes its copies lack."""
    s, clipping, speculate = fit.shape, job.clipping, choice.speculate
    numels = s.numels
    # units the host updates from RAM, in the order the speculated ones are taken
    on_gpu_set = set(gpu)
    host = alternate_from_last([u for u in fit.in_ram if u not in on_gpu_set], len(fit.in_ram))
    # copies[n]: host bytes of the copies of the first n, after those of the GPU updates if speculated
    first = sum(copy_bytes(numels[u], host_cost) for u in gpu) if ge and clipping else 0
    copies = [*accumulate((copy_bytes(numels[u], host_cost) if clipping else 0 for u in host), initial=first)]
    params = [0, *accumulate(numels[u] for u in host)]  # params[n]: parameters of the first n
    if copies[0] > fit.room:
        return copies[0] - fit.room
    most = max(n for n in range(len(copies)) if copies[n] <= fit.room)
    on_gpu = sum(numels[u] for u in gpu)

    base = links(job, mem, fit, on_gpu, gpu_speculated=ge)  # what the number speculated does not change

    def timed(n: int) -> tuple[float, Candidate]:
        t, bwd, fwd = with_updates(base, params[n])
        return bwd + fwd, Candidate(k, ge, n, copies[n], sets, t, bwd, fwd)

    if speculate is not None and copies[min(speculate, len(host))] > fit.room:
        return copies[min(speculate, len(host))] - fit.room
    best = None
    for _, c in [timed(min(speculate, len(host)))] if speculate is not None else _least(timed, most):
        if speculate is None and c.speculated:  # a margin: the step is the same, and the host may be faster
            c = timed(
                next(
                    (
                        n
                        for n in range(c.speculated, most + 1)
                        if params[n] >= SPEC_MARGIN * params[c.speculated]
                    ),
                    most,
                )
            )[1]
        if best is None or c.bwd + c.fwd < (best.bwd + best.fwd) * (1 - 1e-9):
            best = c
    return best


def planned(job: Job, mem: Memory, fit: Fit, best: Candidate) -> Plan:
    """The one constructor of a Plan: the search's candidate's memory, its prediction (times, what limits each
    phase, rates; the same step while the global norm clips), and the RunPlan of its units."""
    s, spec = fit.shape, job.spec
    mem = replace(mem, gpu=replace(mem.gpu, sets=best.sets), copies=best.copies)
    cands = gpu_candidates(fit.in_ram, s.kb)
    # each update mode's units, as the runtime takes
    gpu = gpu_updated(cands, best.gpu_updates, best.gpu_speculated)
    t, step = best.times, best.bwd + best.fwd
    clipped, clipped_step = t, step
    if job.clipping and (best.speculated or best.gpu_speculated):
        ct, cb, cf = step_times(job, mem, fit, sum(s.numels[u] for u in gpu), 0)
        clipped, clipped_step = ct, cb + cf
    F, T = spec.flops_per_token(job.seq_len), job.rows * job.seq_len
    # the whole batch's, every rank's
    prediction = Prediction(
        frozen(t),
        step,
        frozen(clipped),
        clipped_step,
        _bottleneck(t, best.bwd, best.fwd),
        T * job.gpus / step,
        F * T * job.gpus / step / 1e12,
    )
    host = alternate_from_last([u for u in fit.in_ram if u not in set(gpu)], len(fit.in_ram))
    nl = spec.num_hidden_layers
    homes = checkpoint_homes(nl - mem.kept, mem.checkpoints)
    outs = attention_blocks(spec, job.seq_len, mem.kept)[: mem.kept_attention]
    units = unit_plans(
        [u.name for u in spec.units()],
        fit.where,
        s.resident,
        gpu,
        best.gpu_speculated,
        host[: best.speculated],
        range(nl + 1 - mem.kept, nl + 1),
        homes,
        outs,
    )
    return Plan(job, replace(s.run_plan, units=units), mem, prediction, s.source, job.ranks_per_host)


def _bottleneck(t: dict, bwd: float, fwd: float) -> str:
    """What limits the step: of the backward pass, then of the forward pass with the update beside it."""
    limits = {
        "compute": (t["compute bwd"], t["compute fwd"]),
        "H2D": (t["H2D bwd"], t["H2D fwd"]),
        "D2H": (t["D2H"], t["D2H fwd"]),
        "PCIe both ways": (None, t["PCIe both fwd"]),
        "host AdamW": (t["host AdamW bwd"], t["host AdamW"]),
        "host DRAM": (t["host DRAM bwd"], t["host DRAM fwd"]),
        "NVMe": (t["NVMe bwd"], max(t["NVMe"], t["NVMe checkpoints fwd"])),
        "GPU links": (t["peer bwd"], t["peer fwd"]),
    }
    phase = {name: (bwd if b == bwd else 0) + (fwd if f == fwd else 0) for name, (b, f) in limits.items()}
    return max(phase, key=phase.get)


def checkpoint_homes(blocks: int, counts: dict[Home, int]) -> dict[int, Home]:
    """The home of each recomputed block's checkpoint (blocks 1..`blocks`), `counts` of them per home: NVMe's
    spread evenly from the first block (each write and read then has the blocks between to hide behind; a run of
    first blocks made the forward pass wait for the disk, with two blocks on their way down at most, as it then
    allowed), then the GPU's from the last block back (the first the backward pass needs), the host's for the rest."""
    n = min(counts.get(Home.NVME, 0), blocks)
    nvme = {1 + i * blocks // n for i in range(n)}
    rest = [b for b in range(blocks, 0, -1) if b not in nvme]
    gpu = min(counts.get(Home.GPU, 0), len(rest))
    return {b: Home.NVME for b in nvme} | {b: Home.GPU if i < gpu else Home.HOST for i, b in enumerate(rest)}


def _counts(n: int) -> list[int]:
    """The numbers of GPU-updated units the search tries: each of 0..n up to GPU_UPDATE_COUNTS units, evenly
    spaced counts for deeper models (each try costs O(units): thousands of layers must still plan in seconds)."""
    most = max(16, min(GPU_UPDATE_COUNTS, 50_000 // max(n, 1)))
    return (
        list(range(n + 1))
        if n <= GPU_UPDATE_COUNTS
        else sorted({round(i * n / most) for i in range(most + 1)})
    )


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


def _expected(p: Plan) -> float:
    """The step a resident budget is chosen by: with clipping on, a step whose norm clips is as likely as not."""
    pr = p.prediction
    return (pr.step_s + pr.clipped_step_s) / 2 if p.job.clipping else pr.step_s


def resident_room(at, budgets: Budgets, hw: HardwareSpec, zero: Plan | Miss | None = None) -> float:
    """GPU memory (GB) resident state can take in the choice `at` plans (a function of Budgets): what the
    choice leaves with nothing resident (`zero`, where planned already), or, for a state the host and disk
    cannot hold (which may fit with part of it on the GPU), what it leaves with room on the host."""
    room = (
        zero
        if zero is not None and (zero.fits or zero.short == Short.GPU)
        else at(replace(budgets, resident_gb=0.0, host_gb=1e6))
    )
    return spare_gb(room.memory, budgets, hw) if room.fits else 0.0


def spare_gb(mem: Memory, budgets: Budgets, hw: HardwareSpec) -> float:
    """GPU memory (GB) a plan of memory `mem` leaves unused or gives to what resident state can replace (kept
    activations, GPU updates' state sets), within the usable part of the budget."""
    g = mem.gpu
    used = g.total - (g.kept or 0) - (g.sets or 0) - (g.kept_attention or 0) + mem.kept_checkpoints
    return (budgets.gpu_gb if budgets.gpu_gb is not None else hw.gpu_mem_gb) * GPU_RESERVE - used / 1e9
