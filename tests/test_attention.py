"""The attention's kernel (train.attention, model/attention.py): the config's keys, the plan's choice and its
pricing, the probe file's tables, the deterministic backward's switch, and on a GPU every kernel against SDPA's math
backend in fp32 (alone and in a tiled block) and the deterministic ones' bits on a rerun."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time

import pytest
import torch

from conftest import tiny_config
from tiertrain.config import load_config
from tiertrain.errors import ConfigError
from tiertrain.model import tiled
from tiertrain.model.attention import _deterministic_backward, attention, usable
from tiertrain.model.llama import Context
from tiertrain.modes import DETERMINISTIC_KERNELS
from tiertrain.plan.attention import choose, deterministic_workspace, rates
from tiertrain.plan.hardware import REFERENCE, HardwareSpec
from tiertrain.plan.planner import plan
from tiertrain.plan.resolve import search
from tiertrain.plan.values import Budgets, Choice, Job
from tiertrain.trainer import Trainer

GPU = torch.cuda.is_available()


@pytest.mark.parametrize(
    "sets, match",
    [
        (['train.attention="fast"'], 'must be one of "auto", "cudnn", "flash"'),
        (["train.attention=1"], "train.attention must be a quoted string"),
        (["train.deterministic=1"], "train.deterministic must be true or false"),
        (['train.attention="cudnn"', "train.deterministic=true"], "no deterministic backward pass"),
        (['train.attention="flash"', 'train.compute_dtype="float32"'], "runs bfloat16 only"),
    ],
)
def test_bad_settings_say_what_to_change_in_one_line(sets, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config("debug", sets)
    assert "\n" not in str(e.value) and "train." in str(e.value)


def test_the_settings_parse():
    cfg = load_config("debug", ['train.attention="efficient"', "train.deterministic=true"])
    assert (cfg.train.attention, cfg.train.deterministic) == ("efficient", True)
    assert load_config("debug").train.attention == "auto" and not load_config("debug").train.deterministic


def test_the_plan_takes_the_fastest_kernel_it_may():
    """cuDNN on the reference (an H100's figures); flash where the run is deterministic (cuDNN's backward is not)
    or where it is faster; the named one; torch's own ("") on a CPU (no figures) and for fp32 compute."""
    assert choose(None, False, "bfloat16", REFERENCE) == "cudnn"
    assert choose(None, True, "bfloat16", REFERENCE) == "flash"
    assert choose("efficient", False, "bfloat16", REFERENCE) == "efficient"
    assert choose(None, False, "float32", REFERENCE) == ""
    assert choose(None, False, "bfloat16", HardwareSpec.cpu(64, 8)) == ""
    fast = dataclasses.replace(
        REFERENCE, attention_tflops={"cudnn": [600, 500, 0], "flash_attn": [700, 550, 500]}
    )
    assert choose(None, False, "bfloat16", fast) == "flash_attn" == choose(None, True, "bfloat16", fast)
    only = dataclasses.replace(REFERENCE, attention_tflops={"cudnn": [600, 500, 0]})
    assert choose(None, True, "bfloat16", only) == ""  # none deterministic measured: torch's, cuDNN excluded
    spec = load_config("llama-3b").model
    p = plan(Job(spec, 1, 8192), Budgets(host_gb=200, gpu_gb=80), REFERENCE, Choice(deterministic=True))
    assert (p.run_plan.attention, p.run_plan.deterministic) == ("flash", True)
    d = p.run_plan.to_dict()
    assert (d["attention"], d["deterministic"]) == ("flash", True)


def test_a_kernel_the_figures_lack_is_refused_before_the_run():
    cfg = load_config("llama-3b", ['train.attention="efficient"'])
    with pytest.raises(ConfigError, match='train.attention = "efficient".*"cudnn", "flash"'):
        search(cfg, REFERENCE, 200, 80, None, "x")
    cpu = HardwareSpec.cpu(64, 8)  # no figures: whatever it names goes to torch
    assert search(cfg, cpu, 200, 80, None, "x").run_plan.attention == "efficient"


def test_attention_is_priced_at_its_kernels_rate():
    """At 128k llama3.1-8b is mostly attention: its compute on flash's figures over cuDNN's is near their ratio;
    the rates scale by head size and attention_efficiency; deterministic takes the deterministic backward's."""
    spec = load_config("llama3.1-8b").model
    b, job = Budgets(host_gb=1000, gpu_gb=80), Job(spec, 1, 131072)

    def compute(**choice):
        t = plan(job, b, REFERENCE, Choice(1, **choice)).prediction.times
        return t["compute fwd"] + t["compute bwd"]

    cudnn, flash = compute(attention="cudnn"), compute(attention="flash")
    assert 1.4 < flash / cudnn < (1 / 280 + 1 / 340) / (1 / 540 + 1 / 630)
    assert compute(attention="flash", deterministic=True) > flash
    f, bw = rates("cudnn", 128, False, "bfloat16", REFERENCE)
    assert (f, bw) == pytest.approx(
        (630e12 * REFERENCE.attention_efficiency, 540e12 * REFERENCE.attention_efficiency)
    )
    assert rates("cudnn", 64, False, "bfloat16", REFERENCE)[0] == pytest.approx(f * 0.72)
    assert rates("flash", 128, True, "bfloat16", REFERENCE)[1] == pytest.approx(
        252e12 * REFERENCE.attention_efficiency
    )
    assert (
        rates("cudnn", 128, False, "float32", REFERENCE)
        == (0.0, 0.0)
        == rates("", 128, False, "bfloat16", REFERENCE)
    )


def test_flash_deterministic_dq_buffers_are_in_the_working_set():
    """FlashAttention 2's deterministic backward: one fp32 dQ buffer per ceil(SMs / heads) split."""
    spec = load_config("llama3.1-8b").model
    b, job = Budgets(host_gb=1000, gpu_gb=80), Job(spec, 1, 131072)
    fast = plan(job, b, REFERENCE, Choice(1, attention="flash"))
    det = plan(job, b, REFERENCE, Choice(1, attention="flash", deterministic=True))
    extra = (math.ceil(132 / 4) - 1) * 4 * 131072 * 128 * 4  # a tiled block: a group of 4 query heads
    assert det.memory.gpu.working - fast.memory.gpu.working == pytest.approx(extra)
    assert deterministic_workspace("efficient", True, spec, 131072, True, REFERENCE) == 0


def test_the_checkpoint_writer_is_priced_and_sized_from_the_probe():
    """Checkpoints on NVMe: the forward pass waits for their writes at the writer's probed rate; the ring the plan
    counts in host memory is its pieces in flight."""
    spec = load_config("llama3.1-8b").model
    b, job = Budgets(host_gb=120, gpu_gb=80, nvme_gb=200), Job(spec, 1, 131072)
    choice = Choice(1, activations="nvme", keep=0)
    slow = dataclasses.replace(REFERENCE, ck_write_gbs=0.5, ck_pieces=12)
    p, q = plan(job, b, REFERENCE, choice), plan(job, b, slow, choice)
    ck = p.memory.nvme_checkpoints
    assert p.prediction.times["NVMe checkpoints fwd"] == pytest.approx(ck / 2.5e9)
    assert q.prediction.times["NVMe checkpoints fwd"] == pytest.approx(ck / 0.5e9)
    assert q.prediction.step_s > p.prediction.step_s and q.prediction.bottleneck == "NVMe"
    assert (p.run_plan.ck_pieces, q.run_plan.ck_pieces) == (8, 12)
    assert q.memory.host_checkpoints - p.memory.host_checkpoints == 4 * (64 << 20)


@pytest.mark.parametrize(
    "table",
    [
        {"attention_tflops": {"cudnn": [600]}},
        {"attention_tflops": {"triton": [600, 500, 0]}},
        {"attention_tflops": {"flash": [600, -1, 0]}},
        {"attention_head_scale": {"x": 1.0}},
        {"ck_pieces": 0},
    ],
)
def test_a_probe_files_bad_tables_are_refused(tmp_path, table):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({**dataclasses.asdict(REFERENCE), **table}))
    with pytest.raises(ConfigError, match="hardware file") as e:
        HardwareSpec.load(path)
    assert "\n" not in str(e.value)


def test_an_older_probe_file_plans_on_the_reference_kernels(tmp_path):
    old = {k: v for k, v in dataclasses.asdict(REFERENCE).items() if not k.startswith(("attention", "ck_"))}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({**old, "attention_speed": {"128": 1.24}}))
    hw = HardwareSpec.load(path)
    assert hw.attention_tflops == REFERENCE.attention_tflops and hw.ck_pieces == 8


def _qkv(heads, kv, t, hd, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randn(1, n, t, hd, generator=g, device=device).to(dtype).requires_grad_()
        for n in (heads, kv, kv)
    ]


def test_kernels_on_a_cpu_match_torchs_own_choice():
    """math (its key/value heads repeated by an expand) and flash (SDPA's CPU kernel) against torch's own call,
    causal with GQA, forward and backward."""
    assert "math" in usable(torch.device("cpu"), 16, 4, 2, torch.float32)
    assert "cudnn" not in usable(torch.device("cpu"), 16, 4, 2, torch.float32)
    q, k, v = _qkv(4, 2, 24, 16, torch.float32, "cpu")
    ref = attention(q, k, v)
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for kernel in ("math", "flash"):
        o = attention(q, k, v, kernel, deterministic=True)  # a no-op on a CPU: deterministic as it is
        got = torch.autograd.grad(o.square().sum(), (q, k, v))
        assert torch.allclose(o, ref, atol=1e-6)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))


def test_the_deterministic_mode_holds_while_the_kernels_backward_runs_alone():
    """_deterministic_backward's hooks: torch's deterministic mode on while the attention node runs, off before and
    after (nothing else of a step is held to it)."""
    q, k, v = _qkv(4, 2, 24, 16, torch.float32, "cpu")
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    node = o.grad_fn
    assert "Attention" in node.name()
    _deterministic_backward(o)
    seen = []
    node.register_prehook(lambda g: seen.append(torch.are_deterministic_algorithms_enabled()))
    assert not torch.are_deterministic_algorithms_enabled()
    o.sum().backward()
    assert seen == [True] and not torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory


def test_a_cpu_run_takes_torchs_own_kernel(token_file):
    tr = Trainer(tiny_config(token_file, "train.steps=1"))
    assert tr.run_plan.attention == "" and tr.run.step.ctx.attention == ""
    tr.close()


# ---- on a GPU --------------------------------------------------------------------------------------------------
def _kernels(hd=128, heads=8, kv=2):
    return usable(torch.device("cuda"), hd, heads, kv, torch.bfloat16) if GPU else []


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.gpu
def test_every_kernel_matches_the_math_backend_in_fp32():
    """Causal, GQA 8/2 heads of 128, 2048 tokens: each kernel in bf16 against SDPA's math backend in fp32 on the
    same bf16-rounded inputs, forward and backward: within bf16's rounding (2^-8; on a CPU flash's bf16 dK is off
    by 7e-3 in norm, math's by 2e-3)."""
    kernels = _kernels()
    assert {"flash", "efficient", "math"} <= set(kernels)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert "cudnn" in kernels
    q, k, v = _qkv(8, 2, 2048, 128, torch.bfloat16, "cuda")
    do = torch.randn_like(q)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attention(q32, k32, v32, "math")
    want = torch.autograd.grad(ref, (q32, k32, v32), do.float())
    for kernel in kernels:
        for det in (False, True) if kernel in DETERMINISTIC_KERNELS else (False,):
            o = attention(q, k, v, kernel, det)
            got = torch.autograd.grad(o, (q, k, v), do)
            assert o.dtype == torch.bfloat16 and _rel(o, ref) < 1e-2, kernel
            for name, a, b in zip("qkv", got, want):
                assert _rel(a, b) < 3e-2, (kernel, det, name)


@pytest.mark.gpu
def test_every_kernel_in_the_tiled_block_matches_the_math_backend_in_fp32():
    """A tiled GQA block (8/2 heads of 128, 2 x 1024 tokens in tiles of 512) in bf16 on each kernel against the
    same block in fp32 on the math backend, its weights and input the bf16-rounded ones: output, input gradient
    and every weight's gradient within bf16 training's rounding."""
    spec = load_config(
        "debug",
        [
            "model.hidden_size=1024",
            "model.num_attention_heads=8",
            "model.num_key_value_heads=2",
            "model.intermediate_size=2048",
            "model.max_position_embeddings=1024",
        ],
    ).model
    torch.manual_seed(0)
    w = {
        t.name: (
            torch.randn(t.shape, device="cuda") * 0.03
            if len(t.shape) > 1
            else torch.ones(t.shape, device="cuda")
        ).bfloat16()
        for t in spec.units()[1].tensors
    }
    x = torch.randn(2, 1024, spec.hidden_size, device="cuda").bfloat16().float()
    g = torch.randn_like(x).bfloat16().float()

    def run(dtype, kernel, det=False):
        ctx = Context.build(spec, 1024, dtype, torch.device("cuda"), 512, kernel, det)
        ws = {n: t.to(dtype) for n, t in w.items()}
        accs = {n: torch.zeros(t.shape, device="cuda") for n, t in w.items()}
        with torch.no_grad():
            y = tiled.forward(ws, x, ctx)
        return y, tiled.backward(ws, accs, x, g.clone(), ctx), accs

    y32, gx32, acc32 = run(torch.float32, "math")
    for kernel in _kernels():
        for det in (False, True) if kernel in DETERMINISTIC_KERNELS else (False,):
            y, gx, accs = run(torch.bfloat16, kernel, det)
            assert _rel(y - x, y32 - x) < 3e-2 and _rel(gx - g, gx32 - g) < 5e-2, (kernel, det)
            for n in w:
                assert _rel(accs[n], acc32[n]) < 5e-2, (kernel, det, n)


@pytest.mark.gpu
def test_deterministic_kernels_give_the_same_bits_on_a_rerun():
    """At 8k tokens (32/8 heads of 128), where flash's and cuDNN's ordinary dQ differ run to run: every kernel with a
    deterministic backward, run deterministically twice, gives the same output, dQ, dK and dV bits."""
    for kernel in sorted(set(_kernels(128, 32, 8)) & DETERMINISTIC_KERNELS - {"math"}):
        runs = []
        for _ in range(2):
            q, k, v = _qkv(32, 8, 8192, 128, torch.bfloat16, "cuda", seed=1)
            o = attention(q, k, v, kernel, deterministic=True)
            runs.append([o.detach(), *torch.autograd.grad(o, (q, k, v), torch.ones_like(o))])
            del q, k, v, o
        for name, a, b in zip(("out", "dq", "dk", "dv"), *runs):
            assert torch.equal(a, b), (kernel, name)


@pytest.mark.gpu
def test_a_gpu_run_takes_the_plans_kernel_and_deterministic_runs_repeat_their_bits(token_file):
    """On a GPU with no probe file: cuDNN's kernel on Hopper, flash elsewhere; train.deterministic: flash, and
    two runs of a tiled bf16 model give the same bits."""
    sets = [
        'train.device="cuda"',
        'train.compute_dtype="bfloat16"',
        "train.steps=3",
        "train.seq_len=512",
        "model.max_position_embeddings=512",
        "train.tile_tokens=256",
        "model.head_dim=64",
    ]
    tr = Trainer(tiny_config(token_file, *sets))
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert tr.run_plan.attention == ("cudnn" if hopper else "flash") == tr.run.step.ctx.attention
    tr.close()
    runs = []
    for _ in range(2):
        tr = Trainer(tiny_config(token_file, *sets, "train.deterministic=true"))
        assert (tr.run_plan.attention, tr.run.step.ctx.deterministic) == ("flash", True)
        losses = [tr.train_step()["loss"] for _ in range(3)]
        runs.append((losses, tr.state_dict()))
        tr.close()
    (la, sa), (lb, sb) = runs
    assert la == lb and all(torch.equal(sa[n], sb[n]) for n in sa)


# ---- the NVMe checkpoints' writer -------------------------------------------------------------------------------
class SlowIO:
    """POSIX I/O whose writes each take 20 ms more, or with a `target` wait until that many writes are in flight
    (at most a second: the last ones of a save), counting how many are in flight at once; with a target a busy
    machine cannot make the writer look shallower."""

    def __init__(self, target: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        from tiertrain.tiers.nvme import PosixIO

        self.inner, self.pool = PosixIO(4), ThreadPoolExecutor(16)
        self.now = self.most = 0
        self.target = target
        self.cond = threading.Condition()

    def write(self, path, buf):
        with self.cond:
            self.now += 1
            self.most = max(self.most, self.now)
            self.cond.notify_all()

        def slow():
            if self.target is None:
                time.sleep(0.02)
            else:
                with self.cond:
                    self.cond.wait_for(lambda: self.now >= self.target, timeout=1.0)
            self.inner.write(path, buf).result()
            with self.cond:
                self.now -= 1

        return self.pool.submit(slow)

    def read(self, path, buf):
        return self.inner.read(path, buf)

    def close(self):
        self.pool.shutdown(wait=True)
        self.inner.close()


@pytest.mark.parametrize("pieces", [1, 3, 6])
def test_the_checkpoint_writer_keeps_its_pieces_in_flight_and_the_bits(tmp_path, monkeypatch, pieces):
    """A block's checkpoint in 10 pieces through a ring of `pieces` buffers: that many disk writes in flight at once
    (never more: the ring's buffers), and read back bit for bit, in fp32 and in bf16."""
    from tiertrain.engine import activations
    from tiertrain.engine.activations import ActivationStore
    from tiertrain.engine.streams import StallClock, Streams
    from tiertrain.modes import Home
    from tiertrain.tiers import pieces as piece_store
    from tiertrain.tiers.pieces import PieceStore

    for mod in (activations, piece_store):
        monkeypatch.setattr(mod, "CK_PIECE_BYTES", 8192)
    cpu = torch.device("cpu")
    streams = Streams(cpu)
    for dtype in (torch.float32, torch.bfloat16):
        xs = [torch.randn(2, 5 * 2048 // 2).float() for _ in range(2)]  # 2 micro-batches of 5 pieces in fp32
        per_row = -(-xs[0].numel() * dtype.itemsize // 8192)
        io = SlowIO(min(pieces, 2 * per_row))
        store = PieceStore(tmp_path / str(dtype), [1], 2 * per_row, io)
        acts = ActivationStore({1: Home.NVME}, streams, StallClock(streams), cpu, False, store, dtype, pieces)
        acts.save(1, xs)
        got = acts.get(1)
        assert all(torch.equal(g, x.to(dtype).float()) for g, x in zip(got, xs))
        assert io.most == min(pieces, 2 * per_row) and acts.write_rate() > 0
        acts.close()


def test_a_kernel_that_cannot_run_here_is_refused_before_anything_is_allocated(token_file):
    with pytest.raises(
        ConfigError, match='train.attention = "cudnn" cannot run this model here.*"math"'
    ) as e:
        Trainer(tiny_config(token_file, 'train.attention="cudnn"', 'train.compute_dtype="bfloat16"'))
    assert "\n" not in str(e.value)
    tr = Trainer(tiny_config(token_file, 'train.attention="math"', "train.steps=1"))
    assert tr.run_plan.attention == "math" == tr.run.step.ctx.attention
    tr.train_step()
    tr.close()
