"""One optimizer step's forward and backward, layer-major over all micro-batches (DESIGN.md).

forward   unit 0..L-2, no autograd: each unit's weights are loaded once and applied to every
          micro-batch while the next unit's weights are copied in; each block's input is saved
          (the activation checkpoint, on the GPU or sent to the host)
head      per micro-batch: final norm, then logits and cross-entropy a chunk of tokens at a time,
          with gradients: the full logits of the batch never exist
backward  unit L-2..1: recompute each micro-batch from its checkpoint with autograd on leaf views
          of the loaded weights, backprop, add the weight gradients into an fp32 accumulator; the
          accumulator drains to the host on the D2H stream while the next unit computes; the
          embedding's gradient is an fp32 scatter-add of the incoming gradients
Every wait between streams is an event; the step ends with per-unit gradient norms on the device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model import llama
from ..model.llama import Context
from ..model.spec import UnitSpec
from ..tiers.slab import SlabLayout
from .activations import Checkpoints
from .buffers import DeviceBuffers
from .streams import StallClock


class StepEngine:
    def __init__(self, units: tuple[UnitSpec, ...], layouts: list[SlabLayout], buffers: DeviceBuffers,
                 checkpoints: Checkpoints, clock: StallClock, ctx: Context, loss_chunk_tokens: int | None):
        self.units, self.layouts, self.buf, self.ck, self.clock, self.ctx = (
            units, layouts, buffers, checkpoints, clock, ctx)
        self.chunk = loss_chunk_tokens or max(256, (16 << 20) // ctx.spec.vocab_size)  # ~64 MiB of fp32 logits

    # ---- binding weights ----------------------------------------------------------------------
    def bind(self, unit: int) -> dict[str, torch.Tensor]:
        """Views of the unit's weights, borrowed (tied) tensors included, once they are on the device."""
        w = self.layouts[unit].views(self.buf.use(unit))
        for name, owner, owner_name in self.units[unit].borrows:
            w[name] = self.layouts[owner].views(self.buf.use(owner))[owner_name]
        return w

    def bind_for_grad(self, unit: int) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Leaf tensors over the weights, each paired with the fp32 accumulator view it feeds."""
        leaves = {n: v.detach().requires_grad_() for n, v in self.bind(unit).items()}
        accs = self.layouts[unit].views(self.buf.grad_begin(unit))
        for name, owner, owner_name in self.units[unit].borrows:
            accs[name] = self.layouts[owner].views(self.buf.acc(owner))[owner_name]
        return leaves, [(leaves[n], accs[n]) for n in leaves]

    def _release(self, unit: int) -> None:
        self.buf.release(unit, *(owner for _, owner, _ in self.units[unit].borrows))

    # ---- the step -----------------------------------------------------------------------------
    def run(self, inputs: list[torch.Tensor], targets: list[torch.Tensor],
            before_backward=lambda: None, drained=lambda unit: None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward + backward over the micro-batches; returns (summed loss, per-unit grad norms).
        `before_backward` runs once the forward pass has waited for every unit's update (the NVMe
        tier starts reading the next update's slabs then); `drained(u)` once unit u's gradient is on
        its way to the host (a speculative update may start from it)."""
        L, buf, ck, clock = len(self.units), self.buf, self.ck, self.clock
        n_tokens = sum(t.numel() for t in targets)
        buf.zero_own_grads()

        with torch.no_grad():
            buf.expect(range(L), new=True)
            buf.load(0)
            w = self.bind(0)
            with clock.computing("forward"):
                xs = [llama.embed(w, tok, self.ctx) for tok in inputs]
            self._release(0)
            buf.load(1)
            for i in range(1, L - 1):
                w = self.bind(i)
                ck.save(i, xs)
                with clock.computing("forward"):
                    xs = [llama.block(w, x, self.ctx) for x in xs]
                self._release(i)
                buf.load(i + 1)  # the next block, or the head after the last block

        before_backward()
        buf.expect(range(L - 2, -1, -1))  # the head's load of the last block, then the loop's
        norms: list[torch.Tensor | None] = [None] * L
        loss, grads = self._head(xs, targets, n_tokens)
        del xs
        norms[L - 1] = buf.drain(L - 1)
        drained(L - 1)

        for i in range(L - 2, 0, -1):
            leaves, pairs = self.bind_for_grad(i)
            buf.load(i - 1)
            if i > 1:
                ck.prefetch(i - 1)
            saved = ck.get(i)  # waits for its H2D outside the timed compute
            with clock.computing("backward"):
                for m, x in enumerate(saved):
                    x = x.requires_grad_()
                    with torch.enable_grad():
                        y = llama.block(leaves, x, self.ctx)
                    out = torch.autograd.grad(y, [x] + [p for p, _ in pairs], grads[m])
                    grads[m] = out[0]
                    for (_, acc), g in zip(pairs, out[1:]):
                        acc.add_(g)
            self._release(i)
            ck.drop(i)
            norms[i] = buf.drain(i)
            drained(i)

        with clock.computing("backward"):
            emb = self.layouts[0].views(buf.acc(0))["embed_tokens.weight"]
            for tok, g in zip(inputs, grads):
                # one order of additions on either device: CUDA's index_put_ sorts (its index_add_ uses atomics),
                # the CPU's index_add_ is serial (its index_put_ adds atomically on several threads)
                if emb.is_cuda:
                    emb.index_put_((tok.reshape(-1),), g.reshape(-1, g.shape[-1]), accumulate=True)
                else:
                    emb.index_add_(0, tok.reshape(-1), g.reshape(-1, g.shape[-1]))
        norms[0] = buf.drain(0)
        drained(0)
        return loss, norms

    def _head(self, xs: list[torch.Tensor], targets: list[torch.Tensor], n_tokens: int):
        L = len(self.units)
        leaves, pairs = self.bind_for_grad(L - 1)
        self.buf.load(L - 2)  # the last block is still in its slot: nothing moves
        if L > 2:
            self.ck.prefetch(L - 2)
        acc = {id(p): a for p, a in pairs}
        wn, wh = leaves["norm.weight"], leaves["lm_head.weight"]
        loss = torch.zeros((), dtype=torch.float32, device=xs[0].device)
        grads = []
        with self.clock.computing("backward"):
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
        self._release(L - 1)
        return loss, grads
