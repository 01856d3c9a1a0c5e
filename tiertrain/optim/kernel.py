"""The one-pass host AdamW of csrc/adamw.cpp, built on first use by torch's C++ extension loader (a C++
compiler and ninja; the build is cached under ~/.cache/torch_extensions). Without them, or with
optim.host_kernel = "torch", the host AdamW is torch's fused kernel, an update into copies a copy first."""

from __future__ import annotations

import contextlib
import fcntl
import logging
from pathlib import Path

log = logging.getLogger("tiertrain")
SOURCE = Path(__file__).parent / "csrc" / "adamw.cpp"
# `stores` of the kernel: which outputs it writes with streamed (non-temporal) stores
STREAM_STATE, STREAM_COPY = 1, 2  # the master and moments into other buffers; the bf16 copy
# and above bit 8, how far ahead it prefetches master, gradient and moments, in blocks of 64 elements
# (0: not at all). The cores' prefetchers stop at each 4 KiB page, and on a loaded host 14 threads
# streaming four arrays then keep too few lines in flight: 16 blocks (4 KiB of each array) ahead ran
# 15% faster alone and 9-26% beside PCIe copies (bench/results/2026-11-23-H200-host-kernel-prefetch.md).
AHEAD = 16
NAME = "tiertrain_adamw"


def prefetch(blocks: int) -> int:
    """The `stores` bits of a prefetch `blocks` ahead."""
    return blocks << 8


_ext, _why = None, ""


def load():
    """The extension module, or None (why: `reason()`), built once per process."""
    global _ext, _why
    if _ext is None and not _why:
        try:
            from torch.utils.cpp_extension import load as build

            # -fopenmp only when compiling: at::parallel_for then runs on torch's own OpenMP runtime
            # (resolved when loaded), with its thread count; -ffp-contract=off: see the source
            with _build_lock():
                _ext = build(
                    name=NAME,
                    sources=[str(SOURCE)],
                    verbose=False,
                    extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"],
                )
        except Exception as e:  # no compiler, no ninja, a failed build: torch's kernel does the work
            _why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning(
                "tiertrain: the one-pass host AdamW did not build (%s); using torch's fused kernel", _why
            )
    return _ext


@contextlib.contextmanager
def _build_lock():
    """Torch's loader takes a lock file in the kernel's build directory for every load, the cached one's too, and
    waits forever for one a killed process left. Loads here hold an flock around it, which the kernel releases
    when its process dies: within it, a lock file is a killed load's, and goes. Says when the kernel is about
    to be built (the first run waits for it)."""
    from torch.utils.cpp_extension import _get_build_directory

    d = Path(_get_build_directory(NAME, verbose=False))
    with open(d / "tiertrain.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if (d / "lock").exists():
            log.warning(
                "tiertrain: removing %s, left by a load of the host AdamW that was killed", d / "lock"
            )
            (d / "lock").unlink(missing_ok=True)
        if not any(d.glob(f"{NAME}*.so")):
            log.warning("tiertrain: building the one-pass host AdamW (once, about 20 s; cached in %s)", d)
        yield


def reason() -> str:
    return _why


def wanted(choice: str):
    """The extension for optim.host_kernel `choice` ("auto": if it builds; "tiertrain": it must; "torch":
    never), or None."""
    if choice == "torch":
        return None
    ext = load()
    if ext is None and choice == "tiertrain":
        from ..errors import ConfigError

        raise ConfigError(
            f'optim.host_kernel = "tiertrain" but its build failed ({_why}); install a C++ '
            'compiler and ninja, or set optim.host_kernel = "auto" or "torch"'
        )
    return ext
