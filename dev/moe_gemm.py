"""The experts' GPU time against a dense MLP of the same active FLOPs (issue 40): model/moe.experts (routing, the
sort, the grouped GEMMs, the pairs summed back to their tokens) forward and backward, in bf16, beside a SwiGLU MLP of
intermediate size k x I on the same tokens, with the parts timed alone. Qwen3-30B-A3B's shape by default.

    python dev/moe_gemm.py [--tokens 8192] [--root TREE] [--graph] [--out FILE.json]

The experts are timed with their Triton kernels (the default on a GPU) and eager. --root times the tiertrain of
another tree (an older commit's: `git archive REV | tar -x -C TREE`) with this script; run both in one call and
compare each one's ratio to its own dense MLP. Each pass is timed two ways: one call from an
idle GPU (events around it, so the CPU's launches count where it falls behind), and calls queued back to back
(the GPU's time where the CPU keeps ahead of it, as it does in a step); `*_issue_s` is the CPU's time to issue one.
--graph also replays each pass as one CUDA graph (`*_graph_s`): the GPU's time without the launches' gaps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

_root = (
    sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv else Path(__file__).resolve().parent.parent
)
sys.path.insert(0, str(_root))
from tiertrain.model import llama, moe  # noqa: E402
from tiertrain.model.spec import ModelSpec  # noqa: E402
from tiertrain.probe import _timed_cuda  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import commit  # noqa: E402


def timed(fn, reps: int = 10) -> float:
    """Median seconds of fn() on the GPU: the probe's timer, after two more warm-up calls (three in all)."""
    fn()
    fn()
    return _timed_cuda(fn, reps)


def queued(fn, reps: int = 20) -> float:
    """Mean seconds of fn() with reps calls queued back to back, after two warm-up calls."""
    fn()
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def graphed(fn, reps: int = 20) -> float | str:
    """Mean seconds of fn() replayed as one CUDA graph, reps replays back to back (no launch gaps: what a graph of
    the experts' pass would buy); the error's text where fn cannot be captured."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up on a side stream, as torch.cuda.graphs asks
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        # thread_local: autograd's own thread runs the backward, and another thread's calls must not end the capture
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            fn()
    except Exception as e:  # noqa: BLE001 - the measurement says why it is missing
        torch.cuda.synchronize()
        return f"{type(e).__name__}: {e}"[:300]
    return queued(g.replay, reps)


def issue(fn, reps: int = 10) -> float:
    """Median seconds the CPU takes to issue fn() to an idle GPU."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--expert-size", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--root", default=None, help="the tree whose tiertrain to time (default: this script's)")
    p.add_argument("--graph", action="store_true", help="also time each pass replayed as one CUDA graph")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    H, I, E, k, T = a.hidden, a.expert_size, a.experts, a.k, a.tokens
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
    dev, dt = torch.device("cuda"), torch.bfloat16
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

    def experts_fwd():
        with torch.no_grad():
            moe.experts(w, h, ctx)

    def experts_fb():
        y = moe.experts(leaves, hx, ctx)
        torch.autograd.grad(y, [hx, *leaves.values()], gy)

    accs = {n: torch.zeros(v.shape, device=dev) for n, v in w.items()}
    dense_accs = {n: torch.zeros(v.shape, device=dev) for n, v in dense.items()}

    def experts_fb_acc():  # as the step's backward: weight gradients added into fp32 accumulators
        y = moe.experts(leaves, hx, ctx)
        for acc, g in zip(accs.values(), torch.autograd.grad(y, [hx, *leaves.values()], gy)[1:]):
            acc.add_(g)

    def dense_fb_acc():
        for acc, g in zip(dense_accs.values(), torch.autograd.grad(mlp(hx, dl), [hx, *dl.values()], gy)[1:]):
            acc.add_(g)

    def mlp(x, d):
        return F.linear(F.silu(F.linear(x, d["gate"])) * F.linear(x, d["up"]), d["down"]).float()

    def dense_fwd():
        with torch.no_grad():
            mlp(h, dense)

    def dense_fb():
        torch.autograd.grad(mlp(hx, dl), [hx, *dl.values()], gy)

    def route_only():
        with torch.no_grad():
            moe.route(w, h, ctx)

    flops = 2 * 3 * T * k * H * I  # forward matmul FLOPs of the active experts (= the dense MLP's)
    # the graphs first: captured after the passes below had run eagerly, the experts' capture failed on an H100
    graphs = (
        {"experts_fwd_bwd_graph_s": graphed(experts_fb), "dense_fwd_bwd_graph_s": graphed(dense_fb)}
        if a.graph
        else {}
    )
    r = {
        "code": commit(),  # this script's commit (BENCH_COMMIT on the device); --root's tree is "root"
        "shape": dict(tokens=T, hidden=H, expert_size=I, experts=E, k=k),
        "torch": torch.__version__,
        "root": str(_root),
        "gpu": torch.cuda.get_device_name(),
        "grouped": moe._GROUPED is not None,
        "experts_fwd_s": timed(experts_fwd),
        "experts_fwd_bwd_s": timed(experts_fb),
        "dense_fwd_s": timed(dense_fwd),
        "dense_fwd_bwd_s": timed(dense_fb),
        "route_s": timed(route_only),
    }
    r["experts_fwd_bwd_acc_s"], r["dense_fwd_bwd_acc_s"] = timed(experts_fb_acc), timed(dense_fb_acc)
    r["acc_ratio"] = r["experts_fwd_bwd_acc_s"] / r["dense_fwd_bwd_acc_s"]
    y = moe.experts(leaves, hx, ctx)
    grads = torch.autograd.grad(y, [hx, *leaves.values()], gy)[1:]
    r["grad_contiguous"] = {n: g.is_contiguous() for n, g in zip(leaves, grads)}
    r["experts_fwd_bwd_queued_s"], r["dense_fwd_bwd_queued_s"] = queued(experts_fb), queued(dense_fb)
    r["experts_fwd_bwd_issue_s"], r["dense_fwd_bwd_issue_s"] = issue(experts_fb), issue(dense_fb)
    r["queued_ratio"] = r["experts_fwd_bwd_queued_s"] / r["dense_fwd_bwd_queued_s"]
    r.update(graphs)
    if graphs and all(isinstance(v, float) for v in graphs.values()):
        r["graph_ratio"] = r["experts_fwd_bwd_graph_s"] / r["dense_fwd_bwd_graph_s"]
    try:  # the switch: model/kernels.py's, or the older trees' in model/moe.py
        from tiertrain.model import kernels as owner

        switch = "ENABLED"
    except ImportError:
        owner, switch = moe, "KERNELS" if hasattr(moe, "KERNELS") else "COMPILE"
    setattr(owner, switch, False)
    r["eager_fwd_s"], r["eager_fwd_bwd_s"] = timed(experts_fwd), timed(experts_fb)
    setattr(owner, switch, True)
    r["eager_fwd_bwd_ratio"] = r["eager_fwd_bwd_s"] / r["dense_fwd_bwd_s"]
    r["fwd_ratio"] = r["experts_fwd_s"] / r["dense_fwd_s"]
    r["fwd_bwd_ratio"] = r["experts_fwd_bwd_s"] / r["dense_fwd_bwd_s"]
    r["experts_tflops_fwd_bwd"] = 3 * flops / r["experts_fwd_bwd_s"] / 1e12
    r["dense_tflops_fwd_bwd"] = 3 * flops / r["dense_fwd_bwd_s"] / 1e12
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # one pass, no accumulation: its kernels' time
        experts_fb()
        torch.cuda.synchronize()
    kernels = prof.key_averages()
    r["experts_fwd_bwd_kernels_s"] = sum(e.self_device_time_total for e in kernels) / 1e6
    table = kernels.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    r["profile"] = table.splitlines()
    print(table)
    print(json.dumps({k: v for k, v in r.items() if k != "profile"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
