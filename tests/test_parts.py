"""Expert groups (model/parts.py): a block with experts streamed as its attention part, then groups of its experts.
The parts' pieces against the slab, a part's drain, the plan's choice and the config's checks; test_moe.py trains
blocks in parts against transformers and checks their spill and resume bits."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import ROOT, cli, tiny_config
from tiertrain.config import load_config
from tiertrain.engine.buffers import Accumulators
from tiertrain.engine.streams import StallClock, Streams
from tiertrain.errors import ConfigError
from tiertrain.model.parts import EXPERTS, WHOLE, gaps, group_options, norm_pieces, unit_parts
from tiertrain.tiers.slab import SlabLayout

MOE = [
    'model.model_type="qwen3_moe"',
    "model.qk_norm=true",
    "model.num_experts=4",
    "model.num_experts_per_tok=2",
]
BLOCK = [  # a gpt-oss block's tensors, tiny: biases on the experts, 4 experts
    ("self_attn.q_proj.weight", (8, 4)),
    ("mlp.router.weight", (4, 4)),
    ("mlp.experts.gate_up_proj", (4, 4, 6)),
    ("mlp.experts.gate_up_proj_bias", (4, 6)),
    ("mlp.experts.down_proj", (4, 3, 4)),
    ("mlp.experts.down_proj_bias", (4, 4)),
    ("input_layernorm.weight", (4,)),
    ("mlp.router.bias", (4,)),
]


@pytest.mark.parametrize("groups", [2, 4])
def test_parts_cover_the_slab_once_and_slice_the_experts(groups):
    """Every tensor's elements are in exactly one part; a group's views are its experts' rows of the slab's."""
    lay = SlabLayout.build(BLOCK)
    parts = unit_parts(lay, 4, groups)
    assert len(parts) == groups + 1 and parts[0].experts == 0
    flat = torch.arange(lay.numel, dtype=torch.float32)
    seen = torch.zeros(lay.numel, dtype=torch.int64)
    for p in parts:
        for pc in p.pieces:
            seen[pc.src : pc.src + pc.numel] += 1
        assert all(pc.dst + pc.numel <= p.numel for pc in p.pieces)
    for a, b in gaps(lay.numel, parts):
        assert not seen[a:b].any()
        seen[a:b] = 1
    assert (seen == 1).all()  # the pieces and the gaps tile the slab
    whole = lay.views(flat)
    n = 4 // groups
    for p in parts:
        buf = torch.full((p.numel,), -1.0)
        for pc in p.pieces:
            buf[pc.dst : pc.dst + pc.numel] = flat[pc.src : pc.src + pc.numel]
        for name, v in p.views(buf).items():
            sliced = name.startswith(EXPERTS) and name != WHOLE  # gpt-oss's down biases go whole
            want = whole[name][p.first : p.first + n] if sliced else whole[name]
            assert torch.equal(v, want), name
    grouped = {n for n, _ in BLOCK if n.startswith(EXPERTS) and n != WHOLE}
    assert {n for p in parts[1:] for n in p.views(flat)} == grouped and WHOLE in parts[0].views(flat)
    # the parts' norm pieces, in order, hold the values of the unit's: the same whatever the groups
    bufs = [torch.cat([flat[pc.src : pc.src + pc.numel] for pc in p.pieces]) for p in parts]
    packed = [torch.zeros(p.numel) for p in parts]
    for p, b, pk in zip(parts, bufs, packed):
        for pc, v in zip(p.pieces, b.split([pc.numel for pc in p.pieces])):
            pk[pc.dst : pc.dst + pc.numel] = v
    by_parts = [pk[a : a + n] for p, pk in zip(parts, packed) for a, n in p.norm_pieces()]
    by_unit = [flat[a : a + n] for a, n in norm_pieces(lay, 4)]
    assert len(by_parts) == len(by_unit) == 5 + 4 * 3 and all(map(torch.equal, by_parts, by_unit))
    assert unit_parts(lay, 4, 1) == () and unit_parts(SlabLayout.build(BLOCK[:2]), 4, 2) == ()


def test_a_part_drains_to_its_places_and_the_padding_to_zeros():
    """Each part's accumulator lands in its pieces' places of the unit's sink, the layout's padding zeroed there
    (a staging buffer holds another unit's bytes); the parts' norms by pieces are the bits of the whole block's."""
    emb, head = SlabLayout.build([("e", (4, 4))]), SlabLayout.build([("h", (4, 4))])
    lay = SlabLayout.build(BLOCK)
    parts = unit_parts(lay, 4, 2)
    sink = torch.full((lay.numel,), float("nan"))
    landed = []
    streams = Streams(torch.device("cpu"))
    grads = Accumulators(
        [emb, lay, head],
        torch.device("cpu"),
        streams,
        StallClock(streams),
        lambda u: (sink, landed.append),
        parts={1: parts},
    )
    want = torch.zeros(lay.numel)
    norms = []
    for i in (2, 1, 0):  # the backward pass's order: the groups, then the attention part
        acc = grads.begin(1, i)
        for pc in parts[i].pieces:
            vals = torch.randn(pc.numel)
            acc[pc.dst : pc.dst + pc.numel] = vals
            want[pc.src : pc.src + pc.numel] = vals
        norms.append(grads.drain_part(1, i, last=i == 0))
        assert len(landed) == (i == 0)
    assert torch.equal(sink, want)
    assert float(torch.cat(norms).norm()) == pytest.approx(float(want.norm()), rel=1e-6)
    whole = Accumulators(
        [emb, lay, head],
        torch.device("cpu"),
        streams,
        StallClock(streams),
        lambda u: (torch.empty(lay.numel), None),
        pieces={1: norm_pieces(lay, 4)},
    )
    whole.begin(1).copy_(want)
    assert torch.equal(whole.drain(1), torch.cat(norms[::-1]))  # the parts' pieces in the unit's order


def test_the_plan_streams_experts_in_groups_where_whole_blocks_crowd_the_gpu():
    """gpt-oss-120b: whole blocks on 80 GB; on 24 GB its experts in groups, the plan's slots a part's size; a
    dense model never."""
    from tiertrain.plan.hardware import REFERENCE
    from tiertrain.plan.resolve import search

    cfg = load_config("gpt-oss-120b", [])
    big = search(cfg, REFERENCE, 1500, 80, 4000, "gpt-oss-120b")
    small = search(cfg, REFERENCE, 1500, 24, 4000, "gpt-oss-120b")
    assert big.fits and big.run_plan.expert_groups == 1
    assert small.fits and small.run_plan.expert_groups in group_options(128)[1:]
    assert small.memory.gpu.slots < big.memory.gpu.slots / 4
    assert not small.run_plan.kept() and not small.run_plan.count("gpu", "gpu-speculated", "resident")
    fixed = load_config("gpt-oss-120b", ["tiers.expert_groups=1"])
    assert not search(fixed, REFERENCE, 1500, 24, 4000, "gpt-oss-120b").fits
    # what blocks in parts do without, asked for: the plan leaves the blocks whole rather than the setting unheard
    tiled = search(load_config("gpt-oss-120b", ["train.tile_tokens=4096"]), REFERENCE, 1500, 24, 4000, "x")
    assert tiled.run_plan.expert_groups == 1 and tiled.run_plan.tile == 4096
    dense = search(load_config("llama-1b", []), REFERENCE, 64, 8, None, "llama-1b")
    assert dense.run_plan.expert_groups == 1


@pytest.mark.parametrize(
    "sets, why",
    [
        (["tiers.expert_groups=3"], "must divide model.num_experts (4)"),
        (["tiers.expert_groups=2", "train.keep_activations=1"], "set train.keep_activations=0"),
        (["tiers.expert_groups=2", "train.tile_tokens=64"], "set train.tile_tokens=0"),
        (["tiers.expert_groups=0"], 'must be "auto"'),
    ],
)
def test_bad_expert_groups_get_one_line(token_file, sets, why):
    from tiertrain.trainer import Trainer

    with pytest.raises(ConfigError, match=re.escape(why)):
        Trainer(tiny_config(token_file, *MOE, *sets))
    with pytest.raises(ConfigError, match="the model has no experts"):
        Trainer(tiny_config(token_file, "tiers.expert_groups=2"))


def test_plan_json_says_the_groups():
    args = ["--config", "gpt-oss-20b", "--set", "tiers.expert_groups=4", "--gpu-gb", "80", "--host-gb", "512"]
    r = cli("plan", *args, "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["expert_groups"] == 4


def test_the_plan_prices_each_group():
    """A step in more groups is planned longer: the attention part's second pass once, then each group's own cost
    (plan.times.group_seconds, fitted on an H200: 1.08x, 1.11x and 1.50x whole blocks' step for 2, 4, 16 groups)."""
    from tiertrain.plan.hardware import REFERENCE
    from tiertrain.plan.resolve import search

    fixed = [
        "train.batch_size=8",
        "train.micro_batch_size=1",
        "tiers.gpu_resident_gb=0",
        "tiers.gpu_update_units=0",
    ]
    fixed += ["train.keep_activations=0", 'tiers.stream="compute"', 'tiers.activations="gpu"']
    steps = []
    for g in (1, 2, 4, 16):
        cfg = load_config(
            str(ROOT / "bench/configs/qwen3-30b-a3b-6l.toml"), [*fixed, f"tiers.expert_groups={g}"]
        )
        steps.append(search(cfg, REFERENCE, 256, 80, None, "cut").prediction.step_s)
    assert steps == sorted(steps) and len(set(steps)) == 4
    assert 1.3 < steps[3] / steps[0] < 1.8  # measured: 1.50


def test_a_moe_miss_names_the_budget_its_groups_fit_in():
    """mixtral-8x7b on 24 GB needs expert groups, which spill more (no resident units): a miss short of NVMe says
    the groups' need, and the plan fits once it is raised (whole blocks' need, 778 GB, missed the GPU again)."""
    args = ["--config", "mixtral-8x7b", "--gpu-gb", "24", "--host-gb", "128"]
    miss = json.loads(cli("plan", *args, "--nvme-gb", "500", "--format", "json").stdout)
    need = re.search(r"raise --nvme-gb to ([0-9]+)$", miss["why"])
    assert not miss["fits"] and miss["short_of"] == "NVMe" and need, miss["why"]
    got = json.loads(cli("plan", *args, "--nvme-gb", need.group(1), "--format", "json").stdout)
    assert got["fits"] and got["expert_groups"] > 1
    # the report's extremes are of blocks in groups too: the model itself, and a longer sequence than 0
    assert got["largest_layers"] >= 32 and got["longest_seq_len"] >= 4096 and got["least_host"] > 0


def test_groups_make_up_for_disk_where_whole_blocks_fit_the_gpu():
    """qwen3-30b-a3b cut to 238 blocks, 512 GB of RAM and 2 TB of disk: whole blocks fit the GPU but spill 2,004 GB;
    in expert groups the GPU has room for more checkpoints, fewer go to the disk, and the plan fits."""
    from tiertrain.plan.hardware import REFERENCE
    from tiertrain.plan.resolve import search

    cfg = load_config("qwen3-30b-a3b", ["model.num_hidden_layers=238"])
    p = search(cfg, REFERENCE, 512, 80, 2000, "cut", advise=False)
    assert p.fits and p.run_plan.expert_groups > 1
    whole = search(
        load_config("qwen3-30b-a3b", ["model.num_hidden_layers=238", "tiers.expert_groups=1"]),
        REFERENCE,
        512,
        80,
        2000,
        "cut",
        advise=False,
    )
    assert not whole.fits and whole.short.value == "NVMe"
