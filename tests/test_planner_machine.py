"""The planner against machines and shapes: hardware files and the probe, resident state, the shipped shapes of released models, the longest sequence, and a GPU machine planning for its own GPU and RAM."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from dataclasses import replace

import psutil
import pytest

from conftest import cli
from tiertrain.config import load_config
from tiertrain.plan import hardware
from tiertrain.plan.advice import explain
from tiertrain.plan.gpus import BY_KEY, this_machine
from tiertrain.plan.hardware import FITTED, REFERENCE, HardwareSpec
from tiertrain.plan.planner import evaluate, plan
from tiertrain.plan.values import Budgets, Choice, Job
from tiertrain.tiers.placement import kind_bytes


def test_hardware_file_round_trip_and_errors(tmp_path):
    from tiertrain.errors import ConfigError

    hw = HardwareSpec(h2d_gbs=20.0, source="test")
    hw.save(tmp_path / "hw.json")
    assert HardwareSpec.load(tmp_path / "hw.json") == hw
    with pytest.raises(ConfigError, match="tiertrain probe"):
        HardwareSpec.load(tmp_path / "missing.json")
    data = json.loads((tmp_path / "hw.json").read_text())
    (tmp_path / "odd.json").write_text(json.dumps({**data, "experts_speed": [0.4]}))
    with pytest.raises(ConfigError, match="experts_speed = \\[0.4\\] must be two finite numbers"):
        HardwareSpec.load(tmp_path / "odd.json")
    # a rate of 0: the plan divides by it (a ZeroDivisionError traceback); ck_write_gbs 0 means the disk's rate
    (tmp_path / "zero.json").write_text(json.dumps({**data, "h2d_gbs": 0, "ck_write_gbs": 0}))
    with pytest.raises(ConfigError, match=r"h2d_gbs = 0 must be a finite number, more than 0"):
        HardwareSpec.load(tmp_path / "zero.json")
    # a probe's file from before a refit: its fitted figures give way to this code's; a file made otherwise keeps them
    old = {**data, "compute_efficiency": 0.5, "experts_speed": [0.4, 0.2], "adam_contention": 1.18}
    (tmp_path / "old.json").write_text(json.dumps({**old, "source": "tiertrain probe, 2026-11-25"}))
    assert replace(HardwareSpec.load(tmp_path / "old.json"), source="test") == hw
    (tmp_path / "own.json").write_text(json.dumps(old))
    mine = HardwareSpec.load(tmp_path / "own.json")
    assert (mine.compute_efficiency, mine.experts_speed, mine.adam_contention) == (0.5, (0.4, 0.2), 1.18)
    assert set(FITTED) <= {f.name for f in dataclasses.fields(HardwareSpec)}
    slow = plan(Job(load_config("llama-3b").model, 16, 2048), Budgets(), hw)
    fast = plan(Job(load_config("llama-3b").model, 16, 2048), Budgets(), REFERENCE)
    assert slow.prediction.step_s >= fast.prediction.step_s


def test_probe_writes_a_hardware_file_the_planner_reads(tmp_path, monkeypatch):
    """`tiertrain probe --out --nvme-dir` in process, its measurements on small arrays and files (the full sizes
    take 25 s of two cores: the figures' code is the same)."""
    from functools import partial

    from click.testing import CliRunner

    from tiertrain import probe
    from tiertrain.cli import main

    monkeypatch.setattr(probe, "host_adam_rate", partial(probe.host_adam_rate, n_params=1 << 20, reps=3))
    monkeypatch.setattr(probe, "disk_rates", partial(probe.disk_rates, nbytes=1 << 24))
    monkeypatch.setattr(probe, "ck_writer_rate", partial(probe.ck_writer_rate, counts=(1, 2), total=2))
    out = tmp_path / "hw.json"
    r = CliRunner().invoke(main, ["probe", "--out", str(out), "--nvme-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    hw = HardwareSpec.load(out)
    assert (
        hw.source.startswith("tiertrain probe")
        and hw.disk_read_gbs > 0
        and hw.disk_write_gbs > 0
        and hw.disk_mixed_gbs > 0
    )
    assert hw.host_adam_params_per_s > 0 and hw.host_adam_copy_params_per_s > 0
    assert (
        "GPU memory, PCIe and matmul rates are the reference" in r.stdout
        or hw.gpu_mem_gb != REFERENCE.gpu_mem_gb
    )
    assert not list(tmp_path.glob(".tiertrain-probe-*"))  # the probe's file is gone


def test_resident_units_move_their_update_to_the_gpu():
    """24 GB of resident state at 16 B/param (fp32 streaming: master, two moments, grad) is the first
    units of llama-3b up to 1.5 G params: their bytes leave the host's AdamW and the PCIe links and
    join the GPU's memory, and the runtime's placement picks the same units."""
    from tiertrain.plan.memory import slab_sizes as _layouts
    from tiertrain.tiers.placement import resident_units

    spec = load_config("llama-3b").model
    numels = _layouts(spec)
    res = resident_units(numels, kind_bytes("bfloat16", "master"), 24e9)
    r = sum(numels[u] for u in res)
    assert res == list(range(len(res))) and r * 16 <= 24e9 < (r + numels[len(res)]) * 16
    fixed = Choice(4, "master", "host", gpu_updates=0, speculate=0, keep=0)
    a = evaluate(Job(spec, 4, 2048), fixed, Budgets(), REFERENCE)
    b = evaluate(Job(spec, 4, 2048), fixed, Budgets(resident_gb=24), REFERENCE)
    assert b.memory.gpu.resident == r * 16 and a.memory.gpu.resident == 0
    assert b.prediction.times["host AdamW"] == pytest.approx(
        a.prediction.times["host AdamW"] * (sum(numels) - r) / sum(numels)
    )
    assert b.prediction.times["D2H"] < a.prediction.times["D2H"] and b.prediction.step_s < a.prediction.step_s
    assert sum(b.memory.host.values()) < sum(a.memory.host.values())


def test_resident_auto_takes_what_the_gpu_has_left():
    """tiers.gpu_resident_gb = "auto": the GPU memory the rest of the plan leaves holds resident units, when
    that is faster. llama-3b's whole state (50 GB) fits a 141 GB GPU; a 24 GB GPU takes a part of it."""
    spec = load_config("llama-3b").model
    state = spec.n_params * 16  # fp32 streaming: master, moments, gradient

    def at(batch, gpu_gb, resident):
        return plan(
            Job(spec, batch, 2048),
            Budgets(host_gb=200, gpu_gb=gpu_gb, resident_gb=resident),
            REFERENCE,
            Choice(4),
        )

    big = at(4, 141, "auto")
    assert big.fits and big.run_plan.resident_gb * 1e9 >= state and big.memory.gpu.resident >= state * 0.99
    assert big.memory.gpu.total <= 141e9 * 0.95 and big.prediction.step_s < at(4, 141, 0).prediction.step_s
    small = at(4, 24, "auto")
    assert (
        1 <= small.run_plan.resident_gb < 24
        and small.memory.gpu.total <= 24e9 * 0.95
        and small.prediction.step_s < at(4, 24, 0).prediction.step_s
    )

    def expected(p):  # what "auto" is chosen by with clipping on: a step that clips as likely as not
        return (p.prediction.step_s + p.prediction.clipped_step_s) / 2

    assert expected(at(16, 24, "auto")) <= expected(at(16, 24, 0))  # never slower than none
    # what "auto" chose, as a number
    assert at(4, 24, small.run_plan.resident_gb).prediction.step_s == small.prediction.step_s


def test_resident_auto_holds_what_host_and_disk_cannot():
    """A state larger than the host and disk budgets together fits when the GPU holds the rest: llama3.1-8b
    (145 GB) in 40 GB of RAM, 55 GB of disk and a 141 GB GPU; without the GPU tier it does not fit. The
    largest model the report names for these budgets plans as fitting, and one more layer does not."""
    spec = load_config("llama3.1-8b").model
    b = Budgets(host_gb=40, gpu_gb=141, nvme_gb=55, resident_gb="auto")
    assert not plan(Job(spec, 2, 4096), replace(b, resident_gb=0), REFERENCE, Choice(2)).fits
    p = explain(
        Job(spec, 2, 4096), plan(Job(spec, 2, 4096), b, REFERENCE, Choice(2)), b, REFERENCE, Choice(2)
    )
    assert p.fits and p.run_plan.resident_gb >= 1 and p.memory.gpu.total <= 141e9 * 0.95
    assert p.report.largest_layers > spec.num_hidden_layers
    big = replace(spec, num_hidden_layers=p.report.largest_layers)
    assert plan(Job(big, 2, 4096), b, REFERENCE, Choice(2)).fits
    assert not plan(
        Job(replace(big, num_hidden_layers=p.report.largest_layers + 1), 2, 4096), b, REFERENCE, Choice(2)
    ).fits


def test_the_search_of_any_choice_finds_the_largest_each_choice_fits():
    """The largest-model and longest-sequence searches: the largest n that some choice fits, each choice's fits
    monotone in n, found with one choice's search and one try of each other (more where one fits further), as
    a search asking every choice at every n finds it."""
    import random

    from tiertrain.plan.advice import _most, _most_of_any

    rng = random.Random(0)
    for _ in range(300):
        edges = [rng.choice([0, 1, rng.randrange(1, 5000), 4096, 5000]) for _ in range(rng.randrange(1, 7))]
        cap, start, step = 4096, rng.randrange(-5, 6000), rng.randrange(1, 300)
        tries = []

        def fits(c, n, edges=edges, tries=tries):
            tries.append((c, n))
            return n <= edges[c]

        got = _most_of_any(fits, list(range(len(edges))), start, cap, step)
        assert got == _most(lambda n: any(n <= e for e in edges), start, cap, step) == min(max(edges), cap)
        # no (choice, n) asked twice; a choice that fits no further than those before it is asked once (none
        # once the cap is reached), where asking every choice at each n asks it at every try of the search
        assert len(tries) == len(set(tries)), (edges, start, step)
        best = min(edges[0], cap)
        for c, e in enumerate(edges[1:], 1):
            if e <= best or best == cap:
                assert sum(t[0] == c for t in tries) == (best < cap), (edges, start, step, c)
            best = max(best, min(e, cap))


@pytest.mark.parametrize(
    "name,params",
    [("llama3.1-8b", 8.03e9), ("qwen2.5-7b", 7.62e9), ("qwen3-8b", 8.19e9), ("mistral-7b", 7.25e9)],
)
def test_shipped_shapes_of_popular_models(name, params):
    """The published shapes: their parameter counts, planned under the config's own name."""
    cfg = load_config(name, [])
    assert cfg.model.n_params == pytest.approx(params, rel=2e-3)
    r = cli("plan", "--config", name, "--host-gb", "1500", "--format", "json")
    p = json.loads(r.stdout)
    assert r.returncode == 0 and p["fits"] and p["model"] == name


def test_longest_sequence_is_the_edge_of_the_budgets():
    """The report's longest sequence (batch 1) plans as fitting, 1024 tokens more do not, and the bound it
    names is the budget that longer sequence misses; a smaller GPU shortens it. (The model's positions lifted: they
    would bound it first, test_longest_sequence_within_the_positions.)"""
    spec = replace(load_config("llama-7b").model, max_position_embeddings=1 << 24)
    b = Budgets(host_gb=115, gpu_gb=141, nvme_gb=55, resident_gb="auto")
    p = explain(Job(spec, 4, 2048), plan(Job(spec, 4, 2048), b, REFERENCE), b, REFERENCE)
    n = p.report.longest_seq_len
    assert n > 2048 and n % 1024 == 0 and "GPU" in p.report.longest_bound.split(", ")

    def at(seq):
        return plan(Job(spec, 1, seq), b, REFERENCE, Choice(1))

    miss = at(n + 1024)
    assert at(n).fits and not miss.fits
    assert {"ring": "host", "copies": "host"}.get(
        miss.short.value, miss.short.value
    ) in p.report.longest_bound.split(", ")
    b80 = replace(b, gpu_gb=80)
    small = explain(Job(spec, 4, 2048), plan(Job(spec, 4, 2048), b80, REFERENCE), b80, REFERENCE)
    assert 0 < small.report.longest_seq_len < n
    r = cli("plan", "--config", "llama-7b", "--host-gb", "115", "--nvme-gb", "55", "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["longest_seq_len"] == 4096  # its positions


def test_longest_sequence_within_the_positions():
    """llama3.1-8b under 256 GB on the H200 holds 400k+ tokens, but its positions end at 131,072: the report says
    131,072, bound by its positions, and names the budgets' longest and the rope scaling that lifts the limit;
    those settings, as printed, make a config whose longest is the budgets', and whose refusal of a longer
    --seq-len says the same."""
    from click.testing import CliRunner

    from tiertrain.cli import main

    def planned(*more: str) -> tuple[dict, str]:
        args = ["plan", "--config", "llama3.1-8b", "--host-gb", "256", "--hardware", "reference", *more]
        js, md = (CliRunner().invoke(main, [*args, *f]) for f in (["--format", "json"], []))
        return json.loads(js.output), md.output

    p, md = planned()
    budgets = p["longest_budgets_seq_len"]
    assert (p["longest_seq_len"], p["longest_bound"]) == (131072, "positions") and budgets > 3 * 131072
    lift = re.search(r"`(--set model.max_position_embeddings=.*?)`", md).group(1)
    sets = [a.strip("'") for a in shlex.split(lift) if a != "--set"]
    assert sets[0] == f"model.max_position_embeddings={budgets}" and '"llama3"' in sets[1]
    q, _ = planned(*[x for s in sets for x in ("--set", s)])
    assert q["longest_seq_len"] == budgets and q["longest_bound"] != "positions"
    cfg = load_config("llama3.1-8b", sets)
    assert (
        cfg.model.rope_scaling["factor"] * 8192 >= budgets
        and cfg.model.rope_scaling["low_freq_factor"] == 1.0
    )
    r = CliRunner().invoke(main, ["plan", "--config", "llama3.1-8b", "--seq-len", "524288"])
    assert r.exit_code == 2 and "max_position_embeddings (131072)" in r.output and "rope_scaling" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_plan_on_a_gpu_machine_plans_for_its_gpu_and_ram(tmp_path, monkeypatch):
    """`plan` without --hardware where nvidia-smi answers (a stand-in for an H100's): that GPU's entry (its measured
    figures, within the memory nvidia-smi gives) and this host's RAM, as `run` plans, so a plan that fits the
    reference H200 can miss; with no probe file only. With `--hardware reference`, or where no nvidia-smi answers:
    the reference H200."""
    args = [
        *["plan", "--config", "llama3.1-8b", "--seq-len", "262144", "--batch-size", "1"],
        *["--set", "model.max_position_embeddings=1048576", "--host-gb", "115", "--nvme-gb", "55"],
    ]
    planned = _gpu_machine(tmp_path, monkeypatch, args)
    ref, h100 = planned("--hardware", "reference"), planned()
    ram = psutil.virtual_memory().total / 1e9
    assert ref["hardware"] == REFERENCE.source and ref["longest_seq_len"] > 262144
    assert h100["hardware"].startswith("H100 SXM 80GB (the GPU here): measured on the project's H100")
    assert (
        f"NVIDIA H100 80GB HBM3 ({BY_KEY['h100'].memory_gb:.1f} GB) and {ram:.0f} GB of RAM"
        in h100["hardware"]
    )
    assert h100["longest_seq_len"] < ref["longest_seq_len"]
    assert planned(path=str(tmp_path))["hardware"] == REFERENCE.source  # no nvidia-smi: no GPU to plan for
    probe = tmp_path / "probe.json"
    dataclasses.replace(REFERENCE, disk_read_gbs=1.0, source="probed here").save(probe)
    monkeypatch.setattr(hardware, "PROBE_FILE", probe)
    assert planned()["hardware"] == "probed here"  # probe's default file, as `run` reads it


def test_a_named_gpu_plans_alike_on_every_machine(tmp_path, monkeypatch):
    """`plan --gpu h100 --config llama3.1-8b --host-gb 256` on a machine without a GPU and on one whose nvidia-smi
    names an H100 (a stand-in) gives the same plan, and the same as that H100 machine plans for itself with no
    probe file (run's figures): the name fully sets the GPU's figures; only the hardware line says how."""
    args = ["plan", "--config", "llama3.1-8b", "--host-gb", "256"]
    planned = _gpu_machine(tmp_path, monkeypatch, args)
    cpu, gpu, own = planned("--gpu", "h100", path=str(tmp_path)), planned("--gpu", "h100"), planned()
    assert cpu == gpu and cpu["fits"] and cpu["hardware"].startswith("H100 SXM 80GB (--gpu h100)")
    assert {k: v for k, v in own.items() if k != "hardware"} == {
        k: v for k, v in cpu.items() if k != "hardware"
    }
    assert own["hardware"].startswith("H100 SXM 80GB (the GPU here)")
    # a run's figures: torch's name and memory for this GPU, no probe file
    run = this_machine(("NVIDIA H100 80GB HBM3", 85.017493504))
    assert (run.bf16_tflops, run.bidir_gbs, run.gpu_mem_gb) == (770.95, 88.71, 85.017493504)


def _gpu_machine(tmp_path, monkeypatch, args: list[str]):
    """planned(*more, path=...): `args` + `more` planned as JSON with an nvidia-smi on the PATH that names an H100
    80GB (`path`: another PATH), and no probe file."""
    from click.testing import CliRunner

    from tiertrain.cli import main

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 81559'\n")
    smi.chmod(0o755)
    monkeypatch.setattr(hardware, "PROBE_FILE", tmp_path / "no-probe.json")

    def planned(*more: str, path: str = str(smi.parent)) -> dict:
        monkeypatch.setenv("PATH", path)
        r = CliRunner().invoke(main, [*args, *more, "--format", "json"])
        return json.loads(r.output)

    return planned


def test_a_yarn_model_is_lifted_by_its_own_yarn():
    """gpt-oss's positions come from yarn (factor 32 over 4,096): the lift past its 131,072 keeps yarn and every key
    of its table (truncate false among them), with the factor that reaches the length, as settings that load."""
    from tiertrain.config import position_lift

    spec = load_config("gpt-oss-20b").model
    sets = [a for a in shlex.split(position_lift(spec, 300_000)) if a != "--set"]
    rs = load_config("gpt-oss-20b", sets).model.rope_scaling
    assert rs == {**spec.rope_scaling, "factor": 74.0}  # ceil(300,000 / 4,096)
    assert load_config("gpt-oss-20b", sets).model.max_position_embeddings == 300_000
