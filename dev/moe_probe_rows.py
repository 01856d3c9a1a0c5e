"""Issue 40 at 8k: the slot sum (model/slot_sum.py) and the experts' activation (model/glu.py) as kernels of R
rows a program and narrower column blocks, against today's, with their bits checked against today's.

    OUT=DIR python dev/moe_probe_rows.py      # on a Hopper GPU, a minute

On 2026-11-27 (one H100) no variant was faster than today's kernels, which already run at about 3 TB/s
(`bench/results/2026-11-27-H100-moe-probe-rows.json`; `2026-11-27-issue40-route-kernels.md`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_gemm import queued  # noqa: E402

from tiertrain.model import glu, moe, slot_sum  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp"))
T, k, E, H, I = 8192, 8, 128, 2048, 768
dev = "cuda"


@triton.jit
def add_slots_r(
    acc,
    y,
    pos,
    out,
    lo,
    n,
    t,
    width,
    K: tl.constexpr,
    START: tl.constexpr,
    R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tokens = tl.program_id(0) * R + tl.arange(0, R)
    live = tokens < t
    tk = tokens.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = live[:, None] & (cols < width)[None, :]
    if START:
        a = tl.load(acc + tk[:, None] * width + cols[None, :], mask=m, other=0.0)
    else:
        a = tl.zeros([R, BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(pos + tk * K + j, mask=live, other=0).to(tl.int64) - lo
        hit = (row >= 0) & (row < n)
        v = tl.load(y + row[:, None] * width + cols[None, :], mask=m & hit[:, None], other=0.0).to(tl.float32)
        a = tl.where(hit[:, None], a + v, a)
    tl.store(out + tk[:, None] * width + cols[None, :], a.to(out.dtype.element_ty), mask=m)


def run_add(acc, y, pos, dtype, R, B, w):
    t, kk = pos.shape
    width = y.shape[-1]
    out = torch.empty(t, width, dtype=dtype, device=y.device)
    add_slots_r[(triton.cdiv(t, R), triton.cdiv(width, B))](
        acc if acc is not None else out,
        y,
        pos,
        out,
        0,
        y.shape[0],
        t,
        width,
        K=kk,
        START=acc is not None,
        R=R,
        BLOCK=B,
        num_warps=w,
    )
    return out


@triton.jit
def glu_fwd_r(y, ws, out, n, inter, R: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    live = rows < n
    rk = rows.to(tl.int64)
    w = tl.load(ws + rk, mask=live, other=0.0)
    for c in range(0, inter, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        m = live[:, None] & (cols < inter)[None, :]
        g = tl.load(y + rk[:, None] * 2 * inter + cols[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.load(y + rk[:, None] * 2 * inter + inter + cols[None, :], mask=m, other=0.0).to(tl.float32)
        a = g * tl.sigmoid(g) * u * w[:, None]
        tl.store(out + rk[:, None] * inter + cols[None, :], a.to(out.dtype.element_ty), mask=m)


@triton.jit
def glu_bwd_r(y, ws, da, dy, dws, n, inter, R: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    live = rows < n
    rk = rows.to(tl.int64)
    w = tl.load(ws + rk, mask=live, other=0.0)
    acc = tl.zeros([R, BLOCK], dtype=tl.float32)
    for c in range(0, inter, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        m = live[:, None] & (cols < inter)[None, :]
        d = tl.load(da + rk[:, None] * inter + cols[None, :], mask=m, other=0.0).to(tl.float32)
        dp = d * w[:, None]
        g = tl.load(y + rk[:, None] * 2 * inter + cols[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.load(y + rk[:, None] * 2 * inter + inter + cols[None, :], mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        silu = g * s
        acc += d * (silu * u)
        du = dp * silu
        dg = dp * u * (s * (1 + g * (1 - s)))
        base = dy + rk[:, None] * 2 * inter + cols[None, :]
        tl.store(base, dg.to(dy.dtype.element_ty), mask=m)
        tl.store(base + inter, du.to(dy.dtype.element_ty), mask=m)
    tl.store(dws + rk, tl.sum(acc, axis=1), mask=live)


res = {"gpu": torch.cuda.get_device_name()}
g = torch.Generator(device=dev).manual_seed(0)
chosen = torch.rand(T, E, generator=g, device=dev).topk(k, dim=-1).indices
order = moe.sort_pairs(chosen, E)
pos = moe.positions(order, k)
y = torch.randn(T * k, H, generator=g, device=dev).bfloat16()
acc = torch.randn(T, H, generator=g, device=dev)
for start, dtype, name in (
    (None, torch.float32, "fwd"),
    (None, torch.bfloat16, "bwd"),
    (acc, torch.float32, "acc"),
):
    ref = slot_sum.add_slots(start, y, pos, 0, dtype)
    res[f"add_{name}_today"] = queued(lambda: slot_sum.add_slots(start, y, pos, 0, dtype), 50)
    for R in (1, 2, 4, 8):
        for B in (256, 512, 1024):
            for w in (2, 4, 8):
                if not 4 <= R * B // (32 * w) <= 64:
                    continue
                got = run_add(start, y, pos, dtype, R, B, w)
                key = f"add_{name}_R{R}_B{B}_w{w}"
                res[key] = queued(lambda: run_add(start, y, pos, dtype, R, B, w), 50)
                if not torch.equal(got, ref):
                    res[key] = "DIFFERENT BITS"

gu = torch.randn(T * k, 2 * I, generator=g, device=dev).bfloat16()
ws = torch.rand(T * k, 1, generator=g, device=dev)
da = torch.randn(T * k, I, generator=g, device=dev).bfloat16()
ref_a = glu.activation(gu, ws, False, 7.0, 1.702)
kern = glu._kernels()
grid, block = glu._launch(gu)


def today_fwd():
    out = gu.new_empty(gu.shape[0], I)
    kern[0][grid](gu, ws, out, I, 7.0, 1.702, GPT_OSS=False, BLOCK=block)
    return out


def today_bwd():
    dy, dws = torch.empty_like(gu), torch.empty_like(ws)
    kern[1][grid](gu, ws, da, dy, dws, I, 7.0, 1.702, GPT_OSS=False, BLOCK=block)
    return dy, dws


res["glu_fwd_today"], res["glu_bwd_today"] = queued(today_fwd, 50), queued(today_bwd, 50)
rdy, rdws = today_bwd()
n = gu.shape[0]
for R in (1, 2, 4, 8):
    for B in (256, 512, 1024):
        for w in (2, 4, 8):
            if not 2 <= R * B // (32 * w) <= 64:
                continue

            def f():
                out = gu.new_empty(n, I)
                glu_fwd_r[(triton.cdiv(n, R),)](gu, ws, out, n, I, R=R, BLOCK=B, num_warps=w)
                return out

            def b():
                dy, dws = torch.empty_like(gu), torch.empty_like(ws)
                glu_bwd_r[(triton.cdiv(n, R),)](gu, ws, da, dy, dws, n, I, R=R, BLOCK=B, num_warps=w)
                return dy, dws

            key = f"R{R}_B{B}_w{w}"
            res["glu_fwd_" + key] = queued(f, 50) if torch.equal(f(), ref_a) else "DIFFERENT BITS"
            dy, dws = b()
            res["glu_bwd_" + key] = queued(b, 50)
            res["glu_bwd_same_" + key] = [bool(torch.equal(dy, rdy)), float((dws - rdws).abs().max())]
(OUT / "probe2.json").write_text(json.dumps(res, indent=1))
for kk, v in res.items():
    print(kk, v if not isinstance(v, float) else round(v * 1e6, 1))
