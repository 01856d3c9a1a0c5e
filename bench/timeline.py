"""Where the host optimizer's time goes in a step, from Updates.timeline (OptimizerThread's marks and the step's).

The timeline holds (event, unit, seconds) marks: the trainer's "step" and "backward" (the forward pass
has waited for every update: the backward pass starts), the optimizer's "norm" (the global norm is known,
the update starts), each host job's "job" (the worker picks it up), "grad" (its gradient has landed) and
"done", prefixed "spec " for a speculative update in the backward pass, and "wait" / "waited" where the
next forward pass blocked on a unit. The update of step k runs beside the forward pass of step k+1, so a step is summarised only
when the next one's marks are there too.
"""

from __future__ import annotations

from statistics import median

FIELDS = {  # summary key -> what it is (the report's column note)
    "bwd_s": "backward pass: its start to the norm",
    "spec_busy_s": "speculative host updates running (grad landed to done)",
    "spec_grad_wait_s": "speculative jobs waiting for their gradient",
    "spec_late_s": "last speculative update done, after the norm (negative: before)",
    "spec_gparams_s": "speculative update rate, G params/s",
    "upd_queued_s": "norm to the first non-speculative update starting",
    "upd_busy_s": "non-speculative host updates running",
    "upd_gparams_s": "their rate, G params/s",
    "upd_end_s": "last update done, after the next step's start",
    "fwd_wait_s": "next forward pass blocked on updates",
}


def _marks(events: list, name: str) -> list[float]:
    return [t for e, _, t in events if e == name]


def _jobs(events: list, prefix: str, lo: float, hi: float) -> list[tuple[int, float, float, float]]:
    """(unit, picked up, gradient landed, done) of the jobs of this kind done in (lo, hi]."""
    out, start, grad = [], {}, {}
    for e, u, t in events:
        if e == prefix + "job":
            start[u] = t
            grad.pop(u, None)
        elif e == prefix + "grad":
            grad[u] = t
        elif e == prefix + "done" and lo < t <= hi and u in start:
            out.append((u, start[u], grad.get(u, start[u]), t))
    return out


def summarize(events: list, numels: list[int], host: set[int] | None = None) -> dict[str, float]:
    """Medians over the steps whose update ran within the log (see the module's docstring), of the updates
    of the `host` units (None: all). Runs recorded before the step's rewrite (4f06fac) ran resident units'
    GPU updates on the worker too, in a millisecond or two: counted, they pass for a fast host AdamW."""
    steps, backs, norms = _marks(events, "step"), _marks(events, "backward"), _marks(events, "norm")
    per: dict[str, list[float]] = {k: [] for k in FIELDS}
    for k in range(min(len(steps), len(backs), len(norms)) - 1):
        b, n, s1, b1 = backs[k], norms[k], steps[k + 1], backs[k + 1]
        spec, upd = (
            [j for j in _jobs(events, kind, lo, b1) if host is None or j[0] in host]
            for kind, lo in (("spec ", b), ("", n))
        )
        waits = [t for e, _, t in events if e in ("wait", "waited") and s1 <= t <= b1]
        per["bwd_s"].append(n - b)
        busy = sum(d - g for _, _, g, d in spec)
        per["spec_busy_s"].append(busy)
        per["spec_grad_wait_s"].append(sum(g - j for _, j, g, _ in spec))
        per["spec_late_s"].append(max(d for *_, d in spec) - n if spec else 0.0)
        per["spec_gparams_s"].append(sum(numels[u] for u, *_ in spec) / busy / 1e9 if busy else 0.0)
        busy = sum(d - g for _, _, g, d in upd)
        per["upd_queued_s"].append(min(j for _, j, _, _ in upd) - n if upd else 0.0)
        per["upd_busy_s"].append(busy)
        per["upd_gparams_s"].append(sum(numels[u] for u, *_ in upd) / busy / 1e9 if busy else 0.0)
        per["upd_end_s"].append(max(d for *_, d in upd) - s1 if upd else 0.0)
        per["fwd_wait_s"].append(sum(waits[1::2]) - sum(waits[0::2]))
    return {k: median(v) for k, v in per.items() if v}


def host_units(row: dict, numels: list[int]) -> set[int] | None:
    """The units a recorded tiertrain row's host updated: as recorded, or for rows from before, all but the
    first units whose parameters are those it did not (its resident units: none of its rows had both
    resident units and GPU updates then); None when that does not add up."""
    if "host_units" in row:
        return set(row["host_units"])
    off = sum(numels) - row.get("host_adam_params", 0)
    first = [sum(numels[:k]) for k in range(len(numels) + 1)]
    return set(range(first.index(off), len(numels))) if off in first and not row.get("gpu_updates") else None


def table(rows: list[dict]) -> list[str]:
    """The report's section for the rows that carry a timeline summary."""
    rows = [r for r in rows if r.get("timeline")]
    if not rows:
        return []
    lines = [
        "",
        "## host optimizer timeline (median over the timed steps)",
        "",
        "; ".join(f"{k}: {v}" for k, v in FIELDS.items()) + ".",
        "",
        "| system | batch | " + " | ".join(FIELDS) + " |",
        "| --- | --- | " + "--- | " * len(FIELDS),
    ]
    for r in rows:
        t = r["timeline"]
        lines.append(
            f"| {r['system']} | {r['batch']} | "
            + " | ".join(f"{t.get(k, float('nan')):.3f}" for k in FIELDS)
            + " |"
        )
    return lines
