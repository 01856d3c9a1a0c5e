"""What a micro-batch holds on the GPU: the working set of a block's backward pass (the MLP tiled or not) and
what a kept block's autograd graph saves. Pure Python."""
from __future__ import annotations

from ..model.spec import ModelSpec

# a micro-batch's working set: WORK_H x H bytes per token and WORK_FF x FF per token of the MLP (of a tile, when
# tiled; then with its weights' gradient sums, MLP_TILE_SUMS x H x FF): a block's backward pass measured on an
# H200 at 16k-128k tokens, tiled, is 32-34.4 x H per token (dev/workset.py); untiled llama-3b at 8k 5.2 GB
WORK_H, WORK_FF, MLP_TILE_SUMS = 34.5, 16.8, 12
MLP_TILE = 8192  # tokens per MLP tile when the plan tiles it
MLP_SHARE = 1 / 8  # the plan tiles the MLP where its untiled working set would take more of the GPU budget
KEPT_SLACK = 1.05  # kept activations are many tensors: the allocator's rounding on top of their bytes


def kept_bytes_per_token(spec: ModelSpec, dtype: str) -> int:
    """GPU bytes a block's autograd graph saves per token (what keeping its activations costs): the fp32
    residual and norms (16 H), four H-wide and four FF-wide matmul inputs or outputs in the compute dtype,
    K and V, the attention's log-sum-exp per head, the RoPE tables cast per call. Counted exactly with
    saved-tensor hooks on llama.block (tests/test_keep.py checks it)."""
    w = 2 if dtype == "bfloat16" else 4
    kv = spec.n_kv_heads * spec.hd
    return (16 * spec.hidden_size + 4 * w * spec.hidden_size + 4 * w * spec.intermediate_size + 2 * w * kv
            + 4 * spec.num_attention_heads + 8 * spec.hd + 8)
