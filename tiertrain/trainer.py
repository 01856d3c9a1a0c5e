"""Wiring: config -> data -> slabs on the host tier -> device buffers -> step engine -> loop."""
from __future__ import annotations

import copy
import functools
import time
from pathlib import Path

import psutil
import torch

from . import checkpoint as ckpt
from . import rundir
from .config import Config, absolute_paths, fixed
from .data import loaders
from .engine.activations import Checkpoints
from .engine.buffers import Accumulators, WeightSlots
from .engine.schedule import Step
from .engine.streams import StallClock, Streams
from .errors import ConfigError, DataError
from .metrics import human_bytes, human_count, tensorboard_writer
from .model.hf import HFReader, spec_from_hf
from .model.llama import Context
from .optim.adamw import HostAdamW, lr_at
from .optim.updates import Updates
from .modes import Home, Update
from .parallel import Ranks
from .plan.resolve import check_ram, resolve
from .plan.runplan import RunPlan
from .plan.saves import Saves, check_disk, checkpoint_bytes, saves
from .probe import available_ram, run_hardware
from .state import State
from .tiers.host import HostStore
from .tiers.manager import nvme_tier
from .tiers.nvme import check_backend, discard
from .tiers.pieces import checkpoint_store
from .tiers.placement import disk_bytes, spilled_bytes
from .tiers.slab import Shard, SlabLayout

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# dense bf16 tensor-core peaks (TFLOP/s) from the datasheets, for MFU
BF16_PEAK = {"H200": 989.4, "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 NVL": 835.0, "H100 PCIe": 756.0,
             "A100": 312.0, "L40S": 362.1, "GH200": 989.4, "B200": 2250.0}


def bf16_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in BF16_PEAK.items() if k in name), None)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError('train.device = "cuda" but no CUDA GPU is visible; use --set train.device="cpu" or "auto"')
    return torch.device(name)


def _imported(cfg: Config, resume: Path | None) -> tuple[Config, HFReader | None]:
    """The config a run trains: with train.init_from (and no checkpoint to resume), a copy whose [model] is the
    Hugging Face model's (the caller's stays as given), checked whole before anything large is allocated; and
    the reader of its weights."""
    if not cfg.train.init_from or resume is not None:
        return cfg, None
    cfg = copy.deepcopy(cfg)
    cfg.model = spec_from_hf(cfg.train.init_from, cfg.train.seq_len)
    cfg.validate()
    reader = HFReader(cfg.train.init_from)
    reader.check(t.hf_name for u in cfg.model.units() for t in u.tensors)
    return cfg, reader


class Trainer:
    def __init__(self, cfg: Config, run_name: str = "run", resume: Path | None = None,
                 updates: dict[int, str] | None = None, hardware: Path | None = None, ranks: Ranks | None = None,
                 out: Path | None = None):
        """`resume`: a checkpoint to continue from (its state replaces the init; one of the weights alone starts
        a new run from them); else the weights come from train.init_from (a Hugging Face directory, whose
        config.json replaces [model]) or a fresh init. `out`: the run directory, whose checkpoints' disk is checked
        (None: no checkpoints are planned).
        `updates`: {unit: update} replacing the RunPlan's for those units (RunPlan.with_updates checks them).
        `hardware`: a `tiertrain probe` file for the plan (else probe's default file, else the reference).
        `ranks`: the ranks training together (parallel.Ranks; None: the torchrun job of the environment, or
        this process alone): each holds 1/N of the state and takes 1/N of every batch's rows."""
        if cfg.train.tensorboard:
            tensorboard_writer(None)  # refused here, before anything is allocated, when the package is missing
        cfg, hf_reader = _imported(cfg, resume)
        self.cfg, self.run_name, self.out, tc, d = cfg, run_name, out, cfg.train, cfg.data
        self.ranks, self.owns_ranks = ranks or Ranks.from_env(), ranks is None  # close() ends the group it made
        self.ranks.check_batch(tc.batch_size, fixed(tc.micro_batch_size))
        self.device = self.ranks.device(resolve_device(tc.device))
        self.loader, self.val = loaders(d.path, d.val_path, d.val_fraction, d.shuffle, tc.seq_len, tc.batch_size,
                                        cfg.model.vocab_size, tc.seed)
        self.units = cfg.model.units()
        self.layouts = [SlabLayout.build([(t.name, t.shape) for t in u.tensors]) for u in self.units]
        self.shards = [Shard(lay, self.ranks.rank, self.ranks.size) for lay in self.layouts]  # this rank's part
        # from here on the run obeys its RunPlan (written to <out>/plan.json): each unit's home and update
        self.hw, self.plan, self.run_plan, self.chosen = self._plan(resume, updates, hardware)
        self.dtype, self.where, rp = DTYPES[self.run_plan.compute_dtype], self.run_plan.where(), self.run_plan
        self.predicts = pin = self.device.type == "cuda"  # on a CPU the plan settles the choices; its times are rough
        self.host = HostStore(self.shards, self.dtype, pin, compute_copy=rp.stream == "compute", where=self.where,
                              device=self.device)
        t, spilled = cfg.tiers, Home.NVME in self.where.values()
        self.tiers = nvme_tier(rp, {k: self.host.dtype(k) for k in self.host.kinds}, self.host.streamed_kind, pin,
                               t.nvme_dir, run_name, t.io, t.io_threads, {"model": cfg.to_dict()["model"]}) \
            if spilled else None
        self._build(cfg, resume, hf_reader, pin)

    def _plan(self, resume: Path | None, updates: dict[int, str] | None, hardware: Path | None):
        """(the figures the run plans with, its plan, the RunPlan it obeys, the settings the plan chose): what the
        config leaves "auto" settled for this machine and this rank, and what cannot run here refused, before
        anything is allocated, naming the setting to change."""
        cfg, ranks, tc = self.cfg, self.ranks, self.cfg.train
        # a resume keeps the micro-batch it ran with (it sets the order of the gradients' sums: the bits)
        micro = ckpt.read_meta(resume).get("plan", {}).get("micro_batch") if resume is not None else None
        if micro and (tc.batch_size // ranks.size) % micro:  # resumed on more ranks: a rank's rows are fewer
            micro = None
        hw = run_hardware(self.device, hardware, cfg.optim.host_kernel)
        # without --host-gb a GPU run plans within the RAM free here (a tenth left to the process), so that
        # what the host cannot hold goes to the GPU's memory when it has room
        avail = available_ram()
        ranks.barrier()  # every rank of the host has seen its RAM before any allocates
        ram = None if hw.unified else avail * 0.9 / 1e9  # the host's, for its ranks
        p, rp, chosen = resolve(cfg, hw, micro, ram, ranks.size, ranks.local_size)
        rp = rp.with_updates(updates) if updates else rp
        if Home.NVME in rp.where().values():
            check_backend(cfg.tiers.io)
        check_ram(rp, self.copied(rp), avail // ranks.local_size, cfg.tiers.host_gb, cfg.tiers.nvme_dir,
                  p.memory.gpu.total if hw.unified else 0.0, ranks.local_size)
        if self.out is not None and ranks.first:
            self._check_saves(rp, p, resume)
        return hw, p, rp, chosen

    def _check_saves(self, rp: RunPlan, p, resume: Path | None) -> None:
        """The run's checkpoints, and the NVMe stores on the same disk, fit the free space of the checkpoints'
        disk (plan.saves): refused before anything is allocated, naming the settings that would fit."""
        c, t = self.cfg.checkpoint, self.cfg.tiers
        where = rundir.checkpoint_dir(self.out)
        meta = ckpt.read_meta(resume) if resume is not None else None
        start = meta["step"] if meta and meta["kinds"] == list(ckpt.KINDS) else 0
        existing = len([q for q in rundir.checkpoints(self.out) if int(q.name[5:]) <= start]) if start else 0
        numels = [lay.numel for lay in self.layouts]
        free, dev = rundir.disk_free(where)
        same = bool(t.nvme_dir) and rundir.disk_free(Path(t.nvme_dir))[1] == dev
        spilled = {k for (_, k), h in rp.where().items() if h == Home.NVME}
        store = (disk_bytes(list(rp.numels), rp.kind_bytes(), rp.where()) + p.memory.nvme_checkpoints) \
            * self.ranks.local_size if same else 0
        count = saves(start, self.cfg.train.steps, c.every, c.final)
        by_state = {}
        for state in ckpt.SAVED:
            each = checkpoint_bytes(numels, state)
            taken = sum(n * 4 for (u, k), h in rp.where().items() if h == Home.NVME and k in ckpt.SAVED[state]
                        for n in [numels[u]]) if same and self.ranks.size == 1 and spilled else 0
            by_state[state] = Saves(each, each - taken, count, existing, c.keep)
        check_disk(by_state, free, store, str(where), c.state)

    def copied(self, rp: RunPlan) -> frozenset[int]:
        """The units whose speculated update writes copies of their master and moments: clipping may undo it."""
        speculated = rp.updated(Update.HOST_SPECULATED, Update.GPU_SPECULATED)
        return speculated if self.cfg.optim.grad_clip > 0 else frozenset()

    def _build(self, cfg: Config, resume: Path | None, hf_reader, pin: bool) -> None:
        """The rest of __init__: the device buffers, the updates, the initial state and the step."""
        try:
            spec, tc, t = cfg.model, cfg.train, cfg.tiers
            self.host.add_copies(self.copied(self.run_plan))
            self.streams = Streams(self.device)
            self.clock = StallClock(self.streams)
            reader = self.tiers if self.tiers and self.tiers.s_units else None
            self.slots = WeightSlots(self.layouts, self.host, self.device, self.dtype, self.streams, self.clock,
                                     reader=reader, shards=self.shards, ranks=self.ranks)
            self.state = State(self.units, self.layouts, self.shards, self.ranks, self.host, self.tiers, self.where)
            self.grads = Accumulators(self.layouts, self.device, self.streams, self.clock, self.state.grad_sink,
                                      self.shards, self.ranks)
            rp = self.run_plan
            self.updates = Updates(rp, HostAdamW(self.host, self.shards, cfg.optim, self.tiers), self.grads,
                                   self.streams, self.device, tc.overlap, self.tiers)
            self.checkpoints = Checkpoints(rp.checkpoints(), self.streams, self.clock, self.device, pin,
                                           checkpoint_store(rp, t.nvme_dir, self.run_name, t.io, t.io_threads),
                                           getattr(torch, rp.checkpoint_dtype))
            context = Context.build(spec, tc.seq_len, self.dtype, self.device, rp.tile)
            self.schedule = Step(self.units, self.layouts, self.slots, self.grads, self.checkpoints, self.updates,
                                 self.clock, context, fixed(tc.loss_chunk_tokens), cfg.optim.grad_clip, rp.kept(),
                                 self.ranks)
            self.step = 0
            if resume is not None:
                self.restore(resume)
            elif hf_reader is not None:
                self.state.load(hf_reader.get)
            else:
                self.state.init_weights(spec.initializer_range, tc.seed)
            self.peak_tflops = bf16_peak_tflops(self.device) if self.dtype == torch.bfloat16 else None
        except BaseException:  # a refusal after a store was made (another model's checkpoint): it goes
            if getattr(self, "checkpoints", None) is not None:
                self.checkpoints.close()
            else:
                self.checkpoints = None
            self.discard_scratch()
            raise

    def plan_json(self) -> str:
        """<out>/plan.json: the RunPlan this run obeys (run-wide choices, every unit's update and homes), with
        the cost model's prediction (on a CPU from rough figures), in the keys of `tiertrain plan --format json`."""
        import json
        from dataclasses import replace

        from .plan.report import plan_dict

        return json.dumps(plan_dict(replace(self.plan, run_plan=self.run_plan)), indent=1, default=float) + "\n"

    def device_nbytes(self) -> int:
        return self.slots.nbytes() + self.grads.nbytes() + self.updates.gpu.nbytes()

    def kind_bytes(self) -> dict[str, int]:
        return self.run_plan.kind_bytes()

    def _quiesce(self) -> None:
        """The update in flight lands (on the GPU too), and the NVMe write-backs with it: the state is
        one step's."""
        self.updates.settle()
        if self.tiers:
            self.tiers.flush()

    def save_checkpoint(self, run_dir: Path, last: bool = False) -> tuple[Path, float]:
        """Writes the run's checkpoint of this step (whole or not at all: checkpoint.py), of the state that
        checkpoint.state names, and prunes to checkpoint.keep; (path, GB/s). `last`: the process's last save, which
        may take the NVMe store's chunks of spilled slabs by rename where they share the checkpoints' disk."""
        self._quiesce()
        o, t0, c = self.cfg.optim, time.perf_counter(), self.cfg.checkpoint
        config = absolute_paths(self.cfg.to_dict())  # a resume from another directory finds the same files
        meta = {"step": self.step, "config": config, "run": str(Path(run_dir).resolve()),
                "data": {"next_step": self.step, "path": config["data"]["path"], "shuffle": self.cfg.data.shuffle,
                         "seed": self.cfg.train.seed, "rows": self.loader.rows, "identity": self.data_identity},
                "rng": ckpt.rng_state(self.device),
                "optimizer": {"type": "AdamW", "step_count": self.updates.opt.step_count, "lr": o.lr,
                              "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
                              "grad_clip": o.grad_clip, "schedule": o.schedule, "warmup_steps": o.warmup_steps,
                              "min_lr": o.min_lr},
                "units": [u.name for u in self.units], "plan": self.run_plan.to_dict()}
        path = rundir.step_path(run_dir, self.step)
        take = self._store_chunk(path.parent) if last else None
        nbytes = ckpt.save(path, [lay.numel for lay in self.layouts], lambda u, k: self.state.part(u, k, read=True),
                           meta, self.ranks, kinds=ckpt.SAVED[c.state], take=take)
        if self.ranks.first:
            rundir.prune(run_dir, c.keep)
        self.ranks.barrier()  # every rank's checkpoint is whole before any goes on
        return path, nbytes / 1e9 / (time.perf_counter() - t0)

    def _store_chunk(self, where: Path):
        """take() for a last save into `where`: the NVMe store's chunk file of a spilled slab, where the store and
        the checkpoints share a filesystem (None: the slab is written)."""
        if self.tiers is None or rundir.disk_free(where)[1] != rundir.disk_free(self.tiers.store.root)[1]:
            return None
        return lambda u, k: self.tiers.store.path(k, u) if self.where.get((u, k)) == Home.NVME else None

    @functools.cached_property
    def data_identity(self) -> dict:
        return self.loader.identity()

    def restore(self, path: Path) -> float:
        """The state of a checkpoint (any placement: slabs go to whichever tier this run put them on); one of the
        weights alone (checkpoint.state = "weights") sets the master and leaves the run new: step 0, zero moments.
        Returns the read rate in GB/s."""
        meta = ckpt.read_meta(path)
        mine, theirs = self.cfg.to_dict()["model"], meta["config"]["model"]
        numels = [lay.numel for lay in self.layouts]
        if mine != theirs or meta["numels"] != numels:
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise ckpt.CheckpointError(f"{path} was written for a different model ({', '.join(diff) or 'layout'} "
                                       "differ); resume with the run's own config, or start a new run")
        kinds = tuple(meta["kinds"])
        whole = sorted(kinds) == sorted(ckpt.KINDS)
        theirs = meta.get("data", {}).get("identity")
        if whole and theirs and theirs != self.data_identity:
            was = meta["data"].get("path") or "the built-in corpus"
            raise DataError(f"{self.loader.name} is not the data {path} trained on ({was}: {theirs['size']:,} bytes, "
                            "another checksum): set data.path to that file, or export the checkpoint and start a new "
                            "run from it with --init-from")
        self._quiesce()
        t0 = time.perf_counter()
        ckpt.load_all(path, numels, lambda u, k: self.state.part(u, k, read=False), self.ranks, kinds=kinds)
        if whole:
            self.step = meta["step"]
            self.updates.opt.step_count = meta["optimizer"]["step_count"]
            ckpt.set_rng_state(meta["rng"], self.device)
        self.restore_gbs = sum(sh.stored for sh in self.shards) * 4 * len(kinds) / 1e9 / (time.perf_counter() - t0)
        return self.restore_gbs

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under Hugging Face names (copies; of several ranks, every rank's parts)."""
        self._quiesce()
        return self.state.to_dict()

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self._quiesce()
        self.state.load(lambda name, shape: sd[name])

    # ---- training -----------------------------------------------------------------------------
    def train_step(self) -> dict:
        """The next step on this rank's rows of its batch (parallel.Ranks.rows)."""
        inp, tgt = self.loader.batch(self.step)
        rows = self.ranks.rows(len(inp))
        return self.train_on(torch.from_numpy(inp[rows]), torch.from_numpy(tgt[rows]))

    def evaluate(self) -> float:
        """The validation loss of the weights after the last step: the mean token loss over the first
        train.eval_batches batches of the validation data (as many as it holds). The pending update lands
        first (the same bits as when the next forward pass runs it); nothing is saved or updated."""
        self._quiesce()
        n = min(self.cfg.train.eval_batches, self.val.rows // self.val.B)
        total = torch.zeros((), dtype=torch.float64)
        for k in range(n):
            inp, tgt = (torch.from_numpy(a[self.ranks.rows(len(a))]).to(self.device).split(self.run_plan.micro_batch)
                        for a in self.val.batch(k))
            total += self.schedule.evaluate(list(inp), list(tgt)).double().cpu()
        return float(total / n)

    def train_on(self, inp: torch.Tensor, tgt: torch.Tensor) -> dict:
        """One optimizer step on this rank's (B / N, S) rows of a batch; the update itself finishes during the
        next step. The record's loss, norm, tokens and rates are the whole batch's; bytes and times this rank's."""
        tc = self.cfg.train
        t0 = time.perf_counter()
        upd, tiers = self.updates, self.tiers
        moved, ck_disk, ck_wait = self.bytes_moved(), self.checkpoints.disk_bytes, self.checkpoints.wait_s
        spec_kept = upd.last_kept
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        inputs = inp.to(self.device).split(self.run_plan.micro_batch)
        targets = tgt.to(self.device).split(self.run_plan.micro_batch)
        lr = lr_at(self.step, self.cfg.optim, tc.steps)
        loss, grad_norm = self.schedule.run(list(inputs), list(targets), lr)
        loss = float(loss)
        dt = time.perf_counter() - t0
        self.step += 1
        tokens = tgt.numel() * self.ranks.size
        tflops = self.cfg.model.flops_per_token(tgt.shape[1]) * tokens / dt / 1e12
        rec = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": self.step * tokens,
               "step_s": dt, "tokens_per_s": tokens / dt, "model_tflops": tflops}
        times = self.clock.read()
        rec.update({f"{k}_s": v for k, v in times.items()})
        rec["opt_wait_s"] = upd.host.wait_s
        if upd.any_speculated:  # steps so far whose speculation was kept / redone (clipped)
            rec["speculation_kept"], rec["speculation_redone"] = upd.kept, upd.redone
        now = self.bytes_moved()
        rec["h2d_gb"], rec["d2h_gb"] = (now[0] - moved[0]) / 1e9, (now[1] - moved[1]) / 1e9
        if tiers:  # NVMe bytes of the last whole update (the previous step's, read ahead and written back)
            rec["nvme_read_gb"], rec["nvme_write_gb"] = (b / 1e9 for b in tiers.last_pass)
            rec["nvme_io_s"] = tiers.last_window_s
        if self.checkpoints.store is not None:  # activation checkpoints written to NVMe and read back this step
            rec["ck_disk_gb"] = (self.checkpoints.disk_bytes - ck_disk) / 1e9
            rec["ck_wait_s"] = self.checkpoints.wait_s - ck_wait  # the step's thread waiting on their disk I/O
        if self.peak_tflops:
            rec["mfu"] = tflops / self.peak_tflops
        if self.device.type == "cuda":
            rec["gpu_peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        rec["host_rss_gb"] = psutil.Process().memory_info().rss / 1e9
        if self.predicts and tgt.shape == (tc.batch_size // self.ranks.size, tc.seq_len):  # what the plan predicted for this step:
            # its forward pass waited for the last update, speculated beside a backward pass unless a norm clipped
            p = self.plan.prediction
            pt, ps = (p.times, p.step_s) if spec_kept else (p.clipped_times, p.clipped_step_s)
            rec.update(pred_step_s=ps, pred_forward_s=pt["compute fwd"],
                       pred_backward_s=pt["compute bwd"], pred_opt_wait_s=pt["exposed update"])
        return rec

    def bytes_moved(self) -> tuple[int, int]:
        """(H2D, D2H) bytes so far: weights, gradients, GPU updates' state and activation checkpoints."""
        ck, gpu = self.checkpoints, self.updates.gpu
        return (self.slots.h2d_bytes + gpu.h2d_bytes + ck.h2d_bytes,
                self.grads.d2h_bytes + gpu.d2h_bytes + ck.d2h_bytes)

    def close(self) -> None:
        """The optimizer's thread, then the NVMe tier's threads (their writes landed first), then the checkpoints',
        then the process group this trainer made (gloo's threads abort the process at exit without it)."""
        self.updates.close()
        if self.tiers:
            self.tiers.close()
        self.checkpoints.close()
        if self.owns_ranks:
            self.ranks.close()

    def _checkpoint_homes(self) -> str:
        """Where the activation checkpoints live, for the run's description; the MLP's tiles."""
        homes = list(self.run_plan.checkpoints().values())
        where = {"gpu": "on the device", "host": "in pinned host memory", "nvme": "on NVMe"}
        text = ", ".join(f"{homes.count(h)} checkpoints {w}" for h, w in where.items() if h in homes) or "no checkpoints"
        store = self.checkpoints.store
        return text + (f" in {store.root}" if store else "") + (
            f", blocks in tiles of {self.run_plan.tile:,} tokens" if self.run_plan.tile else "")

    def discard_scratch(self) -> None:
        """Deletes the run's NVMe scratch stores (the state's and the activation checkpoints'), after close()."""
        for store in (self.tiers.store if self.tiers else None, self.checkpoints.store if self.checkpoints else None):
            if store is not None:
                discard(store.root)

    def describe(self) -> list[str]:
        spec, tc, pr = self.cfg.model, self.cfg.train, self.plan.prediction
        host = self.host.nbytes()
        nv = spilled_bytes([sh.numel for sh in self.shards], self.kind_bytes(), self.where)
        r = self.ranks
        return [
            *([f"ranks: {r.size} ({r.local_size} on this host), each taking {tc.batch_size // r.size} rows of every batch "
               f"and holding 1/{r.size} of every slab; the tiers below are rank 0's"] if r.size > 1 else []),
            f"model: {human_count(spec.n_params)} parameters, {len(self.units)} units "
            f"({spec.num_hidden_layers} blocks), {spec.flops_per_token(tc.seq_len) / 1e9:.3g} GFLOP/token",
            f"batch: {tc.batch_size} x {tc.seq_len} tokens in micro-batches of {self.run_plan.micro_batch}, "
            f"compute {tc.compute_dtype} on {self.device}, data: {self.loader.name} ({self.loader.rows} rows)",
            f"host tier: {human_bytes(sum(host.values()))} ("
            + ", ".join(f"{k} {human_bytes(v)}" for k, v in host.items()) + ")",
            *([f"NVMe tier: {human_bytes(sum(nv.values()))} ("
               + ", ".join(f"{k} {human_bytes(v)}" for k, v in nv.items())
               + f") in {self.tiers.store.root} via {self.tiers.store.io.name}, staging ring "
               + human_bytes(self.tiers.ring_nbytes())] if self.tiers else []),
            *([f"plan: step {pr.step_s:.2f} s"
               + (f" ({pr.clipped_step_s:.2f} s while the global norm clips: then nothing speculates)"
                  if pr.clipped_step_s > pr.step_s * 1.005 else "")
               + f", {pr.tokens_per_s:,.0f} tok/s, bottleneck "
               f"{pr.bottleneck}, GPU {self.plan.memory.gpu.total / 1e9:.1f} GB ({self.plan.hardware})"]
              if self.predicts else []),
            f"device: {human_bytes(self.device_nbytes())} in weight slots, gradient accumulators and "
            f"GPU updates' state, "
            f"plus activations ({self._checkpoint_homes()}); "
            f"weights stream as "
            f"{'the compute-dtype copy' if 'weights' in self.host.kinds else 'fp32 master'}"
            + (f" ({', '.join(self.chosen)}: the plan)"
               if self.chosen else ""),
        ]
