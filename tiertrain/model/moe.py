"""The mixture-of-experts MLP of qwen3_moe, qwen2_moe, mixtral and gpt_oss, and its load-balancing loss.

Routing follows each family's transformers class: qwen and mixtral take the top k of the router's softmax (fp32),
mixtral and qwen with norm_topk_prob rescale them to sum to one; gpt_oss takes the top k router logits (with the
router's bias) and a softmax over those. The experts' compute grows with the routed tokens: the (token, expert)
pairs are sorted by expert, each projection is one grouped GEMM over the sorted rows (torch's grouped matmul on a
Hopper GPU in bf16; elsewhere a loop over the experts that received tokens), each pair's activation is weighted by
its routing weight before the down projection, and the rows go back to their tokens, each token's k summed in
fp32. On a GPU the activation and that sum are Triton kernels (model/glu.py, model/slot_sum.py), and so are the
router (model/router_kernel.py), the sort, the places and the gathers (model/route_kernels.py). An expert that
received no token takes no part in the graph, so its gradient is exactly zero.

The load-balancing loss (transformers' load_balancing_loss_func, output_router_logits true) of a micro-batch is
    aux = E * sum_e (c_e / N) * (P_e / N)
over every MoE block of its forward pass: N the (block, token) rows, c_e how many of the rows' top k chose expert
e, P_e the rows' summed softmax of the router logits. c is a constant of the forward pass, so block l's share of
the gradient is that of sum_e P_e,l * coef * E * c_e / N^2 (per micro-batch of the step's mean): the training
forward pass counts c (RouterLog.observe), and each block's recompute adds that term to its backward pass
(RouterLog.term), with the counts of the whole forward pass.
"""

from __future__ import annotations

import functools
from itertools import accumulate

import torch
import torch.nn.functional as F

from . import glu, kernels, route_kernels, router_kernel, slot_sum

ROUTER, GPT_OSS_ROUTER = "mlp.gate.weight", "mlp.router.weight"  # a block with experts has one of them
# torch's grouped matmul (torch 2.8+: torch._grouped_mm; later also F.grouped_mm): bf16 on sm90+
_GROUPED = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class RouterLog:
    """The routers' choices over one step's micro-batches, for the load-balancing loss: the training forward pass
    counts, the backward pass's recomputes collect each block's softmax sums with their graphs."""

    def __init__(self, n_micro: int, n_experts: int, coef: float, share: int, device: torch.device):
        self.coef, self.e, self.share = coef, n_experts, share  # share: micro-batches of the step, all ranks
        self.counts = [torch.zeros(n_experts, device=device) for _ in range(n_micro)]
        self.sums = [torch.zeros(n_experts, device=device) for _ in range(n_micro)]
        self.rows = [0] * n_micro
        self.weights: list[torch.Tensor] = []
        self.micro = 0  # the micro-batch being computed (Step sets it)
        self.counting = False  # the training forward pass
        self.terms: list[torch.Tensor] = []

    def observe(self, probs: torch.Tensor, chosen: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """A block's router on a slice of the micro-batch's tokens: fp32 softmax (T, E) and the chosen experts (T, k);
        `valid` (T,): 1 on the tokens counted, 0 on padding (None: all), weights rather than an index: no sync."""
        m = self.micro
        if valid is not None:
            probs = probs * valid[:, None]
        if self.counting:
            slots = None if valid is None else valid[:, None].expand_as(chosen)
            self.counts[m] += _counts(chosen, self.e, slots)
            self.sums[m] += probs.detach().sum(0)
            self.rows[m] += probs.shape[0] if valid is None else valid.sum()
        if probs.requires_grad:
            self.terms.append((m, probs.sum(0)))

    def finish(self) -> torch.Tensor:
        """After the forward pass: the weights of the backward terms, and the step's share of the aux loss."""
        self.counting = False
        total = torch.zeros((), device=self.counts[0].device)
        for c, p, n in zip(self.counts, self.sums, self.rows):
            n = torch.as_tensor(n, dtype=torch.float32, device=c.device).clamp(min=1)
            self.weights.append(self.coef * self.e * c / (n * n * self.share))
            total += self.coef * self.e * (c / n * p / n).sum() / self.share
        return total

    def term(self) -> torch.Tensor | None:
        """The aux loss's term of what ran since the last call, for autograd.grad beside the block's output."""
        terms, self.terms = self.terms, []
        if not terms or not self.weights:
            return None
        return sum((p * self.weights[m]).sum() for m, p in terms)


def _counts(chosen: torch.Tensor, n: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """How many of the chosen slots (each counted at its weight, None: 1) went to each of n experts (int64 without
    weights, else fp32), without the device sync of bincount."""
    flat = chosen.reshape(-1)
    ones = torch.ones_like(flat) if weights is None else weights.reshape(-1).float()
    return ones.new_zeros(n).scatter_add_(0, flat, ones)


def grad_pairs(router: RouterLog | None, y: torch.Tensor, g: torch.Tensor):
    """(outputs, their gradients) for autograd.grad: y against g, and the aux loss's term of the block's router."""
    t = router.term() if router is not None else None
    return ([y], [g]) if t is None else ([y, t], [g, torch.ones_like(t)])


def route(
    w: dict[str, torch.Tensor], h: torch.Tensor, ctx, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the chosen experts (T, k), their routing weights (T, k) fp32) of tokens h (T, H); the router log observes
    the `valid` ones (experts())."""
    s = ctx.spec
    gpt_oss, on = s.model_type == "gpt_oss", kernels.on(h) and s.num_experts <= route_kernels.MAX_EXPERTS
    logits = F.linear(h, w[GPT_OSS_ROUTER], w["mlp.router.bias"]) if gpt_oss else F.linear(h, w[ROUTER])
    norm = s.norm_topk_prob or s.model_type == "mixtral"
    args = (logits, s.num_experts_per_tok, gpt_oss, norm, ctx.router is not None)
    weights, chosen, probs = kernels.run(on, _route, router_kernel.route, *args)
    if ctx.router is not None:
        ctx.router.observe(probs, chosen, valid)
    return chosen, weights


def _route(logits: torch.Tensor, k: int, gpt_oss: bool, norm: bool, probs: bool):
    """(routing weights (T, k) fp32, chosen experts (T, k), the softmax over every expert (T, E) fp32 where `probs`
    asks, else None) of router logits (T, E): qwen and mixtral take the top k of the softmax, rescaled to sum to one
    where `norm`; gpt-oss the top k logits and a softmax over those. Equal values may come in any order (torch's
    top k); the set is the same. model/router_kernel.py on a GPU."""
    if gpt_oss:
        x = logits.float()
        top, chosen = torch.topk(x, k, dim=-1)
        return torch.softmax(top, dim=-1), chosen, torch.softmax(x, dim=-1) if probs else None
    p = torch.softmax(logits.float(), dim=-1)  # the aux loss's statistics too
    weights, chosen = torch.topk(p, k, dim=-1)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, chosen, p if probs else None


def _mm(
    x: torch.Tensor, w: torch.Tensor, ends, counts: list[int] | None, bias=None, experts=None
) -> torch.Tensor:
    """Rows x (sorted by expert, expert e's ending at ends[e]) times their experts' w[e] (in, out), plus their
    experts' bias (E, out) where one is given (`experts`: each row's, for the grouped matmul)."""
    if counts is None:
        out = _GROUPED(x, w, offs=ends)
        # a GPU's index backward sums each expert's rows in order (sorted, not atomics), in groups as whole
        return out if bias is None else out + bias[experts]
    out = x.new_empty(x.shape[0], w.shape[-1])
    a = 0
    for e, n in enumerate(counts):
        if n:
            # the bias an expert at a time: a CPU's index backward accumulates in no fixed order
            out[a : a + n] = x[a : a + n] @ w[e] if bias is None else x[a : a + n] @ w[e] + bias[e]
        a += n
    return out


class _Spread(torch.autograd.Function):
    """Tokens h (T, H) to their (token, slot) pairs sorted by expert: h[src], src = order // k. Its backward adds
    each token's k rows in one pass (add_slots: fp32 inside), where autograd's index backward would sort and
    accumulate repeated rows one by one."""

    @staticmethod
    def forward(fn, h, src, pos, on):
        fn.save_for_backward(pos)
        fn.on = on
        return gather(on, h, src, h.dtype)

    @staticmethod
    def backward(fn, g):
        (pos,) = fn.saved_tensors
        return add_slots(fn.on, None, g, pos, 0, g.dtype), None, None, None


def _gather(x: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).index_select(0, idx)


def gather(on: bool, x: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x's rows idx (x (N, D), idx (n,)) in `dtype`: model/route_kernels.py's kernel where `on`, else eager."""
    return kernels.run(on, _gather, route_kernels.gather, x, idx, dtype)


def positions(order: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's pairs as places in the sorted `order` (T, k), in expert order: the order add_slots adds them
    in, whether the rows come at once or a group of experts at a time."""
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return inv.view(-1, k).sort(dim=1).values


def _add_slots(acc, y: torch.Tensor, pos: torch.Tensor, lo: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows y of the sorted pairs lo .. lo + len(y) added to their tokens' rows of acc (fp32 (T, D); None: zero)
    in the order of pos (T, k; positions()), one slot after another in fp32, written in `dtype` (T, D). The
    sum's order is the experts', so rows added a group of experts at a time give the bits of all at once."""
    n = y.shape[0]
    out = y.new_zeros(pos.shape[0], y.shape[-1], dtype=torch.float32) if acc is None else acc
    for j in range(pos.shape[1] if n else 0):
        row = pos[:, j] - lo
        if n == pos.numel():  # every row (a whole block): each slot hits
            out = out + y.index_select(0, row).float()
            continue
        hit = ((row >= 0) & (row < n))[:, None]
        out = torch.where(hit, out + y.index_select(0, row.clamp(0, n - 1)).float(), out)
    return out.to(dtype)


def add_slots(on: bool, acc, y: torch.Tensor, pos: torch.Tensor, lo: int, dtype: torch.dtype) -> torch.Tensor:
    """_add_slots: where `on` (kernels.on), model/slot_sum.py's Triton kernel, else eager."""
    return kernels.run(on, _add_slots, slot_sum.add_slots, acc, y, pos, lo, dtype)


class _Combine(torch.autograd.Function):
    """The adjoint of _Spread: sorted pair rows y (T k, H) added to their tokens' rows of acc (fp32 (T, H): the
    residual and what the block added to it; None: zero) in fp32 and left in fp32 (the residual's dtype: no
    rounding to y's between); its backward hands acc the gradient as it is and each pair its token's in y's
    dtype (a gather, no accumulation)."""

    @staticmethod
    def forward(fn, acc, y, src, pos, on):
        fn.save_for_backward(src)
        fn.dtype, fn.acc, fn.on = y.dtype, acc is not None, on
        return add_slots(on, acc, y, pos, 0, torch.float32)

    @staticmethod
    def backward(fn, g):
        (src,) = fn.saved_tensors
        return g if fn.acc else None, gather(fn.on, g, src, fn.dtype), None, None, None


def _glu(y: torch.Tensor, ws: torch.Tensor, gpt_oss: bool, limit: float, alpha: float) -> torch.Tensor:
    """The experts' gated activation of their gate/up rows y (T k, 2 I), times each row's routing weight ws (fp32,
    (T k, 1)), in y's dtype: SwiGLU of [gate; up], or gpt-oss's clamped SwiGLU of interleaved gate and up."""
    if gpt_oss:
        g, u = y[:, ::2].float().clamp(max=limit), y[:, 1::2].float().clamp(-limit, limit)
        return ((u + 1) * (g * torch.sigmoid(g * alpha)) * ws).to(y.dtype)
    g, u = y.float().chunk(2, dim=-1)
    return (F.silu(g) * u * ws).to(y.dtype)


def _act(on: bool, y: torch.Tensor, ws: torch.Tensor, s, counts: list[int] | None = None) -> torch.Tensor:
    """The experts' gated activation (_glu) of the gate/up rows y, weighted by ws: model/glu.py's kernels where
    `on`. Eagerly, where the experts run as a loop (`counts`: each one's rows), an expert's rows at a time: a
    CPU's vectorized exp leaves the last elements of a run to a scalar exp that rounds otherwise, so a row's bits
    would hang on the rows beside it, which expert groups change."""
    args = (s.model_type == "gpt_oss", float(s.swiglu_limit), float(s.swiglu_alpha))
    if on or counts is None:
        return kernels.run(on, _glu, glu.activation, y, ws, *args)
    ends = list(accumulate(counts))
    rows = [_glu(y[a:b], ws[a:b], *args) for a, b in zip([0, *ends], ends) if b > a]
    return torch.cat(rows) if rows else y.new_empty(0, y.shape[1] // 2)


def sort_pairs(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The (token, slot) pairs of the chosen experts (T, k), sorted by expert, stably. The key is one byte where
    the experts fit (two elsewhere): a GPU's radix sort takes a pass per byte of it, eight over int64."""
    key = chosen.reshape(-1)
    if n_experts <= 1 << 15:
        key = key.to(torch.uint8 if n_experts <= 1 << 8 else torch.int16)
    return torch.argsort(key, stable=True)


def _pairs(chosen: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, ...]:
    order, per = sort_pairs(chosen, n_experts), _counts(chosen, n_experts)
    k = chosen.shape[1]
    return order, positions(order, k), order // k, per, per.cumsum(0).to(torch.int32)


def pairs(on: bool, chosen: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, ...]:
    """The (token, slot) pairs of the chosen experts (T, k), as the experts take them: (order: the pairs sorted by
    expert, stably (sort_pairs); pos: each token's places in order, in expert order (positions); src: each sorted
    pair's token; per: the pairs of each expert, int64 (E,); ends: where each expert's pairs end in order, int32
    (E,), the grouped matmul's offsets). model/route_kernels.py's kernels where `on` and they take the sizes (the
    same bits), else torch's ops."""
    gpu = on and route_kernels.sorts(chosen, n_experts)
    return kernels.run(gpu, _pairs, route_kernels.pairs, chosen, n_experts)


def _experts_of(s, chosen: torch.Tensor, sel: torch.Tensor) -> torch.Tensor | None:
    """The expert of each sorted pair `sel` (ids in the (T k) slots), for gpt-oss's gate/up bias; None elsewhere."""
    return chosen.reshape(-1).index_select(0, sel) if s.model_type == "gpt_oss" else None


def _rows(
    w: dict[str, torch.Tensor],
    xs: torch.Tensor,
    ws: torch.Tensor,
    experts: torch.Tensor | None,
    ends,
    counts,
    on: bool,
    s,
) -> torch.Tensor:
    """The routed rows xs (sorted by expert; `experts`: each row's expert among w's, for gpt-oss) through their
    experts: the gate/up projection, the gated activation weighted by each row's routing weight ws (model/glu.py's
    kernels where `on`), the down projection."""
    gu, down = w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"]
    if s.model_type == "gpt_oss":  # x @ W + b, gate and up interleaved, W (in, out)
        a = _act(on, _mm(xs, gu, ends, counts, w["mlp.experts.gate_up_proj_bias"], experts), ws, s, counts)
        return _mm(a, down, ends, counts)
    # F.linear's layout, [gate; up] in the rows
    a = _act(on, _mm(xs, gu.transpose(1, 2), ends, counts), ws, s, counts)
    return _mm(a, down.transpose(1, 2), ends, counts)


def _grouped(h: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the experts' projections are torch's grouped matmuls (else a loop over the experts with tokens):
    bf16 on a Hopper GPU, every row of tokens h and of an expert's weights w (E, a, b) 16-byte aligned (its
    kernel refuses others: a hidden or expert size not a multiple of 8). On Blackwell its backward gives an
    expert without rows a gradient that is not zero (pytorch/pytorch#172439), so other GPUs take the loop until
    that is fixed."""
    aligned = h.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0
    return (
        _GROUPED is not None
        and h.is_cuda
        and h.dtype == torch.bfloat16
        and aligned
        and _hopper(h.device.index)
    )


@functools.cache
def _hopper(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def shared(w: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """qwen2_moe's shared expert behind its sigmoid gate, on tokens h (T, H): fp32 (T, H)."""
    sg, su, sd = (w[f"mlp.shared_expert.{n}_proj.weight"] for n in ("gate", "up", "down"))
    out = F.linear(F.silu(F.linear(h, sg)) * F.linear(h, su), sd).float()
    return torch.sigmoid(F.linear(h, w["mlp.shared_expert_gate.weight"]).float()) * out


def experts(
    w: dict[str, torch.Tensor],
    h: torch.Tensor,
    ctx,
    valid: torch.Tensor | None = None,
    into: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The MoE MLP of tokens h (T, H) in the compute dtype added to `into` (fp32 (T, H), the residual; None: zero):
    fp32 (T, H). `valid`: (T,) 1 on a sample's tokens, 0 on padding (None: all a sample's), for the routers'
    statistics.

    What needs no expert's weights is added first: qwen2_moe's shared expert, gpt-oss's down-projection biases
    (each token's k, weighted). Then every (token, expert) pair's row, weighted by its routing weight before the
    down projection (linear, so the same sum as transformers' weighting after it), is added to its token in
    expert order in fp32 (add_slots), left in fp32 for the residual: no (T k, H) tensor in fp32 or gathered
    twice.

    A block's attention part alone (expert groups, model/parts.py: w holds no expert's projections) routes the
    tokens, hands (h, chosen experts, routing weights) to ctx.routed for its groups (model/grouped.py) and
    returns what it added (None where `into` is None and it added nothing); each group then adds its experts'
    rows in the same order, so groups give the bits of the whole block."""
    s = ctx.spec
    chosen, weights = route(w, h, ctx, valid)
    base = None
    if s.model_type == "gpt_oss":  # kept whole in the attention part (model/parts.py)
        b = w["mlp.experts.down_proj_bias"].float()
        base = F.embedding_bag(chosen, b, per_sample_weights=weights, mode="sum")
    if s.shared_expert_intermediate_size:
        base = shared(w, h)
    acc = base if into is None else into if base is None else into + base
    if "mlp.experts.down_proj" not in w:
        ctx.routed.append((h, chosen, weights))
        return acc
    on = kernels.on(h)
    order, pos, src, per, ends = pairs(on, chosen, s.num_experts)
    grouped = _grouped(h, w["mlp.experts.down_proj"])
    ends, counts = (ends, None) if grouped else (None, per.tolist())
    xs = _Spread.apply(h, src, pos, on)
    ws = weights.reshape(-1).index_select(0, order)[:, None]  # fp32 (T k, 1)
    y = _rows(w, xs, ws, _experts_of(s, chosen, order), ends, counts, on, s)
    return _Combine.apply(acc, y, src, pos, on)
