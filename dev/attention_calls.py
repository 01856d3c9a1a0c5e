"""How a block's causal attention is best called at long lengths (issue 42): SDPA once over all heads (GQA as it
is), or once per key/value head group as model/tiled.py calls it; and the kernels' own forward (returning the
log-sum-exp) and backward (from a kept output and log-sum-exp), which let a backward pass skip the recompute.
For each length and kernel: seconds and TFLOP/s (the kernels' own count: the forward 2 x heads x hd x T^2 over
the causal half, the backward 2.5 times that) of the forward, forward + backward, and the backward alone; the
peak memory of each; whether the outputs and gradients match SDPA's autograd bit for bit.

    python dev/attention_calls.py [--tokens 131072 262144] [--kernels cudnn flash] [--reps 3] [--out FILE.jsonl]
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tiertrain.probe import _timed_cuda

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, nargs="+", default=[131072, 262144])
p.add_argument("--kernels", nargs="+", default=["cudnn", "flash"])
p.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("Q", "KV", "HD"))
p.add_argument("--reps", type=int, default=3)
p.add_argument("--out", default=None)
a = p.parse_args()
h, kv, hd = a.heads
dt, dev = torch.bfloat16, torch.device("cuda")
BACKEND = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
lines = []


def say(**rec):
    rec = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        **rec,
    }
    print(json.dumps(rec), flush=True)
    lines.append(rec)


def sdpa(kernel, q, k, v):
    with sdpa_kernel(BACKEND[kernel]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def grouped(kernel, q, k, v):
    r = q.shape[1] // k.shape[1]
    return torch.cat(
        [
            sdpa(kernel, q[:, g * r : (g + 1) * r], k[:, g : g + 1], v[:, g : g + 1])
            for g in range(k.shape[1])
        ],
        1,
    )


def own_forward(kernel, q, k, v):
    """(output, log-sum-exp, what the backward takes besides)."""
    if kernel == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
        return r[0], r[1], r
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
    return r[0], r[1], r


def own_backward(kernel, do, q, k, v, o, lse, r):
    if kernel == "cudnn":
        _, _, cq, ck, mq, mk, seed, off, _ = r
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, lse, seed, off, None, cq, ck, mq, mk, 0.0, True
        )
    _, _, cq, ck, mq, mk, seed, off, _ = r
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, o, lse, cq, ck, mq, mk, 0.0, True, seed, off
    )


def peak(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def measure(t: int) -> None:
    fl = 2 * h * hd * t * (t + 1)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, h, t, hd, device=dev, dtype=dt, generator=g)
    k, v = (torch.randn(1, kv, t, hd, device=dev, dtype=dt, generator=g) for _ in "kv")
    do = torch.randn(1, h, t, hd, device=dev, dtype=dt, generator=g)
    for kernel in a.kernels:
        rec = {"tokens": t, "kernel": kernel}
        for name, fn in (("one_call", sdpa), ("per_group", grouped)):
            try:
                with torch.no_grad():
                    f = _timed_cuda(lambda: fn(kernel, q, k, v), a.reps)
                ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
                both = _timed_cuda(
                    lambda: torch.autograd.grad(fn(kernel, ql, kl, vl), (ql, kl, vl), do), a.reps
                )
                rec[name] = {
                    "fwd_s": f,
                    "fwd_tflops": fl / f / 1e12,
                    "bwd_s": both - f,
                    "bwd_tflops": 2.5 * fl / (both - f) / 1e12,
                    "peak_gb": peak(lambda: torch.autograd.grad(fn(kernel, ql, kl, vl), (ql, kl, vl), do)),
                }
            except RuntimeError as e:
                rec[name] = {"error": str(e)[:300]}
            torch.cuda.empty_cache()
        try:
            with torch.no_grad():
                f = _timed_cuda(lambda: own_forward(kernel, q, k, v), a.reps)
                o, lse, r = own_forward(kernel, q, k, v)
                b = _timed_cuda(lambda: own_backward(kernel, do, q, k, v, o, lse, r), a.reps)
                mine = own_backward(kernel, do, q, k, v, o, lse, r)
            ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
            ref_o = sdpa(kernel, ql, kl, vl)
            with torch.no_grad():
                plain = sdpa(kernel, q, k, v)
                o2 = own_forward(kernel, q, k, v)[0]
            ref = torch.autograd.grad(ref_o, (ql, kl, vl), do)
            rec["own"] = {
                "fwd_s": f,
                "fwd_tflops": fl / f / 1e12,
                "bwd_s": b,
                "bwd_tflops": 2.5 * fl / b / 1e12,
                "lse_shape": list(lse.shape),
                "lse_dtype": str(lse.dtype),
                "out_equal": bool(torch.equal(o, ref_o)),
                "out_equal_no_grad": bool(torch.equal(o, plain)),
                "out_rerun_equal": bool(torch.equal(o, o2)),
                **{f"{n}_equal": bool(torch.equal(x, y)) for n, x, y in zip(("dq", "dk", "dv"), mine, ref)},
                **{
                    f"{n}_maxdiff": float((x.float() - y.float()).abs().max())
                    for n, x, y in zip(("dq", "dk", "dv"), mine, ref)
                },
            }
        except (RuntimeError, TypeError, ValueError) as e:
            rec["own"] = {"error": str(e)[:300]}
        torch.cuda.empty_cache()
        say(**rec)


for t in a.tokens:
    measure(t)
    torch.cuda.empty_cache()
if a.out:
    with open(a.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
