"""The RunPlan: one entry per unit (its update and the home of each kind), in the plan's JSON and in a run's
plan.json, and the runtime obeys it."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from conftest import DEEP, budget_for, cli, tiny_config
from tiertrain.loop import fit
from tiertrain.modes import Home, Kind, Update
from tiertrain.plan.runplan import RunPlan, unit_plans
from tiertrain.trainer import Trainer


def test_unit_plans_take_each_update_mode_from_its_set():
    M, A = Kind.MASTER, Kind.EXP_AVG
    where = {(u, k): Home.NVME if (u, k) == (3, A) else Home.HOST for u in range(5) for k in (M, A)}
    units = unit_plans(
        ["embed", "a", "b", "c", "head"],
        where,
        resident=[0],
        gpu=[1],
        gpu_speculated=True,
        host_speculated=[3, 4],
    )
    assert [u.update for u in units] == [
        "resident",
        "gpu-speculated",
        "host",
        "host-speculated",
        "host-speculated",
    ]
    assert dict(units[0].homes) == {A: Home.GPU, M: Home.GPU}  # a resident unit's state is on the GPU
    assert dict(units[3].homes) == {A: Home.NVME, M: Home.HOST}
    assert unit_plans(["a"], {(0, M): Home.HOST}, [], [0], False, [])[0].update == "gpu"


def test_plan_json_lists_every_unit():
    r = cli(
        "plan",
        "--config",
        "llama-3b",
        "--host-gb",
        "40",
        "--nvme-gb",
        "200",
        "--set",
        "tiers.gpu_resident_gb=6",
        "--format",
        "json",
    )
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    units = p["units"]
    assert (
        [u["index"] for u in units] == list(range(28))
        and units[0]["name"] == "embed"
        and units[-1]["name"] == "head"
    )
    n = Counter(u["update"] for u in units)
    assert set(n) <= set(Update) and n["host-speculated"] == p["speculated"]
    assert n["gpu"] + n["gpu-speculated"] == p["gpu_updates"] and n["resident"] >= 1
    homes = Counter(h for u in units for h in u["homes"].values())
    # the report's counts, unit by unit
    assert homes["nvme"] == sum(v["nvme"] for v in p["placement"].values())
    assert all(set(u["homes"].values()) == {"gpu"} for u in units if u["update"] == "resident")


def test_a_run_writes_the_plan_it_obeys(token_file, tmp_path):
    """GPU-updated units and a resident unit; then spilled moments: plan.json says so unit by unit, and the
    trainer's placement and update sets are the RunPlan's."""
    sets = [
        "tiers.gpu_update_units=2",
        "optim.speculate_gpu_updates=false",
        "tiers.gpu_resident_gb=0.0002",
        "optim.speculate_units=99",
        "train.steps=2",
    ]
    tr = Trainer(tiny_config(token_file, *sets))
    fit(tr, tmp_path / "run", echo=lambda s: None)
    p = json.loads((tmp_path / "run" / "plan.json").read_text())
    units = p["units"]
    assert len(units) == len(tr.units) and p["micro_batch"] == tr.run_plan.micro_batch == 2
    assert tr.run_plan == tr.plan.run_plan  # the planner's, unit by unit
    assert [u["update"] for u in units] == ["resident", "gpu", "gpu", "host-speculated", "host-speculated"]
    # the keys of `tiertrain plan --format json` (its totals were missing), the same figures
    from tiertrain.plan.report import to_json

    assert p == json.loads(json.dumps(json.loads(to_json(tr.plan))))
    assert {u["index"] for u in units if u["update"] == "gpu"} == tr.run_plan.updated("gpu", "gpu-speculated")
    assert {
        (u["index"], Kind(k)): Home(h) for u in units for k, h in u["homes"].items()
    } == tr.run_plan.where()
    gb = budget_for(tiny_config(token_file, *DEEP))
    tr = Trainer(
        tiny_config(token_file, *DEEP, f"tiers.host_gb={gb}", f'tiers.nvme_dir="{tmp_path / "nvme"}"')
    )
    units = json.loads(tr.plan_json())["units"]
    tr.close()
    assert {
        (u["index"], Kind(k)): Home(h) for u in units for k, h in u["homes"].items()
    } == tr.run_plan.where()
    assert {u["homes"]["exp_avg"] for u in units[1:-1]} == {"nvme"}  # the moments spill first


def test_a_runplan_takes_the_updates_a_test_gives_where_the_state_allows():
    where = {(u, k): Home.HOST for u in range(4) for k in (Kind.MASTER, Kind.EXP_AVG)}
    where[(3, Kind.EXP_AVG)] = Home.NVME
    rp = RunPlan(2, "master", "gpu", 0.0, unit_plans(["embed", "a", "b", "head"], where, [], [], False, []))
    got = rp.with_updates({1: "gpu", 2: "gpu", 0: "host-speculated"})
    assert [u.update for u in got.units] == ["host-speculated", "gpu", "gpu", "host"] and rp.units[
        1
    ].update == "host"
    for bad in (
        {3: "gpu"},
        {3: "host-speculated"},
        {1: "resident"},
        {1: "sideways"},
        {1: "gpu", 2: "gpu-speculated"},
    ):
        with pytest.raises(ValueError):
            rp.with_updates(bad)
