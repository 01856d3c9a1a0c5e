"""Before anything large is allocated: the run's plan (which settles what the config leaves "auto"),
where every slab lives, which units update on the GPU, and the NVMe tier. Each step refuses what
cannot run with a message that names the setting to change."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import AUTO, Config
from .config import fixed as given
from .errors import ConfigError
from .optim import kernel
from .plan.hardware import REFERENCE, TORCH_COPIES, HardwareSpec
from .plan.planner import Plan
from .plan.resolve import search
from .sizes import budget, gb
from .tiers.manager import TierManager
from .tiers.nvme import NvmeStore, discard, discard_stale, make_io, new_scratch
from .tiers.placement import (RING_SLOTS, alternate_from_last, copy_bytes, disk_bytes, gpu_updated, host_state_bytes, kind_bytes, least_host, place,
                              place_within, resident_units, ring_bytes, ring_widths, spilled_bytes, update_candidates)
from .tiers.slab import host_cost, torch_pinned_cost

HARDWARE_FILE = Path.home() / ".cache" / "tiertrain" / "hardware.json"  # written by `tiertrain probe`

Where = dict[tuple[int, str], str]


def hardware(device: torch.device, path: Path | None = None) -> HardwareSpec:
    """The figures the plan uses: the `tiertrain probe` file `path`, else the one `probe` saves by default if
    there is one, else the reference; the GPU memory is this GPU's."""
    gpu_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
    if path is None and HARDWARE_FILE.is_file():
        path = HARDWARE_FILE
    return dataclasses.replace(HardwareSpec.load(path) if path else REFERENCE, gpu_mem_gb=gpu_gb)  # a copy


@dataclass(frozen=True)
class Settled:
    """What the config leaves to the plan ("auto", 0, -1), settled for this run. The Config is never written:
    config.toml stays what the user asked for, and the RunPlan records what was chosen."""
    stream: str  # "compute" or "master"
    activations: str  # "gpu" or "host"
    micro_batch: int
    speculate_units: int  # how many of the units the host updates from RAM speculate
    speculate_gpu: bool  # the GPU-updated units speculate too
    resident_gb: float  # GPU memory for the whole state of the first units
    chosen: tuple[str, ...]  # the settings the plan (or the CPU rules) chose


def settle(cfg: Config, device: torch.device, micro: int | None = None,
           hardware_file: Path | None = None) -> tuple[Plan | None, Settled]:
    """(the plan of this exact run, or None without a GPU or when it does not fit; the settled choices).
    Where the config leaves tiers.stream, tiers.activations, train.micro_batch_size, optim.speculate_units,
    optim.speculate_gpu_updates and tiers.gpu_resident_gb to the plan ("auto"): its choice
    on a GPU, else the cheapest copies, the largest micro-batch of at most 8 sequences, every unit
    speculated when that costs no memory or no host budget is set, and no resident units. On CUDA a run
    whose GPU memory the plan says will not fit stops here, saying what to lower. `micro`: the micro-batch
    a resumed run ran with, kept where the config leaves it to the plan; `hardware_file`: see hardware()."""
    t, tc, o = cfg.tiers, cfg.train, cfg.optim
    fixed = {"stream": given(t.stream), "activations": given(t.activations),
             "micro": given(tc.micro_batch_size) or micro, "speculate": given(o.speculate_units),
             "speculate_gpu": given(o.speculate_gpu_updates)}
    resident = t.gpu_resident_gb
    if t.gpu_update_units not in (AUTO, 0) and tc.compute_dtype == "bfloat16" and fixed["stream"] is None:
        fixed["stream"] = "master"  # the GPU update makes the weights from the fp32 master (as resolve.search)
    p = None
    if device.type == "cuda":  # the cost model is the GPU pipeline's
        hw = hardware(device, hardware_file)
        if kernel.wanted(o.host_kernel) is None:  # torch's kernel: an update into copies copies first
            hw = dataclasses.replace(hw, **TORCH_COPIES)
        p = search(cfg, hw, t.host_gb or 1e9, hw.gpu_mem_gb, t.nvme_gb or (1e9 if t.nvme_dir else None), "run",
                   micro=micro, advise=False)
    if p is not None and not p.fits and p.why.startswith("GPU"):
        fixes = [*([f"lower tiers.gpu_resident_gb ({resident:g})"] if resident != AUTO and resident > 0 else []),
                 *(["lower train.micro_batch_size"] if fixed["micro"] else []),
                 *(['set tiers.activations="host"'] if fixed["activations"] == "gpu" else []),
                 "lower train.seq_len"]
        raise ConfigError(f"{p.why}: " + ", or ".join(fixes))
    # without a plan: every unit speculates when that costs no memory (clipping off) or no host budget is set
    free = o.grad_clip == 0 or not t.host_gb
    names = {"stream": "stream", "activations": "activations", "micro": "micro-batch", "speculate": "speculation",
             "speculate_gpu": "GPU updates' speculation"}
    chosen = tuple([names[k] for k, v in fixed.items() if v is None] + (["resident GB"] if resident == AUTO else []))
    settled = Settled(
        stream=fixed["stream"] or (p.stream if p else "compute" if tc.compute_dtype == "bfloat16" else "master"),
        activations=fixed["activations"] or (p.activations if p else "gpu"),
        micro_batch=fixed["micro"] or (p.micro_batch if p else max(m for m in range(1, 9) if tc.batch_size % m == 0)),
        speculate_units=fixed["speculate"] if fixed["speculate"] is not None else
        p.speculated if p else len(cfg.model.units()) if free else 0,
        speculate_gpu=fixed["speculate_gpu"] if fixed["speculate_gpu"] is not None else
        (p.gpu_speculated if p else free),
        resident_gb=(p.resident_gb if p else 0.0) if resident == AUTO else resident,
        chosen=chosen)
    return (p if p is not None and p.fits else None), settled


def place_state(cfg: Config, s: Settled, numels: list[int], pin: bool) -> Where:
    """Resident units' slabs on the GPU; every other slab under tiers.host_gb: all in RAM when it fits,
    else on NVMe by policy with the staging ring reserved. Refuses what cannot run."""
    t, tc = cfg.tiers, cfg.train
    kb = kind_bytes(tc.compute_dtype, s.stream)
    resident = resident_units(numels, kb, s.resident_gb * 1e9)
    rest = [0 if u in resident else n for u, n in enumerate(numels)]
    where = place(rest, kb)
    if t.host_gb:
        acts = _host_checkpoints(cfg, s, pin)
        where, ring, total = place_within(rest, kb, t.host_gb * 1e9, acts, host_cost)
        if where is None or ring:
            least = least_host(rest, kb, acts, host_cost)
            if not t.nvme_dir:
                raise ConfigError(f"the state needs {gb(total)} of host memory and --host-gb is "
                                  f"{t.host_gb:g}: raise --host-gb to {budget(total)}, or pass --nvme-dir "
                                  f"to spill part of it to disk (then --host-gb {budget(least)} is the least)")
            if where is None:
                raise ConfigError(f"--host-gb {t.host_gb:g} cannot hold even the staging ring"
                                  + (" and the host activation checkpoints" if acts else "")
                                  + f" with all it can spill on NVMe: raise --host-gb to at least {budget(least)}")
    where.update({(u, k): "gpu" for u in resident for k in kb})
    return where


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


def check_ram(cfg: Config, s: Settled, numels: list[int], where: Where, copied: frozenset[int], pin: bool) -> None:
    """Refuses, before anything is allocated, a run whose host memory (the state placed in RAM, the staging
    ring, host checkpoints, speculation's copies) is more than this machine has available, naming the
    --host-gb and --nvme-dir that would fit: the kernel would kill it mid-run otherwise."""
    t = cfg.tiers
    kb = kind_bytes(cfg.train.compute_dtype, s.stream)
    acts = _host_checkpoints(cfg, s, pin)
    need = host_need(cfg, s, numels, where, copied, pin)
    avail = available_ram()
    if need <= avail:
        return
    rest = [0 if where.get((u, "master")) == "gpu" else n for u, n in enumerate(numels)]
    least = least_host(rest, kb, acts, host_cost)
    have = f"this machine has {gb(avail)} of RAM available"
    if least > avail * 0.9:
        raise ConfigError(f"the run needs {gb(need)} of host memory and {have}; even with every slab it can "
                          f"spill on disk it needs {gb(least)}: use a machine with more RAM, or a smaller model or batch")
    fit = f"{avail * 0.9 / 1e9:.3g}"  # a tenth left for the process itself
    spill = f"--host-gb {fit}" + ("" if t.nvme_dir else " --nvme-dir DIR (a directory on a fast disk)")
    if t.host_gb:
        raise ConfigError(f"--host-gb {t.host_gb:g} is more than the RAM here, and the run needs {gb(need)} of it: "
                          f"{have}; pass {spill} to spill the rest to disk")
    raise ConfigError(f"the run needs {gb(need)} of host memory and {have}: pass {spill} to spill the rest "
                      "to disk")


def host_need(cfg: Config, s: Settled, numels: list[int], where: Where, copied, pin: bool) -> int:
    """Host bytes of a run: the slabs `where` puts in RAM, the staging ring, host checkpoints, and the copies
    of the `copied` units' master and moments (speculation under clipping)."""
    kb = kind_bytes(cfg.train.compute_dtype, s.stream)
    return (sum(host_state_bytes(numels, kb, where, host_cost).values())
            + ring_bytes(ring_widths(numels, where), kb, host_cost) + _host_checkpoints(cfg, s, pin)
            + sum(copy_bytes(numels[u], host_cost) for u in copied))


def _host_checkpoints(cfg: Config, s: Settled, pin: bool) -> int:
    """Host bytes of the activation checkpoints, when they live there."""
    tc, spec = cfg.train, cfg.model
    if s.activations != "host":
        return 0
    return spec.num_hidden_layers * (torch_pinned_cost if pin else host_cost)(
        tc.batch_size * tc.seq_len * spec.hidden_size * 4)


def gpu_update_units(cfg: Config, s: Settled, p: Plan | None, where: Where, kinds, n_units: int) -> frozenset[int]:
    """Units whose update runs on the GPU (tiers.gpu_update_units; "auto": the plan's choice, none without a
    plan): as their weights load, or speculated in the backward pass (optim.speculate_gpu_updates, settled):
    tiers.placement.gpu_updated says which."""
    n = cfg.tiers.gpu_update_units
    if n == AUTO:
        n = p.gpu_updates if p else 0
    if n and "weights" in kinds:
        raise ConfigError("tiers.gpu_update_units needs tiers.stream=\"master\" (the GPU update makes the "
                          "weights from the fp32 master); set it, or tiers.gpu_update_units=0")
    return frozenset(gpu_updated(update_candidates(where, kinds, n_units), n, s.speculate_gpu))


def speculated_units(cfg: Config, s: Settled, numels: list[int], where: Where, kinds, deferred: frozenset[int],
                     pin: bool) -> tuple[frozenset[int], frozenset[int]]:
    """(units whose update starts on the host in the backward pass, GPU-updated units whose update starts
    on the GPU there). The first: optim.speculate_units of the units the host updates with every slab in
    RAM, every other one from the last first (tiers.placement.alternate_from_last); the second: every
    GPU-updated unit when
    optim.speculate_gpu_updates is on. With clipping on each needs copies of its master and moments:
    refused when --host-gb cannot hold them beside the state."""
    n = s.speculate_units
    ram = [u for u in update_candidates(where, kinds, len(numels)) if u not in deferred]
    units = frozenset(alternate_from_last(ram, max(n, 0)))
    on_gpu = deferred if s.speculate_gpu else frozenset()
    t = cfg.tiers
    if (units or on_gpu) and cfg.optim.grad_clip > 0 and t.host_gb:
        copies = sum(copy_bytes(numels[u], host_cost) for u in units | on_gpu)
        need = host_need(cfg, s, numels, where, units | on_gpu, pin) / 1e9
        if need > t.host_gb:
            who = [f"optim.speculate_units = {n}"] * bool(units) + ["optim.speculate_gpu_updates = true"] * bool(on_gpu)
            fix = ['lower optim.speculate_units ("auto": the plan\'s number)'] * bool(units) + \
                ["set optim.speculate_gpu_updates = false"] * bool(on_gpu)
            raise ConfigError(f"{' and '.join(who)} keep{'s' * (len(who) == 1)} copies of {gb(copies)} "
                              f"beside the state: raise --host-gb to {budget(need * 1e9)}, or {', or '.join(fix)}")
    return units, on_gpu


def nvme_tier(cfg: Config, s: Settled, numels: list[int], where: Where, dtypes: dict[str, torch.dtype],
              streamed: str, pin: bool, run_name: str, replace: bool) -> TierManager:
    """The run's store, in a new directory under nvme_dir, and its manager; `replace`: a resumed run first
    deletes the stores its killed processes left (scratch: the checkpoint holds the state)."""
    t = cfg.tiers
    kb = kind_bytes(cfg.train.compute_dtype, s.stream)
    disk = disk_bytes(numels, kb, where)
    if t.nvme_gb and disk > t.nvme_gb * 1e9:
        raise ConfigError(f"the spilled state takes {gb(disk)} on disk and --nvme-gb is "
                          f"{t.nvme_gb:g}: raise --nvme-gb or --host-gb")
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
    return TierManager(store, where, {k: dtypes[k] for k in kinds}, pin, depth=RING_SLOTS - 2, streamed=streamed)
