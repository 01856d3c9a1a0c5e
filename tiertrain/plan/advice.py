"""What a capacity report adds to the plan the search chose: single changes with their predicted gain, the largest
model of its shape that fits the same budgets, and with an NVMe tier the least host budget. Pure Python."""
from __future__ import annotations

from dataclasses import replace

from ..model.spec import ModelSpec
from .hardware import HardwareSpec
from .planner import LARGEST_LAYERS, LONGEST_SEQ, PROCESS_GB, Budgets, Plan, evaluate, plan, resident_room, spare_gb


def explain(spec: ModelSpec, p: Plan, budgets: Budgets, hw: HardwareSpec, gpu_updates: int,
             clipping: bool = True) -> Plan:
    """What the report adds to the chosen plan: advice, the largest model of its shape that fits these
    budgets, and with an NVMe tier the least host budget of its choice."""
    chosen = replace(budgets, resident_gb=p.resident_gb)  # "auto" settled
    p.advice = advice(spec, p, chosen, hw)
    p.largest_layers, p.largest_params = largest(spec, p, budgets, hw)
    p.longest_seq_len, p.longest_bound = longest(spec, p, budgets, hw)
    if budgets.nvme_gb:
        p.least_host = evaluate(spec, p.batch, p.seq_len, p.dtype, p.micro_batch, p.stream, p.activations, chosen,
                                hw, p.model, gpu_updates, least=True, clipping=clipping,
                                speculate=p.speculated, speculate_gpu=p.gpu_speculated,
                                ck_dtype=p.checkpoint_dtype).least_host
    return p


def advice(spec: ModelSpec, p: Plan, budgets: Budgets, hw: HardwareSpec) -> list[str]:
    """Single changes, each with its predicted gain, best first."""
    tries = []
    if p.nvme_bytes:
        need = p.host_total / 1e9 + sum(p.nvme_bytes.values()) / 1e9 - p.host_fixed.get("staging ring", 0) / 1e9
        tries.append((f"+{need - (budgets.host_gb or hw.host_ram_gb - PROCESS_GB):.0f} GB host RAM "
                      "(NVMe traffic gone)", replace(budgets, host_gb=need)))
    spare = spare_gb(p, budgets, hw)
    if spare > 1.0:  # the GPU's free memory holding whole units' state, updated there
        gb = int(p.resident_gb + spare * 0.9)
        tries.append((f'tiers.gpu_resident_gb = {gb} (GPU memory the plan leaves free; "auto" takes it)',
                      replace(budgets, resident_gb=gb)))
    tries.append(("twice the batch (tokens per step)", None))
    out = []
    for text, b in tries:
        q = plan(spec, p.batch * (1 if b else 2), p.seq_len, p.dtype, b or budgets, hw, advise=False,
                 ck_dtype=p.checkpoint_dtype)
        if q.fits and q.tokens_per_s > p.tokens_per_s * 1.01:
            out.append((q.tokens_per_s / p.tokens_per_s, f"{text}: {q.tokens_per_s / p.tokens_per_s:.2f}x the tokens/s"))
    return [t for _, t in sorted(out, reverse=True)]


def largest(spec: ModelSpec, p: Plan, budgets: Budgets, hw: HardwareSpec) -> tuple[int, int]:
    """The most decoder layers of this shape that still fit the budgets (binary search, up to
    LARGEST_LAYERS). Memory alone decides, so each try plans the plan's micro-batch with nothing
    speculated or updated on the GPU (what costs the least memory), with a resident budget "auto" at all
    the GPU memory left: a few candidates, O(layers) each."""
    def fits(n: int) -> bool:
        return _fits(replace(spec, num_hidden_layers=n), p, p.batch, p.seq_len, p.micro_batch, budgets, hw)[0]

    lo = _most(fits, spec.num_hidden_layers, LARGEST_LAYERS)
    return lo, replace(spec, num_hidden_layers=max(lo, 1)).n_params if lo else 0


def _most(fits, start: int, cap: int) -> int:
    """The largest n <= cap with fits(n), 0 if none, fits being monotone: doubling from `start`, then halving."""
    lo, hi = (start, 2 * start) if fits(start) else (0, start)
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _fits(spec: ModelSpec, p: Plan, batch: int, seq_len: int, micro: int, budgets: Budgets,
          hw: HardwareSpec) -> tuple[bool, str]:
    """(whether `spec` at this batch fits the budgets in the least memory: nothing speculated or updated on
    the GPU, either stream, any checkpoint home or their split, a resident budget "auto" at all the GPU memory left; the budget the
    misses are short of, each named once: "GPU", "host", "NVMe")."""
    short: list[str] = []
    for stream in ("compute", "master") if p.dtype == "bfloat16" else ("master",):
        for acts in ("gpu", "host", "split"):
            def at(b: Budgets) -> Plan:
                return evaluate(spec, batch, seq_len, p.dtype, micro, stream, acts, b, hw, gpu_updates=0, speculate=0,
                                ck_dtype=p.checkpoint_dtype)
            # "auto": all the GPU leaves (the most memory resident state can add)
            resident = int(resident_room(at, budgets, hw)) if budgets.resident_gb == "auto" else p.resident_gb
            q = at(replace(budgets, resident_gb=resident))
            if q.fits:
                return True, ""
            short.append({"ring": "host", "copies": "host"}.get(q.short_of, q.short_of))
    return False, ", ".join(sorted(set(short), key=("GPU", "host", "NVMe").index))


def longest(spec: ModelSpec, p: Plan, budgets: Budgets, hw: HardwareSpec) -> tuple[int, str]:
    """The longest sequence, in multiples of 1024 tokens, that one sequence per step (batch 1) can train with
    under these budgets (binary search up to LONGEST_SEQ), and the budgets the next 1024 tokens miss
    ("GPU": its memory for the working set and activations; "host"; "NVMe"; comma-separated)."""
    def fits(n: int) -> tuple[bool, str]:
        return _fits(spec, p, 1, n * 1024, 1, budgets, hw)

    n, cap = _most(lambda n: fits(n)[0], 1, LONGEST_SEQ // 1024), LONGEST_SEQ // 1024
    return n * 1024, "" if n == cap else fits(n + 1)[1]
