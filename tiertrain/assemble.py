"""A RunPlan made a run, bottom-up: the host store, the NVMe tier (its store, the optimizer's staging, the streamed
kind's reader), the activation checkpoints' store, the streams, the weight slots, the gradient accumulators, the
state where the plan put it, the updates and the step. Each part takes the sizes and homes it needs, never the
RunPlan; what builds them settles nothing: the plan has (plan_run, before anything is allocated)."""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import paths, rundir
from .checkpoint_load import read_meta
from .config import Config
from .engine.activations import ActivationStore
from .engine.buffers import Accumulators, WeightSlots
from .engine.schedule import Step
from .engine.streams import StallClock, Streams
from .errors import ConfigError, Everywhere, UserError, close_all, close_quietly
from .model.llama import Context
from .model.parts import norm_pieces, unit_parts
from .model.spec import UnitSpec
from .modes import Home, Kind, Update, by_value
from .optim.adamw import HostAdamW
from .optim.updates import Updates
from .parallel import Ranks
from .plan.resolve import check_ram, resolve
from .plan.runplan import RunPlan
from .plan.saves import Saves, check_disk, checkpoint_bytes, saves
from .plan.values import Plan
from .probe import available_ram, run_hardware
from .sections import AUTO, fixed
from .state import State
from .tiers.host import HostStore
from .tiers.nvme import NvmeStore, check_backend, discard, make_io, new_scratch
from .tiers.pieces import PieceStore
from .tiers.placement import CK_PIECE_BYTES, READ_AHEAD, ck_disk_bytes, disk_bytes, ring_widths, spilled_bytes
from .tiers.reader import StreamReader
from .tiers.slab import Shard, SlabLayout
from .tiers.staging import Staging, Traffic

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class NvmeTier:
    """The spilled state's store, the optimizer's staging of it and the streamed kind's reader (None: the streamed
    kind stays in RAM), with the traffic both count."""

    store: NvmeStore
    staging: Staging
    reader: StreamReader | None
    traffic: Traffic

    def ring_nbytes(self) -> int:
        return self.staging.ring_nbytes() + (self.reader.ring_nbytes() if self.reader else 0)

    def close(self) -> None:
        """The staging's writes land and its thread shuts, then the store's I/O threads (whatever the first
        raised)."""
        close_all(self.staging.close, self.store.close)


@dataclass(frozen=True)
class Run:
    """The parts of a run, each built by assemble from what the RunPlan says of it."""

    host: HostStore
    nvme: NvmeTier | None
    activations: ActivationStore
    streams: Streams
    clock: StallClock
    slots: WeightSlots
    grads: Accumulators
    state: State
    updates: Updates
    step: Step

    def close(self) -> None:
        """The optimizer's thread, then the NVMe tier's threads (their writes landed first), then the activation
        store's: each, whatever an earlier one raised."""
        close_all(self.updates.close, *([self.nvme.close] if self.nvme else []), self.activations.close)

    def discard_scratch(self) -> None:
        """Deletes the run's NVMe scratch stores (the state's and the activation checkpoints'), after close(): each,
        whatever deleting the other raised."""
        stores = (self.nvme.store if self.nvme else None, self.activations.store)
        close_all(*(functools.partial(discard, s.root) for s in stores if s is not None))


def copied(rp: RunPlan, clipping: bool) -> frozenset[int]:
    """The units whose speculated update writes copies of their master and moments: clipping may undo it."""
    return rp.updated(Update.HOST_SPECULATED, Update.GPU_SPECULATED) if clipping else frozenset()


def plan_run(
    cfg: Config,
    device: torch.device,
    ranks: Ranks,
    layouts: list[SlabLayout],
    resume: Path | None,
    updates: dict[int, str] | None,
    hardware: Path | None,
    out: Path | None,
    data_bytes: int = 0,
    segmented: bool = False,
):
    """(the figures the run plans with, its Plan with the RunPlan it obeys, the settings the plan chose): what the
    config leaves "auto" settled for this machine and this rank, and what cannot run here refused, before anything
    is allocated, naming the setting to change: the GPU's memory (the plan), the host's RAM, the checkpoints' disk
    (`out`: the run directory; None: no checkpoints planned); `data_bytes`: what the data loader will add;
    `segmented`: its rows hold several segments (the loader's)."""
    tc = cfg.train
    with ranks.together(UserError) as agreed:  # this rank's figures and checkpoint, before the barrier
        # a resume keeps the micro-batch it ran with (it sets the order of the gradients' sums: the bits)
        micro = read_meta(resume).get("plan", {}).get("micro_batch") if resume is not None else None
        if micro and (tc.batch_size // ranks.size) % micro:  # resumed on more ranks: a rank's rows are fewer
            micro = None
        hw = run_hardware(
            device,
            hardware,
            cfg.optim.host_kernel,
            cfg.model,
            tc.compute_dtype,
            tc.attention,
            cfg.hardware.gpu,
        )
    agreed.raise_any(ranks.rank)
    # without --host-gb a GPU run plans within the RAM free here (a tenth left to the process), so that
    # what the host cannot hold goes to the GPU's memory when it has room: every rank's, read before any
    # allocates, and the least of them, so that the ranks plan from one figure
    avail = min(a for (a,) in ranks.host_ints([available_ram()]))
    # each rank plans and checks its own host (its RAM, its GPU; rank 0 the checkpoints' disk): a refusal on one
    # stops them all together, before any goes on to the next collective
    with ranks.together(UserError) as agreed:
        p, chosen = _planned(
            cfg, hw, micro, avail, ranks, layouts, resume, updates, out, data_bytes, segmented
        )
    agreed.raise_any(ranks.rank)
    # the ranks' collectives follow their plans: plans that differ (hosts of other RAM or GPUs) would mismatch them
    if len({d for (d,) in ranks.host_ints([zlib.crc32(repr(p.run_plan).encode())])}) > 1:
        raise Everywhere(
            "the ranks planned different runs (their hosts' RAM or GPUs differ); fix the plan's choices: "
            "--host-gb, and the tiers.* and train.* settings `tiertrain plan` reports"
        )
    return hw, p, chosen


def _planned(
    cfg: Config,
    hw,
    micro,
    avail: int,
    ranks: Ranks,
    layouts,
    resume,
    updates,
    out,
    data_bytes: int,
    segmented,
):
    """plan_run's plan and checks on this rank, any of which may refuse: (its Plan, the settings it chose)."""
    ram = None if hw.unified else avail * 0.9 / 1e9  # the host's, for its ranks
    p, rp, chosen = resolve(cfg, hw, micro, ram, ranks.size, ranks.local_size, segmented)
    if (
        out is not None
        and ranks.size == 1
        and rp.spill_first == "gradients"
        and cfg.tiers.spill_first == AUTO
    ):
        # a last save takes the spilled master and moments from the NVMe store by rename, never gradients: where
        # the disk is short for the checkpoints with the gradients first, the order goes back to the moments (the
        # same memory, a slower step); where it is short either way, the check below says so
        try:
            _check_saves(cfg, p, [lay.numel for lay in layouts], ranks, resume, out)
        except ConfigError:
            moments = replace(cfg, tiers=replace(cfg.tiers, spill_first="moments"))
            p, rp, _ = resolve(moments, hw, micro, ram, ranks.size, ranks.local_size, segmented)
    if updates:
        p = replace(p, run_plan=rp.with_updates(updates))
    rp = p.run_plan
    if Home.NVME in rp.where().values() or rp.checkpoints(Home.NVME):  # state or activation checkpoints
        check_backend(cfg.tiers.io)
    check_ram(
        rp,
        copied(rp, cfg.optim.grad_clip > 0),
        avail // ranks.local_size,
        cfg.tiers.host_gb,
        cfg.tiers.nvme_dir,
        p.memory.gpu.total if hw.unified else 0.0,
        ranks.local_size,
        data_bytes,
    )
    if out is not None and ranks.first:
        _check_saves(cfg, p, [lay.numel for lay in layouts], ranks, resume, out)
    return p, chosen


def _check_saves(
    cfg: Config, p: Plan, numels: list[int], ranks: Ranks, resume: Path | None, out: Path
) -> None:
    """The run's checkpoints, and the NVMe stores on the same disk, fit the free space of the checkpoints' disk
    (plan.saves): refused before anything is allocated, naming the settings that would fit."""
    c, t, rp = cfg.checkpoint, cfg.tiers, p.run_plan
    where = rundir.checkpoint_dir(out)
    meta = read_meta(resume) if resume is not None else None
    start = meta["step"] if meta and ckpt.whole(meta) else 0
    existing = len([q for q in rundir.checkpoints(out) if int(q.name[5:]) <= start]) if start else 0
    free, dev = rundir.disk_free(where)
    same = bool(t.nvme_dir) and rundir.disk_free(Path(t.nvme_dir))[1] == dev
    home = rp.where()
    store = (
        (disk_bytes(list(rp.numels), rp.kind_bytes(), home) + p.memory.nvme_checkpoints) * ranks.local_size
        if same
        else 0
    )
    count = saves(start, cfg.train.steps, c.every, c.final)
    # the final save takes the store's chunks by rename, where one works between them (not across bind mounts)
    moves = same and c.final and ranks.size == 1 and paths.renames_between(Path(t.nvme_dir), where)
    by_state = {}
    for state, kinds in ckpt.SAVED.items():
        each = checkpoint_bytes(numels, state)
        taken = (
            sum(numels[u] * 4 for (u, k), h in home.items() if h == Home.NVME and k in kinds) if moves else 0
        )
        by_state[state] = Saves(each, each - taken, count, existing, c.keep)
    check_disk(by_state, free, store, str(where), c.state, resume is not None)


@dataclass(frozen=True)
class Scratch:
    """Where a run's scratch stores go (new directories under `parent`, named for the run) and how they move bytes."""

    parent: str  # tiers.nvme_dir
    run_name: str
    io: str  # tiers.io
    threads: int  # tiers.io_threads

    def store(self, build):
        """build(root, io): a store in a new scratch directory with an I/O backend of its own (its trial read
        there). Where it is refused (its disk), the backend's threads and the directory go."""
        root, io = new_scratch(self.parent, self.run_name), None
        try:
            io = make_io(self.io, self.threads, root)
            return build(root, io)
        except BaseException:
            close_quietly(*([io.close] if io is not None else []), functools.partial(discard, root))
            raise


def _dropped(store) -> None:
    """A store made for a part that was then refused (a ring's pinned memory, a signal): its threads and its
    scratch directory go, raising nothing over the refusal."""
    close_quietly(store.close, functools.partial(discard, store.root))


def assemble(
    cfg: Config,
    rp: RunPlan,
    units: tuple[UnitSpec, ...],
    layouts: list[SlabLayout],
    shards: list[Shard],
    ranks: Ranks,
    device: torch.device,
    run_name: str,
) -> Run:
    """The run of RunPlan `rp`, built bottom-up; what was made of it goes again where a later part is refused, on
    this rank or another: a rank's refusal (its store's disk) reaches every rank before the next collective, which
    it would never join."""
    t, tc, pin, dtype = cfg.tiers, cfg.train, device.type == "cuda", DTYPES[rp.compute_dtype]
    scratch, where = Scratch(t.nvme_dir, run_name, t.io, t.io_threads), rp.where()
    nvme = activations = updates = None
    try:
        with ranks.together(UserError) as agreed:
            host = HostStore(
                shards, dtype, pin, compute_copy=rp.stream == "compute", where=where, device=device
            )
            host.add_copies(copied(rp, cfg.optim.grad_clip > 0))
            spilled = spilled_bytes(list(rp.numels), rp.kind_bytes(), where)
            meta = {"model": cfg.to_dict()["model"], "compute_dtype": rp.compute_dtype}
            dtypes = {k: host.dtype(k) for k in spilled}
            nvme = (
                nvme_tier(list(rp.numels), where, dtypes, host.streamed_kind, pin, scratch, meta)
                if spilled
                else None
            )
            streams = Streams(device)
            clock = StallClock(streams)
            activations = activation_store(rp, streams, clock, device, scratch)
            staging, reader = (nvme.staging, nvme.reader) if nvme else (None, None)
            n_experts = cfg.model.num_experts
            parts = {
                u: p for u, lay in enumerate(layouts) if (p := unit_parts(lay, n_experts, rp.expert_groups))
            }
            if parts and (ranks.size > 1 or rp.updated(Update.GPU, Update.GPU_SPECULATED, Update.RESIDENT)):
                raise ValueError("blocks in parts (expert groups) run on one rank, updated on the host")
            slots = WeightSlots(
                layouts,
                host,
                device,
                dtype,
                streams,
                clock,
                reader=reader,
                shards=shards,
                ranks=ranks,
                parts=parts,
            )
            state = State(units, layouts, shards, ranks, host, staging, where)
            # one rank: a block with experts takes its norm by pieces, the same in parts as whole (model/parts.py)
            pieces = (
                {}
                if ranks.size > 1
                else {u: q for u, lay in enumerate(layouts) if (q := norm_pieces(lay, n_experts))}
            )
            grads = Accumulators(
                layouts, device, streams, clock, state.grad_sink, shards, ranks, parts, pieces
            )
            opt = HostAdamW(host, shards, cfg.optim, staging)
            updates = Updates(rp, opt, grads, streams, device, tc.overlap, staging, reader)
            context = Context.build(
                cfg.model, tc.seq_len, dtype, device, rp.tile, rp.attention, rp.deterministic
            )
            chunk = fixed(tc.loss_chunk_tokens)
            step = Step(
                units,
                layouts,
                slots,
                grads,
                activations,
                updates,
                clock,
                context,
                chunk,
                cfg.optim.grad_clip,
                rp.kept(),
                ranks,
                parts,
                rp.attention_kept(),
            )
        agreed.raise_any(ranks.rank)
    except BaseException:  # a refusal after a store was made (a full disk): what was made goes
        made = [p for p in (updates, nvme, activations) if p is not None]
        stores = [p.store.root for p in (nvme, activations) if p is not None and p.store is not None]
        # the refusal is what to say; the stores go all the same
        close_quietly(*(p.close for p in made), *(functools.partial(discard, root) for root in stores))
        raise
    return Run(host, nvme, activations, streams, clock, slots, grads, state, updates, step)


def nvme_tier(
    numels: list[int],
    where: dict[tuple[int, Kind], Home],
    dtypes: dict[Kind, torch.dtype],
    streamed: Kind,
    pin: bool,
    scratch: Scratch,
    meta: dict,
) -> NvmeTier:
    """The store of the slabs `where` puts on NVMe (`dtypes`: each spilled kind's), in a new scratch directory, with
    the optimizer's staging and, where the streamed kind spills, its reader; `meta`: what the store records."""
    kinds = by_value(dtypes)
    # numpy has no bfloat16: the compute-dtype copy is stored as its bits
    meta = {**meta, **({"weights": "bfloat16 bits, as uint16"} if Kind.WEIGHTS in kinds else {})}
    units = {k: [u for (u, kk), home in where.items() if kk == k and home == Home.NVME] for k in kinds}
    stored = {k: "uint16" if k == Kind.WEIGHTS else "float32" for k in kinds}
    store = scratch.store(
        lambda root, io: NvmeStore(root, numels, stored, meta, io, create=True, units=units)
    )
    try:
        return _staged(store, numels, where, dtypes, streamed, units, pin)
    except BaseException:
        _dropped(store)
        raise


def _staged(store, numels, where, dtypes, streamed, units, pin: bool) -> NvmeTier:
    """nvme_tier's staging and reader of `store`."""
    widths, traffic = ring_widths(numels, where), Traffic()
    on_disk = set(units.get(streamed, []))
    reader = (
        StreamReader(store, streamed, on_disk, dtypes[streamed], widths[streamed], pin, READ_AHEAD, traffic)
        if on_disk
        else None
    )
    spilled = {
        u: [k for (uu, k), home in where.items() if uu == u and home == Home.NVME] for u in range(len(numels))
    }
    staging = Staging(
        store,
        spilled,
        dtypes,
        widths,
        pin,
        READ_AHEAD,
        fresh=frozenset({Kind.WEIGHTS}),
        drained=frozenset({Kind.GRAD}),
        on_write=reader.written if reader else None,
        traffic=traffic,
    )
    return NvmeTier(store, staging, reader, traffic)


def activation_store(
    rp: RunPlan, streams: Streams, clock: StallClock, device: torch.device, scratch: Scratch
) -> ActivationStore:
    """The activation checkpoints' store: each block's home as the RunPlan says; those on NVMe in a PieceStore (a
    new scratch directory, each block's checkpoint in whole pieces)."""
    rows = sorted(rp.checkpoints(Home.NVME))
    store = None
    if rows:
        pieces = (
            ck_disk_bytes(rp.checkpoint_bytes(rp.micro_batch), rp.rows // rp.micro_batch) // CK_PIECE_BYTES
        )
        store = scratch.store(lambda root, io: PieceStore(root, rows, pieces, io))
    try:
        return ActivationStore(
            rp.checkpoints(),
            streams,
            clock,
            device,
            device.type == "cuda",
            store,
            getattr(torch, rp.activation_dtype),
            rp.ck_pieces,
        )
    except BaseException:
        if store is not None:
            _dropped(store)
        raise
