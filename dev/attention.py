"""Causal attention's kernels on this GPU (model/attention.py), bf16, 32 query and 8 key/value heads of 128 unless
told: for each kernel that runs here and each length, forward and backward TFLOP/s (the backward in the model's
FLOPs, twice the forward, and in the kernels' own count, 2.5 times), the deterministic backward's, and whether a
rerun gives the same bits (output, dQ, dK, dV); then which backend torch's SDPA takes by itself for the shapes
tiertrain calls (an untiled block's, a tiled block's head group). One JSON line per measurement.
    python dev/attention.py [--tokens 16384 65536] [--heads 32 8 128] [--reps 5] [--out FILE.jsonl]"""

import argparse
import json

import torch

from tiertrain.model.attention import attention, usable
from tiertrain.modes import DETERMINISTIC_KERNELS
from tiertrain.probe import _timed_cuda

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
p.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("Q", "KV", "HD"))
p.add_argument("--reps", type=int, default=5)
p.add_argument("--bits-tokens", type=int, default=8192, help="length of the rerun-bits check")
p.add_argument("--out", default=None)
a = p.parse_args()
h, kv, hd = a.heads
dt, dev = torch.bfloat16, torch.device("cuda")
lines = []


def say(**rec):
    rec = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **rec}
    print(json.dumps(rec), flush=True)
    lines.append(rec)


def inputs(t: int, heads: int = h, kvh: int = kv, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, heads, t, hd, device=dev, dtype=dt, generator=g).requires_grad_()
    k = torch.randn(1, kvh, t, hd, device=dev, dtype=dt, generator=g).requires_grad_()
    v = torch.randn(1, kvh, t, hd, device=dev, dtype=dt, generator=g).requires_grad_()
    return q, k, v, torch.randn(1, heads, t, hd, device=dev, dtype=dt, generator=g)


kernels = [k for k in usable(dev, hd, h, kv, dt) if k != "math"]
say(
    what="kernels",
    usable=usable(dev, hd, h, kv, dt),
    sms=torch.cuda.get_device_properties(0).multi_processor_count,
)
for t in a.tokens:
    flops = (
        2 * h * hd * t * (t + 1)
    )  # the forward: QK^T and AV over the causal half (spec.attention_flops_per_token)
    for kernel in kernels:
        q, k, v, do = inputs(t)
        with torch.no_grad():
            fwd = _timed_cuda(lambda: attention(q, k, v, kernel), a.reps)
        rec = {"what": "rate", "kernel": kernel, "tokens": t, "fwd_tflops": flops / fwd / 1e12}
        for det in (False, True) if kernel in DETERMINISTIC_KERNELS else (False,):
            both = _timed_cuda(
                lambda: torch.autograd.grad(attention(q, k, v, kernel, det), (q, k, v), do), a.reps
            )
            name = "bwd_det" if det else "bwd"
            rec[f"{name}_tflops"] = 2 * flops / (both - fwd) / 1e12  # the model's count (the probe's)
            rec[f"{name}_tflops_kernel_count"] = 2.5 * flops / (both - fwd) / 1e12
        rec["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        say(**rec)
        del q, k, v, do
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

t = a.bits_tokens
for kernel in kernels:
    for det in (False, True) if kernel in DETERMINISTIC_KERNELS else (False,):
        runs = []
        for _ in range(2):
            q, k, v, do = inputs(t)
            o = attention(q, k, v, kernel, det)
            runs.append([o.detach(), *torch.autograd.grad(o, (q, k, v), do)])
        same = {n: bool(torch.equal(x, y)) for n, x, y in zip(("out", "dq", "dk", "dv"), *runs)}
        say(what="rerun bits", kernel=kernel, deterministic=det, tokens=t, same=same)

names = {int(b.value): b.name for b in torch.nn.attention.SDPBackend}
for label, (qh, kh) in {"untiled block": (h, kv), "tiled head group": (h // kv, 1)}.items():
    q, k, v, _ = inputs(a.tokens[0], qh, kh)
    try:
        pick = names.get(int(torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=qh != kh)), "?")
    except (RuntimeError, TypeError, AttributeError) as e:
        pick = f"unknown ({type(e).__name__}: {e})"
    say(what="torch's own choice", shape=label, q_heads=qh, kv_heads=kh, backend=pick)
if a.out:
    with open(a.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
