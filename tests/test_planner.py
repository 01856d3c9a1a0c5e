"""The planner: pure Python, its arithmetic by hand, and more of any budget never predicts a slower step."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from conftest import SLOW_HOST, cli
from tiertrain.config import load_config
from tiertrain.modes import Home, Kind, Update
from tiertrain.plan.advice import explain
from tiertrain.plan.hardware import REFERENCE, HardwareSpec
from tiertrain.plan.planner import evaluate, plan
from tiertrain.plan.values import Budgets, Choice, Job
from tiertrain.tiers.placement import kind_bytes, least_host
from tiertrain.tiers.slab import host_cost


def test_plan_runs_without_torch(tmp_path):
    chart = tmp_path / "plan.png"
    code = (
        "import sys, tiertrain.cli as c; from click.testing import CliRunner; "
        "r = CliRunner().invoke(c.main, ['plan', '--config', 'llama-120b', '--host-gb', '1500', '--gpu-gb', '141', "
        f"'--nvme-gb', '8000', '--format', 'json', '--chart', '{chart}']); assert r.exit_code == 0, r.output; "
        "assert 'torch' not in sys.modules; print(r.output)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000
    p = json.loads(r.stdout)
    assert p["fits"] and p["params"] > 119e9 and p["nvme_bytes"] and p["bottleneck"]
    assert abs(p["params"] * 18 / 1e12 - 2.16) < 0.01  # about 2.2 TB of state at 18 B/param


# finetune.toml holds no [model]: it needs --init-from (tests/test_inputs.py)
@pytest.mark.parametrize("path", sorted(p for p in glob.glob("configs/*.toml") if "finetune" not in p))
def test_every_shipped_config_gets_a_plan(path):
    cfg = load_config(path)
    job = Job(cfg.model, cfg.train.batch_size, cfg.train.seq_len, cfg.train.compute_dtype)
    p = plan(job, Budgets(host_gb=1500, gpu_gb=141, nvme_gb=8000), REFERENCE)
    assert p.fits, p.why
    assert p.prediction.step_s > 0 and p.prediction.tokens_per_s > 0 and p.memory.gpu.total <= 141e9


def test_arithmetic_by_hand():
    """llama-3b, 8k tokens, fp32 master streamed, checkpoints on the host, the figures below."""
    spec = load_config("llama-3b").model
    hw = HardwareSpec(
        bf16_tflops=776.0,
        h2d_gbs=55.5,
        d2h_gbs=55.4,
        bidir_gbs=101.3,
        host_adam_params_per_s=3.78e9,
        compute_efficiency=0.54,
        attention_efficiency=0.83,
        adam_contention=1.18,
        host_dram_gbs=120.0,
        copy_efficiency=0.75,
    )
    p = evaluate(
        Job(spec, 4, 2048), Choice(4, "master", "host", gpu_updates=0, speculate=0, keep=0), Budgets(), hw
    )
    # slabs by hand: embedding 32000 x 3072 = 98,304,000 (a multiple of 2048); a block's matrices
    # 4 x 3072^2 + 3 x 8192 x 3072 = 113,246,208, plus two 3072 norms = 113,252,352 (a multiple of 2048);
    # head 98,304,000 + 3072 = 98,307,072, rounded up to 2048s: 98,308,096
    sizes = (98_304_000, *[113_252_352] * 26, 98_308_096)
    n, T = sum(sizes), 8192
    assert sum(p.memory.host.values()) == sum(host_cost(x * 4) for x in sizes for _ in range(4))
    # the matmuls at their rate; attention at the fastest kernel's (the reference's cuDNN: 630 / 540 TFLOP/s
    # forward / backward) times attention_efficiency, its forward twice (the recompute)
    A = spec.attention_flops_per_token(2048)
    M, rate = spec.flops_per_token(2048) - A, 776e12 * 0.54
    assert p.run_plan.attention == "cudnn"
    fa, ba = 630e12 * 0.83, 540e12 * 0.83
    assert p.prediction.times["compute bwd"] == pytest.approx(
        T * M / rate + T * A / 3 / fa + T * 2 * A / 3 / ba
    )
    assert p.prediction.times["compute fwd"] == pytest.approx(T * M / 3 / rate + T * A / 3 / fa)
    assert p.prediction.times["H2D fwd"] == pytest.approx(4 * n / 55.5e9)
    assert p.prediction.times["host AdamW"] == pytest.approx(n / 3.78e9 * 1.18)
    # AdamW > forward here
    assert p.prediction.step_s == pytest.approx(
        p.prediction.times["compute bwd"] + p.prediction.times["host AdamW"]
    )
    assert p.prediction.times["host DRAM fwd"] == pytest.approx((4 * n + 26 * T * 3072 * 4 + 28 * n) / 120e9)
    assert p.prediction.bottleneck == "host AdamW" and p.prediction.tokens_per_s == pytest.approx(
        T / p.prediction.step_s
    )

    # the same with k units updated on the GPU: 12 more bytes per parameter each way in the forward pass,
    # fewer parameters for the host AdamW; the plan takes the k with the shortest step
    ck = 26 * T * 3072 * 4  # the checkpoints go to the host in the forward pass

    def step_with(k):
        d = sum(sizes[:k])
        h2d, d2h = 4 * n + 12 * d, 12 * d + ck
        # the host's DRAM serves the copies and the AdamW
        fwd = max(
            p.prediction.times["compute fwd"],
            h2d / 55.5e9,
            d2h / 55.4e9,
            (h2d + d2h) / (101.3e9 * 0.75),
            (n - d) / 3.78e9 * 1.18,
            (h2d + d2h + 28 * (n - d)) / 120e9,
        )
        return p.prediction.times["compute bwd"] + fwd

    best = min(range(len(sizes) + 1), key=step_with)
    q = evaluate(Job(spec, 4, 2048), Choice(4, "master", "host", speculate=0, keep=0), Budgets(), hw)
    assert 0 < q.run_plan.count(Update.GPU, Update.GPU_SPECULATED) == best < len(sizes)
    assert (
        q.prediction.step_s == pytest.approx(step_with(best))
        and q.prediction.step_s < 0.9 * p.prediction.step_s
    )
    assert q.memory.gpu.sets == 2 * 16 * 113_252_352
    assert q.prediction.bottleneck in ("H2D", "host AdamW", "host DRAM", "PCIe both ways")
    # a bf16 copy streamed: the GPU update needs the fp32 master there, so none
    assert (
        evaluate(Job(spec, 4, 2048), Choice(4, "compute", "host", keep=0), Budgets(), hw).run_plan.count(
            Update.GPU, Update.GPU_SPECULATED
        )
        == 0
    )


def test_spill_plan_matches_the_runtime_placement():
    """llama-3b (3.14 G params: 11.7 GiB per fp32 kind) under --host-gb 39 (36 GB, 33.5 GiB, beside the process's
    own 3 GB), fp32 streaming:
    master + grad take 23.4 GiB, the ring 8 x the widest slab (0.42 GiB) 3.4 GiB, which leaves 6.7 GiB
    for moments: every exp_avg (11.7 GiB) and 11.7 - 6.7 = 5.0 GiB of exp_avg_sq go to NVMe, as the
    runtime's placement (the same function) puts them."""
    spec = load_config("llama-3b").model
    p = evaluate(
        Job(spec, 4, 2048),
        Choice(4, "master", "gpu", keep=0, spill="moments"),
        Budgets(host_gb=39, nvme_gb=60),
        REFERENCE,
    )
    assert p.fits and p.prediction.bottleneck == "NVMe"
    assert (
        round(p.memory.nvme[Kind.EXP_AVG] / 2**30, 1) == 11.7
        and round(p.memory.nvme[Kind.EXP_AVG_SQ] / 2**30, 1) == 5.0
    )
    assert Kind.MASTER not in p.memory.nvme


def test_everything_spilled_by_hand():
    """llama-3b with a bf16 copy streaming under the least host budget: every slab on NVMe. Beside the
    forward pass the disk reads the moments, master and gradient for the optimizer and the bf16 copy
    for the forward pass, and writes moments, master and copy; in the backward pass it takes the
    gradients and gives the copy of every block but the last two, and the first two units' master and
    moments, read ahead of the optimizer."""
    spec = load_config("llama-3b").model
    sizes = (98_304_000, *[113_252_352] * 26, 98_308_096)
    n, hw = sum(sizes), HardwareSpec(disk_mixed_gbs=0.0)  # first without a rate of both directions at once
    least = least_host(list(sizes), kind_bytes("bfloat16", "compute"), 0, host_cost)
    # 4 + 2x the copy's
    assert least == 4 * host_cost(113_252_352 * 4) * 4 + 4 * host_cost(113_252_352 * 2) * 2
    least_budget = Budgets(
        host_gb=least / 1e9 + hw.process_gb + 1e-6, nvme_gb=100
    )  # --host-gb: the process's too
    p = evaluate(Job(spec, 4, 2048), Choice(4, "compute", "gpu", keep=0), least_budget, hw)
    assert (
        p.fits
        and p.memory.host == {}
        and p.memory.nvme == {k: n * b for k, b in kind_bytes("bfloat16", "compute").items()}
    )
    r, w = hw.disk_read_gbs * 1e9, hw.disk_write_gbs * 1e9
    ahead = 12 * (sizes[0] + sizes[1])
    late = 4 * sizes[0]  # the embedding's gradient, drained last: written after the norm, then read
    assert p.memory.nvme_late == late
    assert p.prediction.times["NVMe read"] == pytest.approx((18 * n - ahead) / r) and p.prediction.times[
        "NVMe write"
    ] == pytest.approx(14 * n / w)
    assert p.prediction.times["NVMe bwd"] == pytest.approx(
        (2 * sum(sizes[1:25]) + ahead) / r + (4 * n - late) / w
    )
    assert p.prediction.step_s == pytest.approx(
        p.prediction.times["NVMe bwd"]
        + p.prediction.times["NVMe read"]
        + p.prediction.times["NVMe write"]
        + late / w
    )
    assert p.prediction.bottleneck == "NVMe"
    # a probed rate of reads and writes at once: each phase's bytes within it, each direction within its own
    q = evaluate(
        Job(spec, 4, 2048),
        Choice(4, "compute", "gpu", keep=0),
        least_budget,
        dataclasses.replace(hw, disk_mixed_gbs=3.0),
    )
    assert q.prediction.times["NVMe"] == pytest.approx(
        max((18 * n - ahead) / r, 14 * n / w, (32 * n - ahead) / 3e9) + late / w
    )
    assert q.prediction.times["NVMe bwd"] == pytest.approx(
        max(
            (2 * sum(sizes[1:25]) + ahead) / r,
            (4 * n - late) / w,
            (2 * sum(sizes[1:25]) + ahead + 4 * n - late) / 3e9,
        )
    )
    assert (
        q.prediction.step_s == pytest.approx(q.prediction.times["NVMe bwd"] + q.prediction.times["NVMe"])
        and q.prediction.step_s < p.prediction.step_s
    )


@pytest.mark.parametrize("knob", ["host_gb", "gpu_gb", "nvme_gb"])
def test_more_budget_never_predicts_a_slower_step(knob):
    spec = load_config("llama-7b").model
    steps = []
    for gb in (40, 60, 90, 140, 400, 2000):
        b = replace(Budgets(host_gb=60, gpu_gb=80, nvme_gb=500), **{knob: gb})
        p = plan(Job(spec, 16, 2048), b, REFERENCE)
        steps.append(p.prediction.step_s if p.fits else math.inf)
    assert all(b <= a * (1 + 1e-9) for a, b in zip(steps, steps[1:])), steps
    assert steps[-1] < float("inf")


def test_a_plan_that_does_not_fit_says_which_budget():
    spec = load_config("llama-7b").model
    job = Job(spec, 16, 2048)
    p = plan(job, Budgets(host_gb=40), REFERENCE)
    assert not p.fits and re.search(r"raise --host-gb to [0-9.]+ or give an NVMe tier", p.why)
    p = plan(job, Budgets(host_gb=1000, gpu_gb=2), REFERENCE)
    assert not p.fits and p.why.startswith("GPU: needs")
    # with an NVMe tier, too little host memory for even the ring: the least budget, of every choice
    one_b = load_config("llama-1b").model
    p = plan(Job(one_b, 16, 2048), Budgets(host_gb=5, nvme_gb=100), REFERENCE)
    need = float(re.search(r"raise --host-gb to at least ([0-9.]+)$", p.why).group(1))
    assert plan(Job(one_b, 16, 2048), Budgets(host_gb=need, nvme_gb=100), REFERENCE).fits
    # the report of a plan that fits names its own choice's least budget: the same figure, unrounded
    at_need = Budgets(host_gb=need, nvme_gb=100)
    reported = explain(
        Job(one_b, 16, 2048), plan(Job(one_b, 16, 2048), at_need, REFERENCE), at_need, REFERENCE
    )
    reported = reported.least_host / 1e9
    assert need - 0.1 < reported <= need
    assert not plan(Job(one_b, 16, 2048), Budgets(host_gb=need - 0.1, nvme_gb=100), REFERENCE).fits
    # a 141 GB GPU holds what the host does not
    r = cli("plan", "--config", "llama-7b", "--host-gb", "40", "--gpu-gb", "24")
    assert r.returncode == 1 and "Does not fit" in r.stdout


def test_plan_keeps_what_the_config_sets(tmp_path):
    """`plan` searches what the config leaves "auto" (as `run` does on a GPU) and keeps what it sets.
    On a host whose AdamW into copies is slow, so that clipping changes how many units speculate."""
    from click.testing import CliRunner

    from tiertrain.cli import main

    SLOW_HOST.save(tmp_path / "hw.json")

    def chosen(*sets):
        r = CliRunner().invoke(
            main,
            [
                "plan",
                "--config",
                "llama-3b",
                "--batch-size",
                "4",
                "--host-gb",
                "200",
                "--hardware",
                str(tmp_path / "hw.json"),
                "--format",
                "json",
                *[x for s in ("tiers.gpu_resident_gb=0", *sets) for x in ("--set", s)],
            ],
        )
        assert r.exit_code == 0, r.output
        p = json.loads(r.output)
        return (
            p["stream"],
            p["activations"],
            p["speculated"],
            p["clipping"],
            "update copies" in p["host_fixed"],
        )

    searched = chosen()
    ref = plan(Job(load_config("llama-3b").model, 4, 2048), Budgets(host_gb=200), SLOW_HOST)
    assert (
        searched == (ref.run_plan.stream, searched[1], ref.run_plan.count(Update.HOST_SPECULATED), True, True)
        and ref.run_plan.count(Update.HOST_SPECULATED) > 0
    )
    # the config's clipping and speculation too: with clipping off a speculated update runs in place
    off = plan(Job(load_config("llama-3b").model, 4, 2048, clipping=False), Budgets(host_gb=200), SLOW_HOST)
    assert chosen("optim.grad_clip=0")[2:] == (
        off.run_plan.count(Update.HOST_SPECULATED),
        False,
        False,
    ) and off.run_plan.count(Update.HOST_SPECULATED) != ref.run_plan.count(Update.HOST_SPECULATED)
    assert chosen("optim.speculate_units=2")[2] == 2 and chosen("optim.speculate_units=0")[2:] == (
        0,
        True,
        False,
    )
    other = {"compute": "master", "master": "compute"}[searched[0]]
    assert chosen(f'tiers.stream="{other}"')[0] == other
    assert chosen('tiers.activations="host"')[1] == "host" and chosen('tiers.activations="gpu"')[1] == "gpu"

    # the config's micro-batch too (llama-3b sets 4); 0 searches: the largest that fits the GPU (the
    # cost model gives every micro-batch the same speed), here the whole batch of 16; with nothing resident
    # and nothing kept, which would take the memory a larger micro-batch's working set needs
    def micro(*sets):
        r = CliRunner().invoke(
            main,
            [
                "plan",
                "--config",
                "llama-3b",
                "--host-gb",
                "200",
                "--format",
                "json",
                *[
                    x
                    for s in ("tiers.gpu_resident_gb=0", "train.keep_activations=0", *sets)
                    for x in ("--set", s)
                ],
            ],
        )
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["micro_batch"]

    assert (
        micro() == 4
        and micro("train.micro_batch_size=2") == 2
        and micro('train.micro_batch_size="auto"') == 16
    )
    # at most 64k tokens per micro-batch
    assert micro('train.micro_batch_size="auto"', "train.batch_size=64") == 32


def test_the_plan_spills_gradients_first_where_faster():
    """The same budgets in either spill order: the same bytes on NVMe, but moments first cost the disk a read and a
    write beside the next forward pass, gradients first a write in the backward pass and a read beside the forward
    one. Left to the plan, the order is the faster one's; llama3.1-8b at 131,072 tokens on an 80 GB GPU with 120 GB
    of RAM (issue 42's run) takes the gradients first."""
    spec = load_config("llama3.1-8b").model
    job, budgets = Job(spec, 1, 131072), Budgets(host_gb=120, gpu_gb=80, nvme_gb=55)
    fixed = Choice(1, "master", "split", keep=0)
    got = {s: evaluate(job, replace(fixed, spill=s), budgets, REFERENCE) for s in ("moments", "gradients")}
    m, g = got["moments"], got["gradients"]
    assert m.fits and g.fits and sum(m.memory.nvme.values()) == sum(g.memory.nvme.values())
    assert Kind.GRAD not in m.memory.nvme and Kind.EXP_AVG in m.memory.nvme
    assert set(g.memory.nvme) == {Kind.GRAD}
    tm, tg = m.prediction.times, g.prediction.times
    assert (
        tg["NVMe"] < tm["NVMe"] and tg["NVMe bwd"] > tm["NVMe bwd"]
    )  # the disk's work moves to the backward pass
    auto = evaluate(job, fixed, budgets, REFERENCE)
    assert auto.run_plan.spill_first == "gradients" and g.prediction.step_s < m.prediction.step_s
    assert auto.prediction.step_s == g.prediction.step_s and auto.run_plan.where() == g.run_plan.where()
    # a short sequence whose state spills as much: the backward pass is short too, and the plan says which
    short = evaluate(Job(spec, 4, 2048), replace(fixed, micro=4, activations="gpu"), budgets, REFERENCE)
    both = [
        evaluate(Job(spec, 4, 2048), replace(fixed, micro=4, activations="gpu", spill=s), budgets, REFERENCE)
        for s in ("moments", "gradients")
    ]
    assert short.prediction.step_s == min(b.prediction.step_s for b in both)


def test_a_first_unit_gradient_on_disk_is_waited_for_after_the_norm():
    """The first unit's gradient is drained last in the backward pass: spilled, its write ends as the norm comes and
    the update reads it back at once. The plan prices that write beside the forward pass, not the backward one."""
    spec = load_config("llama-3b").model
    job, b = Job(spec, 4, 2048), Budgets(host_gb=36, gpu_gb=80, nvme_gb=100)
    fixed = Choice(4, "master", "gpu", keep=0, gpu_updates=0, speculate=0)
    g = evaluate(job, replace(fixed, spill="gradients"), b, REFERENCE)
    m = evaluate(job, replace(fixed, spill="moments"), b, REFERENCE)
    first = g.run_plan.numels[0]
    assert g.run_plan.where()[(0, Kind.GRAD)] == Home.NVME and g.memory.nvme_late == first * 4
    assert m.run_plan.where()[(0, Kind.GRAD)] == Home.HOST and m.memory.nvme_late == 0
    free = replace(g.memory, nvme_late=0)  # the same plan, the wait left out
    from tiertrain.plan.times import _disk

    with_wait, without = (
        _disk(g.memory, g.run_plan.kind_bytes(), 0, REFERENCE),
        _disk(free, g.run_plan.kind_bytes(), 0, REFERENCE),
    )
    assert with_wait["NVMe"] - without["NVMe"] == pytest.approx(first * 4 / (REFERENCE.disk_write_gbs * 1e9))
    assert with_wait["NVMe bwd"] < without["NVMe bwd"]


def test_auto_micro_batch_of_rows_longer_than_its_limit_is_one_row():
    """train.micro_batch_size "auto" takes micro-batches of at most 64 Ki tokens; where one row is longer, one row
    at a time, not the whole batch (which missed on the GPU where one row fits)."""

    r = cli(
        "plan",
        *("--config", "llama3.1-8b", "--batch-size", "16", "--seq-len", "131072"),
        *("--host-gb", "1000", "--nvme-gb", "4000", "--hardware", "reference", "--format", "json"),
    )
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["fits"] and d["micro_batch"] == 1, r.stdout[-300:]
