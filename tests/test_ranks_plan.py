"""Several ranks as the planner sees them: shards that cover each slab once, each rank's share of a plan, and the host's budgets a plan of several GPUs names."""

from __future__ import annotations

import math
import re

import pytest

from tiertrain.modes import Update
from tiertrain.plan.advice import explain
from tiertrain.plan.hardware import REFERENCE
from tiertrain.plan.planner import plan
from tiertrain.plan.values import Budgets, Choice, Job
from tiertrain.tiers.slab import Shard, SlabLayout


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 8])
def test_shards_cover_each_slab_once(ranks):
    """Whatever the number of ranks, the shards' parts inside the slab tile it, on whole pages, and their
    optimizer ranges are the slab's, cut at the shards' edges."""
    for shapes in (
        [("w", (7, 300)), ("b", (300,))],
        [("n", (64,))],
        [("e", (97, 64)), ("h", (64, 97)), ("g", (5,))],
    ):
        lay = SlabLayout.build(shapes)
        shards = [Shard(lay, r, ranks) for r in range(ranks)]
        assert sum(s.stored for s in shards) == lay.numel
        assert all(s.numel % 2048 == 0 and s.start == r * s.numel for r, s in enumerate(shards))
        cut = [(a + s.start, b + s.start, d) for s in shards for a, b, d in s.ranges()]
        merged = []
        for a, b, d in cut:
            if merged and merged[-1][1] == a and merged[-1][2] == d:
                merged[-1] = (merged[-1][0], b, d)
            else:
                merged.append((a, b, d))
        assert merged == lay.ranges()


def test_the_plan_for_two_gpus_halves_each_ranks_share():
    """llama-3b at 64k tokens per step on two H200s of one host: each rank holds half the state and moves half
    the weights over its PCIe link, computes half the tokens (and, with half the activations, keeps more blocks'
    on the GPU: more than twice one GPU's rate is possible); the host's budget is shared; the report says the
    scaling and its bound."""
    from tiertrain.config import load_config
    from tiertrain.plan.report import to_markdown

    spec = load_config("llama-3b", []).model
    one = plan(Job(spec, 8, 8192), Budgets(host_gb=250), REFERENCE)
    two = plan(Job(spec, 8, 8192, gpus=2), Budgets(host_gb=250), REFERENCE)
    assert one.fits and two.fits and two.run_plan.gpus == 2 and two.job.rows == 4
    assert sum(two.memory.host.values()) == pytest.approx(sum(one.memory.host.values()) / 2, rel=0.01)
    assert two.prediction.times["H2D fwd"] == pytest.approx(one.prediction.times["H2D fwd"] / 2, rel=0.02)
    assert two.prediction.times["compute fwd"] == pytest.approx(
        one.prediction.times["compute fwd"] / 2, rel=1e-6
    )
    assert two.prediction.times["peer fwd"] > 0 and one.prediction.times["peer fwd"] == 0
    assert (
        two.prediction.tokens_per_s > 1.5 * one.prediction.tokens_per_s and two.memory.kept >= one.memory.kept
    )
    apart = plan(Job(spec, 8, 8192, gpus=2, per_host=1), Budgets(host_gb=125), REFERENCE)
    assert apart.prediction.times["peer bwd"] == pytest.approx(
        two.prediction.times["peer bwd"] * REFERENCE.peer_gbs / REFERENCE.network_gbs
    )
    text = to_markdown(two, one)
    assert "2 GPUs" in text and "x one GPU" in text
    # the host budget is the host's: what one rank's half of the state needs, twice over, and not less
    need = two.memory.host_total - two.memory.host_fixed()["process"]
    assert plan(
        Job(spec, 8, 8192, gpus=2),
        Budgets(host_gb=2 * need / 1e9 * 1.01),
        REFERENCE,
        Choice(speculate=two.run_plan.count(Update.HOST_SPECULATED)),
    ).fits
    assert not plan(Job(spec, 8, 8192, gpus=2), Budgets(host_gb=need / 1e9), REFERENCE).fits


def test_the_plan_of_two_gpus_names_the_hosts_budgets():
    """Two ranks on a host short of RAM: the miss names the host's --host-gb (as passed) and the least the host
    needs, which then fits, where a little less does not; the report of a fit names the same least budget."""
    from tiertrain.config import load_config

    spec = load_config("llama-3b", []).model
    job, at = Job(spec, 16, 2048, gpus=2), lambda gb: Budgets(host_gb=gb, gpu_gb=30, nvme_gb=100)
    miss = plan(job, at(4), REFERENCE)
    assert not miss.fits and miss.why.startswith("host: 4.00 GB cannot hold")
    need = float(re.search(r"at least ([0-9.]+)$", miss.why).group(1))
    unit = 10 ** (math.floor(math.log10(need)) - 2)  # the last digit printed: the least rounded up to three
    assert (
        need > 2 * 4 / 2 + 2 * REFERENCE.process_gb  # two processes' own memory in it
        and plan(job, at(need), REFERENCE).fits
        and not plan(job, at(need - unit), REFERENCE).fits
    )
    fit = plan(job, at(need), REFERENCE)
    assert explain(job, fit, at(need), REFERENCE).least_host / 1e9 == pytest.approx(need, abs=unit)
