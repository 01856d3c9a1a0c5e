"""Host AdamW over slabs, global-norm clipping, and the learning-rate schedule.

Semantics are torch.optim.AdamW's (decoupled weight decay, bias correction), applied per contiguous
range of a unit's slabs (the decayed tensors, 2 or more dims, and the rest) by tiertrain's one-pass
kernel (optim.kernel: AdamW and the rounding into the compute-dtype copy in one pass, a call per range)
or by torch's fused CPU kernel (a chunk at a time, each chunk still in cache for the rounding). Clipping
follows torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), applied when below 1
(inside the kernel).
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from ..config import OptimConfig
from ..errors import UserError
from ..tiers.host import HostStore
from ..tiers.slab import SlabLayout
from . import kernel

CHUNK = 1 << 22  # elements: 16 MiB per fp32 array
NO_COPY = torch.empty(0, dtype=torch.bfloat16)  # the one-pass kernel's "no bf16 copy to write"


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


def adam_threads() -> int:
    """Threads of the host AdamW: memory-bound, two cores fewer lose nothing, and leave the main thread
    free to launch kernels."""
    return max(1, (os.cpu_count() or 2) - 2)


def adam_pool(threads: int | None = None) -> ThreadPoolExecutor:
    """The one worker thread host updates run on, with `threads` intra-op threads (else adam_threads)."""
    return ThreadPoolExecutor(1, thread_name_prefix="tiertrain-adamw", initializer=torch.set_num_threads,
                              initargs=(threads or adam_threads(),))


class HostAdamW:
    def __init__(self, host: HostStore, layouts: list[SlabLayout], cfg: OptimConfig, tiers=None):
        self.host, self.layouts, self.cfg, self.tiers = host, layouts, cfg, tiers
        self.kernel = kernel.wanted(cfg.host_kernel)  # None: torch's fused kernel
        # the one-pass kernel's streamed stores: the new state into copies, and the bf16 copy (no read for
        # ownership of its lines: 2 B of a parameter's 32 through DRAM; bench/results/*-copy-stores-ab8k.md);
        # and its software prefetch (optim.kernel.AHEAD)
        self.stores = kernel.STREAM_STATE | kernel.STREAM_COPY | kernel.prefetch(kernel.AHEAD)
        self.stream = None  # the GPU stream of resident units' updates
        self.step_count = 0  # completed updates; every tensor shares it, as in torch.optim.AdamW

    def apply(self, unit: int, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
              w: torch.Tensor | None, step: int, lr: float, clip: float, out: dict | None = None) -> None:
        """The update of one unit's flat slabs wherever they are, enqueued on the current stream: on a GPU
        or by the one-pass kernel whole ranges, by torch's kernel a chunk at a time (each chunk still in
        cache for the rounding into the copy `w`). Scalars are made by fill kernels: a copy from host
        memory would block this thread until the stream's earlier work is done. `out` (host only): the
        master and moments to write ({kind: slab}), the given ones left as they were: by the one-pass
        kernel (optim.kernel) where it built, else each chunk copied there first (torch's fused kernel
        works in place); the same arithmetic either way."""
        dev, on_gpu = master.device, master.is_cuda
        b1, b2 = self.cfg.betas
        st = torch.full((), float(step), device=dev)
        # clipping inside the kernel (grad / (1/clip)) saves a pass over the gradient: host AdamW is
        # bound by DRAM bandwidth. It differs from clip_grad_norm_'s multiply by at most an ulp.
        scale = torch.full((), 1.0 / clip, device=dev) if clip < 1.0 else None
        for a, b, decay in self.layouts[unit].ranges():
            wd = self.cfg.weight_decay if decay else 0.0
            # the one-pass kernel takes a whole range: each call takes the GIL back, which the main thread
            # holds while it launches GPU work (up to the 5 ms switch interval per call)
            step_by = b - a if on_gpu or self.kernel is not None else CHUNK
            for c0 in range(a, b, step_by):
                c = slice(c0, min(c0 + step_by, b))
                p_, m_, v_ = master[c], m[c], v[c]
                if self.kernel is not None and not on_gpu:  # one pass, in place or into `out`
                    dst = [out[k][c] if out else x for k, x in (("master", p_), ("exp_avg", m_), ("exp_avg_sq", v_))]
                    self.kernel.adamw(p_, grad[c], m_, v_, *dst, NO_COPY if w is None else w[c], lr, b1, b2, wd,
                                      self.cfg.eps, float(step), 1.0 / clip if clip < 1.0 else 0.0, self.stores)
                    continue
                if out is not None:
                    p_, m_, v_ = (out[k][c].copy_(x) for k, x in (("master", p_), ("exp_avg", m_), ("exp_avg_sq", v_)))
                torch._fused_adamw_([p_], [grad[c]], [m_], [v_], [], [st], lr=lr, beta1=b1,
                                    beta2=b2, weight_decay=wd, eps=self.cfg.eps, amsgrad=False, maximize=False,
                                    grad_scale=scale)
                if w is not None:
                    w[c].copy_(p_)

    def update_unit(self, unit: int, step: int, lr: float, clip: float, into_copies: bool = False) -> None:
        """One unit's update, where its slabs are: the host or, for a resident unit, the GPU (on a stream
        of this thread's own, synchronized before the unit counts as updated: the next load of its
        weights runs on another stream). `into_copies`: a speculative update, written into the host's
        copies of the unit's master and moments (the bf16 copy in place: nothing reads it before the
        update is kept or redone); it counts once the host swaps them in."""
        s = dict(self.host.slabs[unit])
        if self.tiers is not None:  # slabs on NVMe, read ahead into the staging ring
            s.update(self.tiers.acquire(unit))
        master, grad, m, v, w = s["master"], s["grad"], s["exp_avg"], s["exp_avg_sq"], s.get("weights")
        on_gpu = master.is_cuda
        if on_gpu and self.stream is None:
            self.stream = torch.cuda.Stream(master.device)
        out = self.host.copies[unit] if into_copies else None
        with torch.cuda.stream(self.stream) if on_gpu else contextlib.nullcontext():
            self.apply(unit, master, grad, m, v, w, step, lr, clip, out)
        if on_gpu:
            self.stream.synchronize()
        if self.tiers is not None:
            self.tiers.release(unit)
        if not into_copies:
            self.host.version[unit] += 1


class OptimizerThread:
    """Runs the host AdamW of a step on a worker thread, unit by unit in forward order.

    `wait(u)` blocks until unit u is updated: the next step's H2D of unit u calls it, so the update
    overlaps the next forward pass. With `overlap` off every step waits for its whole update (the
    synchronous reference: the numbers are the same either way).

    `deferred` units are not updated here: their (step, lr, clip) waits in `pending` until the device
    buffers take it (`take`) and run the update on the GPU as the unit's weights are loaded next.

    `speculated` units: `begin(lr)` before the backward pass, then `drained(u, event)` as the
    backward pass sends each gradient down queues the unit's update as if the global norm will not clip
    (into the host's copies of its master and moments where it has them; else, clipping being off, in
    place). The worker takes the queued unit that comes first in forward order among those whose gradient
    has landed (else waits for the next to land): when the host is slower than the backward pass, its
    speculated updates fall between the units left to the next forward pass, which then overlaps the
    host's work instead of running idle through a tail of units already updated. `start` keeps those
    updates when the norm did not clip (the copies swapped in; one not yet started runs in place, in unit
    order) and otherwise runs the update again from the untouched state with the clip factor: the same
    numbers either way. A step after a clipped one does not speculate (clipping tends to persist: early
    training, spikes).
    `gpu_speculated` deferred units are speculated the same way, on the GPU: the device buffers ask
    `speculation(u)` for the job as they drain the unit's gradient; a redone one runs as deferred."""

    def __init__(self, opt: HostAdamW, n_units: int, overlap: bool, deferred: frozenset[int] = frozenset(),
                 speculated: frozenset[int] = frozenset(), gpu_speculated: frozenset[int] = frozenset()):
        self.opt, self.overlap, self.deferred = opt, overlap, deferred
        self.speculated, self.gpu_speculated = speculated, gpu_speculated
        self.on_gpu: set[int] = set()  # the gpu_speculated units speculated this step
        self.copies = bool(opt.host.copies)  # none: clipping is off, a speculation runs in place
        # threads: the main thread (the step) calls every method; the worker (self.pool, owned here and shut
        # by close()) runs _job, _keep and _speculate. Shared between them: speculations and landing (under
        # self.lock), timeline (deque appends are atomic), the host slabs (a unit's, by one at a time:
        # the main thread waits on its future before loading it)
        self.pending: dict[int, tuple[int, float, float]] = {}  # main thread only
        self.pool = adam_pool()
        self.futures: list[Future | None] = [None] * n_units  # main thread only
        self.wait_s = 0.0  # time the caller spent blocked in wait(): the exposed optimizer
        self.speculating: tuple[int, float] | None = None  # (step, lr) of the update speculated this step
        self.speculations: dict[int, Future] = {}  # the speculated units' updates, done by _speculate (under lock)
        self.landing: dict[int, tuple] = {}  # (grad event, step, lr) of those not yet taken (under lock)
        self.lock = threading.Lock()
        self.last_clip = 1.0
        self.kept = self.redone = 0  # steps whose speculation was kept, was redone
        self.last_kept = False  # the last update's speculation was kept (it ran beside a backward pass)
        # (event, unit, time.perf_counter()): when each update waited, ran and finished, and the step's
        # marks (the trainer's too); what shows where the optimizer's time goes (bench.timeline)
        self.timeline: deque[tuple[str, int, float]] = deque(maxlen=1 << 14)

    def mark(self, event: str, unit: int = -1, at: float | None = None) -> None:
        self.timeline.append((event, unit, time.perf_counter() if at is None else at))

    def begin(self, lr: float) -> None:
        """A step starts: its backward pass's gradients may start the next update (none after a clipped step)."""
        on = (self.speculated or self.gpu_speculated) and self.last_clip == 1.0
        self.speculating = (self.opt.step_count + 1, lr) if on else None

    def drained(self, unit: int, grad_event) -> None:
        """The unit's gradient is on its way to the host (`grad_event`: once it has landed)."""
        if self.speculating and unit in self.speculated:
            with self.lock:
                self.speculations[unit] = Future()
                self.landing[unit] = (grad_event, *self.speculating)
            self.pool.submit(self._speculate)

    def _speculate(self) -> None:
        """One speculated update (a job per drained unit): the first unit in forward order whose gradient
        has landed, else the next to land; none once the norm has taken them (start)."""
        t0 = time.perf_counter()
        while True:
            with self.lock:
                if not self.landing:
                    return
                landed = [u for u, (ev, *_) in self.landing.items() if ev is None or ev.query()]
                if landed:
                    unit = min(landed)
                    _, step, lr = self.landing.pop(unit)
                    f = self.speculations[unit]
                    break
                ev = next(iter(self.landing.values()))[0]  # the D2H stream lands them in the order drained
            ev.synchronize()
        if not f.set_running_or_notify_cancel():  # taken by the norm in between: a plain update now
            return
        self.mark("spec job", unit, t0)
        self.mark("spec grad", unit)
        try:
            self.opt.update_unit(unit, step, lr, 1.0, self.copies)
        except BaseException as e:
            f.set_exception(e)
        else:
            f.set_result(None)
        self.mark("spec done", unit)

    def speculation(self, unit: int) -> tuple[int, float, dict | None] | None:
        """(step, lr, where the master and moments go: the host's copies, or None for in place) of the
        speculative GPU update of `unit`, its gradient being accumulated; None: it does not speculate."""
        if not (self.speculating and unit in self.gpu_speculated):
            return None
        self.on_gpu.add(unit)
        return (*self.speculating, self.opt.host.copies.get(unit))

    def start(self, lr: float, clip: float, grad_ready: Callable[[int], object]) -> None:
        self.mark("norm")
        self.opt.step_count += 1
        step = self.opt.step_count
        with self.lock:  # the worker takes no more speculations
            spec, self.speculations = self.speculations, {}
            self.landing.clear()
        on_gpu, self.on_gpu = self.on_gpu, set()
        any_speculated = bool(spec or on_gpu)
        keep = any_speculated and clip == 1.0 and self.speculating == (step, lr)
        if any_speculated and not keep and not self.copies:
            raise RuntimeError("an in-place speculative update cannot be undone: it needs clipping off")
        self.kept, self.redone = self.kept + keep, self.redone + (any_speculated and not keep)
        self.last_kept = keep
        self.last_clip, self.speculating = clip, None
        # one already running when redone writes copies nobody reads. Kept, those not yet started become
        # plain updates (in place, the same numbers), queued in unit order with the rest: the next forward
        # pass needs the first units first, and a speculation's place in the queue was its gradient's
        started = {u: f for u, f in spec.items() if not f.cancel()}
        for u in range(len(self.futures)):
            if keep and u in on_gpu:
                self.opt.host.kept(u)  # loads of the unit wait for the copy's event (DeviceBuffers.written)
            elif u in self.deferred:
                self.pending[u] = (step, lr, clip)
            elif keep and u in started:
                self.futures[u] = self.pool.submit(self._keep, u, started[u]) if self.copies else started[u]
            else:
                self.futures[u] = self.pool.submit(self._job, u, step, lr, clip, grad_ready(u))
        if not self.overlap:
            self.wait_all()

    def _job(self, unit: int, step: int, lr: float, clip: float, grad_event) -> None:
        self.mark("job", unit)
        if grad_event is not None:
            grad_event.synchronize()  # the gradient's D2H copy has landed in the host slab
            self.mark("grad", unit)
        self.opt.update_unit(unit, step, lr, clip)
        self.mark("done", unit)

    def _keep(self, unit: int, speculated: Future) -> None:
        speculated.result()  # done (the pool runs in order); raises its error
        self.opt.host.swap(unit)

    def take(self, unit: int) -> tuple[int, float, float] | None:
        """The deferred update of `unit` still to run, handed over once."""
        return self.pending.pop(unit, None)

    def wait(self, unit: int) -> None:
        f = self.futures[unit]
        if f is not None:
            t0 = time.perf_counter()
            f.result()
            t1 = time.perf_counter()
            self.wait_s += t1 - t0
            if t1 - t0 > 1e-4:
                self.timeline.extend((("wait", unit, t0), ("waited", unit, t1)))
            self.futures[unit] = None

    def wait_all(self) -> None:
        for u in range(len(self.futures)):
            self.wait(u)

    def close(self) -> None:
        with self.lock:  # a step stopped between its backward pass and its update
            self.landing.clear()
        for f in self.speculations.values():
            f.cancel()
        self.pool.shutdown(wait=True)
        self.wait_all()
