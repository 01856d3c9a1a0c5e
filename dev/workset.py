"""Measures a block's GPU working set per token (forward, then recompute and backward as Step.block_backward
does), tiled MLP or not, beside the planner's WORK_H / WORK_FF model. One line per (config, tokens)."""
import sys

import torch

from tiertrain.config import load_config
from tiertrain.model import llama
from tiertrain.model.llama import Context
from tiertrain.plan import workset as planner

cfg_path, tile = sys.argv[1], int(sys.argv[2])
spec = load_config(cfg_path).model
dev, dt = torch.device("cuda"), torch.bfloat16
shapes = {t.name: t.shape for t in spec.units()[1].tensors}
w = {n: (torch.randn(s, device=dev) * 0.02).to(dt) if len(s) > 1 else torch.ones(s, device=dev, dtype=dt)
     for n, s in shapes.items()}
for tokens in map(int, sys.argv[3:]):
    spec.max_position_embeddings = max(spec.max_position_embeddings, tokens)
    ctx = Context.build(spec, tokens, dt, dev, tile)
    x = torch.randn(1, tokens, spec.hidden_size, device=dev)
    g = torch.randn_like(x)
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        y = llama.block(w, x, ctx)
    fwd = torch.cuda.max_memory_allocated() - base
    del y
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    leaves = {n: v.detach().requires_grad_() for n, v in w.items()}
    xr = x.detach().requires_grad_()
    with torch.enable_grad():
        y = llama.block(leaves, xr, ctx)
    out = torch.autograd.grad(y, [xr] + list(leaves.values()), g)
    torch.cuda.synchronize()
    bwd = torch.cuda.max_memory_allocated() - base
    H, FF = spec.hidden_size, spec.intermediate_size
    model = planner.WORK_H * H * tokens + planner.WORK_FF * FF * (min(tokens, tile) if tile else tokens) \
        + (planner.MLP_TILE_SUMS * H * FF if tile else 0)
    print(f"{cfg_path} tile {tile} tokens {tokens}: fwd {fwd / 1e9:.2f} GB, bwd {bwd / 1e9:.2f} GB "
          f"({bwd / tokens / H:.1f} x H per token); model {model / 1e9:.2f} GB", flush=True)
    del out, y, leaves, xr, x, g
    torch.cuda.empty_cache()
