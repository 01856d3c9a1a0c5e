"""The one translation of a Config into the planner's search, for `tiertrain plan` and `tiertrain run` alike,
on a GPU or a CPU: what the config fixes stays fixed, what it leaves "auto" is searched. Pure Python."""

from __future__ import annotations

import math
import shutil

from ..config import Config
from ..errors import ConfigError, why
from ..modes import Home, Kind
from ..paths import existing
from ..sections import AUTO, fixed
from ..sizes import budget, gb
from ..tiers.placement import (
    ck_ring_bytes,
    copy_bytes,
    host_state_bytes,
    least_host,
    resident_units,
    ring_bytes,
    ring_widths,
)
from ..tiers.slab import host_cost
from . import attention
from .advice import explain
from .hardware import HardwareSpec
from .planner import plan
from .runplan import RunPlan
from .values import Budgets, Choice, Job, Miss, Plan, Short


def job_of(
    cfg: Config, name: str, gpus: int = 1, per_host: int | None = None, segmented: bool = False
) -> Job:
    """What `cfg` trains, as one of `gpus` ranks (`per_host` of them on each host; None: all on one); `segmented`:
    its rows hold several segments (data.document_mask, or a file of packed samples: the loader's)."""
    tc = cfg.train
    return Job(
        cfg.model,
        tc.batch_size,
        tc.seq_len,
        tc.compute_dtype,
        cfg.tiers.activation_dtype,
        cfg.optim.grad_clip > 0,
        gpus,
        per_host or 0,
        name,
        segmented or cfg.data.document_mask,
    )


def fixed_choice(cfg: Config, micro: int | None = None) -> Choice:
    """What `cfg` fixes of a plan (None where it says "auto"). `micro`: the micro-batch a resumed run ran with,
    kept where the config leaves it to the plan."""
    t, tc, o = cfg.tiers, cfg.train, cfg.optim
    stream = fixed(t.stream)
    if t.gpu_update_units not in (AUTO, 0) and tc.compute_dtype == "bfloat16":
        if stream == "compute":
            raise ConfigError(
                'tiers.gpu_update_units needs tiers.stream="master" (the GPU update makes the '
                "weights from the fp32 master); set it, or tiers.gpu_update_units=0"
            )
        stream = "master"
    return Choice(
        fixed(tc.micro_batch_size) or micro,
        stream,
        fixed(t.activations),
        fixed(t.gpu_update_units),
        fixed(o.speculate_units),
        fixed(o.speculate_gpu_updates),
        fixed(tc.keep_activations),
        fixed(tc.tile_tokens),
        fixed(tc.attention),
        tc.deterministic,
        fixed(t.expert_groups),
        fixed(t.spill_first),
        fixed(tc.keep_attention),
    )


def check_groups(cfg: Config, job: Job, choice: Choice) -> None:
    """tiers.expert_groups against the model and the rest of the config: one line naming what to change."""
    g, t, spec = choice.groups, cfg.tiers, job.spec
    if g is None or g == 1:
        return
    why = None
    if not spec.is_moe:
        why = "the model has no experts; set it to 1"
    elif spec.num_experts % g:
        why = f"it must divide model.num_experts ({spec.num_experts})"
    elif job.gpus > 1:
        why = "expert groups run on one GPU; set it to 1 or run on one"
    else:
        clash = {
            "train.tile_tokens": choice.tile,
            "train.keep_activations": choice.keep,
            "train.keep_attention": choice.keep_attention,
            "tiers.gpu_update_units": choice.gpu_updates,
            "tiers.gpu_resident_gb": fixed(t.gpu_resident_gb),
        }
        named = [k for k, v in clash.items() if v]
        if named:
            why = f"a block in parts runs untiled, recomputed and updated on the host; set {named[0]}=0"
    if why:
        raise ConfigError(f"tiers.expert_groups = {g} is not allowed: {why}")


def search(
    cfg: Config,
    hw: HardwareSpec,
    host_gb: float | None,
    gpu_gb: float | None,
    nvme_gb: float | None,
    name: str,
    micro: int | None = None,
    advise: bool = True,
    gpus: int = 1,
    per_host: int | None = None,
    segmented: bool = False,
) -> Plan | Miss:
    """The plan of `cfg` under these budgets (None: see Budgets; the host's and the disk's per host), with the
    report's findings where `advise`. `micro`: the micro-batch a resumed run ran with, kept where the config
    leaves it to the plan. `gpus`: of one of that many ranks, `per_host` on each host (default: all on one).
    `segmented`: the rows hold several segments (job_of)."""
    job, choice = job_of(cfg, name, gpus, per_host, segmented), fixed_choice(cfg, micro)
    attention.check(choice.attention, job.dtype, hw)
    kernel = attention.choose(choice.attention, choice.deterministic, job.dtype, hw)
    attention.check_kept(choice.keep_attention, kernel, job, hw.unified)
    check_groups(cfg, job, choice)
    budgets = Budgets(host_gb, gpu_gb, nvme_gb, cfg.tiers.gpu_resident_gb)
    p = plan(job, budgets, hw, choice)
    return explain(job, p, budgets, hw, choice) if advise else p


def free_gb(path: str) -> float:
    """The free space, in GB, of the disk `path` is or will be on (its nearest existing parent's): the NVMe budget
    --nvme-dir gives when --nvme-gb does not, in `run` and `plan` alike."""
    p = existing(path)
    if not p.is_dir():  # a file given, or one on the way: the store could not be made
        raise ConfigError(f"--nvme-dir {path}: {p} is a file; pass a directory (the store is made inside it)")
    try:
        return shutil.disk_usage(p).free / 1e9
    except OSError as e:
        raise ConfigError(f"--nvme-dir {path}: {why(e)}") from None


def chosen(cfg: Config) -> tuple[str, ...]:
    """The settings `cfg` leaves to the plan, by name."""
    t, tc, o = cfg.tiers, cfg.train, cfg.optim
    named = {
        "stream": t.stream,
        "activations": t.activations,
        "micro-batch": tc.micro_batch_size,
        "speculation": o.speculate_units,
        "GPU updates": t.gpu_update_units,
        "GPU updates' speculation": o.speculate_gpu_updates,
        "resident GB": t.gpu_resident_gb,
        "kept activations": tc.keep_activations,
        "kept attention outputs": tc.keep_attention,
        "tile": tc.tile_tokens,
        "attention kernel": tc.attention,
        "expert groups": t.expert_groups,
        "spill order": t.spill_first,
    }
    return tuple(k for k, v in named.items() if v == AUTO)


def resolve(
    cfg: Config,
    hw: HardwareSpec,
    micro: int | None = None,
    ram_gb: float | None = None,
    gpus: int = 1,
    per_host: int = 1,
    segmented: bool = False,
) -> tuple[Plan, RunPlan, tuple[str, ...]]:
    """`tiertrain run`'s (plan of this exact run, the RunPlan it obeys, the settings the plan chose): the
    search on the device's figures `hw` settles what the config leaves "auto", and a run that cannot fit
    stops here, before anything is allocated, naming the setting to change. `micro`: the micro-batch a
    resumed run ran with, kept where the config leaves it to the plan. `ram_gb`: the host budget when
    --host-gb is not given (the RAM free here; None: unbounded, the RAM check after the plan refuses). `gpus`,
    `per_host`: the ranks of the run, and of this host; `segmented`: its rows hold several segments."""
    t = cfg.tiers
    if t.nvme_gb and not t.nvme_dir:  # a store in the working directory: outside --out, and unchecked
        raise ConfigError(
            f"tiers.nvme_gb = {t.nvme_gb:g} (--nvme-gb) needs tiers.nvme_dir (--nvme-dir DIR), the directory the "
            "NVMe tier spills into"
        )
    # tiers.nvme_gb 0: the free space of nvme_dir (its nearest existing parent's disk; this run's stale stores are
    # gone by now), the host's, as --nvme-dir budgets `plan`
    free = free_gb(t.nvme_dir) if t.nvme_dir else None
    nvme = t.nvme_gb or free
    ranks = {"gpus": gpus, "per_host": per_host, "segmented": segmented}
    p = search(
        cfg, hw, t.host_gb or ram_gb or 1e9, hw.gpu_mem_gb, nvme, "run", micro=micro, advise=False, **ranks
    )
    if not p.fits and not t.host_gb and ram_gb and p.short != Short.GPU:
        # short of RAM as it is: the RAM check names the --host-gb and --nvme-dir that would fit
        p = search(cfg, hw, 1e9, hw.gpu_mem_gb, nvme, "run", micro=micro, advise=False, **ranks)
        if p.fits and not t.nvme_dir:  # a disk to spill to: the host budget the plan would then need
            _spill_advice(cfg, hw, micro, ram_gb, p.memory.host_total, ranks)
    disk = (sum(p.memory.nvme.values()) + p.memory.nvme_checkpoints) * per_host if p.fits else 0
    if t.nvme_gb and free is not None and disk > free * 1e9:  # a budget above the free space: the disk fills
        raise ConfigError(
            f"the plan puts {gb(disk)} on the disk of --nvme-dir {t.nvme_dir}, which has {free:.1f} GB free: "
            f"pass --nvme-gb {math.floor(free * 10) / 10:g} or less (0: all of it), or an --nvme-dir on a disk "
            "with room"
        )
    if not p.fits:  # the plan command takes the same flags, and answers a miss with the plans that fit
        raise ConfigError(
            f"{_refusal(cfg, p, micro)} (`tiertrain plan` with the same --config, --set and budget flags "
            "lists the nearest plans that fit)"
        )
    return p, p.run_plan, chosen(cfg)


def _spill_advice(cfg: Config, hw: HardwareSpec, micro, ram_gb: float, need: float, ranks: dict) -> None:
    """Refuses a run whose state this machine's RAM cannot hold, but could with an NVMe tier, naming the --host-gb
    that plan needs (90% of the RAM free, or the least it can run in where that is more and still free)."""
    spill = search(cfg, hw, ram_gb, hw.gpu_mem_gb, 1e7, "run", micro=micro, advise=False, **ranks)
    least = 0.0 if spill.fits else spill.least_host
    if spill.fits or 0 < least <= ram_gb * 1e9 / 0.9:
        host = budget(least, ram_gb * 1e9 / 0.9) if least else f"{math.floor(ram_gb * 10) / 10:g}"
        raise ConfigError(
            f"the run needs {gb(need)} of host memory and this machine has {gb(ram_gb * 1e9 / 0.9)} of RAM "
            f"available: pass --host-gb {host} --nvme-dir DIR (a directory on a fast disk) to spill the rest to disk"
        )


def _refusal(cfg: Config, p: Miss, micro: int | None) -> str:
    """What a plan that misses says to change, in the flags and settings of `tiertrain run`."""
    t, tc = cfg.tiers, cfg.train
    if p.short == Short.GPU:
        resident = t.gpu_resident_gb
        fixes = [
            *([f"lower tiers.gpu_resident_gb ({resident:g})"] if resident != AUTO and resident > 0 else []),
            *(["lower train.micro_batch_size"] if fixed(tc.micro_batch_size) or micro else []),
            *(
                [f"lower train.keep_activations ({tc.keep_activations})"]
                if fixed(tc.keep_activations)
                else []
            ),
            *([f"lower train.keep_attention ({tc.keep_attention})"] if fixed(tc.keep_attention) else []),
            *(['set tiers.activations="auto"'] if t.activations == "gpu" else []),
            "lower train.seq_len",
        ]
        return f"{p.why}: " + ", or ".join(fixes)
    if p.short == Short.HOST:  # no NVMe tier
        # a rank's shards; the budget is the host's
        kb, numels = (p.run_plan.kind_bytes(), list(p.run_plan.numels))
        resident = resident_units(numels, kb, p.run_plan.resident_gb * 1e9)
        rest = [0 if u in resident else n for u, n in enumerate(numels)]
        acts = p.memory.checkpoints.get(Home.HOST, 0) * host_cost(p.run_plan.checkpoint_bytes(p.job.rows))
        total = (sum(host_cost(n * b) for n in rest for b in kb.values()) + acts) * p.per_host
        beside = p.need - total  # the processes' own memory (and a CPU's working set): --host-gb holds it too
        least = least_host(rest, kb, acts, host_cost) * p.per_host + beside
        return (
            f"the state needs {gb(total)} of host memory and the process {gb(beside)} more, and --host-gb is "
            f"{t.host_gb:g}: raise --host-gb to {budget(p.need)}, or pass --nvme-dir to spill part of it to "
            f"disk (then --host-gb {budget(least)} is the least)"
        )
    if p.short == Short.NVME and not t.nvme_dir:  # no tier: only checkpoints asked there miss it
        return (
            f'tiers.activations = "{t.activations}" puts activation checkpoints on the NVMe tier, and there is '
            'none: pass --nvme-dir DIR, or set tiers.activations = "auto"'
        )
    if p.short == Short.NVME and not t.nvme_gb:  # the budget was the directory's free space
        return (
            f"the spilled state takes {gb(p.need)} on disk and --nvme-dir {t.nvme_dir} has {gb(p.have)} free: "
            "free space there, pass an --nvme-dir on a disk with room, or raise --host-gb to spill less"
        )
    if p.short == Short.RING:
        return (
            f"--host-gb {t.host_gb:g} cannot hold even the staging ring"
            + (" and the host activation checkpoints" if p.memory.checkpoints.get(Home.HOST) else "")
            + f" with all it can spill on NVMe: raise --host-gb to at least {budget(p.least_host)}"
        )
    if p.short == Short.COPIES:
        n, gpu = cfg.optim.speculate_units, cfg.optim.speculate_gpu_updates is True
        who = [f"optim.speculate_units = {n}"] * (n not in (AUTO, 0)) + [
            "optim.speculate_gpu_updates = true"
        ] * gpu
        fix = ['lower optim.speculate_units ("auto": the plan\'s number)'] * (n not in (AUTO, 0)) + [
            "set optim.speculate_gpu_updates = false"
        ] * gpu
        return (
            f"{' and '.join(who)} keep{'s' * (len(who) == 1)} copies of the master and moments that need "
            f"{gb(p.least_host - t.host_gb * 1e9)} more than --host-gb {t.host_gb:g} holds beside the state: "
            f"raise --host-gb to {budget(p.least_host)}, or {', or '.join(fix)}"
        )
    return p.why.partition(": ")[2]  # NVMe: the spilled state is larger than --nvme-gb


def check_ram(
    rp: RunPlan,
    copied: frozenset[int],
    avail: int,
    host_gb: float,
    nvme_dir: str,
    device: float = 0.0,
    share: int = 1,
    data: int = 0,
) -> None:
    """Refuses, before anything is allocated, a run whose host memory (host_need, and `device` bytes: on a CPU
    the working set, in the same RAM) is more than the `avail` bytes this process may take (one of `share` ranks
    of a host: its share, measured before any of them allocated), naming the --host-gb and --nvme-dir that would
    fit: the kernel would kill it mid-run otherwise. The refusal names the host's figures (--host-gb is the
    host's); `host_gb`, `nvme_dir`: the run's (0 and "": none given); `data`: the data loader's bytes to come
    (its shuffled order)."""
    need = host_need(rp, copied) + device + data
    if need <= avail:
        return
    where, kb = rp.where(), rp.kind_bytes()
    rest = [0 if where.get((u, Kind.MASTER)) == Home.GPU else n for u, n in enumerate(rp.numels)]
    least = least_host(rest, kb, host_checkpoints(rp), host_cost) + device + data
    need, least, device, avail = need * share, least * share, device * share, avail * share  # the host's
    have = f"this machine has {gb(avail)} of RAM available"
    if least > avail:
        raise ConfigError(
            f"the run needs {gb(need)} of host memory and {have}; even with every slab it can "
            f"spill on disk it needs {gb(least)}"
            + (f" ({gb(device)} of it the device's working set)" if device else "")
            + ": use a machine with more RAM, or a smaller model or batch"
        )
    # --host-gb holds the process and the device's working set too: 90% of what is free, or all it needs if more
    fit = budget(least, avail) if least > avail * 0.9 else f"{math.floor(avail * 0.9 / 1e8) / 10:g}"
    spill = f"--host-gb {fit}" + ("" if nvme_dir else " --nvme-dir DIR (a directory on a fast disk)")
    if host_gb:
        raise ConfigError(
            f"--host-gb {host_gb:g} is more than the RAM here, and the run needs {gb(need)} of it: "
            f"{have}; pass {spill} to spill the rest to disk"
        )
    raise ConfigError(
        f"the run needs {gb(need)} of host memory and {have}: pass {spill} to spill the rest to disk"
    )


def host_need(rp: RunPlan, copied: frozenset[int]) -> int:
    """Host bytes of a run: the slabs its plan puts in RAM, the staging ring, host checkpoints, and the copies
    of the `copied` units' master and moments (speculation under clipping)."""
    kb, where, numels = rp.kind_bytes(), rp.where(), list(rp.numels)
    return (
        sum(host_state_bytes(numels, kb, where, host_cost).values())
        + ring_bytes(ring_widths(numels, where), kb, host_cost)
        + host_checkpoints(rp)
        + sum(copy_bytes(numels[u], host_cost) for u in copied)
    )


def host_checkpoints(rp: RunPlan) -> int:
    """Host bytes of the activation checkpoints the plan puts in RAM, and of the ring of those on NVMe."""
    return len(rp.checkpoints(Home.HOST)) * host_cost(rp.checkpoint_bytes(rp.rows)) + (
        ck_ring_bytes(rp.ck_pieces) if rp.checkpoints(Home.NVME) else 0
    )
