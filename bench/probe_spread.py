"""How much the probe's host AdamW rate moves between calls: python -m bench.probe_spread [--rounds 4]

Alternates the probe as it ran before 2026-11-23 (the calling thread with every core, pageable memory,
the median of 3 updates) with the probe as the runtime runs its updates (plan.probe.host_adam_rate's
defaults: a worker thread with optim.adamw.adam_threads, pinned slabs where a GPU is, the median of 5),
each with the rounding into the bf16 copy; fresh buffers every call, as each probe allocates its own.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from tiertrain.plan.probe import host_adam_rate

WAYS = {"before: every core, pageable, 3": dict(threads=os.cpu_count() or 2, pin=False, reps=3),
        "now: as the runtime, pinned, 5": {}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    got: dict[str, list[float]] = {k: [] for k in WAYS}
    for _ in range(a.rounds):
        for k, kw in WAYS.items():
            got[k].append(host_adam_rate(**kw) / 1e9)
    print(f"# probe spread, {time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} CPUs, "
          f"`python -m bench.probe_spread --rounds {a.rounds}`\n")
    print("| probe | G params/s (bf16 copy), in call order | median | max / min |\n| --- | --- | --- | --- |")
    for k, v in got.items():
        print(f"| {k} | {', '.join(f'{x:.2f}' for x in v)} | {statistics.median(v):.2f} | {max(v) / min(v):.2f} |")


if __name__ == "__main__":
    main()
