"""Issue 40's gap at 8k tokens: can a grouped GEMM of our own beat torch's grouped matmul on the experts' shapes?
torch's (CUTLASS) pads each expert's rows to 128-row tiles (about 12% of the work at 8k tokens, ~512 rows an
expert) and needs the rows gathered first (model/moe.py's index_select, 7% of the experts' GPU time). This is a
Triton kernel with shorter tiles and the gather inside: out[r] = x[src[r]] @ w[e] for the rows r of expert e
(sorted by expert, expert e's ending at ends[e]), timed against index_select + torch's grouped matmul on the
forward projections of Qwen3-30B-A3B's experts. Not used by tiertrain: on an H100 every configuration below ran
1.17-1.79x slower than torch's (bench/results/2026-11-26-issue40-own-kernels.md), so the backward's GEMMs were not
written.

    python dev/grouped_gemm.py [--tokens 8192] [--out FILE.json]   # on a Hopper GPU: every tile config, timed
    TRITON_INTERPRET=1 python dev/grouped_gemm.py --check            # anywhere with triton: values on a small case
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import commit  # noqa: E402
from tiertrain.model import moe  # noqa: E402

# (rows, columns, depth) a tile, warps, pipeline stages: the configs timed (--check runs the first)
CONFIGS = [
    (64, 128, 64, 4, 4),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3),
    (64, 128, 128, 4, 3),
    (64, 256, 64, 4, 4),
    (128, 128, 32, 4, 4),
]


@triton.jit
def _grouped(
    x,
    src,
    w,
    bounds,
    tiles,
    out,
    N,
    sxm,
    sxk,
    swe,
    swk,
    swn,
    som,
    son,
    K: tl.constexpr,
    E: tl.constexpr,
    STEPS: tl.constexpr,
    GATHER: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """One (BM x BN) tile of out: program_id(0) counts the experts' row tiles (tiles: their cumulative counts,
    E + 1), so each expert pads its rows to BM only; the grid's spare programs return."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m >= tl.load(tiles + E):
        return
    lo = 0
    hi = E
    for _ in tl.static_range(STEPS):  # tiles[lo] <= pid_m < tiles[hi]: lo ends at the tile's expert
        mid = (lo + hi) // 2
        before = tl.load(tiles + mid) <= pid_m
        lo = tl.where(before, mid, lo)
        hi = tl.where(before, hi, mid)
    e = lo
    row0 = tl.load(bounds + e) + (pid_m - tl.load(tiles + e)) * BM
    rm = row0 + tl.arange(0, BM)
    in_m = rm < tl.load(bounds + e + 1)
    rows = tl.load(src + rm, mask=in_m, other=0) if GATHER else rm
    rn = pid_n * BN + tl.arange(0, BN)
    in_n = rn < N
    rk = tl.arange(0, BK)
    a_ptr = x + rows.to(tl.int64)[:, None] * sxm + rk[None, :] * sxk
    b_ptr = w + e.to(tl.int64) * swe + rk[:, None] * swk + rn[None, :] * swn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        in_k = k0 + rk < K
        a = tl.load(a_ptr, mask=in_m[:, None] & in_k[None, :], other=0.0)
        b = tl.load(b_ptr, mask=in_k[:, None] & in_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptr += BK * sxk
        b_ptr += BK * swk
    o_ptr = out + rm.to(tl.int64)[:, None] * som + rn[None, :] * son
    tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def grouped_mm(x, w, ends, src=None, config=CONFIGS[0]) -> torch.Tensor:
    """x[src] (or x) @ w[e] for each expert e's rows (sorted, ending at ends[e]); w (E, K, N), any strides."""
    bm, bn, bk, warps, stages = config
    n_exp, k, n = w.shape
    rows = src.numel() if src is not None else x.shape[0]
    zero = ends.new_zeros(1)
    counts = torch.diff(ends, prepend=zero)
    tiles = torch.cat([zero, ((counts + bm - 1) // bm).cumsum(0)]).to(torch.int32)
    bounds = torch.cat([zero, ends]).to(torch.int32)
    out = x.new_empty(rows, n)
    grid = (triton.cdiv(rows, bm) + n_exp, triton.cdiv(n, bn))  # at least the tiles: no sync for their count
    _grouped[grid](
        x,
        src if src is not None else bounds,
        w,
        bounds,
        tiles,
        out,
        n,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        K=k,
        E=n_exp,
        STEPS=max(1, n_exp.bit_length()),
        GATHER=src is not None,
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def routed(tokens: int, hidden: int, n_exp: int, k: int, device, dtype, seed: int = 0):
    """Tokens x (T, H), the sorted pairs' tokens src, the experts' row ends: a softmax router's top k."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
    logits = torch.randn(tokens, n_exp, device=device, generator=g)
    chosen = torch.topk(logits.softmax(-1), k, dim=-1).indices
    order = moe.sort_pairs(chosen, n_exp)
    ends = moe._counts(chosen, n_exp).cumsum(0).to(torch.int32)
    return x, order // k, ends


def reference(x, w, ends, src=None) -> torch.Tensor:
    """A loop over the experts, fp32."""
    xs = (x if src is None else x.index_select(0, src)).float()
    out, a = [], 0
    for e, b in enumerate(ends.tolist()):
        out.append(xs[a:b] @ w[e].float())
        a = b
    return torch.cat(out)


def check() -> None:
    """Values against the loop on small cases (experts without rows, partial tiles, a strided w), fp32."""
    for n_exp, cfg in ((6, (16, 16, 16, 1, 1)), (33, (32, 32, 16, 1, 1))):
        x, src, ends = routed(300, 48, n_exp, 2, torch.device("cpu"), torch.float32)
        w = torch.randn(n_exp, 40, 48).transpose(1, 2)  # (E, K=48, N=40): F.linear's layout, as moe.py passes
        ends[1] = ends[0]  # expert 1 takes no rows
        for s in (src, None):
            xin = x if s is not None else x.index_select(0, src)
            got, want = grouped_mm(xin, w, ends, s, cfg), reference(xin, w, ends, s)
            err = (got - want).abs().max().item()
            print(f"{n_exp} experts, tiles {cfg[:3]}, gather={s is not None}: max abs diff {err:.2e}")
            assert err < 1e-4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.check:
        check()
        return
    from tiertrain.probe import _timed_cuda

    dev, dt = torch.device("cuda"), torch.bfloat16
    H, inter, E, k = 2048, 768, 128, 8  # Qwen3-30B-A3B's experts
    x, src, ends = routed(a.tokens, H, E, k, dev, dt)
    gu = torch.randn(E, 2 * inter, H, device=dev, dtype=dt) * 0.02
    down = torch.randn(E, H, inter, device=dev, dtype=dt) * 0.02
    act = torch.randn(src.numel(), inter, device=dev, dtype=dt)
    shapes = {"gate_up (gathered)": (x, gu.transpose(1, 2), src), "down": (act, down.transpose(1, 2), None)}
    r = {
        "code": commit(),
        "tokens": a.tokens,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": {},
    }
    for name, (xin, w, s) in shapes.items():
        flops = 2 * src.numel() * w.shape[1] * w.shape[2]

        def torch_mm(xin=xin, w=w, s=s):
            return moe._GROUPED(xin if s is None else xin.index_select(0, s), w, offs=ends)

        want = torch_mm()
        row = {"torch_s": _timed_cuda(torch_mm, 20)}
        for cfg in CONFIGS:
            got = grouped_mm(xin, w, ends, s, cfg)
            rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
            t = _timed_cuda(lambda xin=xin, w=w, s=s, cfg=cfg: grouped_mm(xin, w, ends, s, cfg), 20)
            row[str(cfg)] = {"s": t, "rel_err": rel, "tflops": flops / t / 1e12}
        row["torch_tflops"] = flops / row["torch_s"] / 1e12
        r["rows"][name] = row
        print(name, json.dumps(row, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
