"""Before anything large is allocated: the figures the run plans with (plan.resolve then settles what the
config leaves "auto"), the machine's RAM, and the NVMe tier. Each refuses what cannot run with a message
that names the setting to change."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from .config import Config
from .errors import ConfigError
from .optim import kernel
from .plan.hardware import TORCH_COPIES, HardwareSpec, this_machine
from .plan.runplan import RunPlan
from .sizes import gb
from .tiers.manager import TierManager
from .tiers.nvme import NvmeStore, discard, discard_stale, make_io, new_scratch
from .tiers.pieces import PieceStore
from .tiers.placement import (CK_PIECE_BYTES, CK_RING_BYTES, READ_AHEAD, ck_disk_bytes, copy_bytes, host_state_bytes, kind_bytes, least_host, ring_bytes,
                              ring_widths, spilled_bytes)
from .tiers.slab import host_cost


def hardware(device: torch.device, path: Path | None = None, host_kernel: str = "auto") -> HardwareSpec:
    """The figures a run plans with. On a GPU: plan.hardware.this_machine (the probe file `path`, else probe's
    default file, else the reference's rates with this machine's GPU memory and RAM); on a CPU: HardwareSpec.cpu.
    With torch's host AdamW (optim.host_kernel), an update into copies copies first."""
    if device.type != "cuda":
        import psutil

        hw = HardwareSpec.cpu(psutil.virtual_memory().total / 1e9, os.cpu_count() or 1)
    else:
        props = torch.cuda.get_device_properties(device)
        hw = this_machine((props.name, props.total_memory / 1e9), path)
    return dataclasses.replace(hw, **TORCH_COPIES) if kernel.wanted(host_kernel) is None else hw


def available_ram() -> int:
    """Bytes of memory this process can still take: the machine's available RAM, within a cgroup's limit."""
    import psutil

    avail = psutil.virtual_memory().available
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            avail = min(avail, int(Path(limit).read_text()) - int(Path(used).read_text()))
        except (OSError, ValueError):  # no such cgroup file, or "max": no limit
            continue
    return avail


def check_ram(cfg: Config, rp: RunPlan, numels: list[int], copied: frozenset[int], pin: bool,
              device: float = 0.0, avail: int | None = None, share: int = 1) -> None:
    """Refuses, before anything is allocated, a run whose host memory (the state placed in RAM, the staging
    ring, host checkpoints, speculation's copies, and `device` bytes: on a CPU the working set, in the same
    RAM) is more than this machine has available, naming the --host-gb and --nvme-dir that would fit: the
    kernel would kill it mid-run otherwise. `avail`: the RAM this process may take (default: what is available;
    one of `share` ranks of a host: its share, measured before any of them allocated); the refusal names the
    host's figures (--host-gb is the host's)."""
    t, where = cfg.tiers, rp.where()
    kb = kind_bytes(cfg.train.compute_dtype, rp.stream)
    acts = host_checkpoints(cfg, rp)
    need = host_need(cfg, rp, numels, copied, pin) + device
    avail = available_ram() if avail is None else avail
    if need <= avail:
        return
    rest = [0 if where.get((u, "master")) == "gpu" else n for u, n in enumerate(numels)]
    least = least_host(rest, kb, acts, host_cost) + device
    need, least, device, avail = need * share, least * share, device * share, avail * share  # the host's
    have = f"this machine has {gb(avail)} of RAM available"
    if least > avail * 0.9:
        raise ConfigError(f"the run needs {gb(need)} of host memory and {have}; even with every slab it can "
                          f"spill on disk it needs {gb(least)}"
                          + (f" ({gb(device)} of it the device's working set)" if device else "")
                          + ": use a machine with more RAM, or a smaller model or batch")
    fit = f"{(avail * 0.9 - device) / 1e9:.3g}"  # a tenth left for the process itself
    spill = f"--host-gb {fit}" + ("" if t.nvme_dir else " --nvme-dir DIR (a directory on a fast disk)")
    if t.host_gb:
        raise ConfigError(f"--host-gb {t.host_gb:g} is more than the RAM here, and the run needs {gb(need)} of it: "
                          f"{have}; pass {spill} to spill the rest to disk")
    raise ConfigError(f"the run needs {gb(need)} of host memory and {have}: pass {spill} to spill the rest "
                      "to disk")


def host_need(cfg: Config, rp: RunPlan, numels: list[int], copied, pin: bool) -> int:
    """Host bytes of a run: the slabs its plan puts in RAM, the staging ring, host checkpoints, and the copies
    of the `copied` units' master and moments (speculation under clipping)."""
    kb, where = kind_bytes(cfg.train.compute_dtype, rp.stream), rp.where()
    return (sum(host_state_bytes(numels, kb, where, host_cost).values())
            + ring_bytes(ring_widths(numels, where), kb, host_cost) + host_checkpoints(cfg, rp)
            + sum(copy_bytes(numels[u], host_cost) for u in copied))


def host_checkpoints(cfg: Config, rp: RunPlan) -> int:
    """Host bytes of the activation checkpoints the plan puts in RAM, and of the ring of those on NVMe."""
    tc, spec = cfg.train, cfg.model
    return (len(rp.checkpoints("host")) * host_cost(tc.batch_size // rp.gpus * tc.seq_len * spec.hidden_size
                                                    * rp.checkpoint_width)
            + (CK_RING_BYTES if rp.checkpoints("nvme") else 0))


def checkpoint_store(cfg: Config, rp: RunPlan, run_name: str) -> PieceStore | None:
    """The store of the activation checkpoints the plan puts on NVMe (None: none), in a new scratch directory
    under nvme_dir."""
    rows, t, tc = sorted(rp.checkpoints("nvme")), cfg.tiers, cfg.train
    if not rows:
        return None
    micro_bytes = rp.micro_batch * tc.seq_len * cfg.model.hidden_size * rp.checkpoint_width
    pieces = ck_disk_bytes(micro_bytes, tc.batch_size // rp.gpus // rp.micro_batch) // CK_PIECE_BYTES
    root = new_scratch(t.nvme_dir, run_name)
    try:
        return PieceStore(root, rows, pieces, make_io(t.io, t.io_threads))
    except BaseException:
        discard(root)
        raise


def nvme_tier(cfg: Config, rp: RunPlan, numels: list[int], dtypes: dict[str, torch.dtype],
              streamed: str, pin: bool, run_name: str, replace: bool) -> TierManager:
    """The run's store, in a new directory under nvme_dir, and its manager; `replace`: a resumed run first
    deletes the stores its killed processes left (scratch: the checkpoint holds the state)."""
    t, where = cfg.tiers, rp.where()
    kb = kind_bytes(cfg.train.compute_dtype, rp.stream)
    kinds = sorted(spilled_bytes(numels, kb, where))
    # numpy has no bfloat16: the compute-dtype copy is stored as its bits
    meta = {"model": cfg.to_dict()["model"], "compute_dtype": cfg.train.compute_dtype,
            **({"weights": "bfloat16 bits, as uint16"} if "weights" in kinds else {})}
    if replace:
        discard_stale(t.nvme_dir, run_name)
    units = {k: [u for (u, kk), tier in where.items() if kk == k and tier == "nvme"] for k in kinds}
    io = make_io(t.io, t.io_threads)
    root = new_scratch(t.nvme_dir, run_name)
    try:
        store = NvmeStore(root, numels, {k: "uint16" if k == "weights" else "float32" for k in kinds},
                          meta, io, create=True, units=units)
    except BaseException:
        discard(root)
        raise
    return TierManager(store, where, {k: dtypes[k] for k in kinds}, pin, depth=READ_AHEAD, streamed=streamed)
