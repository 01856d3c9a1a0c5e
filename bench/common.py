"""What every benchmark shares: the one subprocess runner, the commit a result was made at, random batches."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def commit() -> dict:
    """{"commit", "dirty"} of the tree a result is made from. On a machine whose copy of the tree carries no
    history of its own (the device machine), BENCH_COMMIT says the commit, and the tree counts as that commit's
    only if BENCH_DIRTY is "0"."""
    if os.environ.get("BENCH_COMMIT"):
        return {"commit": os.environ["BENCH_COMMIT"], "dirty": os.environ.get("BENCH_DIRTY", "1") != "0"}

    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def run_worker(module: str, tag: str, args: list[str], out: Path, timeout: int, errors: dict[str, str]):
    """`python -m module --worker ... --json FILE`, in its own process (peak RSS and GPU memory are per process);
    its JSON output, or None with the reason under `tag` in `errors`. The log stays in out/.<tag>.log."""
    js = out / f".{tag}.json"
    cmd = [sys.executable, "-m", module, *args, "--json", str(js)]
    t0, code = time.perf_counter(), None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        ok, log, code = r.returncode == 0 and js.exists(), r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        ok, log = False, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    (out / f".{tag}.log").write_text(log if isinstance(log, str) else str(log))
    print(f"{tag}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s", flush=True)
    if not ok:
        # a negative code is the signal that ended it (-9: the kernel's OOM killer, which leaves no traceback)
        errors[tag] = (
            f"exit {code}: " * (code is not None) + (log.strip().splitlines() or ["no output"])[-1][:300]
        )
        return None
    data = json.loads(js.read_text())
    js.unlink()
    return data


def batch(B: int, S: int, V: int, seed: int):
    """A (B, S) batch of random tokens and its targets, the same for every system."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, V, (B, S + 1), generator=g)
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()


def peak_rss_gb() -> float:
    """This process's peak RSS. Linux's VmHWM, not ru_maxrss: exec carries the parent's peak into ru_maxrss, so a
    worker started from a large process would report its parent's memory."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) * 1024 / 1e9
    except (OSError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def reference_model(spec, checkpointing: bool):
    """The all-in-GPU and DeepSpeed baselines' model: forward(inputs, targets) -> the summed token loss. A dense
    model is tiertrain's ReferenceLM (transformers' math); a mixture of experts is transformers' own class (its
    grouped-GEMM experts), with its load-balancing loss where the config turns it on, as tiertrain trains it."""
    if not spec.is_moe:
        from tiertrain.model.reference import ReferenceLM

        return ReferenceLM(spec, checkpoint_layers=checkpointing)
    return _hf_loss(spec, checkpointing)


def _hf_loss(spec, checkpointing: bool):
    """A transformers mixture of experts as a module whose forward gives the summed token loss."""
    import torch
    import torch.nn.functional as F
    import transformers

    from tiertrain.model.hf import hf_config

    conf = hf_config(spec, "bfloat16")
    conf.pop("torch_dtype")
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**conf),
        attn_implementation="eager" if spec.model_type == "gpt_oss" else "sdpa",
        dtype=torch.float32,
    )
    if checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.config.use_cache = False
    coef = spec.router_aux_loss_coef if spec.output_router_logits else 0.0

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf

        def forward(self, inp, tgt):
            out = self.hf(input_ids=inp, output_router_logits=bool(coef))
            ce = F.cross_entropy(out.logits.float().flatten(0, 1), tgt.flatten(), reduction="sum")
            return ce + coef * out.aux_loss * tgt.numel() if coef else ce

    return Loss()
