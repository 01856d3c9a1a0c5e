"""The one-pass host AdamW's rate with and without streamed (non-temporal) stores, at several thread
counts, alone and while PCIe copies load the host's DRAM as a training step's do.

    python -m bench.host_kernel [--params 134217728] [--out results.md]

Why: into a speculation's copies, streamed stores ran at half the in-place rate on two of three hosts
(bench/results/2026-11-22-H200-llama3b-one-pass-8k.md), and in a training step the host AdamW shares
DRAM with the gradients' and weights' copies. Rows: G params/s of in place (the bf16 copy written with
plain or streamed stores) and into copies (the state's and the copy's stores each plain or streamed).
"""
from __future__ import annotations

import argparse
import os
import platform
import threading
import time

import torch

from tiertrain.optim import kernel
from tiertrain.optim.adamw import adam_threads
from tiertrain.plan.probe import host_adam_rate

MODES = [  # (label, into_copies, stores)
    ("in place, copy plain", False, 0),
    ("in place, copy streamed", False, kernel.STREAM_COPY),
    ("into copies, all plain", True, 0),
    ("into copies, state streamed", True, kernel.STREAM_STATE),
    ("into copies, all streamed", True, kernel.STREAM_STATE | kernel.STREAM_COPY),
    # software prefetch of master, gradient and moments N blocks (256 B of each) ahead
    *((f"in place, copy streamed, prefetch {n}", False, kernel.STREAM_COPY | kernel.prefetch(n)) for n in (4, 16, 64)),
    ("into copies, all streamed, prefetch 16", True, kernel.STREAM_STATE | kernel.STREAM_COPY | kernel.prefetch(16)),
]


class Traffic:
    """H2D and D2H copies of pinned buffers, back to back on two streams, until stopped: the DRAM load
    of a training step's weight loads and gradient drains. `gbs()`: both directions' GB/s since start."""

    def __init__(self, both: bool, nbytes: int = 1 << 30):
        self.both = both
        n = nbytes // 4
        self.nbytes = nbytes
        self.host = [torch.empty(n, pin_memory=True) for _ in range(2)]
        self.dev = [torch.empty(n, device="cuda") for _ in range(2)]
        self.streams = [torch.cuda.Stream() for _ in range(2)]
        self.stop, self.moved = threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            with torch.cuda.stream(self.streams[0]):
                self.dev[0].copy_(self.host[0], non_blocking=True)
            if self.both:
                with torch.cuda.stream(self.streams[1]):
                    self.host[1].copy_(self.dev[1], non_blocking=True)
            for s in self.streams:
                s.synchronize()
            self.moved += (1 + self.both) * self.nbytes

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.seconds = time.perf_counter() - self.t0

    def gbs(self) -> float:
        return self.moved / self.seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=1 << 27)
    ap.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 2, adam_threads()])
    ap.add_argument("--out", default=None, help="markdown file to write")
    a = ap.parse_args()
    if kernel.load() is None:
        raise SystemExit(f"the one-pass kernel did not build: {kernel.reason()}")
    loads = ["alone"] + (["H2D", "H2D + D2H"] if torch.cuda.is_available() else [])
    lines = [f"# host AdamW kernel: streamed vs plain stores, {a.params / 1e6:.0f} M params",
             "", f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
             f"- host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; GPU: "
             f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}",
             f"- command: `python -m bench.host_kernel --params {a.params}`",
             "- G params/s, median of 3; load 'H2D' ('H2D + D2H'): pinned copies to (and from) the GPU back "
             "to back meanwhile, their GB/s in the last column", "",
             "| threads | load | " + " | ".join(m[0] for m in MODES) + " | PCIe GB/s |",
             "| --- | --- | " + " | ".join("---" for _ in MODES) + " | --- |"]
    print("\n".join(lines), flush=True)
    for threads in a.threads:
        for load in loads:
            def rates():
                return [host_adam_rate(a.params, True, 3, into, stores=st, threads=threads) / 1e9 for _, into, st in MODES]

            if load == "alone":
                r, gbs = rates(), "-"
            else:
                with Traffic(both=load != "H2D") as t:
                    r = rates()
                gbs = f"{t.gbs():.0f}"
            row = f"| {threads} | {load} | " + " | ".join(f"{x:.2f}" for x in r) + f" | {gbs} |"
            lines.append(row)
            print(row, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
