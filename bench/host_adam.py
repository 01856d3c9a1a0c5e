"""Where host AdamW's time goes: memory bandwidth vs the fused kernel and its companions.

    python -m bench.host_adam [--params 134217728]

Prints G params/s for: a plain fp32 copy (DRAM bandwidth), the fused kernel alone, + the clip
multiply, + clipping through the kernel's grad_scale, + the rounding into a bf16 copy, at several
chunk sizes and thread counts; and the update out of place (a speculative update: the chunk's
master and moments copied into other buffers, then the kernel on those), at several chunk sizes.
"""
from __future__ import annotations

import argparse
import time

import torch


def _rate(fn, n: int, reps: int = 3) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return n / sorted(ts)[len(ts) // 2] / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=1 << 27)
    a = ap.parse_args()
    n = a.params
    p, g, m, v = (torch.rand(n) for _ in range(4))
    w = torch.empty(n, dtype=torch.bfloat16)
    dst = torch.empty(n)
    st = torch.tensor(5.0)
    kw = dict(lr=1e-5, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)

    def adam(chunk: int, clip: str, cast: bool):
        def run():
            for c0 in range(0, n, chunk):
                c = slice(c0, min(n, c0 + chunk))
                if clip == "mul":
                    g[c].mul_(0.999)
                scale = {"grad_scale": torch.tensor(1 / 0.999)} if clip == "scale" else {}
                torch._fused_adamw_([p[c]], [g[c]], [m[c]], [v[c]], [], [st], **kw, **scale)
                if cast:
                    w[c].copy_(p[c])
        return run

    p2, m2, v2 = (torch.empty(n) for _ in range(3))

    def out_of_place(chunk: int):
        def run():
            for c0 in range(0, n, chunk):
                c = slice(c0, min(n, c0 + chunk))
                for src, dst in ((p, p2), (m, m2), (v, v2)):
                    dst[c].copy_(src[c])
                torch._fused_adamw_([p2[c]], [g[c]], [m2[c]], [v2[c]], [], [st], **kw)
        return run

    for threads in (16, 12, 8):
        if threads > torch.get_num_threads() and threads != 16:
            continue
        torch.set_num_threads(threads)
        print(f"threads {torch.get_num_threads()}: copy fp32 {_rate(lambda: dst.copy_(p), n) * 8:.1f} GB/s (r+w), "
              f"add_ {_rate(lambda: dst.add_(p), n) * 12:.1f} GB/s (2r+w)", flush=True)
        for chunk in (n, 1 << 24, 1 << 22, 1 << 20):
            row = [f"{name} {_rate(adam(chunk, clip, cast), n):.2f}" for name, clip, cast in
                   (("kernel", "none", False), ("+mul", "mul", False), ("+scale", "scale", False),
                    ("+cast", "none", True), ("+mul+cast", "mul", True), ("+scale+cast", "scale", True))]
            print(f"  chunk {chunk:>10}: G params/s  " + "  ".join(row), flush=True)
        print("  out of place: G params/s  " + "  ".join(
            f"chunk {c} {_rate(out_of_place(c), n):.2f}" for c in (1 << 22, 1 << 20, 1 << 18, 1 << 16)), flush=True)


if __name__ == "__main__":
    main()
