"""The baselines of bench.pipeline, each run in its own process: all-in-GPU PyTorch (model/reference.py's model,
torch's fused AdamW) and DeepSpeed ZeRO-3 with CPU offload, with the same mixed precision, clipping and attention
kernel as tiertrain; and the row every system's run makes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from statistics import median

from bench.common import batch, peak_rss_gb, reference_model

BASELINES = {
    "gpu": "all-in-GPU PyTorch",
    "gpu-nockpt": "all-in-GPU PyTorch, no activation checkpointing",
    "deepspeed": "DeepSpeed ZeRO-3 offload CPU",
}


def result_row(
    system: str,
    kind: str,
    B: int,
    S: int,
    times: list[float],
    gpu_peak: float,
    flops_per_token: float,
    **extra,
) -> dict:
    t = median(times)
    return {
        "system": system,
        "kind": kind,
        "batch": B,
        "tokens": B * S,
        "step_s": t,
        "tokens_per_s": B * S / t,
        "model_tflops": flops_per_token * B * S / t / 1e12,
        "gpu_peak_gb": gpu_peak,
        "host_peak_rss_gb": peak_rss_gb(),
        **extra,
    }


def _timed(a, B: int, S: int, V: int, step) -> tuple[list[float], float]:
    """Runs step(inputs, targets) on the GPU warm-up + timed times; (timed seconds, peak GPU GB of those)."""
    import torch

    times, peaks = [], []
    for k in range(a.warmup + a.steps):
        inp, tgt = (t.cuda() for t in batch(B, S, V, k))
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(inp, tgt)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated() / 1e9)
    return times[a.warmup :], max(peaks[a.warmup :])


def attention_kernel(a, cfg) -> str:
    """The attention kernel tiertrain's plan takes for this config on this GPU, with the figures it plans with
    (--hardware): the one the all-in-GPU baseline runs too, so that the ratio compares the rest."""
    import torch

    from tiertrain.plan.attention import choose
    from tiertrain.probe import run_hardware
    from tiertrain.sections import fixed

    tc = cfg.train
    hw = run_hardware(
        torch.device("cuda"), a.hardware and Path(a.hardware), "auto", cfg.model, "bfloat16", tc.attention
    )
    return choose(fixed(tc.attention), tc.deterministic, "bfloat16", hw)


def run_gpu(a, checkpointing: bool = True) -> list[dict]:
    import torch

    from tiertrain.config import load_config
    from tiertrain.model.attention import backends

    cfg = load_config(a.config)
    spec, S = cfg.model, cfg.train.seq_len
    kernel = attention_kernel(a, cfg)
    kernel = "" if kernel == "flash_attn" else kernel  # SDPA's only: ReferenceLM calls SDPA
    with torch.device("cuda"):
        model = reference_model(spec, checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step(inp, tgt):
        opt.zero_grad(set_to_none=True)
        for m in range(0, inp.shape[0], a.micro):
            # the backward pass recomputes checkpointed layers: the kernel holds there too
            with backends(kernel):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(inp[m : m + a.micro], tgt[m : m + a.micro]) / tgt.numel()
                loss.backward()
        if a.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()

    rows = []
    for B in a.batches:
        times, peak = _timed(a, B, S, spec.vocab_size, step)
        kind = "gpu" if checkpointing else "gpu-nockpt"
        rows.append(
            result_row(BASELINES[kind], kind, B, S, times, peak, spec.flops_per_token(S), attention=kernel)
        )
    return rows


def deepspeed_config(a, nvme_dir: str | None = None) -> dict:
    pin = not getattr(a, "ds_unpinned", False)  # bench.nvme has no such flag
    opt_off = {"device": "cpu", "pin_memory": pin}
    if nvme_dir:
        opt_off = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True, "buffer_count": 4}
    return {
        "train_batch_size": max(a.batches),
        "train_micro_batch_size_per_gpu": a.micro,
        "gradient_accumulation_steps": max(a.batches) // a.micro,
        "bf16": {"enabled": True},
        "gradient_clipping": getattr(a, "grad_clip", 1.0),
        "steps_per_print": 10**9,
        # the engine switches off an outer torch.autocast unless its own section asks for one
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": pin},
            "offload_optimizer": opt_off,
            "overlap_comm": True,
            "contiguous_gradients": True,
            # ZeRO-3's own F.linear ignores autocast; the plain one runs the same math
            # as the other systems
            "memory_efficient_linear": False,
        },
    }


def run_deepspeed(a, nvme_dir: str | None = None) -> list[dict]:
    for k, v in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29533"),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(k, v)
    import deepspeed
    import torch

    from tiertrain.config import load_config

    spec = load_config(a.config).model
    S = load_config(a.config).train.seq_len
    deepspeed.init_distributed()
    conf = deepspeed_config(a, nvme_dir)
    t0 = time.perf_counter()
    # each parameter partitioned to the host as it is made: a whole fp32 model beside ZeRO's own copies
    # does not fit the host's RAM from about 5B parameters on a 128 GiB machine
    pin = conf["zero_optimization"]["offload_param"]["pin_memory"]
    with deepspeed.zero.Init(config_dict_or_path=conf, remote_device="cpu", pin_memory=pin):
        model = reference_model(spec, checkpointing=True)
    if spec.is_moe:  # ZeRO-3 gathers an MoE block's experts whole: its hooks never wait on an idle expert
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(
            model, [type(m) for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
        )
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    setup_s = time.perf_counter() - t0

    def step(inp, tgt):
        for m in range(0, inp.shape[0], a.micro):
            # DeepSpeed's bf16 holds the weights in bf16 but does not cast activations: autocast does
            # (configured in torch_autocast), so all three systems run the same mixed-precision math
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = engine(inp[m : m + a.micro], tgt[m : m + a.micro]) / (a.micro * S)
            engine.backward(loss)
            engine.step()

    rows = []
    for B in a.batches:
        engine.set_train_batch_size(B)
        times, peak = _timed(a, B, S, spec.vocab_size, step)
        name = "DeepSpeed ZeRO-3 offload " + ("optimizer->NVMe" if nvme_dir else "CPU")
        rows.append(
            result_row(name, "deepspeed", B, S, times, peak, spec.flops_per_token(S), setup_s=setup_s)
        )
    return rows
