"""Causal attention through the kernel the RunPlan names (train.attention): SDPA's "cudnn", "flash", "efficient" or
"math" backend, or "flash_attn" (the FlashAttention package, where it is installed); "" is torch's own choice (a CPU,
fp32 compute). Over (B, heads, T, head_dim), with fewer key/value heads (GQA): cuDNN, flash and FlashAttention take
them as they are; efficient and math get each repeated (an expand, whose backward is a plain sum: torch's own
repeat_interleave adds with index_add, which is not deterministic).

Deterministic backward passes (train.deterministic): a kernel's backward node runs under torch's deterministic mode,
switched on for that node alone (its hooks), so nothing else of the step is held to it (cuBLAS would need a
workspace setting). There flash runs FlashAttention 2's deterministic backward (dQ summed in a fixed order, in an
fp32 buffer per group of SMs: plan.attention.deterministic_workspace), efficient runs one key split. Math's backward
is matmuls and a softmax, deterministic as it is. torch's cuDNN backward has no deterministic mode (its dQ differs
run to run at length; torch refuses cuDNN in deterministic mode): the plan never takes it for a deterministic run.

Kept outputs (Kept, train.keep_attention): a block's forward pass keeps each call's output and log-sum-exp from the
kernel's own forward op (cuDNN's and flash's, SDPA's private ops; on a CPU its flash kernel's), and its recompute
replays them through the kernel's own backward op instead of running the forward again.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings

import torch
import torch.nn.functional as F

from ..modes import ATTENTION_KERNELS, KEEPING_KERNELS

_SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
BACKENDS = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
NATIVE_GQA = ("", "cudnn", "flash")  # SDPA's choices that take fewer key/value heads as they are


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel: str = "",
    deterministic: bool = False,
    kept: "Kept | None" = None,
):
    """Causal attention over (B, heads, T, head_dim); k and v may have fewer heads (GQA). `kernel`: the RunPlan's
    (""): torch's choice); `deterministic`: its backward pass deterministic (torch's choice then never cuDNN's);
    `kept`: the block's kept outputs (a forward pass records into it, the recompute replays it), where the kernel
    keeps any (keeps)."""
    if kept is not None and keeps(kernel, q, k, v):
        return (
            kept.replayed(q, k, v, kernel, deterministic)
            if kept.replaying
            else kept.recorded(q, k, v, kernel)
        )
    if kernel == "flash_attn":
        return _flash_attn(q, k, v, deterministic)
    gqa, det = q.shape[1] != k.shape[1], deterministic and q.is_cuda
    # torch's own GQA for efficient and math repeats with index_select, whose backward adds atomically
    if gqa and (kernel not in NATIVE_GQA or not _SDPA_GQA or (det and not kernel)):
        k, v, gqa = _repeat(k, q.shape[1]), _repeat(v, q.shape[1]), False
    with backends(kernel, det):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **({"enable_gqa": True} if gqa else {}))
    if det and o.requires_grad:
        _deterministic_backward(o)
    return o


def _repeat(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, kv heads, T, hd) -> (B, heads, T, hd), each key/value head repeated for its query heads in turn (the
    order of repeat_interleave)."""
    b, h, n, d = t.shape
    return t[:, :, None].expand(b, h, heads // h, n, d).reshape(b, heads, n, d)


def backends(kernel: str, deterministic: bool = False):
    """A context in which SDPA takes: the backend named (not "flash_attn", which is not SDPA's); torch's choice of
    all of them, but cuDNN's, for a deterministic GPU run; or torch's as it is (the all-in-GPU baseline runs in
    the first, bench/pipeline.py)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if kernel:
        return sdpa_kernel(getattr(SDPBackend, BACKENDS[kernel]))
    if deterministic:
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    return contextlib.nullcontext()


def _deterministic_backward(o: torch.Tensor, direct: bool = False) -> None:
    """Torch's deterministic mode on while the attention kernel's backward node runs (on the autograd engine's
    thread), as it was before after it; a kernel with no such node (math) needs none. `direct`: `o` is the
    kernel's own output (varlen_attn's), its node the kernel's whatever its name."""
    node = o.grad_fn
    for _ in range(4):  # the kernel's node, under any view SDPA adds
        if node is None:
            return
        if "Attention" in node.name() or direct:
            break
        node = next((f for f, _ in node.next_functions if f is not None), None)
    else:
        return
    before: list = []
    node.register_prehook(lambda grad_outputs: before.append(_deterministic_on()))
    node.register_hook(lambda grad_inputs, grad_outputs: _deterministic_off(before.pop()))


def _deterministic_on() -> tuple:
    """Torch's deterministic mode on for a kernel's backward; what it was, for _deterministic_off."""
    fill = torch.utils.deterministic
    was = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        fill.fill_uninitialized_memory,
    )
    fill.fill_uninitialized_memory = False  # the kernel writes its outputs whole: no NaN fill first
    _set_deterministic(True, False)
    return was


def _deterministic_off(was: tuple) -> None:
    _set_deterministic(*was[:2])
    torch.utils.deterministic.fill_uninitialized_memory = was[2]


def _set_deterministic(mode: bool, warn_only: bool) -> None:
    """torch.use_deterministic_algorithms without its import of inductor's config (seconds, the first time) and
    its setting of it (around attention's backward: no compiled code runs there)."""
    if hasattr(torch._C, "_set_deterministic_algorithms"):
        torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)


def keeps(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a kept output can stand in for this call's recompute, bit for bit: the kernel's own forward returns
    the log-sum-exp its own backward takes (modes.KEEPING_KERNELS: SDPA's cuDNN and flash on a GPU; on a CPU torch's
    choice, its flash kernel, where SDPA takes that kernel for these inputs)."""
    if q.is_cuda:
        return kernel in KEEPING_KERNELS and q.shape[-1] % 8 == 0  # SDPA pads other head sizes first
    if kernel:
        return False
    flash = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    return int(torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])) == flash


class Kept:
    """A block's attention outputs of one micro-batch, kept from its forward pass for its backward pass (a unit's
    RunPlan entry: attention_kept): each call's output, log-sum-exp and what the kernel's backward takes besides,
    in the order of the calls. The forward pass records them; the recompute replays them in the same order through
    the kernel's own backward, and runs no attention forward. The bits are the recompute's: the output is the op's
    SDPA runs, the same bits whether it writes the log-sum-exp or not (cuDNN and flash on an H200:
    bench/results/2026-11-29-issue42-kept-attention.md), and its backward is the one SDPA's graph runs."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.replaying = False
        self._next = 0

    def replay(self) -> "Kept":
        """The same outputs, for the recompute."""
        self.replaying, self._next = True, 0
        return self

    def nbytes(self) -> int:
        return sum(o.nbytes + lse.nbytes for o, lse, _ in self.calls)

    def recorded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str) -> torch.Tensor:
        o, lse, extra = _own_forward(kernel, q, k, v)
        self.calls.append((o, lse, extra))
        return o

    def replayed(self, q, k, v, kernel: str, deterministic: bool) -> torch.Tensor:
        if self._next == len(self.calls):  # the forward pass kept none (it ran no such call)
            return attention(q, k, v, kernel, deterministic)
        o, lse, extra = self.calls[self._next]
        if o.shape != q.shape:
            raise RuntimeError(
                f"a kept attention output of shape {tuple(o.shape)} replayed for {tuple(q.shape)}"
            )
        self.calls[self._next] = None  # the graph holds it from here: it goes with the graph
        self._next += 1
        return _Replayed.apply(q, k, v, o, lse, (kernel, deterministic, extra))


def _own_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(output, log-sum-exp, the rest the backward takes) of the kernel's own forward op, as SDPA calls it."""
    if not q.is_cuda:  # torch's choice on a CPU: its flash kernel (keeps)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        return o, lse, ()
    if kernel == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    else:
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)
    # beside the output and log-sum-exp: the sequences' offsets and lengths, the random state (dropout's, unused)
    return r[0], r[1], tuple(r[2:8])


class _Replayed(torch.autograd.Function):
    """A kept output in the recompute's graph: its backward is the kernel's own, from the kept log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, o, lse, how):
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.how = how
        return o.detach()

    @staticmethod
    def backward(ctx, do):
        kernel, deterministic, extra = ctx.how
        q, k, v, o, lse = ctx.saved_tensors
        if not q.is_cuda:
            d = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do, q, k, v, o, lse, 0.0, True
            )
        else:
            with _deterministic(deterministic):
                if kernel == "cudnn":
                    cq, ck, mq, mk, seed, offset = extra
                    d = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                        do, q, k, v, o, lse, seed, offset, None, cq, ck, mq, mk, 0.0, True
                    )
                else:
                    cq, ck, mq, mk, rng, unused = extra
                    d = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                        do, q, k, v, o, lse, cq, ck, mq, mk, 0.0, True, rng, unused
                    )
        return (*d, None, None, None)


@contextlib.contextmanager
def _deterministic(on: bool):
    """Torch's deterministic mode around a kernel's backward where asked (as _deterministic_backward's hooks)."""
    was = _deterministic_on() if on else None
    try:
        yield
    finally:
        if was is not None:
            _deterministic_off(was)


def _flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, deterministic: bool) -> torch.Tensor:
    """The FlashAttention package's kernel, which takes (B, T, heads, hd) and GQA as they are."""
    from flash_attn import flash_attn_func

    o = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, deterministic=deterministic
    )
    return o.transpose(1, 2)


def usable(device: torch.device, head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> list[str]:
    """The kernels that run causal attention of this shape and dtype on `device`, forward and backward (a trial
    on 256 tokens: each backend has its own limits of head size, dtype and GPU)."""
    out = []
    for kernel in ATTENTION_KERNELS:
        if kernel == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
            continue
        try:
            with warnings.catch_warnings():  # SDPA warns why each backend it did not take could not run
                warnings.simplefilter("ignore")
                q = torch.randn(1, heads, 256, head_dim, device=device, dtype=dtype, requires_grad=True)
                k, v = (torch.randn(1, kv_heads, 256, head_dim, device=device, dtype=dtype) for _ in "kv")
                attention(q, k.requires_grad_(), v.requires_grad_(), kernel).sum().backward()
        except (RuntimeError, ImportError, ValueError, TypeError):  # no such kernel here
            continue
        out.append(kernel)
    return out
