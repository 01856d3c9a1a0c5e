"""Issue 40 at 8k tokens: torch's grouped matmul with its other tile. torch (GroupMM.cu) picks its CUTLASS
tile from the rows per group (total rows // groups): 64x128x128 (ping-pong) where that is at most 128, else
128x256x64 (cooperative). At 8k tokens Qwen3-30B-A3B's experts get about 512 rows each, so each pads to
128-row tiles, half of them to a fifth one. Here each expert's weights are seen f times as often, as groups
f e (the expert's rows) and f e + 1 .. f e + f - 1 (no rows: never read), by a view whose group stride is the
expert's over f: the rows per group fall to 128 and torch takes the smaller tile, with the same weights and
rows. Times the forward projections and the backward's data gradients (x @ W and dY @ W^T) both ways, and says
whether the bits agree. torch takes at most 1024 groups: 8k and 16k tokens. On an H100 the smaller tile lost
by 1.36-1.65x on every projection at both lengths, with the same bits
(bench/results/2026-11-26-H100-grouped-split.log): tiertrain keeps torch's choice.

    python dev/grouped_split.py [--tokens 8192 16384] [--out FILE.json]   # on a Hopper GPU: 30 s
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_gemm import queued  # noqa: E402 - dev/'s timer of calls queued back to back

from bench.common import commit  # noqa: E402
from tiertrain.model.moe import _GROUPED  # noqa: E402

E, K_ROUTED, H, I = 128, 8, 2048, 768  # Qwen3-30B-A3B's experts


def spread(w: torch.Tensor, ends: torch.Tensor, f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, a, b) and its experts' row ends as f (E - 1) + 1 groups: expert e's at group f e, the others
    empty."""
    n = f * (w.shape[0] - 1) + 1
    view = w.as_strided((n, *w.shape[1:]), (w.stride(0) // f, *w.stride()[1:]), w.storage_offset())
    return view, ends.repeat_interleave(f)[:n]


def case(tokens: int, gen: torch.Generator) -> list[dict]:
    dev = "cuda"
    chosen = torch.randn(tokens, E, device=dev, generator=gen).topk(K_ROUTED, dim=-1).indices
    counts = torch.bincount(chosen.reshape(-1), minlength=E)
    ends = counts.cumsum(0).to(torch.int32)
    rows = tokens * K_ROUTED
    mean = rows / E
    bf = torch.bfloat16
    gu = torch.randn(E, 2 * I, H, device=dev, dtype=bf, generator=gen) * 0.02  # F.linear's layout, as stored
    down = torch.randn(E, H, I, device=dev, dtype=bf, generator=gen) * 0.02
    x = torch.randn(rows, H, device=dev, dtype=bf, generator=gen)
    a = torch.randn(rows, I, device=dev, dtype=bf, generator=gen)
    dgu = torch.randn(rows, 2 * I, device=dev, dtype=bf, generator=gen)
    ddown = torch.randn(rows, H, device=dev, dtype=bf, generator=gen)
    gemms = {  # name: (rows, weights (E, in, out))
        "gate_up fwd": (x, gu.transpose(1, 2)),
        "down fwd": (a, down.transpose(1, 2)),
        "gate_up dgrad": (dgu, gu),
        "down dgrad": (ddown, down),
    }
    f = 1
    while mean / f > 128:  # the least f whose mean is at most 128 rows, dividing the expert stride
        f += 1
    out = []
    for name, (m, w) in gemms.items():
        flops = 2 * rows * w.shape[1] * w.shape[2]
        ref = _GROUPED(m, w, offs=ends)
        t0 = queued(lambda m=m, w=w: _GROUPED(m, w, offs=ends), 30)
        row = {
            "tokens": tokens,
            "gemm": name,
            "mean_rows": mean,
            "torch_s": t0,
            "torch_tflops": flops / t0 / 1e12,
        }
        ff = f
        while w.stride(0) % ff:
            ff += 1
        if ff * (E - 1) + 1 > 1024:  # torch's grouped matmul takes at most 1024 groups
            continue
        ws, es = spread(w, ends, ff)
        got = _GROUPED(m, ws, offs=es)
        t1 = queued(lambda m=m, ws=ws, es=es: _GROUPED(m, ws, offs=es), 30)
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        row |= {"f": ff, "groups": ws.shape[0], "split_s": t1, "split_tflops": flops / t1 / 1e12}
        row |= {"speedup": t0 / t1, "same_bits": bool(torch.equal(got, ref)), "max_rel_diff": err}
        out.append(row)
        print(
            f"{tokens:>6} {name:<14} mean {mean:6.0f}: torch {t0 * 1e3:.3f} ms "
            f"({row['torch_tflops']:.0f} TFLOP/s)"
            f", split f={ff} {t1 * 1e3:.3f} ms ({row['split_tflops']:.0f}), {t0 / t1:.3f}x, same bits "
            f"{row['same_bits']} (max rel diff {err:.2e})",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    rows = [r for t in args.tokens for r in case(t, gen)]
    if args.out:
        info = {
            "code": commit(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(),
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main()
