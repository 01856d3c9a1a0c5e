"""Host AdamW over slabs, global-norm clipping, and the learning-rate schedule.

Semantics are torch.optim.AdamW's (decoupled weight decay, bias correction) applied with torch's fused
CPU kernel, one call per contiguous range of a unit's slabs: the decayed tensors (2 or more dims) and
the rest. Clipping follows torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6),
applied when below 1 (inside the fused kernel). A unit is updated a chunk at a time (clip, AdamW, rounding into the compute-dtype
copy) so that each chunk is still in cache for the next pass over it.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from ..config import OptimConfig
from ..errors import UserError
from ..tiers.host import HostStore
from ..tiers.slab import SlabLayout

CHUNK = 1 << 22  # elements: 16 MiB per fp32 array


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (from 0): linear warmup, then constant or cosine to min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def clip_coefficient(norms: list[torch.Tensor], max_norm: float) -> tuple[float, float]:
    """(global grad norm, factor to multiply the gradients by); factor 1.0 when clipping is off. The
    per-unit norms stay where they are (the GPU): one transfer, the step's one synchronization."""
    total = float(torch.linalg.vector_norm(torch.stack([n.float() for n in norms])))
    if not math.isfinite(total):
        raise UserError(f"the gradient norm is {total}: training diverged; lower optim.lr or "
                        "set optim.grad_clip, and check the data")
    if max_norm <= 0:
        return total, 1.0
    return total, min(1.0, max_norm / (total + 1e-6))


class HostAdamW:
    def __init__(self, host: HostStore, layouts: list[SlabLayout], cfg: OptimConfig, tiers=None):
        self.host, self.layouts, self.cfg, self.tiers = host, layouts, cfg, tiers
        self.stream = None  # the GPU stream of resident units' updates
        self.step_count = 0  # completed updates; every tensor shares it, as in torch.optim.AdamW

    def apply(self, unit: int, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
              w: torch.Tensor | None, step: int, lr: float, clip: float) -> None:
        """The update of one unit's flat slabs wherever they are, enqueued on the current stream: on the
        host a chunk at a time (each chunk still in cache for the rounding into the copy `w`), on a GPU
        whole ranges. Scalars are made by fill kernels: a copy from host memory would block this thread
        until the stream's earlier work is done."""
        dev, on_gpu = master.device, master.is_cuda
        b1, b2 = self.cfg.betas
        st = torch.full((), float(step), device=dev)
        # clipping inside the kernel (grad / (1/clip)) saves a pass over the gradient: host AdamW is
        # bound by DRAM bandwidth. It differs from clip_grad_norm_'s multiply by at most an ulp.
        scale = torch.full((), 1.0 / clip, device=dev) if clip < 1.0 else None
        for a, b, decay in self.layouts[unit].ranges():
            wd = self.cfg.weight_decay if decay else 0.0
            step_by = b - a if on_gpu else CHUNK
            for c0 in range(a, b, step_by):
                c = slice(c0, min(c0 + step_by, b))
                torch._fused_adamw_([master[c]], [grad[c]], [m[c]], [v[c]], [], [st], lr=lr, beta1=b1,
                                    beta2=b2, weight_decay=wd, eps=self.cfg.eps, amsgrad=False, maximize=False,
                                    grad_scale=scale)
                if w is not None:
                    w[c].copy_(master[c])

    def update_unit(self, unit: int, step: int, lr: float, clip: float) -> None:
        """One unit's update, where its slabs are: the host (a chunk at a time, so each chunk is still in
        cache for the rounding into the bf16 copy) or, for a resident unit, the GPU (whole ranges, on a
        stream of this thread's own, synchronized before the unit counts as updated: the next load of its
        weights runs on another stream)."""
        s = dict(self.host.slabs[unit])
        if self.tiers is not None:  # slabs on NVMe, read ahead into the staging ring
            s.update(self.tiers.acquire(unit))
        master, grad, m, v, w = s["master"], s["grad"], s["exp_avg"], s["exp_avg_sq"], s.get("weights")
        on_gpu = master.is_cuda
        if on_gpu and self.stream is None:
            self.stream = torch.cuda.Stream(master.device)
        with torch.cuda.stream(self.stream) if on_gpu else contextlib.nullcontext():
            self.apply(unit, master, grad, m, v, w, step, lr, clip)
        if on_gpu:
            self.stream.synchronize()
        if self.tiers is not None:
            self.tiers.release(unit)
        self.host.version[unit] += 1


class OptimizerThread:
    """Runs the host AdamW of a step on a worker thread, unit by unit in forward order.

    `wait(u)` blocks until unit u is updated: the next step's H2D of unit u calls it, so the update
    overlaps the next forward pass. With `overlap` off every step waits for its whole update (the
    synchronous reference: the numbers are the same either way).

    `deferred` units are not updated here: their (step, lr, clip) waits in `pending` until the device
    buffers take it (`take`) and run the update on the GPU as the unit's weights are loaded next."""

    def __init__(self, opt: HostAdamW, n_units: int, overlap: bool, deferred: frozenset[int] = frozenset()):
        self.opt, self.overlap, self.deferred = opt, overlap, deferred
        self.pending: dict[int, tuple[int, float, float]] = {}
        # memory-bound: two cores fewer lose nothing, and leave the main thread free to launch kernels
        threads = max(1, (os.cpu_count() or 2) - 2)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tiertrain-adamw",
                                       initializer=torch.set_num_threads, initargs=(threads,))
        self.futures: list[Future | None] = [None] * n_units
        self.wait_s = 0.0  # time the caller spent blocked in wait(): the exposed optimizer

    def start(self, lr: float, clip: float, grad_ready: Callable[[int], object]) -> None:
        self.opt.step_count += 1
        step = self.opt.step_count
        for u in range(len(self.futures)):
            if u in self.deferred:
                self.pending[u] = (step, lr, clip)
            else:
                self.futures[u] = self.pool.submit(self._job, u, step, lr, clip, grad_ready(u))
        if not self.overlap:
            self.wait_all()

    def _job(self, unit: int, step: int, lr: float, clip: float, grad_event) -> None:
        if grad_event is not None:
            grad_event.synchronize()  # the gradient's D2H copy has landed in the host slab
        self.opt.update_unit(unit, step, lr, clip)

    def take(self, unit: int) -> tuple[int, float, float] | None:
        """The deferred update of `unit` still to run, handed over once."""
        return self.pending.pop(unit, None)

    def wait(self, unit: int) -> None:
        f = self.futures[unit]
        if f is not None:
            t0 = time.perf_counter()
            f.result()
            self.wait_s += time.perf_counter() - t0
            self.futures[unit] = None

    def wait_all(self) -> None:
        for u in range(len(self.futures)):
            self.wait(u)

    def close(self) -> None:
        self.wait_all()
        self.pool.shutdown()
