"""What a micro-batch holds on the GPU: the working set of a block's backward pass (tiled or not) and what a
kept block's autograd graph saves. Pure Python."""

from __future__ import annotations

from ..model.spec import ModelSpec
from .runplan import WIDTH

# an untiled micro-batch's working set: WORK_H x H bytes per token and WORK_FF x FF per token of the MLP
# (untiled llama-3b at 8k: 5.2 GB on an H200, dev/workset.py); a tiled one's is that of one tile, with its
# weights' gradients (TILE_SUMS x H x FF), and per token of the whole sequence what model/tiled.py holds
# across the attention: TILED_Q x (heads x hd) + TILED_KV x (kv heads x hd) compute-dtype elements
WORK_H, WORK_FF, TILE_SUMS = 34.5, 16.8, 12
TILED_Q, TILED_KV = 3.5, 4
TILE = 8192  # tokens per tile when the plan tiles a block
# the plan tiles blocks where the untiled MLP's working set would take more of the GPU budget
MLP_SHARE = 1 / 8
KEPT_SLACK = 1.05  # kept activations are many tensors: the allocator's rounding on top of their bytes
# SDPA's math kernel (fp32 GQA): bytes per head per token per token of the sequence at the peak of a block's
# backward pass, four fp32 (T x T) tensors a head untiled, three a head of the group that runs in a tiled block
# (llama-1b at 4k-16k on an H200, dev/workset.py: bench/results/2026-11-27-H200-math-attention.md)
MATH_WORK, MATH_GROUP = 16, 12


def kept_bytes_per_token(spec: ModelSpec, dtype: str, kv: str = "native", seq_len: int = 0) -> int:
    """GPU bytes a block's autograd graph saves per token (what keeping its activations costs): the fp32
    residual into each norm (8 H: torch's fused RMSNorm on a GPU saves its input and a scale per token), four
    H-wide and four FF-wide matmul inputs or outputs in the compute dtype, K and V, the attention's log-sum-exp
    per head, the RoPE tables. Counted exactly with saved-tensor hooks on llama.block on a GPU
    (tests/test_keep.py checks it; on a CPU the composite norms save 8 H more). `kv`: how the attention holds K
    and V (plan.attention.kv_graph): repeated for every query head, or by the math kernel, which also saves the
    softmax's weights, 4 x heads x seq_len bytes a token, and no log-sum-exp."""
    w, heads = WIDTH[dtype], spec.num_attention_heads
    kv_heads = spec.n_kv_heads if kv == "native" else heads
    # the math kernel: its softmax's weights in fp32, and q, k and v in fp32 copies where the compute is bf16
    math = 4 * heads * seq_len + 3 * (4 - w) * heads * spec.hd
    return (
        8 * spec.hidden_size
        + 4 * w * spec.hidden_size
        + 4 * w * spec.mlp_width
        + 2 * w * kv_heads * spec.hd
        + 8 * spec.hd
        + 8
        + (math if kv == "math" else 4 * heads)
    )


def working_set(spec: ModelSpec, dtype: str, tokens: int, tile: int, math_len: int = 0) -> float:
    """GPU bytes a micro-batch of `tokens` needs beyond its checkpoints and its gradient, in a block's backward
    pass: untiled, or over tiles of `tile` tokens (0: untiled). `math_len`: the sequences' length where SDPA's
    math kernel runs the attention (plan.attention.kv_graph), whose weights grow with its square."""
    H, FF, heads = spec.hidden_size, spec.mlp_width, spec.num_attention_heads
    if not tile or tokens <= tile:
        return (WORK_H * H + WORK_FF * FF + MATH_WORK * heads * math_len) * tokens
    w = WIDTH[dtype]
    held = w * spec.hd * (TILED_Q * heads + TILED_KV * spec.n_kv_heads)
    # a tiled block keeps every head group's graph, its fp32 weights, through the output's tiles, then takes a
    # group's backward at a time
    math = (4 * heads + MATH_GROUP * heads // spec.n_kv_heads) * math_len
    return (held + math) * tokens + (WORK_H * H + WORK_FF * FF) * tile + TILE_SUMS * H * FF
