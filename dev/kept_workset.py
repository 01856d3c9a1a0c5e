"""Measures what a kept block (train.keep_activations) holds on the GPU beside the planner's figures: its graph, as
engine/keep.forward builds it (untiled, whatever the plan's tile), against kept_bytes_per_token; then its backward
pass's peak above that graph, as engine/keep.backward runs it, in H-wide bytes per token (plan/kept.py's
KEPT_WORK_H), beside the tiled working set the plan prices a recomputed block at. One line per (config, tokens).
    python dev/kept_workset.py configs/llama3.1-8b.toml TOKENS...      (bf16, the plan's tile: 8192)"""

import sys

import torch
from block_kernels import block_weights  # dev/, the script's own directory

from tiertrain.config import load_config
from tiertrain.model import llama
from tiertrain.model.llama import Context
from tiertrain.plan.workset import KEPT_SLACK, TILE, kept_bytes_per_token, working_set

cfg_path = sys.argv[1]
spec = load_config(cfg_path).model
dev, dt = torch.device("cuda"), torch.bfloat16
w, _ = block_weights(spec, dev, dt)
H = spec.hidden_size
for tokens in map(int, sys.argv[2:]):
    spec.max_position_embeddings = max(spec.max_position_embeddings, tokens)
    ctx = Context.build(spec, tokens, dt, dev)
    x = torch.randn(1, tokens, H, device=dev)
    g = torch.randn_like(x)
    leaves = {n: v.detach().requires_grad_() for n, v in w.items()}
    xr = x.detach().requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.enable_grad():
        y = llama.block(leaves, xr, ctx)  # the graph and its fp32 output, held until the backward pass
    graph = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = torch.autograd.grad(y, [xr, *leaves.values()], g)
    torch.cuda.synchronize()
    bwd = torch.cuda.max_memory_allocated() - base
    model = KEPT_SLACK * kept_bytes_per_token(spec, "bfloat16") * tokens
    tiled = working_set(spec, "bfloat16", tokens, TILE)
    print(
        f"{cfg_path} tokens {tokens}: graph + output {graph / 1e9:.2f} GB (kept_bytes_per_token x slack "
        f"{model / 1e9:.2f}, output {tokens * H * 4 / 1e9:.2f}); backward above it {bwd / 1e9:.2f} GB "
        f"({bwd / tokens / H:.1f} x H per token); tiled working set planned {tiled / 1e9:.2f} GB",
        flush=True,
    )
    del y, out, leaves, xr, x, g
    torch.cuda.empty_cache()
