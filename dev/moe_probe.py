"""Issue 40 at 8k: a trace of the experts' and the dense MLP's passes queued back to back (kernel by kernel, with
the gaps between them), and candidate kernels for the ops around the grouped GEMMs timed alone: torch's top k
against a sort, index_select against a Triton row gather of R rows a program (bf16, and fp32 cast on the way).

    OUT=DIR python dev/moe_probe.py      # on a Hopper GPU, a minute; TOKENS=16384 for another length

Run on a923297's model code on 2026-11-27 (one H100): it found the router, the pair sort and the gathers costing
0.5 ms of the 4.6 ms pass and the gather at 4 rows x 256 columns 116 us against index_select's 162
(`bench/results/2026-11-27-H100-moe-probe.json`; `2026-11-27-issue40-route-kernels.md`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_gemm import queued  # noqa: E402

from tiertrain.model import llama, moe  # noqa: E402
from tiertrain.model.spec import ModelSpec  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp"))
H, I, E, k, T = 2048, 768, 128, 8, int(os.environ.get("TOKENS", "8192"))
dev, dt = torch.device("cuda"), torch.bfloat16
spec = ModelSpec(
    hidden_size=H,
    intermediate_size=I,
    num_hidden_layers=1,
    num_attention_heads=16,
    vocab_size=8,
    model_type="qwen3_moe",
    num_experts=E,
    num_experts_per_tok=k,
    moe_intermediate_size=I,
    norm_topk_prob=True,
)
ctx = llama.Context.build(spec, 8, dt, dev)
g = torch.Generator(device=dev).manual_seed(0)
w = {
    "mlp.gate.weight": torch.randn(E, H, device=dev, dtype=dt, generator=g) * 0.02,
    "mlp.experts.gate_up_proj": torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * 0.02,
    "mlp.experts.down_proj": torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * 0.02,
}
dense = {
    "gate": torch.randn(k * I, H, device=dev, dtype=dt) * 0.02,
    "up": torch.randn(k * I, H, device=dev, dtype=dt) * 0.02,
    "down": torch.randn(H, k * I, device=dev, dtype=dt) * 0.02,
}
h = torch.randn(T, H, device=dev, dtype=dt)
gy = torch.randn(T, H, device=dev)
leaves = {n: v.requires_grad_() for n, v in w.items()}
dl = {n: v.requires_grad_() for n, v in dense.items()}
hx = h.clone().requires_grad_()


def experts_fb():
    y = moe.experts(leaves, hx, ctx)
    torch.autograd.grad(y, [hx, *leaves.values()], gy)


def mlp(x, d):
    return F.linear(F.silu(F.linear(x, d["gate"])) * F.linear(x, d["up"]), d["down"]).float()


def dense_fb():
    torch.autograd.grad(mlp(hx, dl), [hx, *dl.values()], gy)


res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": T}
for name, fn in (("experts", experts_fb), ("dense", dense_fb)):
    res[f"{name}_queued_s"] = queued(fn)
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(OUT / f"trace-{name}.json"))

# candidates, each alone
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def gather_rows(x, idx, out, width, R: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(idx + rows).to(tl.int64)
    v = tl.load(x + src[:, None] * width + cols[None, :])
    tl.store(out + rows.to(tl.int64)[:, None] * width + cols[None, :], v.to(out.dtype.element_ty))


def triton_gather(x, idx, dtype, R, BLOCK, warps):
    out = torch.empty(idx.shape[0], x.shape[1], device=x.device, dtype=dtype)
    gather_rows[(idx.shape[0] // R, x.shape[1] // BLOCK)](
        x, idx, out, x.shape[1], R=R, BLOCK=BLOCK, num_warps=warps
    )
    return out


with torch.no_grad():
    probs = torch.softmax(F.linear(h, w["mlp.gate.weight"]).float(), dim=-1)
    chosen = torch.topk(probs, k, dim=-1).indices
    order = moe.sort_pairs(chosen, E)
    src = order // k
    gf = torch.randn(T, H, device=dev)
    cand = {
        "topk": lambda: torch.topk(probs, k, dim=-1),
        "sort_stable_desc": lambda: torch.sort(probs, dim=-1, descending=True, stable=True),
        "sort_desc": lambda: torch.sort(probs, dim=-1, descending=True),
        "index_select_bf16": lambda: h.index_select(0, src),
        "cast_then_index_select": lambda: gf.to(dt).index_select(0, src),
        "add_bf16": lambda: h + h,
        "argsort_u8": lambda: moe.sort_pairs(chosen, E),
        "positions": lambda: moe.positions(order, k),
    }
    for R in (1, 2, 4, 8):
        for B in (256, 512, 1024, 2048):
            for wp in (2, 4, 8):
                if R * B // (32 * wp) < 8 or R * B // (32 * wp) > 64:
                    continue
                cand[f"triton_gather_bf16_R{R}_B{B}_w{wp}"] = lambda R=R, B=B, wp=wp: triton_gather(
                    h, src, dt, R, B, wp
                )
                cand[f"triton_gather_fp32cast_R{R}_B{B}_w{wp}"] = lambda R=R, B=B, wp=wp: triton_gather(
                    gf, src, dt, R, B, wp
                )
    ref = h.index_select(0, src)
    ref32 = gf.to(dt).index_select(0, src)
    for n, fn in cand.items():
        try:
            fn()
            if n.startswith("triton_gather_bf16"):
                assert torch.equal(fn(), ref), n
            if n.startswith("triton_gather_fp32"):
                assert torch.equal(fn(), ref32), n
            res[n] = queued(fn, 50)
        except Exception as e:  # noqa: BLE001
            res[n] = f"{type(e).__name__}: {e}"[:200]
    a, b = torch.topk(probs, k, dim=-1), torch.sort(probs, dim=-1, descending=True, stable=True)
    res["sort_same_values"] = bool(torch.equal(a.values, b.values[:, :k]))
    res["sort_same_indices_rows"] = float((a.indices == b.indices[:, :k]).all(1).float().mean())
    res["sort_same_sets_rows"] = float(
        (a.indices.sort(1).values == b.indices[:, :k].sort(1).values).all(1).float().mean()
    )
(OUT / "probe.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res, indent=1))
