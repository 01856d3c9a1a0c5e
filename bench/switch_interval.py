"""The host AdamW on its worker thread while the main thread launches GPU work, per GIL switch interval.

The worker (optim.adamw.adam_pool, the runtime's) runs the one-pass kernel over units of two ranges, as
HostAdamW does: it needs the GIL back after each kernel call. The main thread meanwhile either waits
(the forward pass blocked on an update) or launches small kernels op after op (the backward pass),
holding the GIL until the interval makes it let go. Prints a markdown table: G params/s per interval.

    python -m bench.switch_interval [--params 113246208] [--units 12]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from tiertrain.optim import kernel
from tiertrain.optim.adamw import NO_COPY, adam_pool, adam_threads


def rate(k, slabs: dict, units: int, busy: bool, interval: float) -> float:
    """G params/s of `units` unit updates on the worker, the main thread launching meanwhile if `busy`."""
    n, tail = slabs["p"].numel(), 6144  # a block's norms: the second, undecayed range
    p, g, m, v, w = (slabs[x] for x in "pgmvw")

    def unit():
        for a, b, wd in ((0, n - tail, 0.1), (n - tail, n, 0.0)):
            k.adamw(p[a:b], g[a:b], m[a:b], v[a:b], p[a:b], m[a:b], v[a:b], w[a:b] if w is not None else NO_COPY,
                    1e-4, 0.9, 0.95, wd, 1e-8, 1.0, 0.0, kernel.STREAM_STATE | kernel.STREAM_COPY)

    def updates():
        t0 = time.perf_counter()
        for _ in range(units):
            unit()
        return time.perf_counter() - t0

    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    pool = adam_pool()
    try:
        pool.submit(unit).result()  # warm: the pool's threads, the pages
        f = pool.submit(updates)
        if busy:
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            x = torch.zeros(256, device=dev)
            while not f.done():
                x.mul_(1.0001)  # one small op after another: the backward pass's launches
        return units * n / f.result() / 1e9
    finally:
        pool.shutdown()
        sys.setswitchinterval(old)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=113_246_208, help="per unit (llama-3b's block)")
    ap.add_argument("--units", type=int, default=12)
    ap.add_argument("--intervals", type=float, nargs="+", default=[5e-3, 1e-3, 2e-4, 5e-5])
    a = ap.parse_args()
    k = kernel.wanted("tiertrain")
    pin = torch.cuda.is_available()
    slabs = {x: torch.rand(a.params).pin_memory() if pin else torch.rand(a.params) for x in "pgmv"}
    slabs["v"].mul_(1e-3)
    slabs["w"] = torch.empty(a.params, dtype=torch.bfloat16, pin_memory=pin)
    gpu = torch.cuda.get_device_name() if pin else "no GPU"
    print(f"# host AdamW on its worker thread, per GIL switch interval\n\n- date: "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n- host: "
          f"{torch.get_num_threads()} torch threads, {adam_threads()} AdamW threads; GPU: {gpu}\n"
          f"- command: `python -m bench.switch_interval {' '.join(sys.argv[1:])}`\n- {a.units} units of "
          f"{a.params / 1e6:.0f} M params, two kernel calls each, bf16 copy; G params/s\n\n"
          "| switch interval ms | main thread waits | main thread launches |\n| --- | --- | --- |")
    for iv in a.intervals:
        print(f"| {iv * 1e3:g} | {rate(k, slabs, a.units, False, iv):.2f} | {rate(k, slabs, a.units, True, iv):.2f} |")


if __name__ == "__main__":
    main()
