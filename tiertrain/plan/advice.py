"""What a capacity report adds to the plan the search chose: single changes with their predicted gain, the largest
model of its shape that fits the same budgets, and with an NVMe tier the least host budget. Pure Python."""

from __future__ import annotations

import functools
from dataclasses import replace
from itertools import product

from ..model.parts import group_options
from ..model.spec import MOST_LAYERS
from ..modes import Update
from ..sizes import budget
from .hardware import HardwareSpec
from .memory import least_host_of
from .planner import evaluate, groupable, in_parts, plan, resident_room, settled, spare_gb
from .values import Budgets, Choice, Job, Miss, Plan, Report, Short

LARGEST_LAYERS = MOST_LAYERS  # the largest-model search stops at the deepest model allowed: "at least"
LONGEST_SEQ = 1 << 24  # the longest-sequence search stops here (16M tokens): the report then says "at least"


def explain(
    job: Job, p: Plan | Miss, budgets: Budgets, hw: HardwareSpec, fixed: Choice = Choice()
) -> Plan | Miss:
    """The chosen plan `p` of `job` (planner.plan's, with these budgets and `fixed`), with what the report adds:
    advice, the largest model of its shape that fits these budgets, the longest sequence, and with an NVMe tier
    the least host budget of its choice. A miss is returned as it is."""
    if not p.fits:
        return p
    fixed, budgets = settled(fixed, budgets, hw)
    rp = p.run_plan
    chosen = replace(budgets, resident_gb=rp.resident_gb)  # "auto" settled
    groups = _groups(job, p, fixed, budgets)
    layers, params = largest(job, p, budgets, hw, groups)
    seq, bound, budgets_seq = longest(job, p, budgets, hw, groups)
    least = 0.0
    if budgets.nvme_gb:  # the least host budget of this choice
        exact = Choice(
            rp.micro_batch,
            rp.stream,
            rp.activations,
            fixed.gpu_updates,
            rp.count(Update.HOST_SPECULATED),
            bool(rp.count(Update.GPU_SPECULATED)),
            keep=0,
            groups=rp.expert_groups,
        )
        least = least_host_of(job, in_parts(exact, chosen)[0], chosen, hw)
    found = Report(tuple(advice(job, p, chosen, hw)), layers, params, seq, bound, least, budgets_seq)
    return replace(p, report=found)


def advice(job: Job, p: Plan, budgets: Budgets, hw: HardwareSpec) -> list[str]:
    """Single changes, each with its predicted gain, best first."""
    # the plan's bytes are a rank's; budgets, advice the host's
    tries, ranks, mem = ([], job.ranks_per_host, p.memory)
    rate = p.prediction.tokens_per_s
    if mem.nvme:
        need = (mem.host_total / 1e9 + sum(mem.nvme.values()) / 1e9 - mem.ring / 1e9) * ranks
        tries.append(
            (
                f"--host-gb {budget(need * 1e9)}, {need - (budgets.host_gb or hw.host_ram_gb):,.0f} GB more host "
                "RAM (NVMe traffic gone)",
                replace(budgets, host_gb=need),
            )
        )
    spare = spare_gb(mem, budgets, hw)
    if spare > 1.0:  # the GPU's free memory holding whole units' state, updated there
        gb = int(p.run_plan.resident_gb + spare * 0.9)
        tries.append(
            (
                f"tiers.gpu_resident_gb = {gb} (its resident state and 90% of the GPU memory it leaves free)",
                replace(budgets, resident_gb=gb),
            )
        )
    tries.append(("twice the batch (tokens per step)", None))
    out = []
    for text, b in tries:  # each variant of the same job, with every choice left to the plan
        q = plan(replace(job, batch=job.batch * (1 if b else 2)), b or budgets, hw)
        if q.fits and q.prediction.tokens_per_s > rate * 1.01:
            gain = q.prediction.tokens_per_s / rate
            out.append((gain, f"{text}: {gain:.2f}x the tokens/s"))
    return [t for _, t in sorted(out, reverse=True)]


def largest(
    job: Job, p: Plan, budgets: Budgets, hw: HardwareSpec, groups: tuple[int, ...]
) -> tuple[int, int]:
    """The most decoder layers of this shape that still fit the budgets (up to LARGEST_LAYERS). Memory alone
    decides, so each try plans the plan's micro-batch in one of the least-memory choices (_least), with a
    resident budget "auto" at all the GPU memory left: O(layers) each."""
    spec = job.spec

    @functools.cache  # one spec of n layers for every choice tried there: its units and slabs are built once
    def at(n: int) -> Job:
        return replace(job, spec=spec.with_layers(n))

    def fits(c: Choice, n: int) -> bool:
        return _fits_in(at(n), p, c, budgets, hw).fits

    # a little short of where the whole state's bytes, resident ones included, would fill the host and the disk:
    # where the search starts, with steps of a 32nd of it (any start gives the same answer; one that fits costs
    # the fewest plans)
    mem = p.memory
    state = sum(mem.host.values()) + sum(mem.nvme.values()) + mem.gpu.resident
    host = budgets.host_gb if budgets.host_gb is not None else hw.host_ram_gb  # None: the machine's RAM
    room = (host + (budgets.nvme_gb or 0)) * 1e9
    guess = int(0.9 * spec.num_hidden_layers * room / state) if state and room else spec.num_hidden_layers
    least = _least(job, p.run_plan.micro_batch, groups)
    lo = _most_of_any(fits, least, guess, LARGEST_LAYERS, max(1, guess // 32))
    return lo, spec.with_layers(max(lo, 1)).n_params if lo else 0


def _most_of_any(fits, choices: list[Choice], start: int, cap: int, step: int = 1) -> int:
    """The largest n <= cap that some choice fits (fits(choice, n), monotone in n for each), 0 if none: the first
    choice's largest (_most), then each other choice's where it fits one more. A choice that does not costs one
    try, where asking every choice at each n of one search costs them all at each miss."""
    memo: dict[tuple[Choice, int], bool] = {}

    def once(c: Choice, n: int) -> bool:
        if (c, n) not in memo:
            memo[c, n] = fits(c, n)
        return memo[c, n]

    best = _most(lambda n: once(choices[0], n), start, cap, step)
    for c in choices[1:]:
        if best < cap and once(c, best + 1):
            best = _most(lambda n, c=c: once(c, n), best + 1, cap, step)
    return best


def _most(fits, start: int, cap: int, step: int = 1) -> int:
    """The largest n <= cap with fits(n), 0 if none, fits being monotone: steps doubling from `step`, from `start`
    (clamped to 1..cap) up while n fits, or down while it does not, then halving the bracket."""
    g = min(max(start, 1), cap)
    if fits(g):
        lo = g
        while lo + step <= cap and fits(lo + step):
            lo, step = lo + step, step * 2
        hi = min(lo + step, cap + 1)
    else:
        hi = g
        while hi - step >= 1 and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(hi - step, 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _groups(job: Job, p: Plan, fixed: Choice, budgets: Budgets) -> tuple[int, ...]:
    """The expert groups the report's searches try: the plan's, then any other the plan could have chosen."""
    mine = p.run_plan.expert_groups
    free = fixed.groups is None and groupable(job, fixed, budgets)
    return (mine, *(g for g in group_options(job.spec.num_experts) if free and g != mine))


def _least(job: Job, micro: int, groups: tuple[int, ...]) -> list[Choice]:
    """The choices that take the least memory at this micro-batch: nothing speculated or updated on the GPU,
    either stream, any checkpoint home or their split, any of these expert `groups`; the splits first (where
    anything fits, a split nearly always does: the searches then cost one try a step), the master stream first
    (no compute-dtype copy on the host: where the host or the disk bounds a search, it fits the most), the groups
    in their order."""
    streams = ("master", "compute") if job.dtype == "bfloat16" else ("master",)
    # either spill order takes the same memory: one is enough to say whether it fits
    return [
        Choice(micro, stream, acts, gpu_updates=0, speculate=0, keep=0, groups=g, spill="moments")
        for g, acts, stream in product(groups, ("split", "gpu", "host"), streams)
    ]


def _fits_in(job: Job, p: Plan, least: Choice, budgets: Budgets, hw: HardwareSpec) -> Plan | Miss:
    """The plan of `job` in the choice `least` (its blocks in parts as its expert groups say), with a resident
    budget "auto" at all the GPU memory left (the most memory resident state can add), else the plan's."""
    least, budgets = in_parts(least, budgets)

    def at(b: Budgets) -> Plan | Miss:
        return evaluate(job, least, b, hw)

    # not "auto": the config's, the plan's too
    resident = int(resident_room(at, budgets, hw)) if budgets.resident_gb == "auto" else budgets.resident_gb
    return at(replace(budgets, resident_gb=resident))


def _fits(
    job: Job, p: Plan, micro: int, budgets: Budgets, hw: HardwareSpec, groups: tuple[int, ...]
) -> tuple[bool, str]:
    """(whether `job` fits the budgets in one of the least-memory choices (_least); the budgets the misses are
    short of, each named once: "GPU", "host", "NVMe")."""
    short: list[str] = []
    # a miss tries every choice, so the answer does not depend on the order
    for c in _least(job, micro, groups):
        q = _fits_in(job, p, c, budgets, hw)
        if q.fits:
            return True, ""
        short.append({Short.RING: "host", Short.COPIES: "host"}.get(q.short, q.short.value))
    return False, ", ".join(sorted(set(short), key=("GPU", "host", "NVMe").index))


def longest(
    job: Job, p: Plan, budgets: Budgets, hw: HardwareSpec, groups: tuple[int, ...]
) -> tuple[int, str, int]:
    """The longest sequence that one sequence per step (batch 1) can train with: the budgets' longest, in multiples
    of 1024 tokens (binary search up to LONGEST_SEQ), within the model's positions (max_position_embeddings);
    what bounds it (the budgets the next 1024 tokens miss, comma-separated: "GPU": its memory for the working set
    and activations; "host"; "NVMe"; or "positions"); and the budgets' longest."""

    def at(n: int) -> Job:
        return replace(job, batch=job.gpus, seq_len=n * 1024)  # one row per rank

    cap = LONGEST_SEQ // 1024
    n = _most_of_any(lambda c, n: _fits_in(at(n), p, c, budgets, hw).fits, _least(job, 1, groups), 1, cap)
    positions = job.spec.max_position_embeddings
    if positions < n * 1024:
        return positions, "positions", n * 1024
    return n * 1024, "" if n == cap else _fits(at(n + 1), p, 1, budgets, hw, groups)[1], n * 1024
