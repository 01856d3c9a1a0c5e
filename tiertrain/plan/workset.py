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
    return (
        8 * spec.hidden_size
        + 4 * w * spec.hidden_size
        + 4 * w * spec.mlp_width
        + 2 * w * kv_heads * spec.hd
        + 8 * spec.hd
        + 8
        + (4 * heads * seq_len if kv == "math" else 4 * heads)
    )


def working_set(spec: ModelSpec, dtype: str, tokens: int, tile: int) -> float:
    """GPU bytes a micro-batch of `tokens` needs beyond its checkpoints and its gradient, in a block's backward
    pass: untiled, or over tiles of `tile` tokens (0: untiled)."""
    H, FF = spec.hidden_size, spec.mlp_width
    if not tile or tokens <= tile:
        return WORK_H * H * tokens + WORK_FF * FF * tokens
    w = WIDTH[dtype]
    held = w * spec.hd * (TILED_Q * spec.num_attention_heads + TILED_KV * spec.n_kv_heads)
    return held * tokens + (WORK_H * H + WORK_FF * FF) * tile + TILE_SUMS * H * FF
