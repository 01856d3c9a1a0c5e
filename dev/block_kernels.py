"""Where a dense block's GPU time goes: one block of a config (random weights, bf16), its forward pass without
gradients and its backward pass from its checkpoint as Step.block_backward runs them (tiled or not), profiled;
each kernel counted as a matmul, attention, or the rest (norms, RoPE, the MLP's activation, casts, adds).

    python dev/block_kernels.py CONFIG TILE TOKENS... [--attention cudnn] [--root TREE] [--out FILE.json]

TILE 0: untiled. --root: the tiertrain of another tree (an older commit's), timed by this script.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

_root = (
    sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv else Path(__file__).resolve().parent.parent
)
sys.path.insert(0, str(_root))
from tiertrain.config import load_config  # noqa: E402
from tiertrain.model import llama, tiled  # noqa: E402
from tiertrain.model.llama import Context  # noqa: E402

MATMUL = ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")
ATTENTION = ("flash", "fmha", "cudnn", "attention", "sdpa", "softmax_warp")


def kind(name: str) -> str:
    n = name.lower()
    if any(a in n for a in ATTENTION):
        return "attention"
    if any(m in n for m in MATMUL):
        return "matmul"
    return "rest"


def block_weights(spec, dev: torch.device, dt: torch.dtype) -> tuple[dict, dict]:
    """A block's random weights (matrices at 0.02, norms at 1) in dt, and zeroed fp32 gradient accumulators; also
    dev/workset.py's."""
    shapes = {t.name: t.shape for t in spec.units()[1].tensors}
    w = {
        n: (torch.randn(s, device=dev) * 0.02).to(dt) if len(s) > 1 else torch.ones(s, device=dev, dtype=dt)
        for n, s in shapes.items()
    }
    return w, {n: torch.zeros(s, device=dev) for n, s in shapes.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("tile", type=int)
    p.add_argument("tokens", type=int, nargs="+")
    p.add_argument("--attention", default="cudnn")
    p.add_argument("--root", default=None, help="the tree whose tiertrain to time (default: this script's)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    spec = load_config(a.config).model
    dev, dt = torch.device("cuda"), torch.bfloat16
    w, accs = block_weights(spec, dev, dt)
    from torch.profiler import ProfilerActivity, profile

    out = []
    for tokens in a.tokens:
        spec.max_position_embeddings = max(spec.max_position_embeddings, tokens)
        ctx = Context.build(spec, tokens, dt, dev, a.tile, a.attention)
        x = torch.randn(1, tokens, spec.hidden_size, device=dev)

        def forward():
            with torch.no_grad():
                return tiled.forward(w, x, ctx) if ctx.tiled(x) else llama.block(w, x, ctx)

        def backward():
            g = torch.randn_like(x)
            if ctx.tiled(x):
                return tiled.backward(w, accs, x, g, ctx)
            leaves = {n: t.detach().requires_grad_() for n, t in w.items()}
            xg = x.detach().requires_grad_()
            with torch.enable_grad():
                y = llama.block(leaves, xg, ctx)
            d = torch.autograd.grad(y, [xg, *leaves.values()], g)
            for n, gw in zip(leaves, d[1:]):
                accs[n].add_(gw)
            return d[0]

        for fn in (forward, backward):  # warm-up: kernels chosen, caches filled
            fn()
        torch.cuda.synchronize()
        row = {
            "tokens": tokens,
            "tile": a.tile,
            "attention": a.attention,
            "gpu": torch.cuda.get_device_name(),
            "root": str(_root),
        }
        for name, fn in (("forward", forward), ("backward", backward)):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            by, top = defaultdict(float), []
            for ev in prof.key_averages():
                t = ev.self_device_time_total / 1e6
                by[kind(ev.key)] += t
                top.append((t, ev.count, ev.key[:90]))
            row[name] = {
                "wall_s": e0.elapsed_time(e1) / 1e3,
                "kernels_s": sum(by.values()),
                **{f"{k}_s": v for k, v in sorted(by.items())},
                "top": [f"{t * 1e3:9.3f} ms {c:5d}x {k}" for t, c, k in sorted(top, reverse=True)[:30]],
            }
        out.append(row)
        print(json.dumps({k: v for k, v in row.items()}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
