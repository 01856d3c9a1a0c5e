"""The planner: pure Python, its arithmetic by hand, and more of any budget never predicts a slower step."""
from __future__ import annotations

import dataclasses
from dataclasses import replace
import glob
import json
import math
import re
import subprocess
import sys

import pytest

from conftest import SLOW_HOST
from tiertrain.config import load_config
from tiertrain.modes import Kind, Update
from tiertrain.plan.hardware import REFERENCE, HardwareSpec
from tiertrain.plan.advice import explain
from tiertrain.plan.planner import evaluate, plan
from tiertrain.plan.values import Budgets, Choice, Job
from tiertrain.tiers.placement import kind_bytes, least_host
from tiertrain.tiers.slab import host_cost


def test_plan_runs_without_torch(tmp_path):
    chart = tmp_path / "plan.png"
    code = ("import sys, tiertrain.cli as c; from click.testing import CliRunner; "
            "r = CliRunner().invoke(c.main, ['plan', '--config', 'llama-120b', '--host-gb', '1500', '--gpu-gb', '141', "
            f"'--nvme-gb', '8000', '--format', 'json', '--chart', '{chart}']); assert r.exit_code == 0, r.output; "
            "assert 'torch' not in sys.modules; print(r.output)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000
    p = json.loads(r.stdout)
    assert p["fits"] and p["params"] > 119e9 and p["nvme_bytes"] and p["bottleneck"]
    assert abs(p["params"] * 18 / 1e12 - 2.16) < 0.01  # about 2.2 TB of state at 18 B/param


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.toml")))
def test_every_shipped_config_gets_a_plan(path):
    cfg = load_config(path)
    job = Job(cfg.model, cfg.train.batch_size, cfg.train.seq_len, cfg.train.compute_dtype)
    p = plan(job, Budgets(host_gb=1500, gpu_gb=141, nvme_gb=8000), REFERENCE)
    assert p.fits, p.why
    assert p.prediction.step_s > 0 and p.prediction.tokens_per_s > 0 and p.memory.gpu.total <= 141e9


def test_arithmetic_by_hand():
    """llama-3b, 8k tokens, fp32 master streamed, checkpoints on the host, the figures below."""
    spec = load_config("llama-3b").model
    hw = HardwareSpec(bf16_tflops=776.0, h2d_gbs=55.5, d2h_gbs=55.4, bidir_gbs=101.3, host_adam_params_per_s=3.78e9,
                      compute_efficiency=0.54, adam_contention=1.18, host_dram_gbs=120.0, copy_efficiency=0.75)
    p = evaluate(Job(spec, 4, 2048), Choice(4, "master", "host", gpu_updates=0, speculate=0, keep=0), Budgets(), hw)
    # slabs by hand: embedding 32000 x 3072 = 98,304,000 (a multiple of 2048); a block's matrices
    # 4 x 3072^2 + 3 x 8192 x 3072 = 113,246,208, plus two 3072 norms = 113,252,352 (a multiple of 2048);
    # head 98,304,000 + 3072 = 98,307,072, rounded up to 2048s: 98,308,096
    sizes = (98_304_000, *[113_252_352] * 26, 98_308_096)
    n, T = sum(sizes), 8192
    assert sum(p.memory.host.values()) == sum(host_cost(x * 4) for x in sizes for _ in range(4))
    F = spec.flops_per_token(2048) - spec.attention_flops_per_token(2048) * (1 - 1 / 1.24)  # attention at 1.24x
    rate = 776e12 * 0.54
    assert p.prediction.times["compute bwd"] == pytest.approx(T * F / rate)
    assert p.prediction.times["compute fwd"] == pytest.approx(T * F / 3 / rate)
    assert p.prediction.times["H2D fwd"] == pytest.approx(4 * n / 55.5e9)
    assert p.prediction.times["host AdamW"] == pytest.approx(n / 3.78e9 * 1.18)
    assert p.prediction.step_s == pytest.approx(p.prediction.times["compute bwd"] + p.prediction.times["host AdamW"])  # AdamW > forward here
    assert p.prediction.times["host DRAM fwd"] == pytest.approx((4 * n + 26 * T * 3072 * 4 + 28 * n) / 120e9)
    assert p.prediction.bottleneck == "host AdamW" and p.prediction.tokens_per_s == pytest.approx(T / p.prediction.step_s)

    # the same with k units updated on the GPU: 12 more bytes per parameter each way in the forward pass,
    # fewer parameters for the host AdamW; the plan takes the k with the shortest step
    ck = 26 * T * 3072 * 4  # the checkpoints go to the host in the forward pass

    def step_with(k):
        d = sum(sizes[:k])
        h2d, d2h = 4 * n + 12 * d, 12 * d + ck
        fwd = max(T * F / 3 / rate, h2d / 55.5e9, d2h / 55.4e9, (h2d + d2h) / (101.3e9 * 0.75),
                  (n - d) / 3.78e9 * 1.18,
                  (h2d + d2h + 28 * (n - d)) / 120e9)  # the host's DRAM serves the copies and the AdamW
        return p.prediction.times["compute bwd"] + fwd

    best = min(range(len(sizes) + 1), key=step_with)
    q = evaluate(Job(spec, 4, 2048), Choice(4, "master", "host", speculate=0, keep=0), Budgets(), hw)
    assert 0 < q.run_plan.count(Update.GPU, Update.GPU_SPECULATED) == best < len(sizes)
    assert q.prediction.step_s == pytest.approx(step_with(best)) and q.prediction.step_s < 0.9 * p.prediction.step_s
    assert q.memory.gpu.sets == 2 * 16 * 113_252_352
    assert q.prediction.bottleneck in ("H2D", "host AdamW", "host DRAM", "PCIe both ways")
    # a bf16 copy streamed: the GPU update needs the fp32 master there, so none
    assert evaluate(Job(spec, 4, 2048), Choice(4, "compute", "host", keep=0), Budgets(), hw).run_plan.count(Update.GPU, Update.GPU_SPECULATED) == 0


def test_spill_plan_matches_the_runtime_placement():
    """llama-3b (3.14 G params: 11.7 GiB per fp32 kind) under --host-gb 36 (33.5 GiB), fp32 streaming:
    master + grad take 23.4 GiB, the ring 8 x the widest slab (0.42 GiB) 3.4 GiB, which leaves 6.7 GiB
    for moments: every exp_avg (11.7 GiB) and 11.7 - 6.7 = 5.0 GiB of exp_avg_sq go to NVMe, as the
    runtime's placement (the same function) puts them."""
    spec = load_config("llama-3b").model
    p = evaluate(Job(spec, 4, 2048), Choice(4, "master", "gpu", keep=0), Budgets(host_gb=36, nvme_gb=60), REFERENCE)
    assert p.fits and p.prediction.bottleneck == "NVMe"
    assert round(p.memory.nvme[Kind.EXP_AVG] / 2**30, 1) == 11.7 and round(p.memory.nvme[Kind.EXP_AVG_SQ] / 2**30, 1) == 5.0
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
    assert least == 4 * host_cost(113_252_352 * 4) * 4 + 4 * host_cost(113_252_352 * 2) * 2  # 4 + 2x the copy's
    least_budget = Budgets(host_gb=least / 1e9 + 1e-6, nvme_gb=100)
    p = evaluate(Job(spec, 4, 2048), Choice(4, "compute", "gpu", keep=0), least_budget, hw)
    assert p.fits and p.memory.host == {} and p.memory.nvme == {k: n * b for k, b in kind_bytes("bfloat16", "compute").items()}
    r, w = hw.disk_read_gbs * 1e9, hw.disk_write_gbs * 1e9
    ahead = 12 * (sizes[0] + sizes[1])
    assert p.prediction.times["NVMe read"] == pytest.approx((18 * n - ahead) / r) and p.prediction.times["NVMe write"] == pytest.approx(14 * n / w)
    assert p.prediction.times["NVMe bwd"] == pytest.approx((2 * sum(sizes[1:25]) + ahead) / r + 4 * n / w)
    assert p.prediction.step_s == pytest.approx(p.prediction.times["NVMe bwd"] + p.prediction.times["NVMe read"] + p.prediction.times["NVMe write"])
    assert p.prediction.bottleneck == "NVMe"
    # a probed rate of reads and writes at once: each phase's bytes within it, each direction within its own
    q = evaluate(Job(spec, 4, 2048), Choice(4, "compute", "gpu", keep=0), least_budget,
                 dataclasses.replace(hw, disk_mixed_gbs=3.0))
    assert q.prediction.times["NVMe"] == pytest.approx(max((18 * n - ahead) / r, 14 * n / w, (32 * n - ahead) / 3e9))
    assert q.prediction.times["NVMe bwd"] == pytest.approx(max((2 * sum(sizes[1:25]) + ahead) / r, 4 * n / w,
                                                    (2 * sum(sizes[1:25]) + ahead + 4 * n) / 3e9))
    assert q.prediction.step_s == pytest.approx(q.prediction.times["NVMe bwd"] + q.prediction.times["NVMe"]) and q.prediction.step_s < p.prediction.step_s


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
    assert not p.fits and "raise --host-gb or give an NVMe tier" in p.why
    p = plan(job, Budgets(host_gb=1000, gpu_gb=2), REFERENCE)
    assert not p.fits and p.why.startswith("GPU: needs")
    # with an NVMe tier, too little host memory for even the ring: the least budget, of every choice
    one_b = load_config("llama-1b").model
    p = plan(Job(one_b, 16, 2048), Budgets(host_gb=5, nvme_gb=100), REFERENCE)
    need = float(re.search(r"raise --host-gb to at least ([0-9.]+)$", p.why).group(1))
    assert plan(Job(one_b, 16, 2048), Budgets(host_gb=need, nvme_gb=100), REFERENCE).fits
    # the report of a plan that fits names its own choice's least budget: the same figure, unrounded
    at_need = Budgets(host_gb=need, nvme_gb=100)
    reported = explain(Job(one_b, 16, 2048), plan(Job(one_b, 16, 2048), at_need, REFERENCE), at_need, REFERENCE)
    reported = reported.least_host / 1e9
    assert need - 0.1 < reported <= need
    assert not plan(Job(one_b, 16, 2048), Budgets(host_gb=need - 0.1, nvme_gb=100), REFERENCE).fits
    r = subprocess.run([sys.executable, "-m", "tiertrain", "plan", "--config", "llama-7b", "--host-gb", "40",
                        "--gpu-gb", "24"],  # a 141 GB GPU holds what the host does not
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Does not fit" in r.stdout


def test_plan_keeps_what_the_config_sets(tmp_path):
    """`plan` searches what the config leaves "auto" (as `run` does on a GPU) and keeps what it sets.
    On a host whose AdamW into copies is slow, so that clipping changes how many units speculate."""
    from click.testing import CliRunner

    from tiertrain.cli import main

    SLOW_HOST.save(tmp_path / "hw.json")

    def chosen(*sets):
        r = CliRunner().invoke(main, ["plan", "--config", "llama-3b", "--batch-size", "4", "--host-gb", "200",
                                      "--hardware", str(tmp_path / "hw.json"), "--format", "json",
                                      *[x for s in ("tiers.gpu_resident_gb=0", *sets) for x in ("--set", s)]])
        assert r.exit_code == 0, r.output
        p = json.loads(r.output)
        return p["stream"], p["activations"], p["speculated"], p["clipping"], "update copies" in p["host_fixed"]

    searched = chosen()
    ref = plan(Job(load_config("llama-3b").model, 4, 2048), Budgets(host_gb=200), SLOW_HOST)
    assert searched == (ref.run_plan.stream, searched[1], ref.run_plan.count(Update.HOST_SPECULATED), True, True) and ref.run_plan.count(Update.HOST_SPECULATED) > 0
    # the config's clipping and speculation too: with clipping off a speculated update runs in place
    off = plan(Job(load_config("llama-3b").model, 4, 2048, clipping=False), Budgets(host_gb=200), SLOW_HOST)
    assert chosen("optim.grad_clip=0")[2:] == (off.run_plan.count(Update.HOST_SPECULATED), False, False) and off.run_plan.count(Update.HOST_SPECULATED) != ref.run_plan.count(Update.HOST_SPECULATED)
    assert chosen("optim.speculate_units=2")[2] == 2 and chosen("optim.speculate_units=0")[2:] == (0, True, False)
    other = {"compute": "master", "master": "compute"}[searched[0]]
    assert chosen(f'tiers.stream="{other}"')[0] == other
    assert chosen('tiers.activations="host"')[1] == "host" and chosen('tiers.activations="gpu"')[1] == "gpu"
    # the config's micro-batch too (llama-3b sets 4); 0 searches: the largest that fits the GPU (the
    # cost model gives every micro-batch the same speed), here the whole batch of 16; with nothing resident
    # and nothing kept, which would take the memory a larger micro-batch's working set needs
    def micro(*sets):
        r = CliRunner().invoke(main, ["plan", "--config", "llama-3b", "--host-gb", "200", "--format", "json",
                                      *[x for s in ("tiers.gpu_resident_gb=0", "train.keep_activations=0", *sets)
                                        for x in ("--set", s)]])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["micro_batch"]
    assert micro() == 4 and micro("train.micro_batch_size=2") == 2 and micro('train.micro_batch_size="auto"') == 16
    assert micro('train.micro_batch_size="auto"', "train.batch_size=64") == 32  # at most 64k tokens per micro-batch


def test_hardware_file_round_trip_and_errors(tmp_path):
    from tiertrain.errors import ConfigError

    hw = HardwareSpec(h2d_gbs=20.0, source="test")
    hw.save(tmp_path / "hw.json")
    assert HardwareSpec.load(tmp_path / "hw.json") == hw
    with pytest.raises(ConfigError, match="tiertrain probe"):
        HardwareSpec.load(tmp_path / "missing.json")
    slow = plan(Job(load_config("llama-3b").model, 16, 2048), Budgets(), hw)
    fast = plan(Job(load_config("llama-3b").model, 16, 2048), Budgets(), REFERENCE)
    assert slow.prediction.step_s >= fast.prediction.step_s


def test_probe_writes_a_hardware_file_the_planner_reads(tmp_path):
    out = tmp_path / "hw.json"
    r = subprocess.run([sys.executable, "-m", "tiertrain", "probe", "--out", str(out), "--nvme-dir", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    hw = HardwareSpec.load(out)
    assert hw.source.startswith("tiertrain probe") and hw.disk_read_gbs > 0 and hw.disk_write_gbs > 0 and hw.disk_mixed_gbs > 0
    assert hw.host_adam_params_per_s > 0 and hw.host_adam_copy_params_per_s > 0
    assert "GPU memory, PCIe and matmul rates are the reference" in r.stdout or hw.gpu_mem_gb != REFERENCE.gpu_mem_gb
    assert not list(tmp_path.glob(".tiertrain-probe-*"))  # the probe's file is gone


def test_resident_units_move_their_update_to_the_gpu():
    """24 GB of resident state at 16 B/param (fp32 streaming: master, two moments, grad) is the first
    units of llama-3b up to 1.5 G params: their bytes leave the host's AdamW and the PCIe links and
    join the GPU's memory, and the runtime's placement picks the same units."""
    from tiertrain.plan.memory import slab_sizes as _layouts
    from tiertrain.tiers.placement import kind_bytes, resident_units

    spec = load_config("llama-3b").model
    numels = _layouts(spec)
    res = resident_units(numels, kind_bytes("bfloat16", "master"), 24e9)
    r = sum(numels[u] for u in res)
    assert res == list(range(len(res))) and r * 16 <= 24e9 < (r + numels[len(res)]) * 16
    fixed = Choice(4, "master", "host", gpu_updates=0, speculate=0, keep=0)
    a = evaluate(Job(spec, 4, 2048), fixed, Budgets(), REFERENCE)
    b = evaluate(Job(spec, 4, 2048), fixed, Budgets(resident_gb=24), REFERENCE)
    assert b.memory.gpu.resident == r * 16 and a.memory.gpu.resident == 0
    assert b.prediction.times["host AdamW"] == pytest.approx(a.prediction.times["host AdamW"] * (sum(numels) - r) / sum(numels))
    assert b.prediction.times["D2H"] < a.prediction.times["D2H"] and b.prediction.step_s < a.prediction.step_s
    assert sum(b.memory.host.values()) < sum(a.memory.host.values())


def test_resident_auto_takes_what_the_gpu_has_left():
    """tiers.gpu_resident_gb = "auto": the GPU memory the rest of the plan leaves holds resident units, when
    that is faster. llama-3b's whole state (50 GB) fits a 141 GB GPU; a 24 GB GPU takes a part of it."""
    spec = load_config("llama-3b").model
    state = spec.n_params * 16  # fp32 streaming: master, moments, gradient

    def at(batch, gpu_gb, resident):
        return plan(Job(spec, batch, 2048), Budgets(host_gb=200, gpu_gb=gpu_gb, resident_gb=resident), REFERENCE,
                    Choice(4))

    big = at(4, 141, "auto")
    assert big.fits and big.run_plan.resident_gb * 1e9 >= state and big.memory.gpu.resident >= state * 0.99
    assert big.memory.gpu.total <= 141e9 * 0.95 and big.prediction.step_s < at(4, 141, 0).prediction.step_s
    small = at(4, 24, "auto")
    assert 1 <= small.run_plan.resident_gb < 24 and small.memory.gpu.total <= 24e9 * 0.95 and small.prediction.step_s < at(4, 24, 0).prediction.step_s
    def expected(p):  # what "auto" is chosen by with clipping on: a step that clips as likely as not
        return (p.prediction.step_s + p.prediction.clipped_step_s) / 2

    assert expected(at(16, 24, "auto")) <= expected(at(16, 24, 0))  # never slower than none
    assert at(4, 24, small.run_plan.resident_gb).prediction.step_s == small.prediction.step_s  # what "auto" chose, as a number


def test_resident_auto_holds_what_host_and_disk_cannot():
    """A state larger than the host and disk budgets together fits when the GPU holds the rest: llama3.1-8b
    (145 GB) in 40 GB of RAM, 55 GB of disk and a 141 GB GPU; without the GPU tier it does not fit. The
    largest model the report names for these budgets plans as fitting, and one more layer does not."""
    spec = load_config("llama3.1-8b").model
    b = Budgets(host_gb=40, gpu_gb=141, nvme_gb=55, resident_gb="auto")
    assert not plan(Job(spec, 2, 4096), replace(b, resident_gb=0), REFERENCE, Choice(2)).fits
    p = explain(Job(spec, 2, 4096), plan(Job(spec, 2, 4096), b, REFERENCE, Choice(2)), b, REFERENCE, Choice(2))
    assert p.fits and p.run_plan.resident_gb >= 1 and p.memory.gpu.total <= 141e9 * 0.95
    assert p.report.largest_layers > spec.num_hidden_layers
    big = replace(spec, num_hidden_layers=p.report.largest_layers)
    assert plan(Job(big, 2, 4096), b, REFERENCE, Choice(2)).fits
    assert not plan(Job(replace(big, num_hidden_layers=p.report.largest_layers + 1), 2, 4096), b, REFERENCE, Choice(2)).fits


@pytest.mark.parametrize("name,params", [("llama3.1-8b", 8.03e9), ("qwen2.5-7b", 7.62e9), ("qwen3-8b", 8.19e9),
                                         ("mistral-7b", 7.25e9)])
def test_shipped_shapes_of_popular_models(name, params):
    """The published shapes: their parameter counts, planned under the config's own name."""
    import json
    import subprocess
    import sys

    cfg = load_config(name, [])
    assert cfg.model.n_params == pytest.approx(params, rel=2e-3)
    r = subprocess.run([sys.executable, "-m", "tiertrain", "plan", "--config", name, "--host-gb", "1500",
                        "--format", "json"], capture_output=True, text=True)
    p = json.loads(r.stdout)
    assert r.returncode == 0 and p["fits"] and p["model"] == name


def test_longest_sequence_is_the_edge_of_the_budgets():
    """The report's longest sequence (batch 1) plans as fitting, 1024 tokens more do not, and the bound it
    names is the budget that longer sequence misses; a smaller GPU shortens it."""
    spec = load_config("llama-7b").model
    b = Budgets(host_gb=115, gpu_gb=141, nvme_gb=55, resident_gb="auto")
    p = explain(Job(spec, 4, 2048), plan(Job(spec, 4, 2048), b, REFERENCE), b, REFERENCE)
    n = p.report.longest_seq_len
    assert n > 2048 and n % 1024 == 0 and "GPU" in p.report.longest_bound.split(", ")

    def at(seq):
        return plan(Job(spec, 1, seq), b, REFERENCE, Choice(1))

    miss = at(n + 1024)
    assert at(n).fits and not miss.fits
    assert {"ring": "host", "copies": "host"}.get(miss.short.value, miss.short.value) in p.report.longest_bound.split(", ")
    b80 = replace(b, gpu_gb=80)
    small = explain(Job(spec, 4, 2048), plan(Job(spec, 4, 2048), b80, REFERENCE), b80, REFERENCE)
    assert 0 < small.report.longest_seq_len < n
    r = subprocess.run([sys.executable, "-m", "tiertrain", "plan", "--config", "llama-7b", "--host-gb", "115",
                        "--nvme-gb", "55", "--format", "json"], capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["longest_seq_len"] >= 1024


def test_plan_on_a_gpu_machine_plans_for_its_gpu_and_ram(tmp_path, monkeypatch):
    """`plan` without --hardware where nvidia-smi answers (a stand-in for an H100's): that GPU's memory and this
    host's RAM, as `run` plans, so a plan that fits the reference H200 can miss; with no probe file only. With
    `--hardware reference`, or where no nvidia-smi answers: the reference H200."""
    import psutil
    from click.testing import CliRunner

    from tiertrain.cli import main
    from tiertrain.plan import hardware

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 81559'\n")
    smi.chmod(0o755)
    monkeypatch.setattr(hardware, "PROBE_FILE", tmp_path / "no-probe.json")
    args = ["plan", "--config", "llama3.1-8b", "--seq-len", "262144", "--set", "model.max_position_embeddings=262144",
            "--batch-size", "1", "--host-gb", "115", "--nvme-gb", "55", "--format", "json"]

    def planned(*more: str, path: str = str(smi.parent)) -> dict:
        monkeypatch.setenv("PATH", path)
        r = CliRunner().invoke(main, args + list(more))
        return json.loads(r.output)

    ref, h100 = planned("--hardware", "reference"), planned()
    ram = psutil.virtual_memory().total / 1e9
    assert ref["hardware"] == REFERENCE.source and ref["longest_seq_len"] > 262144
    assert f"NVIDIA H100 80GB HBM3 ({81559 * 2**20 / 1e9:.1f} GB) and {ram:.0f} GB of RAM" in h100["hardware"]
    assert h100["longest_seq_len"] < ref["longest_seq_len"]
    assert planned(path=str(tmp_path))["hardware"] == REFERENCE.source  # no nvidia-smi: no GPU to plan for
    probe = tmp_path / "probe.json"
    dataclasses.replace(REFERENCE, disk_read_gbs=1.0, source="probed here").save(probe)
    monkeypatch.setattr(hardware, "PROBE_FILE", probe)
    assert planned()["hardware"] == "probed here"  # probe's default file, as `run` reads it
