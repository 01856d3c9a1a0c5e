"""Measures the machine's ceilings with the runtime's own code paths: PCIe copies from pinned slabs,
GPU matmul rate, host AdamW rate. torch is imported inside the functions: `plan` never needs it."""
from __future__ import annotations

import os
import time


def _timed_cuda(fn, reps: int) -> float:
    """Median seconds of fn() on the current stream, after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def pcie_rates(nbytes: int = 1 << 30, reps: int = 5) -> dict[str, float]:
    """GB/s: pinned H2D, pinned D2H, both at once (sum), pageable H2D."""
    import torch

    from ..tiers.slab import alloc_slab

    n = nbytes // 4
    host = alloc_slab(n, torch.float32, pin=True)
    host2 = alloc_slab(n, torch.float32, pin=True)
    pageable = torch.empty(n, dtype=torch.float32)
    dev, dev2 = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    host.uniform_()
    pageable.uniform_()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    out = {"h2d_gbs": nbytes / _timed_cuda(lambda: dev.copy_(host, non_blocking=True), reps) / 1e9,
           "d2h_gbs": nbytes / _timed_cuda(lambda: host.copy_(dev, non_blocking=True), reps) / 1e9,
           "pageable_h2d_gbs": nbytes / _timed_cuda(lambda: dev.copy_(pageable), reps) / 1e9}

    def both():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    out["bidir_gbs"] = 2 * nbytes / _timed_cuda(both, reps) / 1e9
    return out


def matmul_tflops(dtype_name: str = "bfloat16", n: int = 8192, reps: int = 10) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    return 2 * n ** 3 / _timed_cuda(lambda: a @ b, reps) / 1e12


def host_adam_rate(n_params: int = 1 << 27, compute_copy: bool = True, reps: int = 3) -> float:
    """Parameters per second of the runtime's host AdamW (fused CPU kernel, chunked, with the rounding
    into the bf16 copy when `compute_copy`), over arrays far larger than the caches."""
    import torch

    from ..config import OptimConfig
    from ..optim.adamw import HostAdamW
    from ..tiers.host import HostStore
    from ..tiers.slab import SlabLayout

    lay = SlabLayout.build([("w", (n_params // 1024, 1024))])
    host = HostStore([lay], torch.bfloat16, pin=False, compute_copy=compute_copy)
    for k in ("master", "grad"):
        host.slab(0, k).uniform_(-1, 1)
    opt = HostAdamW(host, [lay], OptimConfig())
    opt.update_unit(0, 1, 1e-4, 1.0)
    times = []
    for step in range(2, 2 + reps):
        t0 = time.perf_counter()
        opt.update_unit(0, step, 1e-4, 0.5)
        times.append(time.perf_counter() - t0)
    return lay.numel / sorted(times)[len(times) // 2]


def probe(gpu: bool = True) -> dict:
    import torch

    out: dict = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                 "host_adam_params_per_s": host_adam_rate(), "host_adam_fp32_stream_params_per_s":
                 host_adam_rate(compute_copy=False)}
    if gpu and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["gpu_mem_gb"] = torch.cuda.get_device_properties(0).total_memory / 1e9
        out.update(pcie_rates())
        out["bf16_tflops"] = matmul_tflops("bfloat16")
        out["fp32_tflops"] = matmul_tflops("float32")
    return out
