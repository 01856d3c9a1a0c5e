"""The NVMe tier: a run that spills to disk trains bit for bit like one in RAM; bad setups are refused."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import zarr

from conftest import DEEP, ROOT, VARIANTS, beside_gb, budget_for, least_budget, least_gb, tiny_config
from tiertrain.errors import ConfigError, UserError
from tiertrain.modes import Home, Kind
from tiertrain.plan.hardware import REFERENCE
from tiertrain.tiers.nvme import NvmeStore, PosixIO, StoreError
from tiertrain.tiers.placement import (
    RING_SLOTS,
    disk_bytes,
    kind_bytes,
    least_host,
    place,
    place_within,
    ring_bytes,
    ring_widths,
    spill_order,
    spilled_bytes,
    streamed_kind,
)
from tiertrain.tiers.slab import host_cost
from tiertrain.trainer import Trainer


def _train(cfg, steps=4, close=True):
    """`close`: shut the trainer's threads (the NVMe tier's too: then its slabs are read no more)."""
    tr = Trainer(cfg, run_name="r")
    recs = [tr.train_step() for _ in range(steps)]
    sd = tr.state_dict()
    if close:
        tr.close()
    return tr, recs, sd


@pytest.mark.parametrize(
    "io,first",
    [("posix", "moments"), ("posix", "gradients"), pytest.param("kvikio", "moments", marks=pytest.mark.gpu)],
)
def test_spilled_run_is_bit_identical(token_file, tmp_path, io, first):
    """Half the state on NVMe, in either spill order (tiers.spill_first): the moments, read and written after the
    norm; or the gradients, written in the backward pass, then the first moments."""
    dev = "cuda" if io == "kvikio" else "cpu"
    base = tiny_config(token_file, *VARIANTS["qwen2"], *DEEP, f'train.device="{dev}"')
    gb = budget_for(base)
    spill = tiny_config(
        token_file,
        *VARIANTS["qwen2"],
        *DEEP,
        f'train.device="{dev}"',
        f"tiers.host_gb={gb}",
        f'tiers.nvme_dir="{tmp_path}"',
        f'tiers.io="{io}"',
        f'tiers.spill_first="{first}"',
    )
    _, want, want_sd = _train(base)
    tr, got, sd = _train(spill, close=False)
    on_nvme = [k for k, t in tr.run_plan.where().items() if t == Home.NVME]
    # the kinds on NVMe are the first of the order (the budget leaves two kinds' worth in RAM, and a bit less on a
    # GPU, whose process takes more beside the state)
    order, kinds = spill_order(tr.kind_bytes(), first), {k for _, k in on_nvme}
    assert tr.run_plan.spill_first == first and order[0] == (
        Kind.EXP_AVG if first == "moments" else Kind.GRAD
    )
    assert kinds == set(order[: max(order.index(k) for k in kinds) + 1]) and len(kinds) in (2, 3)
    sizes = [lay.numel for lay in tr.layouts]
    state = sum(sizes) * 16
    spilled = sum(sizes[u] * 4 for u, _ in on_nvme)
    assert spilled >= state / 2  # at least half of the state lives on disk
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    for k in want_sd:
        assert torch.equal(sd[k], want_sd[k]), k
    # each step reads and writes every spilled byte once; plain zarr reads what the run wrote
    assert got[-1]["nvme_read_gb"] * 1e9 == pytest.approx(spilled) == got[-1]["nvme_write_gb"] * 1e9
    u, kind = on_nvme[0]
    arr = zarr.open_group(tr.run.nvme.store.root, mode="r")[kind.value]
    assert arr.shape[0] == len(sizes) and float(abs(arr[u, : sizes[u]]).max()) > 0
    tr.close()  # the store goes with the trainer
    assert not tr.run.nvme.store.root.exists()


def test_the_spill_order_goes_back_to_the_moments_where_only_they_leave_the_checkpoints_room(
    token_file, tmp_path, monkeypatch
):
    """A last save takes spilled moments from the NVMe store by rename, never gradients. On a disk shared with the
    NVMe tier that holds the checkpoints only so, the plan's "auto" order gives up the gradients first; a config
    that fixes the gradients first is refused, naming what would fit."""
    from tiertrain import rundir
    from tiertrain.plan.saves import checkpoint_bytes

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    sets = [*DEEP, f"tiers.host_gb={budget_for(tiny_config(token_file, *DEEP))}", f'tiers.nvme_dir="{nvme}"']
    plans = {}
    for first in ("auto", "moments"):
        tr = Trainer(tiny_config(token_file, *sets, f'tiers.spill_first="{first}"'))
        plans[first] = tr.run_plan
        numels, kb = [lay.numel for lay in tr.layouts], tr.kind_bytes()
        tr.close()
    assert plans["auto"].spill_first == "gradients" and plans["moments"].spill_first == "moments"
    taken = {
        k: sum(numels[u] * 4 for (u, kind), h in rp.where().items() if h == Home.NVME and kind != Kind.GRAD)
        for k, rp in plans.items()
    }
    store, full = disk_bytes(numels, kb, plans["auto"].where()), checkpoint_bytes(numels, "full")
    assert taken["auto"] < taken["moments"]
    # room for the last save less the moments' chunks, not for it less the gradients-first plan's
    monkeypatch.setattr(
        rundir, "disk_free", lambda p: (full + store - (taken["auto"] + taken["moments"]) // 2, 1)
    )
    tr = Trainer(tiny_config(token_file, *sets), out=tmp_path / "run")
    assert tr.run_plan.spill_first == "moments"
    tr.close()
    with pytest.raises(ConfigError, match="checkpoints need"):
        Trainer(tiny_config(token_file, *sets, 'tiers.spill_first="gradients"'), out=tmp_path / "run2")


def test_spilled_master_is_bit_identical(token_file, tmp_path):
    """With a bf16 copy streaming, the fp32 master is only the optimizer's: it goes to NVMe after the
    moments, and the run is still bit-identical (bf16 compute on the CPU)."""
    sets = [*DEEP, 'train.compute_dtype="bfloat16"', 'tiers.stream="compute"', "train.steps=3"]
    base = tiny_config(token_file, *sets)
    tr = Trainer(base)
    width = max(lay.numel for lay in tr.layouts)
    # grads and the bf16 copy, a third of the masters, and a ring for three kinds
    gb = (
        sum(lay.numel * 6 + 2 * 4096 for lay in tr.layouts)
        + sum(lay.numel * 4 for lay in tr.layouts) / 3
        + RING_SLOTS * 3 * width * 4
    ) / 1e9 + beside_gb(base)
    tr.close()
    spill = tiny_config(
        token_file, *sets, f"tiers.host_gb={gb}", f'tiers.nvme_dir="{tmp_path}"', 'tiers.io="posix"'
    )
    _, want, want_sd = _train(base, steps=3)
    tr, got, sd = _train(spill, steps=3)
    spilled = {k for (_, k), t in tr.run_plan.where().items() if t == Home.NVME}
    assert (
        spilled == {Kind.EXP_AVG, Kind.EXP_AVG_SQ, Kind.MASTER}
        and tr.run_plan.where()[(0, Kind.MASTER)] == Home.HOST
    )
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    for k in want_sd:
        assert torch.equal(sd[k], want_sd[k]), k


@pytest.mark.parametrize("io", ["posix", pytest.param("kvikio", marks=pytest.mark.gpu)])
def test_spilled_gradients_are_bit_identical(token_file, tmp_path, io):
    """Moments and gradients on NVMe, the master in RAM: the backward pass drains each spilled
    gradient through the staging ring to disk, and the optimizer reads it back after that write."""
    dev = "cuda" if io == "kvikio" else "cpu"
    sets = [*DEEP, "train.steps=3", f'train.device="{dev}"']
    base = tiny_config(token_file, *sets)
    tr = Trainer(base)
    sizes = [lay.numel for lay in tr.layouts]
    tr.close()
    # master + ring
    gb = (sum(host_cost(n * 4) for n in sizes) + RING_SLOTS * 3 * max(sizes) * 4 + 1000) / 1e9 + beside_gb(
        base
    )
    spill = tiny_config(
        token_file, *sets, f"tiers.host_gb={gb}", f'tiers.nvme_dir="{tmp_path}"', f'tiers.io="{io}"'
    )
    _, want, want_sd = _train(base, steps=3)
    tr, got, sd = _train(spill, steps=3)
    grads = [u for (u, k), t in tr.run_plan.where().items() if k == Kind.GRAD and t == Home.NVME]
    assert {k for (_, k), t in tr.run_plan.where().items() if t == Home.NVME} == {
        Kind.EXP_AVG,
        Kind.EXP_AVG_SQ,
        Kind.GRAD,
    }
    # unit 0's too: the optimizer's first read must wait for the backward pass
    assert len(grads) == len(sizes)
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]
    for k in want_sd:
        assert torch.equal(sd[k], want_sd[k]), k


@pytest.mark.parametrize(
    "stream,io",
    [("compute", "posix"), ("master", "posix"), pytest.param("master", "kvikio", marks=pytest.mark.gpu)],
)
def test_everything_on_nvme_is_bit_identical(token_file, tmp_path, stream, io, monkeypatch):
    """The least host budget: every slab on NVMe, the weights that stream too (read for the forward and
    the backward pass, written by the optimizer). `compute`: a bf16 copy streams (bf16 compute on the
    CPU), the master is only the optimizer's; `master`: the fp32 master streams. Bit-identical to the
    run in RAM, and a step moves exactly the bytes the schedule says. POSIX writes are slowed down: a
    forward pass that read a unit's weights before the optimizer's write of them landed would see the
    old ones."""
    piece = PosixIO._piece

    def slow(fd, view, offset, write):
        if write:
            time.sleep(0.005)
        piece(fd, view, offset, write)

    monkeypatch.setattr(PosixIO, "_piece", staticmethod(slow))
    dev = "cuda" if io == "kvikio" else "cpu"
    dtype = "bfloat16" if stream == "compute" else "float32"
    sets = [
        *VARIANTS["qwen2"],
        *DEEP,
        f'train.device="{dev}"',
        f'train.compute_dtype="{dtype}"',
        f'tiers.stream="{stream}"',
    ]
    base = tiny_config(token_file, *sets)
    spill = tiny_config(
        token_file,
        *sets,
        f"tiers.host_gb={least_budget(base)}",
        f'tiers.nvme_dir="{tmp_path}"',
        f'tiers.io="{io}"',
    )
    _, want, want_sd = _train(base)
    tr, got, sd = _train(spill, close=False)
    assert set(tr.run_plan.where().values()) == {Home.NVME} and tr.run.host.nbytes() == {}
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    for k in want_sd:
        assert torch.equal(sd[k], want_sd[k]), k
    sizes, kb = [lay.numel for lay in tr.layouts], tr.kind_bytes()
    s, L = streamed_kind(kb), len(sizes)
    # a whole step (backward, update, next forward): the optimizer reads what it updates (not the bf16
    # copy, which it writes whole); the forward pass reads every unit's weights, the backward pass all
    # but the embedding, the head and the last two blocks, which are still on the device
    once = sum(n * b for n in sizes for b in kb.values())
    reads = (
        once
        - (sum(sizes) * 2 if s == Kind.WEIGHTS else 0)
        + sum(sizes) * kb[s]
        + sum(sizes[1 : L - 3]) * kb[s]
    )
    assert got[-1]["nvme_read_gb"] * 1e9 == pytest.approx(reads, rel=1e-12)
    assert got[-1]["nvme_write_gb"] * 1e9 == pytest.approx(once, rel=1e-12)
    if s == Kind.WEIGHTS:  # plain zarr reads the bf16 copy, as its bits
        arr = zarr.open_group(tr.run.nvme.store.root, mode="r")["weights"]
        u = L - 2
        with tr.run.state.slab(u, Kind.MASTER, read=True) as m:
            want_w = m.to(torch.bfloat16)
        assert torch.equal(torch.from_numpy(arr[u, : sizes[u]]).view(torch.bfloat16), want_w)
    tr.close()


def _spilled(where):
    return {uk for uk, t in where.items() if t == Home.NVME}


def test_placement_policy_by_hand():
    """A unit 3x as wide as the others, bytes costing what they are. 220 elements x 18 B = 3960 B."""
    numels, kb = (
        [30] + [10] * 19,
        {Kind.MASTER: 4, Kind.EXP_AVG: 4, Kind.EXP_AVG_SQ: 4, Kind.GRAD: 4, Kind.WEIGHTS: 2},
    )
    one = lambda n: n  # noqa: E731
    assert set(place(numels, kb).values()) == {Home.HOST}
    assert place_within(numels, kb, 3960, 0, one) == (place(numels, kb), 0, 3960)
    # one byte over: exp_avg from the last unit, until 40 B a unit pays for a ring of 4 x 40 B and the byte
    where, ring, total = place_within(numels, kb, 3960, 1, one)
    assert total == 3961 and ring == 160 and _spilled(where) == {(u, Kind.EXP_AVG) for u in range(15, 20)}
    # the other order: the gradients first, as many
    where, ring, _ = place_within(numels, kb, 3960, 1, one, "gradients")
    assert ring == 160 and _spilled(where) == {(u, Kind.GRAD) for u in range(15, 20)}
    # and further: the blocks' gradients (19 x 40 B), then first moments (5 x 40 B), with two kinds' rings (320 B)
    where, _, _ = place_within(numels, kb, 3960 - 19 * 40 - 5 * 40 + 2 * 160, 0, one, "gradients")
    assert _spilled(where) == {(u, Kind.GRAD) for u in range(1, 20)} | {
        (u, Kind.EXP_AVG) for u in range(15, 20)
    }
    # the least: unit 0 kept (its 540 B cost less than rings 3x as wide), the rest spilled: four fp32
    # kinds' rings of 4 x 40 B and the streamed copy's of 8 x 20 B
    least = least_host(numels, kb, 7, one)
    assert least == 7 + 30 * 18 + 4 * 4 * 40 + 8 * 20
    where, ring, _ = place_within(numels, kb, least, 7, one)
    assert ring == 800 and _spilled(where) == {(u, k) for u in range(1, 20) for k in kb}
    assert place_within(numels, kb, least - 1, 7, one) == (None, 0, 3967)


def test_a_kind_stays_in_ram_when_its_ring_would_cost_more():
    """fp32 streaming: the master's ring is twice as deep (8 x 400 B). Seven blocks' masters (2800 B)
    cost less in RAM than that ring, and the 8x-wide embedding (12800 B) less than rings its width; the
    least budget keeps both in RAM and spills the rest, and the ring is sized for the blocks."""
    numels, kb = [800, *[100] * 7], kind_bytes("float32", "master")
    one = lambda n: n  # noqa: E731
    least = least_host(numels, kb, 0, one)
    assert least == 800 * 16 + 7 * 400 + ring_bytes(
        {Kind.EXP_AVG: 100, Kind.EXP_AVG_SQ: 100, Kind.GRAD: 100}, kb, one
    )
    where, ring, _ = place_within(numels, kb, least, 0, one)
    assert _spilled(where) == {
        (u, k) for u in range(1, 8) for k in (Kind.EXP_AVG, Kind.EXP_AVG_SQ, Kind.GRAD)
    }
    assert ring == 3 * 4 * 400 and ring_widths(numels, where) == {
        Kind.EXP_AVG: 100,
        Kind.EXP_AVG_SQ: 100,
        Kind.GRAD: 100,
    }
    assert least < ring_bytes({k: 800 for k in kb}, kb, one)  # every slab spilled: the old least


def test_the_runtime_allocates_the_planned_ring(token_file, tmp_path):
    """A tied embedding three times a block's width, under the least budget: the trainer places what
    place_within places (the embedding in RAM, every kind spilled), and the staging's and the reader's buffers are the
    ring it costed (per kind, no wider); the run is bit-identical to one in RAM."""
    sets = [*VARIANTS["qwen2"], "model.vocab_size=1600", *DEEP, "train.steps=2"]
    tr = Trainer(tiny_config(token_file, *sets))
    numels, kb = [lay.numel for lay in tr.layouts], tr.kind_bytes()
    tr.close()
    assert numels[0] > 2 * max(numels[1:])
    least = least_host(numels, kb, 0, host_cost)
    tr = Trainer(
        tiny_config(
            token_file,
            *sets,
            f"tiers.host_gb={least / 1e9 + beside_gb(tiny_config(token_file, *sets)) + 1e-9}",
            f'tiers.nvme_dir="{tmp_path}"',
            'tiers.io="posix"',
        )
    )
    want, ring, _ = place_within(numels, kb, least + 1, 0, host_cost)
    assert tr.run_plan.where() == want and all(tr.run_plan.where()[(0, k)] == Home.HOST for k in kb)
    assert {k for _, k in _spilled(tr.run_plan.where())} == set(kb)
    assert tr.run.nvme.ring_nbytes() == ring == ring_bytes(ring_widths(numels, want), kb, host_cost)
    assert ring_widths(numels, want) == {k: max(numels[1:]) for k in kb}
    # the disk, too, holds rows a block wide, not the embedding's width
    for u, k in _spilled(tr.run_plan.where()):
        assert tr.run.nvme.store.path(k, u).stat().st_size == max(numels[1:]) * kb[k]
    # what --nvme-gb is held to is what the store takes (the head's rows are a block wide too)
    assert disk_bytes(numels, kb, want) == sum(
        tr.run.nvme.store.path(k, u).stat().st_size for u, k in _spilled(want)
    )
    assert disk_bytes(numels, kb, want) > sum(spilled_bytes(numels, kb, want).values())
    got = [tr.train_step()["loss"] for _ in range(2)]
    tr.close()
    _, want_recs, _ = _train(tiny_config(token_file, *sets), steps=2)
    assert got == [r["loss"] for r in want_recs]


def test_what_fits_in_ram_stays_there(token_file, tmp_path):
    nvme = tmp_path / "nvme"
    tr = Trainer(tiny_config(token_file, *DEEP, "tiers.host_gb=1", f'tiers.nvme_dir="{nvme}"'))
    assert tr.run.nvme is None and set(tr.run_plan.where().values()) == {Home.HOST} and not nvme.exists()
    tr.close()


def test_budget_refusals_say_what_to_raise(token_file, tmp_path):
    cfg = tiny_config(token_file, "tiers.host_gb=0.0001")
    with pytest.raises(
        ConfigError, match=r"raise --host-gb to [0-9.]+, or pass --nvme-dir .*--host-gb [0-9.]+ is the least"
    ):
        Trainer(cfg)
    cfg = tiny_config(token_file, "tiers.host_gb=0.0001", f'tiers.nvme_dir="{tmp_path}"')
    with pytest.raises(
        ConfigError,
        match="cannot hold even the staging ring with all it can spill on NVMe: raise "
        "--host-gb to at least [0-9.]+",
    ):
        Trainer(cfg)
    gb = budget_for(tiny_config(token_file, *DEEP))
    cfg = tiny_config(
        token_file, *DEEP, f"tiers.host_gb={gb}", f'tiers.nvme_dir="{tmp_path}"', "tiers.nvme_gb=0.000001"
    )
    with pytest.raises(ConfigError, match="the spilled state takes [0-9.]+ MiB on disk and --nvme-gb"):
        Trainer(cfg)


def test_a_gpu_run_short_of_ram_is_told_the_host_budget_that_spills():
    """A GPU run without --host-gb on a machine with 40 GB of RAM free, whose state (llama3.1-8b, 145 GB) that RAM
    cannot hold: the refusal names --host-gb and --nvme-dir, at the least host budget the plan then needs (37.3, more
    than 90% of the RAM, and free), and that plan fits. It said "use a machine with more RAM"."""
    import re

    from tiertrain.config import load_config
    from tiertrain.errors import ConfigError
    from tiertrain.plan.hardware import REFERENCE
    from tiertrain.plan.resolve import resolve, search

    cfg = load_config("llama3.1-8b", ["tiers.gpu_resident_gb=0"])
    with pytest.raises(
        ConfigError, match=r"40\.00 GB of RAM available: pass --host-gb ([0-9.]+) --nvme-dir"
    ) as e:
        resolve(cfg, REFERENCE, None, 36.0)  # what a run passes: 90% of the RAM available
    host = float(re.search(r"--host-gb ([0-9.]+)", str(e.value)).group(1))
    assert 36 < host <= 40 and search(cfg, REFERENCE, host, REFERENCE.gpu_mem_gb, 1e7, "x", advise=False).fits


def test_store_faults(tmp_path):
    io = PosixIO(2)
    meta = {"model": {"hidden_size": 8}}
    NvmeStore(tmp_path / "s", [4096, 8192], {Kind.EXP_AVG: "float32"}, meta, io, create=True)
    with pytest.raises(StoreError, match="already holds a store of another run"):
        NvmeStore(tmp_path / "s", [4096, 8192], {Kind.EXP_AVG: "float32"}, meta, io, create=True)
    with pytest.raises(StoreError, match="different model or config"):
        NvmeStore(
            tmp_path / "s",
            [4096, 8192],
            {Kind.EXP_AVG: "float32"},
            {"model": {"hidden_size": 9}},
            io,
            create=False,
        )
    # the same: opens
    NvmeStore(tmp_path / "s", [4096, 8192], {Kind.EXP_AVG: "float32"}, meta, io, create=False)
    chunk = tmp_path / "s" / "exp_avg" / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:100])
    with pytest.raises(StoreError, match="missing or truncated"):
        NvmeStore(tmp_path / "s", [4096, 8192], {Kind.EXP_AVG: "float32"}, meta, io, create=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="cannot use --nvme-dir"):
        NvmeStore(tmp_path / "file" / "s", [4096], {Kind.EXP_AVG: "float32"}, meta, io, create=True)


def test_full_disk_is_refused_before_writing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    # digits that differ
    with pytest.raises(StoreError, match="has 1000 B free, the spilled state needs 4.0 MiB"):
        NvmeStore(tmp_path / "s", [1 << 20], {Kind.EXP_AVG: "float32"}, {}, PosixIO(1), create=True)
    assert not (tmp_path / "s" / "zarr.json").exists()


RSS_SCRIPT = r"""
import sys, tempfile
def hwm():  # the peak RSS of this process's memory: ru_maxrss would carry pytest's own peak across exec
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
sys.path.insert(0, "tests")
from conftest import beside_gb
from tiertrain.config import load_config
from tiertrain.trainer import Trainer
from tiertrain.tiers.placement import least_host
from tiertrain.tiers.slab import host_cost
sets = ["model.hidden_size=512", "model.intermediate_size=1536", "model.num_hidden_layers=8", "model.vocab_size=384",
        "model.num_attention_heads=8", "train.seq_len=64", "train.batch_size=2", "train.micro_batch_size=2",
        'train.device="cpu"', 'train.compute_dtype="float32"']
if sys.argv[1] == "least":  # every slab on NVMe: the ring alone
    from tiertrain.plan.memory import slab_sizes as _layouts
    from tiertrain.tiers.placement import kind_bytes
    numels = _layouts(load_config(None, sets).model)
    state_gb = least_host(numels, kind_bytes("float32", "master"), 0, host_cost) / 1e9 + 1e-6
else:
    state_gb = float(sys.argv[1])
base = hwm()
budget = state_gb + beside_gb(load_config(None, sets))  # --host-gb: the process and the CPU's working set too
tr = Trainer(load_config(None, sets + [f"tiers.host_gb={budget}", f'tiers.nvme_dir="{tempfile.mkdtemp(dir=sys.argv[2])}"']))
for _ in range(3):
    tr.train_step()
tr.close()
peak = hwm()
state = sum(lay.numel for lay in tr.layouts) * 16
assert (state_gb > 0.3) == ({h.value for h in tr.run_plan.where().values()} != {"nvme"})
print(budget, state_gb, tr.hw.process_gb, base, peak, state)
"""


@pytest.mark.parametrize("budget", ["0.35", "least"])
def test_peak_rss_stays_under_the_budget(tmp_path, budget):
    """--host-gb bounds the whole process on a CPU: its peak RSS stays within --host-gb, set to the plan's host
    bytes (0.35 GB: the 26 M-parameter model's state is 0.42 GB, +0.11 GB of ring, so the moments go to disk;
    `least`: every slab on NVMe, the host holds the staging ring, 0.24 GB) beside the CPU's working set and the
    process's own memory (HardwareSpec.cpu's process_gb, a measured figure: the process before the trainer, with
    Python, torch and tiertrain loaded, stays within it)."""
    r = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, budget, str(tmp_path)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    budget, state_gb, process_gb, *rest = r.stdout.split()
    base, peak, state = map(int, rest)
    assert state > float(state_gb) * 1e9  # the budget really is smaller than the state
    assert base <= float(process_gb) * 1e9 and peak <= float(budget) * 1e9, (base / 1e9, peak / 1e9, budget)


def test_kvikio_missing_says_what_to_install():
    """tiers.io = "kvikio" where it is not installed (CI): the extra for this torch's CUDA, by name."""
    try:
        import kvikio  # noqa: F401

        pytest.skip("kvikio is installed here")
    except ImportError:
        pass
    from tiertrain.tiers.nvme import check_backend

    with pytest.raises(UserError, match=r'pip install "tiertrain\[cu1[23]\]".*tiers.io = "auto"'):
        check_backend("kvikio")
    # with only the activation checkpoints on NVMe (no state spilled): the same line, before allocating
    from conftest import cli, refused, tiny, write_tokens

    with tempfile.TemporaryDirectory() as d:
        sets = ["--set", 'tiers.io="kvikio"', "--set", 'tiers.activations="nvme"', "--nvme-dir", d]
        refused(
            cli("run", *tiny(write_tokens(Path(d) / "t.npy")), *sets, "--out", f"{d}/run"), "tiertrain[cu1"
        )


def test_a_gpu_runs_plan_says_when_it_prices_an_unmeasured_disk(token_file, tmp_path):
    """A run that spills, planned on the reference machine's disk rates (no probe measured this disk), says how to
    measure it: the 18-block Qwen3-30B-A3B cut ran 1.21-1.37x its plan so, 0.86-0.96x on its probe. A measured disk,
    or a run that does not spill, says nothing."""
    from tiertrain.plan.hardware import HardwareSpec

    assert "tiertrain probe --nvme-dir" in REFERENCE.disk_note()
    assert HardwareSpec.load(ROOT / "bench" / "results" / "2026-11-25-H100-probe.json").disk_note() == ""
    spill = tiny_config(
        token_file, *DEEP, f"tiers.host_gb={least_gb(token_file)}", f'tiers.nvme_dir="{tmp_path}"'
    )
    for cfg, says in ((spill, True), (tiny_config(token_file), False)):
        tr = Trainer(cfg)
        tr.predicts = True  # as on a GPU, where the plan's times are predictions
        assert any("tiertrain probe --nvme-dir" in line for line in tr.describe()) == says
        tr.hw = dataclasses.replace(tr.hw, disk_read_gbs=1.69)
        assert not any("tiertrain probe --nvme-dir" in line for line in tr.describe())
        tr.close()


def test_the_nvme_tier_is_budgeted_at_its_directorys_free_space(token_file, tmp_path, monkeypatch):
    """tiers.nvme_gb 0 means the free space of nvme_dir for `run` too (as --nvme-dir for `plan`): a run whose
    spill does not fit that disk is refused by the plan, naming it, before anything is allocated."""
    import shutil
    from collections import namedtuple

    from conftest import DEEP, least_budget, tiny_config
    from tiertrain.errors import ConfigError
    from tiertrain.trainer import Trainer

    sets = [*DEEP, f"tiers.host_gb={least_budget(tiny_config(token_file, *DEEP))}"]
    sets.append(f'tiers.nvme_dir="{tmp_path / "nvme"}"')
    Trainer(tiny_config(token_file, *sets)).close()  # the disk here holds it
    before = sorted((tmp_path / "nvme").iterdir())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 0, 10**6))
    with pytest.raises(ConfigError, match=r"takes .* on disk and --nvme-dir .*nvme has 976\.6 KiB free"):
        Trainer(tiny_config(token_file, *sets))
    assert sorted((tmp_path / "nvme").iterdir()) == before  # no store made for the refused run
    # a budget above the disk's free space is refused by the plan too where the plan would use more than that free
    # space (the store's own check refused it after the host slabs were allocated); one the plan needs no disk of
    # stands
    with pytest.raises(ConfigError, match=r"which has 0\.0 GB free: pass --nvme-gb 0 or less"):
        Trainer(tiny_config(token_file, *sets, "tiers.nvme_gb=1"))
    assert sorted((tmp_path / "nvme").iterdir()) == before
    Trainer(
        tiny_config(token_file, *DEEP, "tiers.nvme_gb=1", f'tiers.nvme_dir="{tmp_path / "nvme"}"')
    ).close()


def test_a_store_deleted_midway_still_says_whose_it_is(tmp_path, monkeypatch):
    """A process killed while it deletes its scratch store (the launcher stops the other ranks at once) leaves the
    marker, deleted last, so the run's next start finds and deletes the rest; an unmarked store stayed for good."""
    from tiertrain.tiers import nvme

    root = nvme.new_scratch(tmp_path, "run")
    for kind in ("exp_avg", "exp_avg_sq", "grad"):
        (root / kind / "0").mkdir(parents=True)
    real = nvme.shutil.rmtree

    def killed(p, *a, **k):  # the kill lands after the first part went
        real(p, *a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(nvme.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        nvme.discard(root)
    monkeypatch.setattr(nvme.shutil, "rmtree", real)
    assert root.is_dir() and (root / nvme.SCRATCH_MARKER).is_file() and nvme._owner(root) is not None
    nvme.discard(root)
    assert not root.exists()


def _fds_to(path: Path) -> list[int]:
    import os

    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                found.append(int(fd))
        except OSError:
            continue
    return found


def test_posix_io_closes_each_files_descriptor_once_after_its_last_piece(tmp_path, monkeypatch):
    """Pieces end on several threads: the last closes the file, once (two closing it closed a descriptor another
    thread had opened meanwhile, or failed with EBADF); a read the shut pool refuses leaves no descriptor."""
    import os

    from tiertrain.tiers import nvme
    from tiertrain.tiers.slab import alloc_slab

    monkeypatch.setattr(nvme, "TASK_BYTES", 4096)  # 64 pieces a read, finishing together
    f = tmp_path / "chunk"
    f.write_bytes(os.urandom(64 * 4096))
    closed, close = [], os.close
    monkeypatch.setattr(nvme.os, "close", lambda fd: (closed.append(fd), close(fd))[1])
    io = PosixIO(8)
    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: the window the race needs
    try:
        bufs = [alloc_slab(64 * 1024, torch.float32, pin=False) for _ in range(100)]  # direct I/O: aligned
        done = [io.read(f, b) for b in bufs]
        assert [d.result() for d in done] == [64 * 4096] * 100
    finally:
        sys.setswitchinterval(was)
    assert len(closed) == 100 and all(
        torch.equal(b.view(torch.uint8), bufs[0].view(torch.uint8)) for b in bufs
    )
    io.close()
    with pytest.raises(RuntimeError, match="shutdown"):
        io.read(f, bufs[0])
    assert _fds_to(f) == []


@pytest.mark.parametrize("closing", ["closes", "fails"])
@pytest.mark.parametrize("part", ["Staging", "StreamReader", "ActivationStore"])
def test_a_part_refused_after_the_scratch_store_was_made_takes_it_along(
    token_file, tmp_path, monkeypatch, part, closing
):
    """The NVMe tier's staging or reader, or the activation store, refused once the store exists (their rings'
    pinned memory, a signal): the store goes with the refusal, and no thread of it is left; where closing the
    store fails too (its disk), the refusal is still what is raised, and the directory goes all the same."""
    import threading

    from tiertrain import assemble
    from tiertrain.tiers.nvme import ChunkStore

    if closing == "fails":
        close = ChunkStore.close

        def failing(self):
            close(self)
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(ChunkStore, "close", failing)

    def refused(*a, **k):
        raise MemoryError("injected: no pinned memory")

    nv = tmp_path / "nv"
    sets = {"StreamReader": ['tiers.stream="master"'], "ActivationStore": ['tiers.activations="nvme"']}.get(
        part, []
    )
    cfg = tiny_config(token_file, *DEEP, f'tiers.nvme_dir="{nv}"', *sets)
    if part != "ActivationStore":  # the state spilled: the staging's store (the checkpoints' store: its own)
        cfg.tiers.host_gb = least_budget(cfg)
    monkeypatch.setattr(assemble, part, refused)
    with pytest.raises(MemoryError, match="injected"):
        Trainer(cfg)
    assert list(nv.iterdir()) == []
    left = [t.name for t in threading.enumerate() if t.name.startswith("tiertrain-io")]
    assert left == [], [t.name for t in threading.enumerate()]
