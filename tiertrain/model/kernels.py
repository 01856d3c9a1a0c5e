"""Which of the model's ops run as Triton kernels, and what happens where one fails to build.

model/glu.py, model/slot_sum.py and model/rope.py are Triton versions of ops that run eagerly on a CPU. A kernel
runs where `on` says (a GPU where triton runs); deterministic runs take them too, since their tiles are fixed and
their sums run in a fixed order. A kernel's first call failing (a machine without a ptxas for its GPU) leaves its
eager op in its place from then on, with one warning."""

from __future__ import annotations

import functools
import warnings

import torch

ENABLED = True  # dev/moe_gemm.py turns it off to time the eager ops
_BUILT: dict = {}  # each eager op's GPU version: its Triton kernel, or itself where that failed to build


@functools.cache
def has_triton() -> bool:
    """Whether triton runs here, on a GPU it supports."""
    try:
        from torch.utils._triton import has_triton as found

        return found()
    except ImportError:
        return False


def on(x: torch.Tensor) -> bool:
    """Whether ops on x run as Triton kernels: on a GPU with triton."""
    return ENABLED and x.is_cuda and has_triton()


def run(gpu: bool, eager, kernel, *args):
    """eager(*args), or where `gpu` (on) kernel(*args), its Triton version; a kernel whose first call fails (its
    forward pass's build) is replaced by its eager op from then on, with one warning. A backward kernel's build
    failing later raises: the two are built by the same compiler, so the first call is the test."""
    if not gpu:
        return eager(*args)
    fn = _BUILT.get(eager)
    if fn is not None:
        return fn(*args)
    try:
        fn, out = kernel, kernel(*args)
    except Exception as e:  # noqa: BLE001 - the eager call below raises again what is not the kernel's
        warnings.warn(f"the Triton kernel of {eager.__name__} failed, and it runs eagerly: {e}", stacklevel=2)
        fn, out = eager, eager(*args)
    _BUILT[eager] = fn
    return out
