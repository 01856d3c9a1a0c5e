"""Speculative updates (optim.speculate_units): started in the backward pass as if the global norm will
not clip, kept when it does not, redone from the untouched state when it does: never a different bit."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from conftest import DEEP, SLOW_HOST, VARIANTS, beside_gb, tiny_config
from tiertrain.config import load_config
from tiertrain.errors import ConfigError
from tiertrain.modes import Home, Update
from tiertrain.optim.adamw import OptimizerThread
from tiertrain.plan.hardware import REFERENCE
from tiertrain.plan.memory import slab_sizes as _layouts
from tiertrain.plan.planner import SPEC_MARGIN, evaluate, plan
from tiertrain.plan.values import Budgets, Choice, Job
from tiertrain.tiers.placement import RING_SLOTS, alternate_from_last, gpu_updated
from tiertrain.tiers.slab import host_cost
from tiertrain.trainer import Trainer

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _run(cfg, steps=6, gpu_spec=True):
    tr = Trainer(cfg)
    # the placement of a run whose GPU updates speculate, never speculating: its RunPlan says so
    if not gpu_spec:
        updates = {u: "gpu" for u in tr.run_plan.updated("gpu-speculated")}
        tr.close()
        tr = Trainer(cfg, updates=updates)
        assert tr.run_plan.updated("gpu-speculated") == frozenset() and tr.run_plan.updated(
            "gpu", "gpu-speculated"
        ) == set(updates)
    recs = [tr.train_step() for _ in range(steps)]
    sd = tr.state_dict()
    early, kept, redone = tr.run_plan.updated("host-speculated"), tr.run.updates.kept, tr.run.updates.redone
    tr.close()
    return recs, sd, early, (kept, redone)


def _same(a, b):
    assert [r["loss"] for r in a[0]] == [r["loss"] for r in b[0]]
    for k in b[1]:
        assert torch.equal(a[1][k], b[1][k]), k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "variant",
    [
        ['train.compute_dtype="bfloat16"', 'tiers.stream="compute"'],  # the bf16 copy rewritten in place
        ['train.compute_dtype="bfloat16"', 'tiers.stream="master"', "tiers.gpu_update_units=2"],
        ["tiers.gpu_resident_gb=0.0005"],  # the embedding resident: updated on the device, not speculated
    ],
)
def test_kept_and_redone_speculation_change_no_bit(token_file, device, variant):
    """The clip threshold is the median norm of the plain run: some steps clip (their speculation is
    redone, and the next step does not speculate), others do not (kept). GPU-updated units speculate on
    the GPU (optim.speculate_gpu_updates), with the host's speculation and alone."""
    sets = [*VARIANTS["qwen2"], f'train.device="{device}"', *variant]
    none = ["optim.speculate_units=0", "optim.speculate_gpu_updates=false"]
    base = _run(tiny_config(token_file, *sets, *none))
    norms = sorted(r["grad_norm"] for r in base[0])
    clip = f"optim.grad_clip={norms[len(norms) // 2]}"
    every = ["optim.speculate_units=99", "optim.speculate_gpu_updates=true"]  # every one it can
    gpu_only = ["optim.speculate_units=0", "optim.speculate_gpu_updates=true"]
    # the same units updated on the GPU, never speculating (a CUDA kernel may round unlike the host's)
    want = _run(tiny_config(token_file, *sets, clip, *gpu_only), gpu_spec=False)
    assert want[3] == (0, 0)
    for spec in [every, gpu_only] if any("gpu_update_units" in v for v in variant) else [every]:
        got = _run(tiny_config(token_file, *sets, clip, *spec))
        _same(got, want)
        kept, redone = got[3]
        assert kept >= 1 and redone >= 1
    tr = Trainer(tiny_config(token_file, *sets, clip, *every))
    host = [
        u
        for u in range(len(tr.units))
        if all(tr.run_plan.where()[(u, k)] == Home.HOST for k in tr.run.host.kinds)
    ]
    early = tr.run_plan.updated("host-speculated")
    # copies for those
    assert early == set(host) - tr.run_plan.updated("gpu", "gpu-speculated") and set(
        tr.run.host.copies
    ) == early | tr.run_plan.updated("gpu", "gpu-speculated")
    # every other unit from the last: the GPU-updated ones and the host's alternate
    if tr.run_plan.updated("gpu", "gpu-speculated"):
        assert sorted(tr.run_plan.updated("gpu", "gpu-speculated")) == host[::-1][::2][:2][::-1]
    tr.close()


def test_clipping_off_speculates_in_place(token_file):
    """No copies; every step's speculation is kept; the same bits as updating after the backward pass."""
    sets = ["optim.grad_clip=0", *VARIANTS["llama"]]
    got = _run(tiny_config(token_file, *sets, "optim.speculate_units=99"))
    _same(got, _run(tiny_config(token_file, *sets, "optim.speculate_units=0")))
    assert got[3] == (6, 0)
    tr = Trainer(tiny_config(token_file, *sets, "optim.speculate_units=99"))
    assert tr.run.host.copies == {} and "update copies" not in tr.run.host.nbytes()
    started, real = [], tr.run.updates.after_norm

    def after_norm(*a):  # the updates the backward pass started, as the step settles them
        started.append(set(tr.run.updates.host.speculations))
        real(*a)

    tr.run.updates.after_norm = after_norm
    for _ in range(2):
        tr.train_step()
    tr.close()
    assert started == [set(range(len(tr.units)))] * 2


def test_speculation_not_started_at_the_norm_runs_in_place_in_unit_order(token_file):
    """The worker held in the first speculated update until the norm is known: the speculations queued
    behind it become plain updates, after the first units (the next forward pass needs those first),
    and the run keeps every bit of the one that does not speculate."""
    sets = [*VARIANTS["llama"], "optim.grad_clip=100"]
    want = _run(tiny_config(token_file, *sets, "optim.speculate_units=0"), steps=3)
    tr = Trainer(tiny_config(token_file, *sets, "optim.speculate_units=99"))
    calls, gates = [], [threading.Event()]
    update, after_norm = tr.run.updates.opt.update_unit, tr.run.updates.after_norm

    def held(unit, step, lr, clip, into_copies=False):
        calls.append((step, unit, into_copies))
        if into_copies:
            gates[-1].wait(30)
        update(unit, step, lr, clip, into_copies)

    def released(*a):
        after_norm(*a)
        gates.append(threading.Event())
        gates[-2].set()

    tr.run.updates.opt.update_unit, tr.run.updates.after_norm = held, released
    recs = [tr.train_step() for _ in range(3)]
    tr.run.updates.settle()
    got = (recs, tr.state_dict())
    n, kept = len(tr.units), tr.run.updates.kept
    tr.close()
    _same(got, want)
    assert kept == 3
    for step in (1, 2, 3):  # the first speculated into copies (on CPU every gradient has landed at once:
        # the first unit drained so far), then the rest in unit order
        first, *rest = [c[1:] for c in calls if c[0] == step]
        assert first[1] and rest == [(u, False) for u in range(n) if u != first[0]]


class Landing:
    """A gradient's D2H event, landed when the test says."""

    def __init__(self):
        self.landed = threading.Event()

    def query(self) -> bool:
        return self.landed.is_set()

    def synchronize(self) -> None:
        assert self.landed.wait(30)


def test_speculation_takes_the_first_landed_unit_in_forward_order():
    """Of the drained units whose gradient has landed, the worker takes the first in forward order; with
    none landed it waits for the next to land, then takes the first of those landed by then."""
    calls = []

    class Opt:
        step_count = 0
        host = SimpleNamespace(copies={})  # clipping off: speculated updates run in place

        def update_unit(self, unit, step, lr, clip, into_copies=False):
            calls.append(unit)

    th = OptimizerThread(Opt(), 6, overlap=True, units=frozenset(range(6)), speculated=frozenset(range(6)))
    ev = {u: Landing() for u in range(6)}
    for u in (5, 4, 3, 2, 1, 0):  # the backward pass's order; the worker waits for unit 5's gradient
        th.speculate(u, ev[u], 1, 1e-3)
    for u in (4, 2, 5):
        ev[u].landed.set()

    def until(n):
        for _ in range(3000):
            if len(calls) >= n:
                return
            time.sleep(0.01)

    until(3)
    assert calls == [2, 4, 5]
    ev[3].landed.set()  # the next drained, waited for
    until(4)
    for u in (0, 1):  # the worker waits for unit 1's gradient, then takes unit 0 first
        ev[u].landed.set()
    until(6)
    queued, started = th.stop_speculating()
    assert queued and set(started) == set(range(6))
    th.start(1, 1e-3, 1.0, started, lambda u: None)  # kept: nothing runs again
    th.wait_all()
    th.close()
    assert calls == [2, 4, 5, 3, 0, 1]
    assert [u for e, u, _ in th.timeline if e == "spec job"] == calls


def test_units_in_ram_speculate_every_other_from_the_last_and_spilled_ones_never(token_file, tmp_path):
    """With moments of the last units on NVMe, the units speculated are every other one of those wholly
    in RAM, from the last, and the spilled run is bit-identical to the same placement without speculation."""
    tr = Trainer(tiny_config(token_file, *DEEP))
    sizes = [lay.numel for lay in tr.layouts]
    tr.close()
    # a block's slab short of the whole state: the last units' exp_avg spill, enough to pay for their ring
    gb = (sum(host_cost(n * 4) * 4 for n in sizes) - host_cost(sizes[-2] * 4)) / 1e9
    gb += beside_gb(tiny_config(token_file, *DEEP))  # the process and the CPU's working set, in --host-gb
    sets = [*DEEP, 'tiers.io="posix"', "optim.grad_clip=0", f"tiers.host_gb={gb}"]
    got = _run(
        tiny_config(token_file, *sets, f'tiers.nvme_dir="{tmp_path / "a"}"', "optim.speculate_units=3"),
        steps=3,
    )
    want = _run(
        tiny_config(token_file, *sets, f'tiers.nvme_dir="{tmp_path / "b"}"', "optim.speculate_units=0"),
        steps=3,
    )
    _same(got, want)
    tr = Trainer(tiny_config(token_file, *sets, f'tiers.nvme_dir="{tmp_path / "c"}"'))
    ram = [
        u
        for u in range(len(tr.units))
        if all(tr.run_plan.where()[(u, k)] == Home.HOST for k in tr.run.host.kinds)
    ]
    tr.close()
    assert RING_SLOTS < len(sizes) - len(ram) < len(sizes) and got[2] == {ram[-1], ram[-3], ram[-5]}


def test_copies_must_fit_the_host_budget(token_file):
    cfg = tiny_config(token_file)
    tr = Trainer(cfg)
    state = sum(host_cost(lay.numel * 4) * 4 for lay in tr.layouts) / 1e9
    tr.close()
    state += beside_gb(cfg) / 1.01  # the process and the CPU's working set, in --host-gb
    with pytest.raises(ConfigError, match="optim.speculate_units = 2 keeps copies of .* raise --host-gb"):
        Trainer(tiny_config(token_file, f"tiers.host_gb={state * 1.01}", "optim.speculate_units=2"))
    tr = Trainer(tiny_config(token_file, f"tiers.host_gb={state * 1.01}"))  # "auto" on a CPU: none
    assert tr.run_plan.updated("host-speculated") == frozenset() and not tr.run_plan.updated(
        "host-speculated"
    )
    tr.close()


def test_an_error_in_a_kept_speculation_surfaces(token_file, monkeypatch):
    tr = Trainer(tiny_config(token_file, "optim.grad_clip=100", "optim.speculate_units=99"))
    real = tr.run.updates.opt.update_unit

    def boom(unit, step, lr, clip, into_copies=False):
        if into_copies:
            raise RuntimeError("bit flip")
        real(unit, step, lr, clip, into_copies)

    monkeypatch.setattr(tr.run.updates.opt, "update_unit", boom)
    tr.train_step()
    with pytest.raises(RuntimeError, match="bit flip"):
        tr.train_step()


def test_planner_balances_the_speculated_units():
    """llama-3b at 32k tokens (reference H200): with clipping off the backward pass (1.5 s of compute)
    has room for the host AdamW, so the plan speculates and predicts a shorter step; its number is the
    best of every number; copies cost 12 B per speculated parameter when clipping is on."""
    spec = load_config("llama-3b").model
    job, budgets = Job(spec, 16, 2048), Budgets(host_gb=120)

    def at(job=job, **choice):
        return evaluate(job, Choice(16, "master", "host", keep=0, **choice), budgets, REFERENCE)

    unclipped = replace(job, clipping=False)
    off = at(speculate=0, speculate_gpu=False)
    auto = at(unclipped, speculate_gpu=False)
    assert (
        auto.run_plan.count(Update.HOST_SPECULATED) > 0
        and auto.prediction.step_s < off.prediction.step_s * 0.95
    )
    every = [
        at(
            unclipped,
            speculate=n,
            gpu_updates=auto.run_plan.count(Update.GPU, Update.GPU_SPECULATED),
            speculate_gpu=False,
        ).prediction.step_s
        for n in range(29)
    ]
    assert auto.prediction.step_s == pytest.approx(min(every))
    # by hand: the backward phase's host AdamW time of n speculated blocks, in place and into copies
    n = 5
    a = at(unclipped, speculate=n, gpu_updates=0)
    b = at(speculate=n, gpu_updates=0)
    params = 98_308_096 + (n - 1) * 113_252_352  # the head, then the last blocks
    rate = REFERENCE.host_adam_params_per_s
    assert a.prediction.times["host AdamW bwd"] == pytest.approx(params / rate * REFERENCE.adam_contention)
    assert b.prediction.times["host AdamW bwd"] == pytest.approx(
        params / (rate * REFERENCE.out_of_place) * REFERENCE.adam_contention
    )
    assert b.memory.host_fixed()["update copies"] == 3 * (
        host_cost(98_308_096 * 4) + (n - 1) * host_cost(113_252_352 * 4)
    )
    assert "update copies" not in a.memory.host_fixed()
    # while the norm clips nothing speculates: the same plan without its speculation; clipping off, never
    assert b.prediction.clipped_step_s == pytest.approx(at(speculate=0, gpu_updates=0).prediction.step_s)
    assert a.prediction.clipped_step_s == a.prediction.step_s
    at8k = evaluate(
        Job(spec, 4, 2048),
        Choice(4, "compute", "gpu", gpu_updates=0, keep=0),
        Budgets(host_gb=120),
        REFERENCE,
    )
    assert (
        at8k.run_plan.count(Update.HOST_SPECULATED)
        and at8k.prediction.clipped_step_s > at8k.prediction.step_s * 1.1
    )
    assert at8k.prediction.clipped_times["host AdamW"] > at8k.prediction.times["host AdamW"]
    # a budget that holds the state but not the copies: the fixed number misses, -1 takes fewer
    tight = Budgets(
        host_gb=sum(off.memory.host.values()) / 1e9
        + off.memory.host_fixed()["host checkpoints"] / 1e9
        + 2
        + REFERENCE.process_gb  # --host-gb holds the process too
    )
    miss = plan(
        Job(spec, 16, 2048),
        tight,
        REFERENCE,
        Choice(16, "master", "host", gpu_updates=0, speculate=28, speculate_gpu=False),
    )
    assert not miss.fits and "copies of the speculative update" in miss.why
    few = plan(Job(spec, 16, 2048), tight, REFERENCE, Choice(16, "master", "host", gpu_updates=0))
    assert few.fits and 0 < few.run_plan.count(Update.HOST_SPECULATED) < 28 and few.memory.copies <= 2e9


def test_planner_queues_more_than_the_backward_pass_has_room_for():
    """llama-3b at 8k tokens (reference H200, a bf16 copy streamed): the backward pass's DRAM has room for
    some of the host's updates. Those queued beyond it run after the norm (the runtime starts none after
    it), so more never lengthen the plan's step; the plan queues SPEC_MARGIN times the least number that
    gives its shortest step (the host's rate varies between runs), at the same predicted step."""
    spec = load_config("llama-3b").model

    def at(**choice):
        return evaluate(
            Job(spec, 4, 2048), Choice(4, "compute", "gpu", keep=0, **choice), Budgets(host_gb=200), REFERENCE
        )

    steps = [at(speculate=n, gpu_updates=0).prediction.step_s for n in range(29)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(steps, steps[1:]))
    least = next(n for n, s in enumerate(steps) if s <= min(steps) * (1 + 1e-9))
    assert 0 < least < 20 and steps[0] > min(steps) * 1.1
    auto = at(gpu_updates=0)
    numels = _layouts(spec)
    params = [sum(numels[u] for u in alternate_from_last(list(range(len(numels))), n)) for n in range(29)]
    assert (
        params[auto.run_plan.count(Update.HOST_SPECULATED) - 1]
        < SPEC_MARGIN * params[least]
        <= params[auto.run_plan.count(Update.HOST_SPECULATED)]
    )
    assert auto.prediction.step_s == pytest.approx(min(steps))
    # all queued: the backward pass takes what it has room for, in its time, the rest after the norm
    every = at(speculate=28, gpu_updates=0)
    t, bwd = every.prediction.times, every.prediction.times["compute bwd"]
    assert t["host DRAM bwd"] == pytest.approx(bwd) and t["host AdamW bwd"] < bwd
    rate = REFERENCE.host_adam_copy_params_per_s / REFERENCE.adam_contention
    done = t["host AdamW bwd"] * rate * REFERENCE.out_of_place
    assert (t["host AdamW"] * rate + done) == pytest.approx(sum(numels))


def test_planner_speculates_gpu_updates_in_the_backward_pass():
    """llama-3b at 16k tokens, clipping on, a slow host AdamW: the forward pass is short (0.26 s of compute)
    and the GPU updates' state crossing PCIe in it makes the step long; speculated, that state crosses in
    the backward pass, which has PCIe to spare, and the step shortens. The bytes move between the phases
    and their copies take host memory."""
    spec = load_config("llama-3b").model

    def at(clipping=True, **choice):
        return evaluate(
            Job(spec, 8, 2048, clipping=clipping),
            Choice(8, "master", "gpu", keep=0, **choice),
            Budgets(host_gb=120),
            SLOW_HOST,
        )

    fwd = at(speculate_gpu=False)
    auto = at()
    assert (
        bool(auto.run_plan.count(Update.GPU_SPECULATED))
        and auto.run_plan.count(Update.GPU, Update.GPU_SPECULATED) > 0
        and auto.prediction.step_s < fwd.prediction.step_s * 0.9
    )
    k, n = auto.run_plan.count(Update.GPU, Update.GPU_SPECULATED), auto.run_plan.count(Update.HOST_SPECULATED)
    none = at(gpu_updates=0, speculate=n, speculate_gpu=False)
    b = at(gpu_updates=k, speculate=n, speculate_gpu=True)
    numels = _layouts(spec)
    # every other from the last
    params = sum(numels[u] for u in gpu_updated(list(range(len(numels))), k, True))
    rate = SLOW_HOST.h2d_gbs * 1e9
    # the kept masters stream like the host's
    assert b.prediction.times["H2D fwd"] == none.prediction.times["H2D fwd"]
    assert (b.prediction.times["H2D bwd"] - none.prediction.times["H2D bwd"]) * rate == pytest.approx(
        12 * params, rel=1e-9
    )
    # their state shares PCIe with the weights the compute waits for: at spec_copy_efficiency of the copies' rate
    for p, eff in ((b, SLOW_HOST.spec_copy_efficiency), (none, 1.0)):
        both = (
            p.prediction.times["H2D bwd"] * SLOW_HOST.h2d_gbs + p.prediction.times["D2H"] * SLOW_HOST.d2h_gbs
        ) * 1e9
        assert p.prediction.times[
            "PCIe both bwd"
        ] * SLOW_HOST.bidir_gbs * SLOW_HOST.copy_efficiency * eff * 1e9 == pytest.approx(both)
    gpu = gpu_updated(list(range(len(numels))), k, True)
    host = [u for u in range(len(numels)) if u not in gpu]
    assert b.memory.host_fixed()["update copies"] == 3 * sum(
        host_cost(numels[u] * 4) for u in gpu + alternate_from_last(host, n)
    )
    assert (
        "update copies" not in at(False, gpu_updates=k, speculate=0, speculate_gpu=True).memory.host_fixed()
    )


def test_timeline_accounts_for_every_host_update(token_file):
    """bench.timeline's summary of OptimizerThread.timeline: each step's speculated units finish once in
    its backward pass, the other host units once after its norm, and nothing is counted twice."""
    from bench.timeline import _jobs, _marks, summarize

    cfg = tiny_config(token_file, "optim.grad_clip=0", "optim.speculate_units=2")
    tr = Trainer(cfg)
    for _ in range(4):
        tr.train_step()
    tr.run.updates.settle()
    ev, early = list(tr.run.updates.timeline), tr.run_plan.updated("host-speculated")
    numels = [lay.numel for lay in tr.layouts]
    tr.close()
    assert len(early) == 2
    backs, norms = _marks(ev, "backward"), _marks(ev, "norm")
    assert len(backs) == len(norms) == len(_marks(ev, "step")) == 4
    plain = []
    for k in range(3):  # a speculation not started at the norm runs as a plain update
        spec = _jobs(ev, "spec ", backs[k], backs[k + 1])
        assert {u for u, *_ in spec} <= early and all(j <= g <= d for _, j, g, d in spec)
        upd = _jobs(ev, "", norms[k], backs[k + 1])
        assert sorted(u for u, *_ in spec + upd) == list(range(len(numels)))
        plain.append({u for u, *_ in upd})
    s = summarize(ev, numels)
    assert s["bwd_s"] > 0 and s["spec_busy_s"] > 0 and s["upd_busy_s"] > 0
    assert s["upd_gparams_s"] == pytest.approx(
        sum(n for u, n in enumerate(numels) if u in plain[-1]) / 1e9 / s["upd_busy_s"], rel=0.5
    )


@pytest.mark.gpu
@pytest.mark.parametrize("clip, kept", [(1e6, True), (1e-6, False)])
def test_the_step_prediction_follows_whether_the_last_update_was_speculated(token_file, clip, kept):
    """A step's forward pass waits for the last update: its prediction is the plan's step when that update
    was speculated and kept, and the plan's step without speculation when the norm clipped."""
    tr = Trainer(
        tiny_config(token_file, 'train.device="cuda"', f"optim.grad_clip={clip}", "optim.speculate_units=99")
    )
    assert tr.plan is not None and tr.run_plan.updated("host-speculated")
    # whatever the tiny model's times
    apart = dataclasses.replace(tr.plan.prediction, step_s=1.0, clipped_step_s=2.0)
    tr.plan = dataclasses.replace(tr.plan, prediction=apart)
    recs = [tr.train_step() for _ in range(3)]
    tr.close()
    assert [r["pred_step_s"] for r in recs[1:]] == [1.0 if kept else 2.0] * 2
