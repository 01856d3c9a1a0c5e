"""Measures the machine: its ceilings with the runtime's own code paths (PCIe copies from pinned slabs, GPU
matmul rate, host AdamW rate, the disk), the figures a run plans with, and the RAM it can take. torch is
imported inside the functions: `plan` never needs it."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from .errors import ConfigError
from .modes import Kind
from .plan.gpus import named, this_machine
from .plan.hardware import PROBE_FILE, PROBE_SOURCE, TORCH_COPIES, HardwareSpec
from .tiers.placement import CK_PIECE_BYTES

ATTENTION_SHAPE = (
    16384,
    32,
    8,
    128,
)  # the probe's attention: tokens, query heads, key/value heads, head size


def run_hardware(
    device,
    path: Path | None = None,
    host_kernel: str = "auto",
    model=None,
    dtype: str = "bfloat16",
    wanted="auto",
    gpu: str = "",
) -> HardwareSpec:
    """The figures a run on `device` (a torch.device) plans with. On a GPU: plan.gpus.this_machine (the probe
    file `path`, else probe's default file, else the figures of the GPU `gpu` names ([hardware] gpu) or of this
    GPU's own name, else the reference's rates; with this machine's GPU memory and RAM), its attention kernels
    those that run `model` (a ModelSpec) in `dtype` here (attention_here; `wanted`: the config's
    train.attention); on a CPU: HardwareSpec.cpu (`gpu` and `path` checked, unused). With torch's host AdamW
    (optim.host_kernel), an update into copies copies first."""
    import psutil

    from .optim import kernel

    if gpu:
        named(gpu)  # an unknown name: one line listing the known ones, before anything is allocated
    if path is not None:  # read on a CPU too (unused there): a file that is no probe's is one line anywhere
        HardwareSpec.load(path)
    if device.type != "cuda":
        hw = HardwareSpec.cpu(psutil.virtual_memory().total / 1e9, os.cpu_count() or 1)
    else:
        import torch

        props = torch.cuda.get_device_properties(device)
        hw = this_machine((props.name, props.total_memory / 1e9), path, gpu)
    if model is not None:
        hw = attention_here(hw, device, model, dtype, wanted, path is not None or PROBE_FILE.is_file())
    return dataclasses.replace(hw, **TORCH_COPIES) if kernel.wanted(host_kernel) is None else hw


def attention_here(hw: HardwareSpec, device, model, dtype: str, wanted: str, probed: bool) -> HardwareSpec:
    """`hw` with the attention figures of the kernels that run `model`'s attention in `dtype` on `device`
    (model.attention.usable); without a probe (`probed` false) cuDNN's reference figures only on Hopper or later
    (they are an H100's: elsewhere the plan takes flash). A kernel the config names that cannot run here (a GPU
    or a CPU) is refused, before anything is allocated."""
    import torch

    from .model.attention import usable

    if device.type != "cuda" and wanted == "auto":  # a CPU: torch's own kernel, no trial needed
        return hw
    here = usable(device, model.hd, model.num_attention_heads, model.n_kv_heads, getattr(torch, dtype))
    if wanted != "auto" and wanted not in here:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "a CPU"
        raise ConfigError(
            f'train.attention = "{wanted}" cannot run this model here (head size {model.hd}, {dtype}, '
            f'{where}): set train.attention to "auto" or one of ' + ", ".join(f'"{k}"' for k in here)
        )
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    rates = {k: r for k, r in hw.attention_tflops.items() if k in here and (probed or hopper or k != "cudnn")}
    return dataclasses.replace(hw, attention_tflops=rates)


def available_ram() -> int:
    """Bytes of memory this process can still take: the machine's available RAM, within a cgroup's limit."""
    import psutil

    avail = psutil.virtual_memory().available
    for limit, used in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            avail = min(avail, int(Path(limit).read_text()) - int(Path(used).read_text()))
        except (OSError, ValueError):  # no such cgroup file, or "max": no limit
            continue
    return avail


def _timed_cuda(fn, reps: int) -> float:
    """Median seconds of fn() on the current stream, after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def pcie_rates(nbytes: int = 1 << 30, reps: int = 5) -> dict[str, float]:
    """GB/s: pinned H2D, pinned D2H, both at once (sum), pageable H2D."""
    import torch

    from .tiers.slab import alloc_slab

    n = nbytes // 4
    host = alloc_slab(n, torch.float32, pin=True)
    host2 = alloc_slab(n, torch.float32, pin=True)
    pageable = torch.empty(n, dtype=torch.float32)
    dev, dev2 = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    host.uniform_()
    pageable.uniform_()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    out = {
        "h2d_gbs": nbytes / _timed_cuda(lambda: dev.copy_(host, non_blocking=True), reps) / 1e9,
        "d2h_gbs": nbytes / _timed_cuda(lambda: host.copy_(dev, non_blocking=True), reps) / 1e9,
        "pageable_h2d_gbs": nbytes / _timed_cuda(lambda: dev.copy_(pageable), reps) / 1e9,
    }

    def both():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    out["bidir_gbs"] = 2 * nbytes / _timed_cuda(both, reps) / 1e9
    return out


def matmul_tflops(dtype_name: str = "bfloat16", n: int = 8192, reps: int = 10) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    return 2 * n**3 / _timed_cuda(lambda: a @ b, reps) / 1e12


def attention_rates(
    shape: tuple[int, int, int, int] = ATTENTION_SHAPE, reps: int = 5
) -> dict[str, list[float]]:
    """{kernel: [forward, backward, deterministic backward]} TFLOP/s of causal attention of `shape` (tokens, query
    heads, key/value heads, head size) in bf16, through the runtime's model.attention, for every kernel that runs
    here but math (memory squared in the length: never the plan's). FLOPs as the model counts them
    (spec.attention_flops_per_token): the forward 2 x heads x hd x T (T + 1), QK^T and AV over the causal half,
    the backward twice that (the kernels' own backward does 2.5 times the forward: 0.8x these). A backward is
    timed as forward and backward less the forward; 0: no deterministic backward (cuDNN)."""
    import torch

    from .model.attention import usable

    t, h, kv, hd = shape
    kernels = usable(torch.device("cuda"), hd, h, kv, torch.bfloat16)
    return {k: _attention_rate(k, shape, reps) for k in kernels if k != "math"}


def _attention_rate(kernel: str, shape: tuple[int, int, int, int], reps: int) -> list[float]:
    import torch

    from .model.attention import attention
    from .modes import DETERMINISTIC_KERNELS

    t, h, kv, hd = shape
    flops = 2 * h * hd * t * (t + 1)
    q = torch.randn(1, h, t, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, kv, t, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    do = torch.randn_like(q)
    with torch.no_grad():
        fwd = _timed_cuda(lambda: attention(q, k, v, kernel), reps)

    def backward(det: bool) -> float:
        both = _timed_cuda(lambda: torch.autograd.grad(attention(q, k, v, kernel, det), (q, k, v), do), reps)
        return 2 * flops / (both - fwd) / 1e12

    det = backward(True) if kernel in DETERMINISTIC_KERNELS else 0.0
    return [flops / fwd / 1e12, backward(False), det]


def host_adam_rate(
    n_params: int = 1 << 27,
    compute_copy: bool = True,
    reps: int = 5,
    into_copies: bool = False,
    host_kernel: str = "auto",
    stores: int | None = None,
    threads: int | None = None,
    pin: bool | None = None,
) -> float:
    """Parameters per second of the runtime's host AdamW, run as the runtime runs it: its kernel, called
    on a worker thread with the runtime's thread count (`threads`, else optim.adamw.adam_threads), on
    slabs pinned where a GPU is (`pin`, else so); with the rounding into the bf16 copy when
    `compute_copy`; into other buffers, as a speculative update writes, when `into_copies`; `stores`: the
    one-pass kernel's streamed stores, else the runtime's choice. Over arrays far larger than the
    caches; the median of `reps` updates after one to warm up."""
    import torch

    from .optim.adamw import HostAdamW, adam_pool
    from .sections import OptimConfig
    from .tiers.host import HostStore
    from .tiers.slab import SlabLayout

    lay = SlabLayout.build([("w", (n_params // 1024, 1024))])
    pin = torch.cuda.is_available() if pin is None else pin
    host = HostStore([lay], torch.bfloat16, pin=pin, compute_copy=compute_copy)
    for k in (Kind.MASTER, Kind.GRAD):
        host.slab(0, k).uniform_(-1, 1)
    if into_copies:
        host.add_copies([0])
    opt = HostAdamW(host, [lay], OptimConfig(host_kernel=host_kernel))
    if stores is not None:
        opt.stores = stores

    def timed() -> list[float]:
        opt.update_unit(0, 1, 1e-4, 1.0, into_copies)
        times = []
        for step in range(2, 2 + reps):
            t0 = time.perf_counter()
            opt.update_unit(0, step, 1e-4, 1.0 if into_copies else 0.5, into_copies)
            times.append(time.perf_counter() - t0)
        return times

    with adam_pool(threads) as pool:
        times = pool.submit(timed).result()
    return lay.numel / sorted(times)[len(times) // 2]


def probe(gpu: bool = True) -> dict:
    import torch

    from .optim import kernel

    out: dict = {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host_adam_params_per_s": host_adam_rate(),
        "host_adam_fp32_stream_params_per_s": host_adam_rate(compute_copy=False),
        "host_adam_into_copies_params_per_s": host_adam_rate(compute_copy=False, into_copies=True),
        "host_kernel": "tiertrain" if kernel.load() else "torch",
    }
    if gpu and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["gpu_mem_gb"] = torch.cuda.get_device_properties(0).total_memory / 1e9
        out.update(pcie_rates())
        out["bf16_tflops"] = matmul_tflops("bfloat16")
        out["fp32_tflops"] = matmul_tflops("float32")
        out["gpu_sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        out["attention_tflops"] = attention_rates()
    return out


def disk_rates(
    directory: str, nbytes: int = 1 << 30, backend: str = "auto", threads: int = 16
) -> tuple[float, float, float]:
    """GB/s of whole-file direct I/O in `directory` through the runtime's backend: (read, write, both at
    once: half the bytes read from one file while the other half is written to another, summed)."""
    from .tiers.nvme import make_io

    io = make_io(backend, threads)
    try:
        return _disk_rates(directory, nbytes, io)
    finally:
        io.close()


def _disk_rates(directory: str, nbytes: int, io) -> tuple[float, float, float]:
    import tempfile

    import torch

    from .tiers.slab import alloc_slab

    buf = alloc_slab(nbytes // 4, torch.float32, pin=torch.cuda.is_available())
    buf.uniform_()
    half = buf.numel() // 2
    with (
        tempfile.NamedTemporaryFile(dir=directory, prefix=".tiertrain-probe-") as f,
        tempfile.NamedTemporaryFile(dir=directory, prefix=".tiertrain-probe-") as g,
    ):
        f.truncate(nbytes)
        g.truncate(nbytes // 2)
        t0 = time.perf_counter()
        io.write(f.name, buf).result()
        os.fsync(f.fileno())
        w = nbytes / (time.perf_counter() - t0) / 1e9
        _evict(f.fileno())  # a backend that buffers would read the page cache, not the disk
        t0 = time.perf_counter()
        io.read(f.name, buf).result()
        r = nbytes / (time.perf_counter() - t0) / 1e9
        _evict(f.fileno())
        t0 = time.perf_counter()
        jobs = [io.read(f.name, buf[:half]), io.write(g.name, buf[half:])]
        for j in jobs:
            j.result()
        os.fsync(g.fileno())
        both = nbytes / (time.perf_counter() - t0) / 1e9
    return r, w, both


def ck_writer_rate(
    directory: str, backend: str = "auto", threads: int = 16, counts=(1, 2, 4, 8, 16), total: int = 16
) -> tuple[int, float]:
    """(pieces, GB/s) of the NVMe checkpoints' writer's path: pieces of CK_PIECE_BYTES from pinned buffers, each to
    a preallocated file of its own (tiers.pieces), through the runtime's I/O backend, with 1, 2, 4... pieces in
    flight (each pass after a first, untimed one, as a step's writes find their files written); the fewest pieces
    that reach 95% of the best rate, and that rate, with the files' fsync."""
    import tempfile
    from collections import deque

    import torch

    from .tiers.nvme import make_io
    from .tiers.slab import alloc_slab

    io = make_io(backend, threads)
    try:
        with tempfile.TemporaryDirectory(dir=directory, prefix=".tiertrain-probe-") as d:
            files = [Path(d) / str(i) for i in range(total)]
            for f in files:
                fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
                os.posix_fallocate(fd, 0, CK_PIECE_BYTES)
                os.close(fd)
            bufs = [
                alloc_slab(CK_PIECE_BYTES // 4, torch.float32, torch.cuda.is_available())
                for _ in range(max(counts))
            ]
            for b in bufs:
                b.uniform_()

            def written(n: int) -> float:
                t0, flight = time.perf_counter(), deque()
                for i, f in enumerate(files):
                    if len(flight) >= n:
                        flight.popleft().result()
                    flight.append(io.write(f, bufs[i % n]))
                for w in flight:
                    w.result()
                for f in files:
                    fd = os.open(f, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
                return total * CK_PIECE_BYTES / (time.perf_counter() - t0) / 1e9

            written(max(counts))
            rates = {n: written(n) for n in counts}
    finally:
        io.close()
    best = max(rates.values())
    n = min(n for n in counts if rates[n] >= 0.95 * best)
    return n, rates[n]


def _evict(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def spec_of(m: dict, host_ram_gb: float, source: str):
    """The HardwareSpec of probe()'s figures `m` (the reference's where it measured none)."""
    from .plan.hardware import REFERENCE

    spec = HardwareSpec(
        host_ram_gb=host_ram_gb,
        cpu_count=m["cpu_count"],
        host_adam_params_per_s=m["host_adam_fp32_stream_params_per_s"],
        host_adam_copy_params_per_s=m["host_adam_params_per_s"],
        out_of_place=m["host_adam_into_copies_params_per_s"]
        / m["host_adam_fp32_stream_params_per_s"],  # of its kernel
        out_of_place_dram_bytes=0.0
        if m["host_kernel"] == "tiertrain"
        else TORCH_COPIES["out_of_place_dram_bytes"],
        source=source,
    )
    if "gpu" in m:
        spec.gpu, spec.gpu_mem_gb = m["gpu"], m["gpu_mem_gb"]
        spec.h2d_gbs, spec.d2h_gbs, spec.bidir_gbs = m["h2d_gbs"], m["d2h_gbs"], m["bidir_gbs"]
        spec.bf16_tflops, spec.fp32_tflops = m["bf16_tflops"], m["fp32_tflops"]
        if "attention_tflops" in m:  # a bench's probe from before the kernels were measured: the reference's
            spec.attention_tflops, spec.gpu_sms = m["attention_tflops"], m["gpu_sms"]
    else:
        spec.gpu, spec.gpu_mem_gb = REFERENCE.gpu + " (reference: no GPU here)", REFERENCE.gpu_mem_gb
    return spec


def probe_spec(nvme_dir: str | None = None):
    """A HardwareSpec of this machine, and notes on what could not be measured (kept at reference)."""
    import psutil
    import torch

    m = probe(gpu=True)
    spec = spec_of(m, psutil.virtual_memory().total / 1e9, f"{PROBE_SOURCE}, {time.strftime('%Y-%m-%d')}")
    notes = []
    if not torch.cuda.is_available():
        notes.append("no CUDA GPU: GPU memory, PCIe and matmul rates are the reference H200's")
    if nvme_dir:
        spec.disk_read_gbs, spec.disk_write_gbs, spec.disk_mixed_gbs = disk_rates(nvme_dir)
        spec.ck_pieces, spec.ck_write_gbs = ck_writer_rate(nvme_dir)
    else:
        notes.append("no --nvme-dir: disk rates (and the checkpoint writer's) are the reference machine's")
    notes.append(
        "compute efficiency, attention efficiency and AdamW contention are the reference fit (docs/performance.md)"
    )
    return spec, notes
