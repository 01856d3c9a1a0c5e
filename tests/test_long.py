"""Long context: the tiled MLP and loss against untiled runs, checkpoints on NVMe (and split across homes) against
the GPU's, and the plans of the issue's long runs."""

from pathlib import Path

import pytest
import torch

from conftest import TINY, VARIANTS, tiny_config
from tiertrain.config import load_config
from tiertrain.modes import Home
from tiertrain.plan.hardware import REFERENCE
from tiertrain.plan.planner import plan
from tiertrain.plan.report import to_markdown
from tiertrain.plan.resolve import search
from tiertrain.plan.values import Budgets, Choice, Job
from tiertrain.trainer import Trainer

LONG = [
    "train.seq_len=2048",
    "model.max_position_embeddings=2048",
    "train.batch_size=2",
    "train.micro_batch_size=1",
    'train.device="cpu"',
    "train.steps=3",
    'train.compute_dtype="float32"',
]


def _train(cfg, steps: int):
    tr = Trainer(cfg)
    recs = [tr.train_step() for _ in range(steps)]
    sd = tr.state_dict()
    tr.close()
    return [r["loss"] for r in recs], sd, tr


@pytest.mark.parametrize("variant", [*VARIANTS, "mha"])
def test_tiled_block_equals_the_block_under_autograd(variant):
    """model.tiled's forward and written-out backward (tiles of 24 tokens over 2 rows of 40: 12 positions of both
    rows each, the last 4) against llama.block differentiated by autograd, in fp32: output, input gradient and every
    weight's gradient within 1e-6 relative (only the order of the sums over tiles differs)."""
    from tiertrain.model import llama, tiled
    from tiertrain.model.llama import Context

    extra = VARIANTS.get(variant, ["model.num_key_value_heads=4"])
    spec = load_config("debug", [s for s in TINY if s.startswith("model.")] + extra).model
    torch.manual_seed(0)
    w = {
        t.name: torch.randn(t.shape, dtype=torch.float64).float() * (0.3 if len(t.shape) > 1 else 1)
        + (1 if len(t.shape) == 1 and "bias" not in t.name else 0)
        for t in spec.units()[1].tensors
    }
    x, g = torch.randn(2, 40, spec.hidden_size), torch.randn(2, 40, spec.hidden_size)
    ctx = Context.build(spec, 40, torch.float32, torch.device("cpu"), tile=24)
    assert ctx.tiled(x)
    leaves = {n: v.clone().requires_grad_() for n, v in w.items()}
    xr = x.clone().requires_grad_()
    y = llama.block(leaves, xr, ctx)
    want = torch.autograd.grad(y, [xr, *leaves.values()], g)
    with torch.no_grad():
        assert torch.allclose(tiled.forward(w, x, ctx), y, rtol=1e-6, atol=1e-6 * float(y.abs().max()))
    accs = {n: torch.zeros_like(v) for n, v in w.items()}
    gx = tiled.backward(w, accs, x, g.clone(), ctx)
    for name, got, ref in [("x", gx, want[0]), *zip(w, (accs[n] for n in w), want[1:])]:
        assert float((got - ref).norm() / ref.norm()) < 1e-6, name


def test_tiled_mlp_and_loss_match_untiled():
    """The debug model at 2048 tokens, the MLP and the loss in tiles of 128 tokens: losses and weights equal to
    the untiled run within 1e-6 relative (fp32; only the order of the weight gradients' sums differs)."""
    whole = load_config("debug", LONG + ["train.tile_tokens=0", "train.loss_chunk_tokens=4096"])
    tiled = load_config("debug", LONG + ["train.tile_tokens=128", "train.loss_chunk_tokens=128"])
    base, base_sd, tr = _train(whole, 3)
    assert tr.run_plan.tile == 0
    losses, sd, tr = _train(tiled, 3)
    assert tr.run_plan.tile == 128 and tr.run.step.ctx.tile == 128
    assert losses == pytest.approx(base, rel=1e-6)
    # relative in norm: AdamW turns a rounding-level change of a near-zero gradient into one of up to lr
    worst = max(float((sd[k] - base_sd[k]).norm() / base_sd[k].norm()) for k in base_sd)
    assert 0 < worst <= 1e-6  # and the tiles did run: the sums' order shows


def test_plan_tiles_the_mlp_beyond_a_tile():
    """ "auto": no tiles while the untiled MLP takes at most an eighth of the GPU (they cost its forward pass
    again), tiles beyond; and the tiled working set no longer grows with the intermediate size times the length."""
    spec = load_config("llama-7b").model
    b = Budgets(host_gb=1000, gpu_gb=141)
    short = plan(Job(spec, 1, 65536), b, REFERENCE, Choice(1))
    long = plan(Job(spec, 1, 131072), b, REFERENCE, Choice(1, keep_attention=0))
    untiled = plan(Job(spec, 1, 131072), b, REFERENCE, Choice(1, tile=0))
    assert short.run_plan.tile == 0 and long.run_plan.tile == 8192 and untiled.run_plan.tile == 0
    assert untiled.memory.gpu.working - long.memory.gpu.working > 0.5 * 16.8 * spec.intermediate_size * 131072
    # the tiles' forward runs again (their attention outputs recomputed too, as untiled the plan keeps none)
    assert long.prediction.times["compute bwd"] > untiled.prediction.times["compute bwd"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("home", ["host", "nvme", "split"])
@pytest.mark.parametrize("ck", ["float32", "bfloat16"])
def test_checkpoint_homes_give_the_same_bits(token_file, tmp_path, home, device, ck):
    """Checkpoints on NVMe, in RAM, and split across the GPU, the host and NVMe, in fp32 or bf16: the same bits as
    on the GPU in the same dtype."""
    sets = [
        'train.compute_dtype="bfloat16"',
        "model.num_hidden_layers=5",
        "train.steps=3",
        f'train.device="{device}"',
        f'tiers.activation_dtype="{ck}"',
    ]
    base, base_sd, _ = _train(tiny_config(token_file, *sets), 3)
    acts = "nvme" if home == "split" else home
    cfg = tiny_config(token_file, *sets, f'tiers.activations="{acts}"', f'tiers.nvme_dir="{tmp_path}"')
    tr = Trainer(cfg)
    assert set(tr.run_plan.checkpoints().values()) == {Home(acts)} and len(tr.run_plan.checkpoints()) == 5
    # the order a split plan gives: NVMe for the first blocks, then the host, the GPU last
    if home == "split":
        tr.run.activations.place({1: Home.NVME, 2: Home.NVME, 3: Home.HOST, 4: Home.GPU, 5: Home.GPU})
    recs = [tr.train_step() for _ in range(3)]
    sd = tr.state_dict()
    store = tr.run.activations.store
    if acts == "nvme":
        import zarr

        assert (
            store.rows == [1, 2, 3, 4, 5]
            and zarr.open_group(store.root, mode="r")["checkpoints"].shape[0] == 6
        )
        per_step = (
            2
            * (2 if home == "split" else 5)
            * cfg.train.batch_size
            * cfg.train.seq_len
            * cfg.model.hidden_size
            * (2 if ck == "bfloat16" else 4)
        )
        assert recs[-1]["ck_disk_gb"] * 1e9 == per_step  # each written once and read back once
    tr.close()
    assert [r["loss"] for r in recs] == base
    for k in base_sd:
        assert torch.equal(sd[k], base_sd[k]), k
    assert not list(Path(tmp_path).glob("tiertrain-*"))  # the scratch stores are gone


def test_bf16_checkpoints_change_the_losses_by_a_bounded_amount(token_file):
    """bf16 checkpoints (fp32 compute, 8 steps): each block computes from its input rounded to bf16 (the residual
    stream stays fp32), so the losses differ from the first step on (measured 1.4e-6 to 1.5e-4 relative over the 8
    steps), bounded here at 3e-4; the weights by 5.0e-3 of their norm (bf16 keeps 8 bits of each input element),
    bounded at 1e-2."""
    base, base_sd, _ = _train(tiny_config(token_file, "train.steps=8", "model.num_hidden_layers=4"), 8)
    losses, sd, tr = _train(
        tiny_config(
            token_file, "train.steps=8", "model.num_hidden_layers=4", 'tiers.activation_dtype="bfloat16"'
        ),
        8,
    )
    assert tr.run_plan.activation_dtype == "bfloat16" and tr.run.activations.dtype == torch.bfloat16
    assert losses != base
    diff = max(abs(a - b) / b for a, b in zip(losses, base))
    assert diff < 3e-4, diff
    assert max(float((sd[k] - base_sd[k]).norm() / base_sd[k].norm()) for k in base_sd) < 1e-2


def test_nvme_checkpoints_need_an_nvme_tier(token_file):
    from tiertrain.errors import ConfigError

    with pytest.raises(ConfigError, match="--nvme-dir"):
        Trainer(tiny_config(token_file, 'tiers.activations="nvme"'))


@pytest.mark.parametrize("config,seq", [("llama-7b", 262144), ("llama-3b", 524288), ("llama-1b", 1048576)])
def test_long_runs_plan_under_the_issues_budgets(config, seq):
    """115 GB of RAM, 55 GB of disk, a 141 GB GPU: the checkpoints split across the three (the last blocks' on the
    GPU, NVMe's spread from the first block), blocks tiled, the attention's FLOPs counted; no longer sequence by 1024 tokens
    more than the budgets' longest the report names fits (the longest itself is the model's positions, set to seq)."""
    cfg = load_config(
        config,
        [
            f"train.seq_len={seq}",
            "train.batch_size=1",
            "train.micro_batch_size=1",
            f"model.max_position_embeddings={seq}",
        ],
    )
    p = search(cfg, REFERENCE, 115, 141, 55, config)
    assert p.fits, p.why
    assert p.run_plan.activations == "split" and p.run_plan.tile and p.report.longest_budgets >= seq
    assert (p.report.longest_seq_len, p.report.longest_bound) == (seq, "positions")  # the model's, here seq
    homes = [u.checkpoint for u in p.run_plan.units[1:-1]]
    nvme = [b for b, h in enumerate(homes, 1) if h == Home.NVME]
    if nvme:  # spread evenly from the first block: each write and read gets the blocks between to hide behind
        gaps = [b - a for a, b in zip(nvme, nvme[1:])]
        assert nvme[0] == 1 and (not gaps or max(gaps) - min(gaps) <= 1)
    rest = [h for h in homes if h != Home.NVME]
    assert rest == sorted(rest, key=(Home.HOST, Home.GPU).index)  # the GPU's the last blocks
    assert all(homes.count(h) == p.memory.checkpoints[h] for h in (Home.NVME, Home.HOST))
    assert homes.count(Home.GPU) == p.memory.checkpoints[Home.GPU] > 0
    ck = seq * cfg.model.hidden_size * 4
    assert p.memory.host_total <= 115e9 and p.memory.gpu.total <= 141e9 * 0.95  # --host-gb: the process's too
    assert (
        p.memory.nvme_checkpoints >= p.memory.checkpoints[Home.NVME] * ck
        and sum(p.memory.nvme.values()) + p.memory.nvme_checkpoints <= 55e9
    )
    assert (
        f"activation checkpoints on NVMe | | {p.memory.nvme_checkpoints / 1e9:.1f} GB" in to_markdown(p)
        # llama-1b's, since blocks are tiled whole, fit the GPU and the host
    ) == bool(p.memory.checkpoints[Home.NVME])
    # their reads are priced in the backward pass
    assert (p.prediction.times["NVMe bwd"] > 0) == bool(p.memory.checkpoints[Home.NVME])
    longer = load_config(
        config,
        [
            f"train.seq_len={p.report.longest_budgets + 1024}",
            "train.batch_size=1",
            "train.micro_batch_size=1",
            f"model.max_position_embeddings={p.report.longest_budgets + 1024}",
        ],
    )
    assert not search(longer, REFERENCE, 115, 141, 55, config, advise=False).fits


def test_nvme_checkpoints_run_ahead_within_the_gpus_room(tmp_path, monkeypatch):
    """Eight blocks' checkpoints in a split plan's homes (3 on NVMe, 3 on the GPU, 2 in RAM) through a slow disk,
    in Step's order: the forward pass has more than two blocks on their way down where the room allows, the
    backward pass reads an NVMe checkpoint several blocks ahead, the GPU never holds more checkpoints than the
    plan's room (its GPU ones and one), and every block comes back bit for bit."""
    from test_attention import SlowIO

    from tiertrain.engine import activations
    from tiertrain.engine.activations import ActivationStore
    from tiertrain.engine.streams import StallClock, Streams
    from tiertrain.plan.planner import checkpoint_homes
    from tiertrain.tiers import pieces as piece_store
    from tiertrain.tiers.pieces import PieceStore

    for mod in (activations, piece_store):
        monkeypatch.setattr(mod, "CK_PIECE_BYTES", 8192)
    homes = checkpoint_homes(8, {Home.NVME: 3, Home.GPU: 3, Home.HOST: 2})
    nvme = sorted(u for u, h in homes.items() if h == Home.NVME)
    assert nvme == [1, 3, 6] and sorted(u for u, h in homes.items() if h == Home.GPU) == [5, 7, 8]
    cpu = torch.device("cpu")
    streams = Streams(cpu)
    xs = {u: [torch.randn(4 * 2048)] for u in range(1, 9)}  # 4 pieces a block
    io = SlowIO()
    # a ring of 2 buffers: a block's copies down wait for its first writes (20 ms each), so blocks 1 and 3 are
    # still on their way when block 6 is saved, whatever the threads' timing
    store = PieceStore(tmp_path, nvme, 4, io)
    acts = ActivationStore(homes, streams, StallClock(streams), cpu, False, store, pieces=2)
    assert acts.room == 4

    def held():  # checkpoints holding GPU memory: those saved, those whose copies down have not ended
        return len(acts.saved) + sum(not f.done() for f in acts.on_way)

    most_on_way = 0
    for u in range(1, 9):
        acts.save(u, xs[u])
        most_on_way = max(most_on_way, sum(not f.done() for f in acts.on_way))
        assert held() <= acts.room
    assert most_on_way == 3  # blocks 1, 3 and 6: room for them beside block 5's
    for job in acts.written.values():  # the writes landed, so the reads ahead below do not depend on timing
        for w in job.result():
            w.result()
    acts.prefetch(8)
    issued = {}
    for i in range(8, 0, -1):
        if i > 1:
            acts.prefetch(i - 1)
        issued |= {u: i for u in nvme if u in acts.saved and u not in issued}
        assert held() <= acts.room
        assert all(torch.equal(a, b) for a, b in zip(acts.get(i), xs[i]))
        acts.drop(i)
    assert issued == {6: 8, 3: 7, 1: 6}  # one block ahead would read them at blocks 7, 4 and 2
    acts.close()
    io.close()


def test_a_step_holds_no_more_checkpoints_than_the_room(token_file, tmp_path):
    """A step of a 6-block model with checkpoints on NVMe, in RAM and on the GPU, through Step.run: wherever the
    store reads one back, the checkpoints alive (saved, read back, on their way down, or still referenced by the
    step after their block's backward pass) are at most the room the plan gave the GPU."""
    import weakref

    sets = ["model.num_hidden_layers=6", "train.steps=2", 'train.compute_dtype="float32"']
    cfg = tiny_config(token_file, *sets, 'tiers.activations="nvme"', f'tiers.nvme_dir="{tmp_path}"')
    tr = Trainer(cfg)
    acts = tr.run.activations
    acts.place({1: Home.NVME, 2: Home.NVME, 3: Home.HOST, 4: Home.NVME, 5: Home.GPU, 6: Home.GPU})
    assert acts.room == 3
    given: list = []  # (block, a weak reference to a micro-batch's tensor get() handed the step)
    counts = []

    def alive() -> int:  # blocks
        held = set(acts.saved) | {u for u, r in given if r() is not None}
        return len(held) + sum(not f.done() for f in acts.on_way)

    fetch, get = acts._fetch, acts.get

    def counted_fetch(unit):
        fetch(unit)
        counts.append(alive())

    def counted_get(unit):
        xs = get(unit)
        given.extend((unit, weakref.ref(x)) for x in xs)
        counts.append(alive())
        return xs

    acts._fetch, acts.get = counted_fetch, counted_get
    for _ in range(2):
        tr.train_step()
    tr.close()
    assert counts and max(counts) <= acts.room, counts
