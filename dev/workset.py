"""Measures a block's GPU working set per token beside the planner's (plan/workset.py): its forward pass without
gradients, then its backward pass from its checkpoint as Step.block_backward runs it, tiled (model/tiled.py) or
not, the input and its gradient allocated before. One line per (config, tokens).
    python dev/workset.py configs/llama3.1-8b.toml TILE TOKENS...      (TILE 0: untiled; DTYPE=float32 in the
    environment: fp32 compute, where GQA takes SDPA's math kernel)"""

import os
import sys

import torch
from block_kernels import block_weights  # dev/, the script's own directory

from tiertrain.config import load_config
from tiertrain.model import llama, tiled
from tiertrain.model.llama import Context
from tiertrain.plan.attention import kv_graph
from tiertrain.plan.workset import working_set

cfg_path, tile = sys.argv[1], int(sys.argv[2])
spec = load_config(cfg_path).model
dtype = os.environ.get("DTYPE", "bfloat16")
dev, dt = torch.device("cuda"), getattr(torch, dtype)
w, accs = block_weights(spec, dev, dt)
for tokens in map(int, sys.argv[3:]):
    spec.max_position_embeddings = max(spec.max_position_embeddings, tokens)
    ctx = Context.build(spec, tokens, dt, dev, tile)
    x = torch.randn(1, tokens, spec.hidden_size, device=dev)  # the fp32 residual
    g = torch.randn_like(x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = torch.cuda.Event(enable_timing=True)
    t1, t2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    with torch.no_grad():
        y = tiled.forward(w, x, ctx) if ctx.tiled(x) else llama.block(w, x, ctx)
    t1.record()
    fwd = torch.cuda.max_memory_allocated() - base - y.numel() * 4
    del y
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if ctx.tiled(x):
        tiled.backward(w, accs, x, g, ctx)
    else:
        leaves = {n: v.detach().requires_grad_() for n, v in w.items()}
        xr = x.detach().requires_grad_()
        with torch.enable_grad():
            out = torch.autograd.grad(llama.block(leaves, xr, ctx), [xr] + list(leaves.values()), g)
        del out, leaves, xr
    t2.record()
    torch.cuda.synchronize()
    bwd = torch.cuda.max_memory_allocated() - base
    H = spec.hidden_size
    math = kv_graph("", False, dtype, spec) == "math"
    model = working_set(spec, dtype, tokens, tile, tokens if math else 0)
    print(
        f"{cfg_path} tile {tile} tokens {tokens}: fwd {fwd / 1e9:.2f} GB {t0.elapsed_time(t1) / 1e3:.2f} s, "
        f"bwd {bwd / 1e9:.2f} GB ({bwd / tokens / H:.1f} x H per token) {t1.elapsed_time(t2) / 1e3:.2f} s; "
        f"model {model / 1e9:.2f} GB ({model / tokens / H:.1f} x H)",
        flush=True,
    )
    del x, g
    torch.cuda.empty_cache()
