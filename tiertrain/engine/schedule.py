"""One optimizer step's forward and backward, layer-major over all micro-batches (DESIGN.md).

forward   unit 0..L-2, no autograd: each unit's weights are loaded once and applied to every
          micro-batch; the input of each block is kept (the activation checkpoint)
head      per micro-batch: final norm, then logits and cross-entropy a chunk of tokens at a time,
          with gradients: the full logits of the batch never exist
backward  unit L-2..1: recompute each micro-batch from its checkpoint with autograd on leaf views
          of the loaded weights, backprop, add the weight gradients into the fp32 accumulator;
          the embedding's gradient is an fp32 scatter-add of the incoming gradients
then      each unit's accumulator goes to its host grad slab, with its norm for clipping
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model import llama
from ..model.llama import Context
from ..model.spec import UnitSpec
from ..tiers.slab import SlabLayout
from .streams import DeviceBuffers


class StepEngine:
    def __init__(self, units: tuple[UnitSpec, ...], layouts: list[SlabLayout], buffers: DeviceBuffers,
                 ctx: Context, loss_chunk_tokens: int):
        self.units, self.layouts, self.buf, self.ctx = units, layouts, buffers, ctx
        vocab = ctx.spec.vocab_size
        self.chunk = loss_chunk_tokens or max(256, (16 << 20) // vocab)  # ~64 MiB of fp32 logits

    # ---- binding weights ----------------------------------------------------------------------
    def _views(self, unit: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.layouts[unit].views(flat)

    def bind(self, unit: int) -> dict[str, torch.Tensor]:
        """Views of the unit's loaded weights, borrowed (tied) tensors included."""
        w = self._views(unit, self.buf.weights(unit))
        for name, owner, owner_name in self.units[unit].borrows:
            w[name] = self._views(owner, self.buf.weights(owner))[owner_name]
        return w

    def bind_for_grad(self, unit: int) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Leaf tensors over the loaded weights, paired with the fp32 accumulator views they feed."""
        leaves = {n: v.detach().requires_grad_() for n, v in self.bind(unit).items()}
        accs = self._views(unit, self.buf.acc(unit))
        for name, owner, owner_name in self.units[unit].borrows:
            accs[name] = self._views(owner, self.buf.acc(owner))[owner_name]
        return leaves, [(leaves[n], accs[n]) for n in leaves]

    # ---- the step -----------------------------------------------------------------------------
    def run(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward + backward over the micro-batches; returns (summed loss, per-unit grad norms)."""
        L = len(self.units)
        n_tokens = sum(t.numel() for t in targets)
        for i in self.buf.own:
            self.buf.acc(i).zero_()
        ckpt: list[list[torch.Tensor]] = [[] for _ in range(L)]

        with torch.no_grad():
            self.buf.load(0)
            w = self.bind(0)
            xs = [llama.embed(w, tok, self.ctx) for tok in inputs]
            for i in range(1, L - 1):
                self.buf.load(i)
                w = self.bind(i)
                ckpt[i] = xs
                xs = [llama.block(w, x, self.ctx) for x in xs]

        norms: list[torch.Tensor | None] = [None] * L
        self.buf.load(L - 1)
        loss, grads = self._head(xs, targets, n_tokens)
        del xs
        norms[L - 1] = self.buf.drain(L - 1)

        for i in range(L - 2, 0, -1):
            self.buf.load(i)
            self.buf.acc(i).zero_()
            leaves, pairs = self.bind_for_grad(i)
            for m, x in enumerate(ckpt[i]):
                x = x.requires_grad_()
                with torch.enable_grad():
                    y = llama.block(leaves, x, self.ctx)
                out = torch.autograd.grad(y, [x] + [p for p, _ in pairs], grads[m])
                grads[m] = out[0]
                for (_, acc), g in zip(pairs, out[1:]):
                    acc.add_(g)
            ckpt[i] = []
            norms[i] = self.buf.drain(i)

        emb = self._views(0, self.buf.acc(0))["embed_tokens.weight"]
        for tok, g in zip(inputs, grads):  # index_put_ sorts: deterministic on CUDA, unlike index_add_
            emb.index_put_((tok.reshape(-1),), g.reshape(-1, g.shape[-1]), accumulate=True)
        norms[0] = self.buf.drain(0)
        return loss, norms

    def _head(self, xs: list[torch.Tensor], targets: list[torch.Tensor], n_tokens: int):
        L = len(self.units)
        leaves, pairs = self.bind_for_grad(L - 1)
        acc = {id(p): a for p, a in pairs}
        wn, wh = leaves["norm.weight"], leaves["lm_head.weight"]
        loss = torch.zeros((), dtype=torch.float32, device=xs[0].device)
        grads = []
        for x, tgt in zip(xs, targets):
            x = x.requires_grad_()
            with torch.enable_grad():
                h = llama.final_norm({"norm.weight": wn}, x, self.ctx)
            hd = h.detach().reshape(-1, h.shape[-1])
            gh = torch.empty_like(hd)
            t = tgt.reshape(-1)
            for a in range(0, hd.shape[0], self.chunk):
                b = min(a + self.chunk, hd.shape[0])
                hc = hd[a:b].detach().requires_grad_()
                with torch.enable_grad():
                    lg = llama.logits({"lm_head.weight": wh}, hc, self.ctx)
                    part = F.cross_entropy(lg, t[a:b], reduction="sum") / n_tokens
                g_h, g_w = torch.autograd.grad(part, [hc, wh])
                gh[a:b] = g_h
                acc[id(wh)].add_(g_w)
                loss += part.detach()
            gx, gn = torch.autograd.grad(h, [x, wn], gh.view_as(h))
            acc[id(wn)].add_(gn)
            grads.append(gx)
        return loss, grads
