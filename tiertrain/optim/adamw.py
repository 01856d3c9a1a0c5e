"""Host AdamW over slabs, global-norm clipping, and the learning-rate schedule.

Semantics are torch.optim.AdamW's (decoupled weight decay, bias correction), applied per contiguous
range of a unit's slabs (the decayed tensors, 2 or more dims, and the rest) by tiertrain's one-pass
kernel (optim.kernel: AdamW and the rounding into the compute-dtype copy in one pass, a call per range)
or by torch's fused CPU kernel (a chunk at a time, each chunk still in cache for the rounding). Clipping
follows torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), applied when below 1
(inside the kernel).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from ..errors import Everywhere
from ..modes import STATE, Kind
from ..sections import OptimConfig
from ..tiers.host import HostStore
from ..tiers.slab import SlabLayout
from . import kernel

CHUNK = 1 << 22  # elements: 16 MiB per fp32 array
NO_COPY = torch.empty(0, dtype=torch.bfloat16)  # the one-pass kernel's "no bf16 copy to write"


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (from 0): linear warmup (lr (k + 1) / W: its first step moves too),
    then constant or a cosine toward min_lr over the remaining steps, min_lr being the step after the last's (as
    transformers' get_cosine_schedule_with_warmup: every step updates, with min_lr 0 too)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def clip_coefficient(norms: list[torch.Tensor], max_norm: float) -> tuple[float, float]:
    """(global grad norm, factor to multiply the gradients by); factor 1.0 when clipping is off. The
    per-unit norms stay where they are (the GPU): one transfer, the step's one synchronization. A norm may be a
    unit's pieces' (n,) (model/parts.norm_pieces)."""
    total = float(torch.linalg.vector_norm(torch.cat([n.float().reshape(-1) for n in norms])))
    if not math.isfinite(total):
        raise Everywhere(
            f"the gradient norm is {total}: training diverged; lower optim.lr or "
            "set optim.grad_clip, and check the data"
        )
    if max_norm <= 0:
        return total, 1.0
    return total, min(1.0, max_norm / (total + 1e-6))


def adam_threads() -> int:
    """Threads of the host AdamW: memory-bound, two cores fewer lose nothing, and leave the main thread
    free to launch kernels; each of the ranks of a host (torchrun's LOCAL_WORLD_SIZE) takes its share."""
    return max(1, ((os.cpu_count() or 2) - 2) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def adam_pool(threads: int | None = None) -> ThreadPoolExecutor:
    """The one worker thread host updates run on, with `threads` intra-op threads (else adam_threads)."""
    return ThreadPoolExecutor(
        1,
        thread_name_prefix="tiertrain-adamw",
        initializer=torch.set_num_threads,
        initargs=(threads or adam_threads(),),
    )


class HostAdamW:
    def __init__(self, host: HostStore, layouts: list[SlabLayout], cfg: OptimConfig, staging=None):
        """`staging`: the NVMe tier's staging of the spilled slabs (tiers.staging.Staging; None: none spilled)."""
        self.host, self.layouts, self.cfg, self.staging = host, layouts, cfg, staging
        self.kernel = kernel.wanted(cfg.host_kernel)  # None: torch's fused kernel
        # the one-pass kernel's streamed stores: the new state into copies, and the bf16 copy (no read for
        # ownership of its lines: 2 B of a parameter's 32 through DRAM; bench/results/*-copy-stores-ab8k.md);
        # and its software prefetch (optim.kernel.AHEAD)
        self.stores = kernel.STREAM_STATE | kernel.STREAM_COPY | kernel.prefetch(kernel.AHEAD)
        self.step_count = 0  # completed updates; every tensor shares it, as in torch.optim.AdamW

    def apply(
        self,
        unit: int,
        s: dict[Kind, torch.Tensor],
        step: int,
        lr: float,
        clip: float,
        out: dict | None = None,
    ) -> None:
        """The update of one unit's flat slabs wherever they are, enqueued on the current stream: on a GPU or by the
        one-pass kernel whole ranges, by torch's kernel a chunk at a time (still in cache for the rounding into the
        copy `w`). Scalars are made by fill kernels: a copy from host memory would block this thread until the
        stream's earlier work is done. `s`: the unit's master, gradient and moments, and the bf16 copy of the master
        where one streams ({kind: slab}); `out` (host only): the master and moments to write instead."""
        master, grad, m, v, w = (
            s[Kind.MASTER],
            s[Kind.GRAD],
            s[Kind.EXP_AVG],
            s[Kind.EXP_AVG_SQ],
            s.get(Kind.WEIGHTS),
        )
        dev, on_gpu = master.device, master.is_cuda
        b1, b2 = self.cfg.betas
        st = torch.full((), float(step), device=dev)
        # clipping inside the kernel (grad / (1/clip)) saves a pass over the gradient: host AdamW is
        # bound by DRAM bandwidth. It differs from clip_grad_norm_'s multiply by at most an ulp.
        scale = torch.full((), 1.0 / clip, device=dev) if clip < 1.0 else None
        for a, b, decay in self.layouts[unit].ranges():
            wd = self.cfg.weight_decay if decay else 0.0
            one_pass = (
                lr,
                b1,
                b2,
                wd,
                self.cfg.eps,
                float(step),
                1.0 / clip if clip < 1.0 else 0.0,
                self.stores,
            )
            fused = dict(
                lr=lr,
                beta1=b1,
                beta2=b2,
                weight_decay=wd,
                eps=self.cfg.eps,
                amsgrad=False,
                maximize=False,
                grad_scale=scale,
            )
            # the one-pass kernel takes a whole range: each call takes the GIL back, which the main thread
            # holds while it launches GPU work (up to the 5 ms switch interval per call)
            step_by = b - a if on_gpu or self.kernel is not None else CHUNK
            for c0 in range(a, b, step_by):
                c = slice(c0, min(c0 + step_by, b))
                p_, m_, v_ = master[c], m[c], v[c]
                if self.kernel is not None and not on_gpu:  # one pass, in place or into `out`
                    dst = [out[k][c] if out else x for k, x in zip(STATE, (p_, m_, v_))]
                    self.kernel.adamw(p_, grad[c], m_, v_, *dst, NO_COPY if w is None else w[c], *one_pass)
                    continue
                if out is not None:
                    p_, m_, v_ = (out[k][c].copy_(x) for k, x in zip(STATE, (p_, m_, v_)))
                torch._fused_adamw_([p_], [grad[c]], [m_], [v_], [], [st], **fused)
                if w is not None:
                    w[c].copy_(p_)

    def update_unit(self, unit: int, step: int, lr: float, clip: float, into_copies: bool = False) -> None:
        """One unit's update in host memory (its spilled slabs through the staging ring). `into_copies`: a
        speculative update, written into the host's copies of the unit's master and moments (the bf16 copy
        in place: nothing reads it before the update is kept or redone); it counts once the host swaps them in."""
        s = dict(self.host.slabs[unit])
        try:
            if self.staging is not None:  # slabs on NVMe, read ahead into the staging ring
                s.update(self.staging.acquire(unit))
            out = self.host.copies[unit] if into_copies else None
            self.apply(unit, s, step, lr, clip, out)
        except BaseException:  # a read failed (EIO), or the update: its ring buffers go back unwritten
            if self.staging is not None:
                self.staging.drop(unit)
            raise
        if self.staging is not None:
            self.staging.release(unit)
        if not into_copies:
            self.host.version[unit] += 1


class OptimizerThread:
    """Runs the host AdamW of the units updated in host memory on a worker thread, unit by unit in forward
    order (optim.updates.Updates says which units, and when).

    `wait(u)` blocks until unit u is updated: the next step's H2D of unit u calls it, so the update
    overlaps the next forward pass. With `overlap` off every step waits for its whole update (the
    synchronous reference: the numbers are the same either way).

    `speculated` units: `speculate(u, event, step, lr)`, as the backward pass sends unit u's gradient down,
    queues its update as if the global norm will not clip (into the host's copies of its master and
    moments where it has them; else, clipping being off, in place). The worker takes the queued unit that
    comes first in forward order among those whose gradient has landed (else waits for the next to land):
    when the host is slower than the backward pass, its speculated updates fall between the units left to
    the next forward pass, which then overlaps the host's work instead of running idle through a tail of
    units already updated. `stop_speculating()` at the norm takes back those not started; `start` keeps the
    started ones (the copies swapped in) or runs the update again from the untouched state with the clip
    factor: the same numbers either way."""

    def __init__(
        self,
        opt: HostAdamW,
        n_units: int,
        overlap: bool,
        units: frozenset[int],
        speculated: frozenset[int] = frozenset(),
    ):
        self.opt, self.overlap, self.units, self.speculated = opt, overlap, units, speculated
        # threads: the main thread (the step) calls every method; the worker (self.pool, owned here and shut
        # by close()) runs _job, _keep and _speculate. Shared between them: speculations and landing (under
        # self.lock), timeline (deque appends are atomic), the host slabs (a unit's, by one at a time:
        # the main thread waits on its future before loading it)
        self.pool = adam_pool()
        self.futures: list[Future | None] = [None] * n_units  # main thread only
        self.wait_s = 0.0  # time the caller spent blocked in wait(): the exposed optimizer
        # the speculated units' updates, done by _speculate (under lock)
        self.speculations: dict[int, Future] = {}
        self.landing: dict[int, tuple] = {}  # (grad event, step, lr) of those not yet taken (under lock)
        self.lock = threading.Lock()
        # (event, unit, time.perf_counter()): when each update waited, ran and finished, and the step's
        # marks (the trainer's too); what shows where the optimizer's time goes (bench.timeline)
        self.timeline: deque[tuple[str, int, float]] = deque(maxlen=1 << 14)
        self.failed: BaseException | None = None  # the first update's error (worker only)
        self.raised: BaseException | None = None  # the error wait() raised (main thread only)

    def _update(self, *args) -> None:
        """opt.update_unit, unless an earlier update failed: then that error at once. The run stops on it, and a
        later unit's update would wait for the ring buffers of the failed one's read-ahead."""
        if self.failed is not None:
            raise self.failed
        try:
            self.opt.update_unit(*args)
        except BaseException as e:
            self.failed = e
            raise

    def mark(self, event: str, unit: int = -1, at: float | None = None) -> None:
        self.timeline.append((event, unit, time.perf_counter() if at is None else at))

    def speculate(self, unit: int, grad_event, step: int, lr: float) -> None:
        """Queues the unit's update as if the norm will not clip (`grad_event`: its gradient has landed)."""
        with self.lock:
            self.speculations[unit] = Future()
            self.landing[unit] = (grad_event, step, lr)
        self.pool.submit(self._speculate)

    def _speculate(self) -> None:
        """One speculated update (a job per drained unit): the first unit in forward order whose gradient
        has landed, else the next to land; none once the norm has taken them (stop_speculating)."""
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
            self._update(unit, step, lr, 1.0, bool(self.opt.host.copies))
        except BaseException as e:
            f.set_exception(e)
        else:
            f.set_result(None)
        self.mark("spec done", unit)

    def stop_speculating(self) -> tuple[bool, dict[int, Future]]:
        """At the norm: the speculations queued this step, those not yet started cancelled (the worker takes
        no more). Returns (whether any was queued, the started ones)."""
        with self.lock:
            spec, self.speculations = self.speculations, {}
            self.landing.clear()
        return bool(spec), {u: f for u, f in spec.items() if not f.cancel()}

    def start(
        self, step: int, lr: float, clip: float, kept: dict[int, Future], grad_ready: Callable[[int], object]
    ) -> None:
        """Queues this step's update of every unit of this thread in unit order: `kept`, the started
        speculations that stand (the copies swapped in once done), the rest plain updates. One already
        running and redone writes copies nobody reads; one not started runs in place (the same numbers),
        where its unit's place is: the next forward pass needs the first units first."""
        copies = bool(self.opt.host.copies)
        for u in sorted(self.units):
            if u in kept:
                self.futures[u] = self.pool.submit(self._keep, u, kept[u]) if copies else kept[u]
            else:
                self.futures[u] = self.pool.submit(self._job, u, step, lr, clip, grad_ready(u))
        if not self.overlap:
            self.wait_all()

    def _job(self, unit: int, step: int, lr: float, clip: float, grad_event) -> None:
        self.mark("job", unit)
        if grad_event is not None:
            grad_event.synchronize()  # the gradient's D2H copy has landed in the host slab
            self.mark("grad", unit)
        self._update(unit, step, lr, clip)
        self.mark("done", unit)

    def _keep(self, unit: int, speculated: Future) -> None:
        speculated.result()  # done (the pool runs in order); raises its error
        self.opt.host.swap(unit)

    def wait(self, unit: int) -> None:
        f = self.futures[unit]
        if f is not None:
            t0 = time.perf_counter()
            try:
                f.result()
            except BaseException as e:
                self.raised = e
                raise
            t1 = time.perf_counter()
            self.wait_s += t1 - t0
            if t1 - t0 > 1e-4:
                self.timeline.extend((("wait", unit, t0), ("waited", unit, t1)))
            self.futures[unit] = None

    def wait_all(self) -> None:
        for u in range(len(self.futures)):
            self.wait(u)

    def close(self) -> None:
        """The worker shut, the updates done: an update's error raised unless wait() has raised it (the run
        stopped on it; the updates after a failed one fail with its error at once)."""
        self.stop_speculating()  # a step stopped between its backward pass and its update
        self.pool.shutdown(wait=True)
        try:
            self.wait_all()
        except BaseException as e:
            if e is not self.raised:
                raise
