"""Causal attention in the plan: the kernel a run takes (train.attention, "auto": the plan's), the rate the step's
attention runs at with it, and the GPU memory its deterministic backward adds. The kernels themselves are
model/attention.py's. Pure Python.

The rates are in the model's FLOPs (spec.attention_flops_per_token: forward QK^T and AV over the causal half, the
backward counted as twice the forward), as `tiertrain probe` measures them (HardwareSpec.attention_tflops)."""

from __future__ import annotations

import math

from ..errors import ConfigError
from ..model.spec import ModelSpec
from ..modes import DETERMINISTIC_KERNELS, KEEPING_KERNELS
from .hardware import HardwareSpec
from .runplan import WIDTH


def backward_tflops(figures: list[float], deterministic: bool) -> float:
    """A kernel's backward TFLOP/s from its figures [forward, backward, deterministic backward]: the deterministic
    one where asked and measured, else its own (0: it has no deterministic backward: see choose)."""
    if deterministic and len(figures) > 2 and figures[2]:
        return figures[2]
    return figures[1]


def choose(wanted: str | None, deterministic: bool, dtype: str, hw: HardwareSpec) -> str:
    """The kernel of a run: `wanted` (the config's; None: "auto"), else the fastest of those `hw` has figures for
    (a step runs the attention's forward twice, its backward once), of those with a deterministic backward where
    `deterministic`; "": torch's own choice, where none is measured (a CPU) or the compute is fp32 (the fast
    kernels run bf16 only)."""
    if wanted:
        return wanted
    if dtype != "bfloat16":
        return ""
    cands = {
        k: (r[0], backward_tflops(r, deterministic))
        for k, r in sorted(hw.attention_tflops.items())
        if not deterministic or k in DETERMINISTIC_KERNELS
    }
    cands = {k: (f, b) for k, (f, b) in cands.items() if f > 0 and b > 0}
    if not cands:
        return ""
    return min(cands, key=lambda k: 2 / cands[k][0] + 2 / cands[k][1])


def check(wanted: str | None, dtype: str, hw: HardwareSpec) -> None:
    """A named kernel the figures know, where they know any (a probe's, or the reference's limited to the kernels
    that run this model on this GPU): said before anything is allocated."""
    if wanted and dtype == "bfloat16" and hw.attention_tflops and wanted not in hw.attention_tflops:
        have = ", ".join(f'"{k}"' for k in sorted(hw.attention_tflops))
        raise ConfigError(
            f'train.attention = "{wanted}": this machine\'s figures ({hw.source}) have no such kernel for this '
            f'model (they have {have}); set train.attention to one of them, or "auto"'
        )


def rates(
    kernel: str, head_dim: int, deterministic: bool, dtype: str, hw: HardwareSpec
) -> tuple[float, float]:
    """FLOP/s (forward, backward) of a step's attention with `kernel`: its figures at the nearest head size, at
    hw.attention_efficiency; (0, 0) where there are none (torch's own choice, fp32 compute, a kernel not measured):
    the attention is then priced at the matmuls' rate."""
    r = hw.attention_tflops.get(kernel) if dtype == "bfloat16" else None
    if not r or not hw.attention_head_scale:
        return 0.0, 0.0
    near = min(hw.attention_head_scale, key=lambda k: abs(int(k) - head_dim))
    scale = hw.attention_head_scale[near] * hw.attention_efficiency * 1e12
    return r[0] * scale, backward_tflops(r, deterministic) * scale


def check_kept(wanted: int | None, kernel: str, job, unified: bool) -> None:
    """train.keep_attention, where the config names a number, against what can keep attention outputs bit for bit
    (model/attention.Kept): said in one line before anything is allocated."""
    if not wanted:
        return
    why = None
    if unified and kernel:
        why = f'on a CPU only torch\'s own choice keeps them, not "{kernel}"; set train.attention = "auto"'
    elif not unified and kernel not in KEEPING_KERNELS:
        name = f'"{kernel}"' if kernel else "torch's own choice"
        why = f'the attention kernel ({name}) has no ops that keep them; set train.attention = "cudnn" or "flash"'
    elif not keeps_outputs(kernel, unified, job.spec.hd):
        why = f"the head size ({job.spec.hd}) is not a multiple of 8, which SDPA pads first"
    elif not keeping_blocks(job.spec, job.seq_len):
        why = "no block of this model attends causally over the whole row (sinks, or windows shorter than it)"
    elif job.segmented:
        why = "the rows hold several segments (data.document_mask, or packed samples), attended to apart"
    if why:
        raise ConfigError(
            f'train.keep_attention = {wanted}: {why}; or set train.keep_attention to 0 or "auto"'
        )


def keeps_outputs(kernel: str, unified: bool, head_dim: int) -> bool:
    """Whether a run's attention can keep its outputs for the recompute (model/attention.keeps): SDPA's cuDNN or
    flash kernel on a GPU, at a head size SDPA passes as it is (a multiple of 8), or torch's own choice on a CPU
    (its flash kernel; `unified`: the device is the host)."""
    if unified:
        return not kernel
    return kernel in KEEPING_KERNELS and head_dim % 8 == 0


def keeping_blocks(spec: ModelSpec, seq_len: int) -> list[int]:
    """The blocks (unit indices) whose attention may keep its outputs: causal over the whole row, no window shorter
    than it, no sinks (model/llama.attention)."""
    if spec.attention_sinks:
        return []
    return [b + 1 for b in range(spec.num_hidden_layers) if (spec.window(b) or seq_len) >= seq_len]


def attention_out_bytes(spec: ModelSpec, dtype: str) -> int:
    """GPU bytes a kept attention output takes per token: the output in the compute dtype and a log-sum-exp per
    head in fp32."""
    return spec.num_attention_heads * (spec.hd * WIDTH[dtype] + 4)


def kv_graph(kernel: str, deterministic: bool, dtype: str, spec: ModelSpec) -> str:
    """How a block's graph on a GPU holds the attention (model/attention.py): "native" (the kernel takes fewer key/
    value heads as they are), "repeated" (K and V repeated for every query head first: the efficient kernel, or a
    deterministic run of torch's choice), "math" (SDPA's math kernel: K and V repeated, and the softmax's weights,
    heads x T x T, materialized; named, or torch's choice for fp32 compute with GQA, which no fast kernel takes)."""
    gqa = spec.n_kv_heads != spec.num_attention_heads
    if kernel == "math" or (not kernel and dtype == "float32" and gqa and not deterministic):
        return "math"
    return "repeated" if gqa and (kernel == "efficient" or (not kernel and deterministic)) else "native"


def deterministic_workspace(
    kernel: str, deterministic: bool, spec: ModelSpec, tokens: int, tiled: bool, hw
) -> float:
    """GPU bytes flash's deterministic backward adds to a block's working set: FlashAttention 2 accumulates dQ in
    fp32 in one buffer per group of SMs, ceil(SMs / heads) of them (its `nsplits`; the heads: a key/value head's
    group of query heads in a tiled block, all of them in an untiled one) where its ordinary backward keeps one."""
    if not deterministic or kernel not in ("flash", "flash_attn"):
        return 0.0
    heads = spec.num_attention_heads // spec.n_kv_heads if tiled else spec.num_attention_heads
    splits = math.ceil(hw.gpu_sms / heads)
    return (splits - 1) * heads * tokens * spec.hd * 4
