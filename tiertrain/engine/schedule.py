"""One optimizer step, layer-major over all micro-batches (DESIGN.md), every transfer and update a named call.

forward   unit 0..L-2, no autograd: each unit's weights are loaded once and applied to every micro-batch
          while the next unit's weights are copied in; each block's input is saved (the activation
          checkpoint, on the GPU or sent to the host) and the block computes from it as saved (bf16
          checkpoints: the input rounded, the residual kept whole); a kept block (RunPlan: recompute false)
          runs with autograd instead and keeps its graph on the GPU, its weights saved as references to its
          slot; a block whose attention outputs are kept (RunPlan: attention_kept) keeps them on the GPU
head      per micro-batch: final norm, then logits and cross-entropy a chunk of tokens at a time, with
          gradients: the full logits of the batch never exist
backward  unit L-2..1: recompute each micro-batch from its checkpoint with autograd on leaf views of the
          loaded weights (a kept block: its graph, reading the weights loaded again; kept attention outputs
          replayed, no attention forward), backprop, add the weight gradients into an fp32 accumulator;
          the accumulator drains on the D2H stream while the next unit computes; the embedding's gradient
          is an fp32 scatter-add of the incoming gradients
A block in parts (expert groups, RunPlan.expert_groups) runs as engine/groups.py says, its parts' loads in turn.
norm      the global gradient norm from the per-unit norms left on the device, summed over the ranks with the loss
          in one all-reduce: the step's one synchronization
Where and when each unit's AdamW runs is its RunPlan entry's, carried out by optim.updates.Updates.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from ..model import llama, tiled
from ..model.attention import Kept
from ..model.llama import Context
from ..model.moe import RouterLog, grad_pairs
from ..model.parts import Part
from ..model.spec import UnitSpec
from ..optim.adamw import clip_coefficient
from ..optim.updates import Updates
from ..parallel import Ranks
from ..tiers.slab import SlabLayout
from . import groups, keep
from .activations import ActivationStore
from .buffers import Accumulators, WeightSlots
from .streams import StallClock


class Step:
    def __init__(
        self,
        units: tuple[UnitSpec, ...],
        layouts: list[SlabLayout],
        slots: WeightSlots,
        grads: Accumulators,
        checkpoints: ActivationStore,
        updates: Updates,
        clock: StallClock,
        ctx: Context,
        loss_chunk_tokens: int | None,
        max_norm: float,
        kept: frozenset[int] = frozenset(),
        ranks: Ranks | None = None,
        parts: dict[int, tuple[Part, ...]] | None = None,
        attention_kept: frozenset[int] = frozenset(),
    ):
        self.units, self.layouts, self.slots, self.grads, self.ck, self.updates, self.clock, self.ctx = (
            units,
            layouts,
            slots,
            grads,
            checkpoints,
            updates,
            clock,
            ctx,
        )
        self.kept = kept  # blocks whose activations stay on the GPU from forward to backward
        self.attention_kept = attention_kept  # blocks whose recompute replays their kept attention outputs
        self.outs: dict[int, list[Kept]] = {}  # such a block -> its outputs, a Kept per micro-batch
        self.parts = parts or {}  # blocks loaded in parts (expert groups): each one's parts
        self.graphs: dict[int, tuple] = {}  # kept block -> (inputs, outputs, leaves) per micro-batch
        self.weights_now: dict[int, torch.Tensor] = {}  # kept block -> its flat weights for the backward pass
        # ~64 MiB of fp32 logits
        self.chunk = loss_chunk_tokens or max(256, (16 << 20) // ctx.spec.vocab_size)
        self.max_norm = max_norm
        self.ranks = ranks or Ranks()  # each takes as many rows of the batch
        self.ctxs = self.contexts(None)
        self.docs: list = []  # the step's micro-batches' segments (model.docs.Docs; None: a row is one)

    def contexts(self, router: RouterLog | None) -> list[Context]:
        """Each unit's context: its attention window, and the step's router log where the loss has one."""
        base = dataclasses.replace(self.ctx, router=router)
        return [base.of(u.window) for u in self.units]

    def router_log(self, inputs: list[torch.Tensor]) -> RouterLog | None:
        """A new log of the routers' choices for a step, where the loss has transformers' load-balancing term."""
        s = self.ctx.spec
        if not (s.is_moe and s.output_router_logits):
            return None
        n = len(inputs)
        return RouterLog(n, s.num_experts, s.router_aux_loss_coef, n * self.ranks.size, inputs[0].device)

    def run(
        self, inputs: list[torch.Tensor], targets: list[torch.Tensor], lr: float, docs=None, n_tokens=None
    ) -> tuple[torch.Tensor, float]:
        """Forward, backward, norm and the start of the update, over the micro-batches; (the loss: the mean over the
        trained targets, the global gradient norm), over every rank's rows. `docs`: each micro-batch's segments
        (None: each row is one); `n_tokens`: the trained targets of the whole batch, every rank's (None: every
        target of every rank's rows, as many as this rank's). The update finishes during the next step's forward
        pass."""
        L, slots, grads, ck, updates, clock = (
            len(self.units),
            self.slots,
            self.grads,
            self.ck,
            self.updates,
            self.clock,
        )
        n_tokens = n_tokens or sum(t.numel() for t in targets) * self.ranks.size
        self.docs = docs or [None] * len(inputs)
        load = self.load

        updates.begin(lr)
        grads.zero_own()
        self.forget()
        router = self.router_log(inputs)
        self.ctxs = self.contexts(router)
        xs = self.forward(inputs)  # ---- forward: the last block's outputs
        aux = router.finish() if router else None  # the counts of the whole forward pass weigh each router

        updates.before_backward()  # ---- head and backward
        slots.expect(range(L - 2, -1, -1))  # the head's load of the last block, then the loop's
        norms: list[torch.Tensor | None] = [None] * L
        leaves, pairs = self.bind_for_grad(L - 1)
        load(L - 2)  # the last block is still in its slot: nothing moves
        if L > 2 and L - 2 not in self.kept:
            ck.prefetch(L - 2)
        loss, gx = self.head(leaves, pairs, xs, targets, n_tokens)
        if aux is not None:
            loss += aux
        del xs
        self.release(L - 1)
        norms[L - 1] = grads.drain(L - 1)
        updates.gradient_ready(L - 1)

        for i in range(L - 2, 0, -1):
            if i in self.parts:
                gx, norms[i] = groups.backward(self, i, gx)
                updates.gradient_ready(i)
                continue
            leaves, pairs = self.bind_for_grad(i)
            load(i - 1)
            if i > 1 and i - 1 not in self.kept:
                ck.prefetch(i - 1)
            if i in self.kept:
                with clock.computing("backward"):
                    gx = keep.backward(self, i, leaves, pairs, gx)
            else:
                saved = ck.get(i)  # waits for its H2D outside the timed compute
                with clock.computing("backward"):
                    gx = self.block_backward(i, leaves, pairs, saved, gx)
                del saved  # its memory is the room the next checkpoints are read into
            self.release(i)
            ck.drop(i)
            norms[i] = grads.drain(i)
            updates.gradient_ready(i)

        with clock.computing("backward"):
            self.embedding_backward(inputs, gx)
        norms[0] = grads.drain(0)
        updates.gradient_ready(0)

        grads.norms_ready()  # ---- norm and update
        loss, grad_norm, clip = self.global_norm(loss, norms)
        updates.after_norm(lr, clip)
        return loss, grad_norm

    def global_norm(self, loss: torch.Tensor, norms: list[torch.Tensor]) -> tuple[torch.Tensor, float, float]:
        """(the batch's loss, the global gradient norm, the clip factor): one rank's from its units' norms; several
        ranks' from their shards' squared norms and their losses, summed in one all-reduce."""
        if self.ranks.size == 1:
            return (loss, *clip_coefficient(norms, self.max_norm))
        both = torch.stack([loss, torch.cat([n.float().reshape(-1) for n in norms]).square().sum()])
        self.ranks.all_sum(both)
        return (both[0], *clip_coefficient([both[1].sqrt()], self.max_norm))

    def load(self, u: int) -> None:
        """The unit's update, where one is due, runs before its weights go to the GPU (a block in parts: its
        attention part's, which each pass loads first)."""
        if u in self.parts:
            updated, _ = self.updates.before_load(u)
            assert updated is None, "a block in parts is updated on the host"
            self.slots.load_part(u, 0, last=False)
        else:
            self.slots.load(u, *self.updates.before_load(u))

    def forward(self, inputs: list[torch.Tensor], train: bool = True) -> list[torch.Tensor]:
        """The forward pass over the embedding and the blocks, without gradients (the head runs with the loss): each
        unit's weights loaded once for every micro-batch while the next unit's are copied in. In training each
        block's input is saved (its activation checkpoint), a kept block keeps its graph and the compute is timed;
        an evaluation (`train` false: the weights as they are, every update landed) does none of it."""
        L, slots, ck, load = len(self.units), self.slots, self.ck, self.load
        timed = self.clock.computing if train else (lambda phase: contextlib.nullcontext())
        with torch.no_grad():
            slots.expect(range(L), new=train)  # in training every unit's weights change as the update lands
            load(0)
            w = self.bind(0)
            router = self.ctxs[0].router
            if router is not None:
                router.counting = train
            with timed("forward"):
                xs = [llama.embed(w, tok, self.ctx) for tok in inputs]
            self.release(0)
            load(1)
            for i in range(1, L - 1):
                if i in self.parts:
                    xs = groups.forward(self, i, xs, train, timed)
                    continue
                w = self.bind(i)
                kept = train and i in self.kept
                xr = self.inputs(xs)
                if train and not kept:
                    ck.save(i, xr)
                outs = [Kept() for _ in xs] if train and i in self.attention_kept else [None] * len(xs)
                with timed("forward"):
                    if kept:
                        xs = keep.forward(self, i, w, xr, xs)
                    else:
                        xs = self.residual(
                            [self.block(i, m, w, x, outs[m]) for m, x in enumerate(xr)], xr, xs
                        )
                if outs[0] is not None:
                    self.outs[i] = outs
                self.release(i)
                load(i + 1)  # the next block, or the head after the last block
        return xs

    def forget(self) -> None:
        """Drops what a step keeps on the GPU from its forward pass for its backward pass (kept attention outputs,
        kept blocks' graphs): a step that failed part way may have left some."""
        self.outs.clear()
        self.graphs.clear()
        self.weights_now.clear()

    def inputs(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """What a block computes from: its input as its checkpoint holds it, so that the recompute repeats the forward
        pass exactly; with bf16 checkpoints (RunPlan.activation_dtype) the input rounded to bf16, else the input."""
        return [x.to(self.ck.dtype) for x in xs]  # no copy in fp32

    @staticmethod
    def residual(ys, xr: list[torch.Tensor], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The blocks' outputs `ys` (their own: changed in place) from their inputs as computed from (`xr`:
        inputs) with the residual stream kept whole: y - r(x) + x, fp32, where r rounded x; the outputs as they
        are where nothing was rounded. The block's gradient is then its own at r(x): what its recompute from the
        checkpoint computes (a kept block's graph does the same: engine/keep.forward)."""
        if all(r is x for r, x in zip(xr, xs)):
            return ys
        return [y.sub_(r).add_(x) for y, r, x in zip(ys, xr, xs)]

    def evaluate(
        self, inputs: list[torch.Tensor], targets: list[torch.Tensor], docs=None, n_tokens=None
    ) -> torch.Tensor:
        """The mean loss over the trained targets of a forward pass over the micro-batches (`docs`, `n_tokens`: as
        run's), with the weights as they are (the caller lands the pending update first): the training forward
        pass and loss, nothing saved, no gradient. The slots are left stale: the next step's forward pass copies
        every unit again. Summed over the ranks' rows."""
        L = len(self.units)
        n_tokens = n_tokens or sum(t.numel() for t in targets) * self.ranks.size
        self.docs = docs or [None] * len(inputs)
        self.forget()
        self.ctxs = self.contexts(None)  # the validation loss is the cross-entropy alone
        xs = self.forward(inputs, train=False)
        with torch.no_grad():
            w = self.bind(L - 1)
            loss = torch.zeros((), dtype=torch.float32, device=xs[0].device)
            for x, tgt in zip(xs, targets):
                xf, t = x.reshape(-1, x.shape[-1]), tgt.reshape(-1)
                for a in range(0, xf.shape[0], self.chunk):
                    h = llama.final_norm({"norm.weight": w["norm.weight"]}, xf[a : a + self.chunk], self.ctx)
                    lg = llama.logits({"lm_head.weight": w["lm_head.weight"]}, h, self.ctx)
                    loss += F.cross_entropy(lg, t[a : a + self.chunk], reduction="sum") / n_tokens
            self.release(L - 1)
        self.slots.forget()
        return self.ranks.all_sum(loss)

    # ---- binding weights ----------------------------------------------------------------------
    def bind(self, unit: int, part: int | None = None) -> dict[str, torch.Tensor]:
        """Views of the unit's weights (or its part's), borrowed (tied) tensors included, once on the device."""
        if part is not None:
            return self.parts[unit][part].views(self.slots.use(unit, part))
        w = self.layouts[unit].views(self.slots.use(unit))
        for name, owner, owner_name in self.units[unit].borrows:
            w[name] = self.layouts[owner].views(self.slots.use(owner))[owner_name]
        return w

    def bind_for_grad(
        self, unit: int, part: int | None = None
    ) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Leaf tensors over the weights (or a part's), each paired with the fp32 accumulator view it feeds."""
        leaves = {n: v.detach().requires_grad_() for n, v in self.bind(unit, part).items()}
        if part is not None:
            accs = self.parts[unit][part].views(self.grads.begin(unit, part))
            return leaves, [(leaves[n], accs[n]) for n in leaves]
        accs = self.layouts[unit].views(self.grads.begin(unit))
        for name, owner, owner_name in self.units[unit].borrows:
            accs[name] = self.layouts[owner].views(self.grads.acc(owner))[owner_name]
        return leaves, [(leaves[n], accs[n]) for n in leaves]

    def release(self, unit: int, part: int | None = None) -> None:
        if part is not None:
            self.slots.release(unit, part=part)
        else:
            self.slots.release(unit, *(owner for _, owner, _ in self.units[unit].borrows))

    # ---- compute ------------------------------------------------------------------------------
    def at(self, unit: int, micro: int) -> Context:
        """The unit's context for a micro-batch: its segments where it has them, its router log (if any) set to it."""
        ctx = self.ctxs[unit]
        if ctx.router is not None:
            ctx.router.micro = micro
        docs = self.docs[micro] if micro < len(self.docs) else None
        return ctx if docs is None else dataclasses.replace(ctx, docs=docs)

    def block(
        self, unit: int, micro: int, w: dict[str, torch.Tensor], x: torch.Tensor, outs: Kept | None = None
    ) -> torch.Tensor:
        """A block's forward pass without gradients: over tiles of the sequence where the plan tiles it; its
        attention outputs recorded into `outs` where given (the recompute replays them)."""
        ctx = self.at(unit, micro)
        if outs is not None:
            ctx = dataclasses.replace(ctx, kept=outs)
        return tiled.forward(w, x, ctx) if ctx.tiled(x) else llama.block(w, x, ctx)

    def block_backward(
        self, unit: int, leaves, pairs, saved: list[torch.Tensor], grads: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Each micro-batch's block recomputed from its checkpoint and differentiated, the load-balancing loss's
        term of its router included; weight gradients added into the accumulators. Returns the gradients of
        the block's inputs (a tiled block's in `grads`' memory)."""
        out_grads = []
        outs = self.outs.pop(unit, None)
        for m, (x, g) in enumerate(zip(saved, grads)):
            ctx = self.at(unit, m)
            if outs is not None:  # the recompute runs no attention: the forward pass's outputs stand in
                ctx = dataclasses.replace(ctx, kept=outs[m].replay())
                outs[m] = None  # its outputs go with the micro-batch's graph
            if ctx.tiled(x):
                out_grads.append(tiled.backward(leaves, dict(zip(leaves, (a for _, a in pairs))), x, g, ctx))
                continue
            x = x.requires_grad_()
            with torch.enable_grad():
                y = llama.block(leaves, x, ctx)
            ys, gs = grad_pairs(ctx.router, y, g)
            out = torch.autograd.grad(ys, [x] + [p for p, _ in pairs], gs)
            out_grads.append(out[0])
            for (_, acc), gw in zip(pairs, out[1:]):
                acc.add_(gw)
        return out_grads

    def embedding_backward(self, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        emb = self.layouts[0].views(self.grads.acc(0))["embed_tokens.weight"]
        pad = self.ctx.spec.pad_token_id
        pad = (
            None if pad is None else pad % self.ctx.spec.vocab_size
        )  # torch's padding_idx may count from the end
        for tok, g in zip(inputs, grads):
            if pad is not None:  # transformers' nn.Embedding(padding_idx=pad): the pad row takes no gradient
                g = g.masked_fill((tok == pad).unsqueeze(-1), 0.0)
            # one order of additions on either device: CUDA's index_put_ sorts (its index_add_ uses atomics),
            # the CPU's index_add_ is serial (its index_put_ adds atomically on several threads)
            if emb.is_cuda:
                emb.index_put_((tok.reshape(-1),), g.reshape(-1, g.shape[-1]), accumulate=True)
            else:
                emb.index_add_(0, tok.reshape(-1), g.reshape(-1, g.shape[-1]))

    def head(self, leaves, pairs, xs: list[torch.Tensor], targets: list[torch.Tensor], n_tokens: int):
        """Final norm, logits and cross-entropy, a chunk of tokens at a time, with their gradients; (the summed
        loss, the gradients of the last block's outputs)."""
        acc = {id(p): a for p, a in pairs}
        wn, wh = leaves["norm.weight"], leaves["lm_head.weight"]
        loss = torch.zeros((), dtype=torch.float32, device=xs[0].device)
        grads = []
        with self.clock.computing("backward"):
            # the final norm too a chunk at a time: nothing (tokens x H) but x, gx
            for x, tgt in zip(xs, targets):
                xf, t = x.reshape(-1, x.shape[-1]), tgt.reshape(-1)
                gx = torch.empty_like(xf)
                for a in range(0, xf.shape[0], self.chunk):
                    b = min(a + self.chunk, xf.shape[0])
                    xc = xf[a:b].detach().requires_grad_()
                    with torch.enable_grad():
                        h = llama.final_norm({"norm.weight": wn}, xc, self.ctx)
                        lg = llama.logits({"lm_head.weight": wh}, h, self.ctx)
                        part = F.cross_entropy(lg, t[a:b], reduction="sum") / n_tokens
                    gx[a:b], g_n, g_w = torch.autograd.grad(part, [xc, wn, wh])
                    acc[id(wh)].add_(g_w)
                    acc[id(wn)].add_(g_n)
                    loss += part.detach()
                grads.append(gx.view_as(x))
        return loss, grads
