"""Updates: every unit's AdamW, run where its RunPlan entry says (plan.runplan.UPDATES).

The step calls, in order: `begin(lr)` before the forward pass, `before_load(u)` before each load of unit u's
weights, `before_backward()`, `gradient_ready(u)` once unit u's gradient has left its accumulator, and
`after_norm(lr, clip)` once the global norm is known. In between:
  host             the worker (OptimizerThread) updates the unit after the norm; its next load waits for it
  host-speculated  the worker starts it at gradient_ready as if the norm will not clip; after_norm keeps it
                   (its copies swapped in) or runs it again with the clip factor: the same numbers either way
  gpu              its fp32 master, gradient and moments cross PCIe into a state set on the H2D stream as its
                   weights load next (before_load); the kernel runs there, the slot gets the new master cast,
                   and master and moments go back to the host slabs on the D2H stream
  gpu-speculated   the same kernel at gradient_ready, from the accumulator, on streams of their own (spec in,
                   back out) so that loads and drains never queue behind them; kept or redone (as "gpu")
  resident         the kernel runs on its slabs in GPU memory, in place, as its weights load next
A step after a clipped one does not speculate (clipping tends to persist: early training, spikes).
"""

from __future__ import annotations

import torch

from ..modes import STATE, Kind, Update
from ..plan.runplan import RunPlan
from .adamw import HostAdamW, OptimizerThread

ON_GPU = (Update.GPU, Update.GPU_SPECULATED, Update.RESIDENT)


class _StateSet:
    """fp32 master, gradient and moments of one unit being updated on the GPU."""

    def __init__(self, numel: int, device: torch.device):
        self.t = {k: torch.empty(numel, dtype=torch.float32, device=device) for k in (*STATE, Kind.GRAD)}
        self.free = None  # event: their write-back to the host has been read out


class GpuUpdates:
    """The AdamW of units updated on the GPU; two state sets take turns for those whose state is on the host."""

    def __init__(self, opt: HostAdamW, run_plan: RunPlan, grads, streams, device: torch.device):
        self.opt, self.host, self.grads, self.s = opt, opt.host, grads, streams
        self.resident = run_plan.updated(Update.RESIDENT)
        crossing = run_plan.updated(Update.GPU, Update.GPU_SPECULATED)
        big = max((opt.layouts[u].numel for u in crossing), default=0)
        self.sets = [_StateSet(big, device) for _ in range(2 if crossing else 0)]
        self._turn = 0
        self.written: dict[int, object] = {}  # unit -> event: its GPU update is back in the host slabs
        self.h2d_bytes = self.d2h_bytes = 0

    def update(self, unit: int, step: int, lr: float, clip: float) -> torch.Tensor:
        """The unit's AdamW on the H2D stream (its state copied in first unless resident); returns its updated
        fp32 master, on the device."""
        self.host.version[unit] += 1
        if unit in self.resident:
            s = self.host.slabs[unit]
            with self.s.on(self.s.h2d):
                self.s.wait(self.s.h2d, self.grads.ready.get(unit))
                self.opt.apply(unit, s, step, lr, clip)
            return s[Kind.MASTER]
        st = self._next_set()
        waits = (st.free, self.grads.ready.get(unit), self.written.get(unit))
        return self._in_set(
            unit,
            st,
            (*STATE, Kind.GRAD),
            waits,
            (self.s.h2d, self.s.d2h),
            step,
            lr,
            clip,
            self.host.slabs[unit],
        )[Kind.MASTER]

    def speculate(self, unit: int, step: int, lr: float, into: dict | None) -> None:
        """The unit's AdamW as if the norm will not clip, from its accumulator (copied into a state set on the
        D2H stream behind its drain), master and moments written to `into` (None: the host slabs)."""
        st = self._next_set()
        with self.s.on(self.s.d2h):
            self.s.wait(self.s.d2h, st.free)
            acc = self.grads.part(unit)  # this rank's part of the gradient summed over the ranks
            st.t[Kind.GRAD][: acc.numel()].copy_(acc)
            copied = self.s.record(self.s.d2h)
        self.grads.read_until(unit, copied)
        self._in_set(
            unit,
            st,
            STATE,
            (copied, self.written.get(unit)),
            (self.s.speculative, self.s.back),
            step,
            lr,
            1.0,
            into or self.host.slabs[unit],
        )

    def _next_set(self) -> _StateSet:
        st = self.sets[self._turn]
        self._turn ^= 1
        return st

    def _in_set(
        self,
        unit: int,
        st: _StateSet,
        kinds: tuple[str, ...],
        waits,
        streams,
        step: int,
        lr: float,
        clip: float,
        dst: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """The AdamW of a unit in state set `st`: on the first of `streams`, after `waits`, the unit's
        `kinds` copied in from its host slabs and the kernel run; on the second, master and moments
        written to `dst`. Returns the set's views."""
        n = self.opt.layouts[unit].numel
        t = {k: v[:n] for k, v in st.t.items()}
        s_in, s_out = streams
        with self.s.on(s_in):
            for ev in waits:
                self.s.wait(s_in, ev)
            for k in kinds:
                t[k].copy_(self.host.slab(unit, k), non_blocking=True)
            self.opt.apply(unit, t, step, lr, clip)
            done = self.s.record(s_in)
        with self.s.on(s_out):
            self.s.wait(s_out, done)
            for k in STATE:
                dst[k].copy_(t[k], non_blocking=True)
            st.free = self.written[unit] = self.s.record(s_out)
        self.h2d_bytes += len(kinds) * n * 4
        self.d2h_bytes += len(STATE) * n * 4
        return t

    def synchronize(self) -> None:
        if self.s.cuda:
            for stream in (self.s.h2d, self.s.d2h, self.s.speculative, self.s.back):
                stream.synchronize()

    def nbytes(self) -> int:
        return sum(t.numel() * 4 for st in self.sets for t in st.t.values())


class Updates:
    """Owns the host worker and the GPU updates, and dispatches each unit's update on its RunPlan entry.
    Main thread only (the worker's shared state is OptimizerThread's)."""

    def __init__(
        self,
        run_plan: RunPlan,
        opt: HostAdamW,
        grads,
        streams,
        device: torch.device,
        overlap: bool,
        staging=None,
        reader=None,
    ):
        """`staging`, `reader`: the NVMe tier's staging of the spilled slabs and reader of the streamed kind
        (tiers.staging.Staging, tiers.reader.StreamReader; None: none spilled)."""
        self.run_plan, self.opt, self.grads, self.staging, self.reader = run_plan, opt, grads, staging, reader
        self.mode = [u.update for u in run_plan.units]
        on_host = run_plan.updated(Update.HOST, Update.HOST_SPECULATED)
        self.host = OptimizerThread(
            opt, len(run_plan.units), overlap, on_host, run_plan.updated(Update.HOST_SPECULATED)
        )
        self.gpu = GpuUpdates(opt, run_plan, grads, streams, device)
        self.any_speculated = bool(run_plan.updated(Update.HOST_SPECULATED, Update.GPU_SPECULATED))
        self.timeline = self.host.timeline
        self.pending: dict[int, tuple[int, float, float]] = {}  # GPU updates due at the unit's next load
        self.speculating: tuple[int, float] | None = None  # (step, lr) of the update speculated this step
        self.on_gpu: set[int] = set()  # the gpu-speculated units speculated this step
        self.last_clip = 1.0
        self.kept = self.redone = 0  # steps whose speculation was kept, was redone
        self.last_kept = False  # the last update's speculation was kept (it ran beside a backward pass)

    def mark(self, event: str, unit: int = -1) -> None:
        self.host.mark(event, unit)

    def begin(self, lr: float) -> None:
        """A step starts: its backward pass's gradients may start the next update (none after a clipped step)."""
        self.mark("step")
        self.host.wait_s = 0.0
        on = self.any_speculated and self.last_clip == 1.0
        self.speculating = (self.opt.step_count + 1, lr) if on else None

    def before_load(self, unit: int) -> tuple[torch.Tensor | None, object]:
        """Before unit u's weights load: its host update has finished, or its GPU update runs now. Returns what
        WeightSlots.load takes: the master just updated on the device, or the event a copy from the host
        slabs waits for (a GPU update's write-back)."""
        self.host.wait(unit)
        job = self.pending.pop(unit, None)
        if job is not None:
            return self.gpu.update(unit, *job), None
        return None, self.gpu.written.get(unit)

    def before_backward(self) -> None:
        """Every unit has waited for its update: the NVMe tier starts reading the next update's spilled slabs."""
        self.mark("backward")
        if self.staging:
            self.staging.start(list(range(len(self.mode))))

    def gradient_ready(self, unit: int) -> None:
        """Unit u's gradient is on its way out of its accumulator: a speculated update starts from it."""
        if self.speculating is None:
            return
        if self.mode[unit] == Update.HOST_SPECULATED:
            self.host.speculate(unit, self.grads.ready.get(unit), *self.speculating)
        elif self.mode[unit] == Update.GPU_SPECULATED:
            self.gpu.speculate(unit, *self.speculating, self.opt.host.copies.get(unit))
            self.on_gpu.add(unit)

    def after_norm(self, lr: float, clip: float) -> None:
        """The norm is known: speculations are kept (no clipping) or redone, and every other update is queued,
        host ones on the worker in unit order, GPU ones for the unit's next load."""
        self.mark("norm")
        if self.reader:
            self.reader.updating()
        self.opt.step_count += 1
        step = self.opt.step_count
        queued, started = self.host.stop_speculating()
        on_gpu, self.on_gpu = self.on_gpu, set()
        speculated = queued or bool(on_gpu)
        keep = speculated and clip == 1.0 and self.speculating == (step, lr)
        if speculated and not keep and not self.opt.host.copies:
            raise RuntimeError("an in-place speculative update cannot be undone: it needs clipping off")
        self.kept, self.redone, self.last_kept = (
            self.kept + keep,
            self.redone + (speculated and not keep),
            keep,
        )
        self.last_clip, self.speculating = clip, None
        for u, mode in enumerate(self.mode):
            if keep and u in on_gpu:
                self.opt.host.kept(u)  # loads of the unit wait for the copy's event (GpuUpdates.written)
            elif mode in ON_GPU:
                self.pending[u] = (step, lr, clip)
        self.host.start(step, lr, clip, started if keep else {}, self.grads.ready.get)

    def settle(self) -> None:
        """Every update of the last step done and back in its home (before a checkpoint reads the state)."""
        self.host.wait_all()
        for u in sorted(self.pending):
            self.gpu.update(u, *self.pending.pop(u))
        self.gpu.synchronize()

    def close(self) -> None:
        self.host.close()
