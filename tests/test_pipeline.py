"""The pipeline's options change where bytes live and when work runs, never the numbers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import VARIANTS, tiny_config
from tiertrain.modes import Home, Kind
from tiertrain.trainer import Trainer

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _run(token_file, device, *sets, steps=4):
    tr = Trainer(
        tiny_config(token_file, *VARIANTS["qwen2"], f'train.device="{device}"', f"train.steps={steps}", *sets)
    )
    recs = [tr.train_step() for _ in range(steps)]
    sd = tr.state_dict()
    tr.close()
    return [r["loss"] for r in recs], sd, recs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "variant",
    [
        ["train.overlap=false"],
        ['tiers.activations="host"'],
        ['tiers.stream="master"'],
        ["train.overlap=false", 'tiers.activations="host"', 'tiers.stream="master"'],
    ],
)
def test_modes_are_bit_identical(token_file, device, variant):
    """Overlapped optimizer vs synchronous, checkpoints on host vs GPU, fp32-master streaming (cast on
    the device) vs a host bf16 copy: the same bits."""
    dtype = 'train.compute_dtype="bfloat16"'
    base_losses, base_sd, _ = _run(token_file, device, dtype)
    losses, sd, _ = _run(token_file, device, dtype, *variant)
    assert losses == base_losses
    for k in base_sd:
        assert torch.equal(sd[k], base_sd[k]), k


def test_bytes_moved_per_step(token_file):
    """H2D: every unit once forward, and every block but the last two once more backward (the last two
    are still in the two slots when backward starts; the embedding is resident); D2H: every unit's fp32
    gradient once. The host bf16 copy streams 2 bytes per parameter, fp32-master streaming 4."""
    for stream, wbytes in (("compute", 2), ("master", 4)):
        _, _, recs = _run(
            token_file, "cpu", 'train.compute_dtype="bfloat16"', f'tiers.stream="{stream}"', steps=2
        )
        tr = Trainer(tiny_config(token_file, *VARIANTS["qwen2"], 'train.device="cpu"'))
        sizes = [lay.numel for lay in tr.layouts]
        tr.close()
        h2d = (sum(sizes) + sum(sizes[1:-3])) * wbytes
        assert recs[-1]["h2d_gb"] * 1e9 == pytest.approx(h2d, rel=1e-12)
        assert recs[-1]["d2h_gb"] * 1e9 == pytest.approx(sum(sizes) * 4, rel=1e-12)


def test_host_checkpoints_move_the_activations(token_file):
    _, _, recs = _run(token_file, "cpu", 'tiers.activations="host"', steps=1)
    _, _, base = _run(token_file, "cpu", steps=1)
    """Every block's fp32 input goes down once in forward and comes back once in backward."""
    cfg = tiny_config(token_file)
    act = cfg.train.batch_size * cfg.train.seq_len * cfg.model.hidden_size * 4
    extra = (recs[0]["d2h_gb"] - base[0]["d2h_gb"]) * 1e9
    assert extra == pytest.approx(act * cfg.model.num_hidden_layers, rel=1e-12)
    assert (recs[0]["h2d_gb"] - base[0]["h2d_gb"]) * 1e9 == pytest.approx(extra, rel=1e-12)


def test_optimizer_errors_surface(token_file, monkeypatch):
    """A failure on the optimizer thread stops the run in the main thread, not silently."""
    tr = Trainer(tiny_config(token_file, 'train.device="cpu"'))

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(tr.run.updates.opt, "update_unit", boom)
    tr.train_step()
    with pytest.raises(RuntimeError, match="disk on fire"):
        tr.train_step()


@pytest.mark.parametrize(
    "sets,stream,acts",
    [
        # half the bytes to copy
        (['train.compute_dtype="bfloat16"', 'tiers.activations="auto"'], "compute", "gpu"),
        (['train.compute_dtype="float32"'], "master", "gpu"),
        # the GPU update needs it
        (['train.compute_dtype="bfloat16"', "tiers.gpu_update_units=2"], "master", "gpu"),
        (
            ['train.compute_dtype="bfloat16"', 'tiers.stream="master"', 'tiers.activations="host"'],
            "master",
            "host",
        ),
    ],
)
def test_auto_on_a_cpu(token_file, sets, stream, acts):
    """On a CPU the plan runs on the CPU's figures: "auto" settles on the cheapest copies, and a set value
    stays; the run obeys the plan's RunPlan (the config stays what was asked for)."""
    cfg = tiny_config(token_file, 'train.device="cpu"', *sets)
    asked = cfg.to_dict()
    tr = Trainer(cfg)
    t = tr.run_plan
    said = tr.describe()[-1]
    tr.close()
    assert t == tr.plan.run_plan or "tiers.gpu_update_units=2" in sets  # that one asks for another update
    assert (t.stream, t.activations) == (stream, acts) and cfg.to_dict() == asked
    copy = stream == "compute" and "bfloat16" in sets[0]
    assert (Kind.WEIGHTS in tr.run.host.kinds) == copy
    assert ("weights stream as the compute-dtype copy" in said) == copy, said  # the run's description says so
    assert {h.value for h in tr.run.activations.homes.values()} == {acts}
    assert bool(tr.run_plan.updated("gpu", "gpu-speculated")) == ("tiers.gpu_update_units=2" in sets)


@pytest.mark.parametrize("batch,micro", [(8, 8), (12, 12), (7, 7), (1024, 1024)])
def test_auto_micro_batch_on_a_cpu(token_file, batch, micro):
    """train.micro_batch_size = "auto" on a CPU: every micro-batch computes as fast there, so the plan takes the
    largest divisor of the batch of at most 64k tokens; recorded."""
    tr = Trainer(tiny_config(token_file, f"train.batch_size={batch}", 'train.micro_batch_size="auto"'))
    tr.close()
    assert (
        tr.run_plan.micro_batch == micro
        and "micro-batch" in tr.chosen
        and tr.cfg.train.micro_batch_size == "auto"
    )


def test_what_saves_pcie_is_not_chosen_on_a_cpu(token_file):
    """On a CPU, whose memory is the host's, "auto" keeps nothing resident, updates nothing on the device and
    speculates nothing (the updates share the compute's cores); recorded."""
    tr = Trainer(
        tiny_config(
            token_file,
            'tiers.gpu_resident_gb="auto"',
            'tiers.gpu_update_units="auto"',
            'optim.speculate_units="auto"',
            "optim.grad_clip=0",
        )
    )
    tr.close()
    assert (
        tr.run_plan.resident_gb == 0
        and "gpu" not in tr.run_plan.where().values()
        and "resident GB" in tr.chosen
    )
    assert {u.update for u in tr.run_plan.units} == {"host"} and "speculation" in tr.chosen


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["slow PCIe", "slow rounding", "small GPU", "micro-batch", "resident"])
def test_auto_obeys_the_plan(token_file, monkeypatch, case):
    """On CUDA "auto" is the plan's choice: a copy of the weights in bf16 when PCIe is what bounds the
    step, the fp32 master when rounding into the copy is; checkpoints on the host when the GPU is short."""
    from tiertrain import assemble
    from tiertrain.plan.hardware import REFERENCE
    from tiertrain.plan.planner import GPU_RESERVE, evaluate
    from tiertrain.plan.values import Budgets, Choice, Job

    sets = ['train.device="cuda"', 'train.compute_dtype="bfloat16"', 'tiers.activations="auto"']
    cfg = tiny_config(token_file, *sets)
    tc = cfg.train
    job = Job(cfg.model, tc.batch_size, tc.seq_len)
    gpu = {
        a: evaluate(
            job, Choice(tc.micro_batch_size, "compute", a, keep=0), Budgets(1e9, 1e3, None), REFERENCE
        ).memory.gpu.total
        / 1e9
        for a in ("gpu", "host")
    }
    assert gpu["host"] < gpu["gpu"]
    hw = {
        "slow PCIe": dict(h2d_gbs=1e-4, d2h_gbs=1e-4, bidir_gbs=2e-4),
        "slow rounding": dict(host_adam_copy_params_per_s=1e3),
        "small GPU": dict(gpu_mem_gb=(gpu["host"] + gpu["gpu"]) / 2 / GPU_RESERVE),
        "micro-batch": {},
        "resident": {},
    }[case]
    monkeypatch.setattr(assemble, "run_hardware", lambda *a: dataclasses.replace(REFERENCE, **hw))
    more = {
        "micro-batch": ['train.micro_batch_size="auto"'],
        "resident": ['tiers.gpu_resident_gb="auto"'],
    }.get(case, [])
    tr = Trainer(tiny_config(token_file, *sets, *more))
    tr.train_step()
    tr.close()
    assert tr.run_plan == tr.plan.run_plan  # the runtime obeys the planner's RunPlan, unit by unit
    assert tr.run_plan.micro_batch == (
        tr.plan.run_plan.micro_batch if case == "micro-batch" else tc.micro_batch_size
    )
    if case == "small GPU":
        assert tr.run_plan.activations == "host"
    elif case == "resident":  # the tiny model's whole state fits what the plan leaves: every unit resident
        assert tr.run_plan.resident_gb == tr.plan.run_plan.resident_gb >= 1
        assert set(tr.run_plan.where().values()) == {Home.GPU}
    elif case == "micro-batch":
        assert tc.batch_size % tr.run_plan.micro_batch == 0 and "micro-batch" in tr.chosen
    else:
        assert tr.run_plan.stream == {"slow PCIe": "compute", "slow rounding": "master"}[case]
    assert (Kind.WEIGHTS in tr.run.host.kinds) == (tr.run_plan.stream == "compute")
    assert {h.value for h in tr.run.activations.homes.values()} == {tr.run_plan.activations}
