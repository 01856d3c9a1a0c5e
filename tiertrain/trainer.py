"""What a run does: train (a step on the next batch), evaluate, save, restore and describe itself. Built from a
config: the data, the plan (assemble.plan_run, which refuses what cannot run here before anything is allocated),
the run's parts (assemble.assemble) and the initial state (a checkpoint, a Hugging Face model or a fresh init)."""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from . import checkpoint as ckpt
from . import paths, rundir
from .assemble import DTYPES, assemble, plan_run
from .config import Config, absolute_paths
from .data import loaders
from .errors import ConfigError, UserError, close_all
from .metrics import human_bytes, human_count, tensorboard_writer
from .model.docs import Docs
from .model.families import unlike_family
from .model.hf import HFReader, open_weights, spec_from_hf
from .modes import Home, Kind
from .optim.adamw import lr_at
from .parallel import Ranks
from .plan.gpus import from_smi
from .rows import IGNORE
from .sections import fixed
from .sizes import num
from .state import rng_state, set_rng_state
from .tiers.placement import spilled_bytes
from .tiers.slab import Shard, SlabLayout


def trained(targets) -> int:
    """How many targets of a batch train (at least one: a batch's loss divides by it)."""
    return max(1, int((targets != IGNORE).sum()))


def bf16_peak_tflops(device: torch.device) -> float | None:
    """The dense bf16 tensor-core peak of the datasheet (plan.gpus), for MFU; None for a GPU the table lacks."""
    if device.type != "cuda":
        return None
    got = from_smi(torch.cuda.get_device_name(device))
    return got.bf16_peak if got else None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            'train.device = "cuda" but no CUDA GPU is visible; use --set train.device="cpu" or "auto"'
        )
    return torch.device(name)


def _imported(cfg: Config, resume: Path | None) -> tuple[Config, HFReader | None]:
    """The config a run trains: with train.init_from (and no checkpoint to resume), a copy whose [model] is the
    Hugging Face model's (the caller's stays as given), checked whole before anything large is allocated; and
    the reader of its weights."""
    if not cfg.train.init_from or resume is not None:
        return cfg, None
    cfg = copy.deepcopy(cfg).imported(spec_from_hf(cfg.train.init_from, cfg.train.seq_len))
    reader = open_weights(cfg.train.init_from, cfg.model)
    reader.check(t.hf_name for u in cfg.model.units() for t in u.tensors)
    return cfg, reader


class Trainer:
    def __init__(
        self,
        cfg: Config,
        run_name: str = "run",
        resume: Path | None = None,
        updates: dict[int, str] | None = None,
        hardware: Path | None = None,
        ranks: Ranks | None = None,
        out: Path | None = None,
    ):
        """`resume`: a checkpoint to continue from (its state replaces the init; one of the weights alone starts a new
        run from them); else the weights come from train.init_from (a Hugging Face directory) or a fresh init.
        `updates`: {unit: update} replacing the RunPlan's (RunPlan.with_updates checks them). `hardware`: a probe
        file for the plan. `ranks`: the ranks training together (None: the torchrun job of the environment, or this
        process alone). `out`: the run directory, whose checkpoints' disk is checked (None: no checkpoints)."""
        if cfg.train.tensorboard:
            # refused here, before anything is allocated, when the package is missing
            tensorboard_writer(None)
        cfg, hf_reader = _imported(cfg, resume)
        self.cfg, self.run_name, self.out = cfg, run_name, out
        # close() ends the group it made
        self.ranks, self.owns_ranks = (ranks or Ranks.from_env(), ranks is None)
        self.run = None
        try:
            self._build(resume, updates, hardware, hf_reader)
        except BaseException:  # a refusal after the group or the stores were made: they go
            with contextlib.suppress(Exception):  # the refusal is what to say (a failing disk fails twice)
                self.close()
            raise

    def _build(self, resume: Path | None, updates, hardware: Path | None, hf_reader: HFReader | None) -> None:
        """__init__'s data, plan, parts and initial state."""
        cfg, out, tc, d = self.cfg, self.out, self.cfg.train, self.cfg.data
        self.ranks.check_batch(tc.batch_size, fixed(tc.micro_batch_size))
        self.device = self.ranks.device(resolve_device(tc.device))
        self.units = cfg.model.units()
        self.layouts = [SlabLayout.build([(t.name, t.shape) for t in u.tensors]) for u in self.units]
        # this rank's part
        self.shards = [Shard(lay, self.ranks.rank, self.ranks.size) for lay in self.layouts]
        # what this rank alone reads (its host's data file and checkpoint): a refusal here reaches every rank
        # before the plan's first collective, and all stop with it
        with self.ranks.together(UserError) as agreed:
            self.loader, self.val = loaders(d, tc, cfg.model.vocab_size)
            if resume is not None:  # another model's checkpoint, or other data: before anything is allocated
                self._check_resume(resume)
        agreed.raise_any(self.ranks.rank)
        # from here on the run obeys its RunPlan (written to <out>/plan.json): each unit's home and update
        self.hw, self.plan, self.chosen = plan_run(
            cfg, self.device, self.ranks, self.layouts, resume, updates, hardware, out, self.loader.host_bytes
        )
        self.run_plan = self.plan.run_plan
        # on a CPU the plan settles the choices; its times are rough
        self.predicts = self.device.type == "cuda"
        self.run = assemble(
            cfg, self.run_plan, self.units, self.layouts, self.shards, self.ranks, self.device, self.run_name
        )
        self.step = 0
        if resume is not None:
            self.restore(resume)
        elif hf_reader is not None:
            self.run.state.load(hf_reader.get)
        else:
            self.run.state.init_weights(cfg.model.initializer_range, tc.seed, cfg.model.pad_token_id)
        dtype = DTYPES[self.run_plan.compute_dtype]
        self.peak_tflops = bf16_peak_tflops(self.device) if dtype == torch.bfloat16 else None

    def plan_json(self) -> str:
        """<out>/plan.json: the RunPlan this run obeys (run-wide choices, every unit's update and homes), with
        the cost model's prediction (on a CPU from rough figures), in the keys of `tiertrain plan --format json`."""
        import json

        from .plan.report import plan_dict

        return json.dumps(plan_dict(self.plan), indent=1, default=float) + "\n"

    def device_nbytes(self) -> int:
        r = self.run
        return r.slots.nbytes() + r.grads.nbytes() + r.updates.gpu.nbytes()

    def kind_bytes(self) -> dict[str, int]:
        return self.run_plan.kind_bytes()

    def _quiesce(self) -> None:
        """The update in flight lands (on the GPU too), and the NVMe write-backs with it: the state is
        one step's."""
        self.run.updates.settle()
        if self.run.nvme:
            self.run.nvme.staging.flush()

    def save_checkpoint(self, run_dir: Path, last: bool = False) -> tuple[Path, float]:
        """Writes the run's checkpoint of this step (whole or not at all: checkpoint.py), of the state that
        checkpoint.state names, and prunes to checkpoint.keep; (path, GB/s). `last`: the process's last save, which
        may take the NVMe store's chunks of spilled slabs by rename where they share the checkpoints' disk."""
        self._quiesce()
        o, t0, c = self.cfg.optim, time.perf_counter(), self.cfg.checkpoint
        config = absolute_paths(self.cfg.to_dict())  # a resume from another directory finds the same files
        meta = {
            "step": self.step,
            "config": config,
            "run": str(Path(run_dir).resolve()),
            "data": {
                "next_step": self.step,
                "path": config["data"]["path"],
                "shuffle": self.cfg.data.shuffle,
                "seed": self.cfg.train.seed,
                "rows": self.loader.rows,
                "identity": self.data_identity,
            },
            "rng": rng_state(self.device),
            "optimizer": {
                "type": "AdamW",
                "step_count": self.run.updates.opt.step_count,
                "lr": o.lr,
                "betas": list(o.betas),
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                "grad_clip": o.grad_clip,
                "schedule": o.schedule,
                "warmup_steps": o.warmup_steps,
                "min_lr": o.min_lr,
            },
            "units": [u.name for u in self.units],
            "plan": self.run_plan.to_dict(),
        }
        path = rundir.step_path(run_dir, self.step)
        take = self._store_chunk(path.parent) if last else None
        nbytes = ckpt.save(
            path,
            [lay.numel for lay in self.layouts],
            lambda u, k: self.run.state.part(u, k, read=True),
            meta,
            self.ranks,
            kinds=ckpt.SAVED[c.state],
            take=take,
        )
        if self.ranks.first:
            rundir.prune(run_dir, c.keep)
        self.ranks.barrier()  # every rank's checkpoint is whole before any goes on
        return path, nbytes / 1e9 / (time.perf_counter() - t0)

    def _store_chunk(self, where: Path):
        """take() for a last save into `where`: the NVMe store's chunk file of a spilled slab, where the store and
        the checkpoints share a filesystem (None: the slab is written)."""
        nvme, where_ = self.run.nvme, self.run_plan.where()
        if nvme is None or not paths.renames_between(nvme.store.root, where):
            return None
        return lambda u, k: nvme.store.path(k, u) if where_.get((u, k)) == Home.NVME else None

    @functools.cached_property
    def data_identity(self) -> dict:
        return self.loader.identity()

    def _check_resume(self, path: Path) -> tuple[dict, list]:
        """(the checkpoint's attributes, the kinds it holds), refused where it is another model's or was trained on
        other data (rundir.check_checkpoint): before the plan allocates anything, and by restore()."""
        numels = [lay.numel for lay in self.layouts]
        meta = rundir.check_checkpoint(
            path,
            self.cfg.to_dict()["model"],
            numels,
            self.data_identity,
            self.loader.name,
            self.cfg.data.val_fraction,
        )
        return meta, ckpt.kinds_of(meta)

    def restore(self, path: Path) -> float:
        """The state of a checkpoint (any placement: slabs go to whichever tier this run put them on); one of the
        weights alone (checkpoint.state = "weights") sets the master and leaves the run new: step 0, zero moments.
        Returns the read rate in GB/s."""
        meta, kinds = self._check_resume(path)
        numels, whole = [lay.numel for lay in self.layouts], ckpt.whole(meta)
        self._quiesce()
        t0 = time.perf_counter()
        ckpt.load_all(
            path, numels, lambda u, k: self.run.state.part(u, k, read=False), self.ranks, kinds=kinds
        )
        if whole:
            self.step = meta["step"]
            self.run.updates.opt.step_count = meta["optimizer"]["step_count"]
            set_rng_state(meta["rng"], self.device)
        self.restore_gbs = (
            sum(sh.stored for sh in self.shards) * 4 * len(kinds) / 1e9 / (time.perf_counter() - t0)
        )
        return self.restore_gbs

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights under Hugging Face names (copies; of several ranks, every rank's parts)."""
        self._quiesce()
        return self.run.state.to_dict()

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self._quiesce()
        self.run.state.load(lambda name, shape: sd[name])

    # ---- training -----------------------------------------------------------------------------
    def train_step(self) -> dict:
        """The next step on this rank's rows of its batch (parallel.Ranks.rows); its loss the mean over the
        trained targets of the whole batch."""
        b = self.loader.get(self.step)
        rows = self.ranks.rows(len(b.inputs))
        pos = None if b.positions is None else b.positions[rows]
        n = trained(b.targets)
        return self.train_on(torch.from_numpy(b.inputs[rows]), torch.from_numpy(b.targets[rows]), pos, n)

    def evaluate(self) -> float:
        """The validation loss of the weights after the last step: the mean loss over the trained targets of the
        first train.eval_batches batches of the validation data (as many as it holds). The pending update lands
        first (the same bits as when the next forward pass runs it); nothing is saved or updated."""
        self._quiesce()
        n = min(self.cfg.train.eval_batches, self.val.batches)
        total, count, mb = torch.zeros((), dtype=torch.float64), 0, self.run_plan.micro_batch
        for k in range(n):
            b = self.val.get(k)
            m = int((b.targets != IGNORE).sum())
            if not m:  # nothing to evaluate (the mean is over the trained targets)
                continue
            rows = self.ranks.rows(len(b.inputs))
            inp, tgt = (torch.from_numpy(a[rows]).to(self.device).split(mb) for a in b[:2])
            docs = self._docs(None if b.positions is None else b.positions[rows])
            total += self.run.step.evaluate(list(inp), list(tgt), docs, m).double().cpu() * m
            count += m
        return float(total / count)  # loaders() refuses held-out rows with no trained target

    def train_on(self, inp: torch.Tensor, tgt: torch.Tensor, pos=None, n_tokens: int | None = None) -> dict:
        """One optimizer step on this rank's (B / N, S) rows of a batch (`pos`: their positions, None: 0..S-1 in
        each; `n_tokens`: the trained targets of the whole batch, None: all of them); the update itself finishes
        during the next step. The record's loss, norm, tokens and rates are the whole batch's; bytes and times
        this rank's."""
        before = self._counters()  # ---- the counters before
        t0 = time.perf_counter()  # ---- the step
        mb = self.run_plan.micro_batch
        lr = lr_at(self.step, self.cfg.optim, self.cfg.train.steps)
        inputs, targets = list(inp.to(self.device).split(mb)), list(tgt.to(self.device).split(mb))
        loss, grad_norm = self.run.step.run(inputs, targets, lr, self._docs(pos), n_tokens)
        loss = float(loss)
        dt = time.perf_counter() - t0
        self.step += 1
        return self._record(before, loss, grad_norm, lr, dt, tgt.shape)  # ---- the counters after

    def _docs(self, pos) -> list | None:
        """Each micro-batch's segments (model.docs), from its rows' positions (None: a row is one segment)."""
        if pos is None:
            return None
        mb = self.run_plan.micro_batch
        return [Docs.build(pos[a : a + mb], self.run.step.ctx) for a in range(0, len(pos), mb)]

    def _counters(self) -> "Counters":
        """What a step's record measures the step against: the counts so far, the last update's speculation."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        acts = self.run.activations
        return Counters(self.bytes_moved(), acts.disk_bytes, acts.wait_s, self.run.updates.last_kept)

    def _record(self, before: "Counters", loss: float, grad_norm: float, lr: float, dt: float, shape) -> dict:
        """The step's metrics.jsonl record: its own, its time split, the bytes it moved on each link, the peaks,
        and on a GPU the plan's prediction of it."""
        tc, upd, nvme, acts = self.cfg.train, self.run.updates, self.run.nvme, self.run.activations
        tokens = shape[0] * shape[1] * self.ranks.size
        tflops = self.cfg.model.flops_per_token(shape[1]) * tokens / dt / 1e12
        rec = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.step * tokens,
            "step_s": dt,
            "tokens_per_s": tokens / dt,
            "model_tflops": tflops,
        }
        rec.update({f"{k}_s": v for k, v in self.run.clock.read().items()})
        rec["opt_wait_s"] = upd.host.wait_s
        if upd.any_speculated:  # steps so far whose speculation was kept / redone (clipped)
            rec["speculation_kept"], rec["speculation_redone"] = upd.kept, upd.redone
        now = self.bytes_moved()
        rec["h2d_gb"], rec["d2h_gb"] = (now[0] - before.moved[0]) / 1e9, (now[1] - before.moved[1]) / 1e9
        if nvme:  # NVMe bytes of the last whole update (the previous step's, read ahead and written back)
            rec["nvme_read_gb"], rec["nvme_write_gb"] = (b / 1e9 for b in nvme.traffic.last_pass)
            rec["nvme_io_s"] = nvme.traffic.last_window_s
        if acts.store is not None:  # activation checkpoints written to NVMe and read back this step
            rec["ck_disk_gb"] = (acts.disk_bytes - before.ck_disk) / 1e9
            rec["ck_wait_s"] = acts.wait_s - before.ck_wait  # the step's thread waiting on their disk I/O
            rec["ck_write_gbs"] = (
                acts.write_rate()
            )  # the writes' rate while some were on their way (landed ones)
        if self.peak_tflops:
            rec["mfu"] = tflops / self.peak_tflops
        if self.device.type == "cuda":
            rec["gpu_peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        rec["host_rss_gb"] = psutil.Process().memory_info().rss / 1e9
        if self.predicts and tuple(shape) == (tc.batch_size // self.ranks.size, tc.seq_len):
            # its forward pass waited for the last update, speculated beside a backward pass unless a norm clipped
            p = self.plan.prediction
            pt, ps = (p.times, p.step_s) if before.speculation_kept else (p.clipped_times, p.clipped_step_s)
            rec.update(
                pred_step_s=ps,
                pred_forward_s=pt["compute fwd"],
                pred_backward_s=pt["compute bwd"],
                pred_opt_wait_s=pt["exposed update"],
            )
        return rec

    def bytes_moved(self) -> tuple[int, int]:
        """(H2D, D2H) bytes so far: weights, gradients, GPU updates' state and activation checkpoints."""
        r = self.run
        ck, gpu = r.activations, r.updates.gpu
        return (
            r.slots.h2d_bytes + gpu.h2d_bytes + ck.h2d_bytes,
            r.grads.d2h_bytes + gpu.d2h_bytes + ck.d2h_bytes,
        )

    def close(self) -> None:
        """The run's threads (Run.close), then the process group this trainer made (gloo's threads abort the process
        at exit without it), each whatever the other raised; then the run's NVMe scratch stores deleted (what they
        held is in a checkpoint, or lost). Also what a refused __init__ made, whatever it had made."""
        run = [self.run.close, self.run.discard_scratch] if self.run is not None else []
        close_all(*run[:1], *([self.ranks.close] if self.owns_ranks else []), *run[1:])

    def _checkpoint_homes(self) -> str:
        """Where the activation checkpoints live, for the run's description; the MLP's tiles."""
        homes = list(self.run_plan.checkpoints().values())
        where = {Home.GPU: "on the device", Home.HOST: "in pinned host memory", Home.NVME: "on NVMe"}
        text = (
            ", ".join(f"{homes.count(h)} checkpoints {w}" for h, w in where.items() if h in homes)
            or "no checkpoints"
        )
        store = self.run.activations.store
        return (
            text
            + (f" in {store.root}" if store else "")
            + (f", blocks in tiles of {self.run_plan.tile:,} tokens" if self.run_plan.tile else "")
        )

    def describe(self) -> list[str]:
        spec, tc, pr = self.cfg.model, self.cfg.train, self.plan.prediction
        host, nvme = self.run.host.nbytes(), self.run.nvme
        nv = spilled_bytes([sh.numel for sh in self.shards], self.kind_bytes(), self.run_plan.where())
        # a GPU run whose plan puts state or checkpoints on a disk no probe measured says how to measure it
        on_disk = sum(self.plan.memory.nvme.values()) or self.plan.memory.nvme_checkpoints
        disk = self.hw.disk_note() if self.predicts and on_disk else ""
        r = self.ranks
        return [
            *(
                [
                    f"ranks: {r.size} ({r.local_size} on this host), each taking {tc.batch_size // r.size} rows of every batch "
                    f"and holding 1/{r.size} of every slab; the tiers below are rank 0's"
                ]
                if r.size > 1
                else []
            ),
            f"model: {human_count(spec.n_params)} parameters"
            + (f" ({human_count(spec.n_active_params)} active)" if spec.is_moe else "")
            + f", {len(self.units)} units "
            f"({spec.num_hidden_layers} blocks), {spec.flops_per_token(tc.seq_len) / 1e9:.3g} GFLOP/token",
            *(
                f"note: {u}; this model trains, but `tiertrain export` refuses it"
                for u in unlike_family(spec)
            ),
            f"batch: {tc.batch_size} x {tc.seq_len} tokens in micro-batches of {self.run_plan.micro_batch}, "
            f"compute {tc.compute_dtype} on {self.device}, data: {self.loader.describe()}",
            f"host tier: {human_bytes(sum(host.values()))} ("
            + ", ".join(f"{getattr(k, 'value', k)} {human_bytes(v)}" for k, v in host.items())
            + ")",
            *(
                [
                    f"NVMe tier: {human_bytes(sum(nv.values()))} ("
                    + ", ".join(f"{k.value} {human_bytes(v)}" for k, v in nv.items())
                    + f") in {nvme.store.root} via {nvme.store.io.name}, staging ring "
                    + human_bytes(nvme.ring_nbytes())
                ]
                if nvme
                else []
            ),
            *(
                [
                    f"plan: step {num(pr.step_s)} s"
                    + (
                        f" ({num(pr.clipped_step_s)} s while the global norm clips: then nothing speculates)"
                        if pr.clipped_step_s > pr.step_s * 1.005
                        else ""
                    )
                    + f", {num(pr.tokens_per_s)} tok/s, bottleneck "
                    f"{pr.bottleneck}, GPU {self.plan.memory.gpu.total / 1e9:.1f} GB ({self.plan.hardware})"
                ]
                if self.predicts
                else []
            ),
            *([disk] if disk else []),
            f"device: {human_bytes(self.device_nbytes())} in weight slots, gradient accumulators and "
            f"GPU updates' state, "
            f"plus activations ({self._checkpoint_homes()}); "
            f"weights stream as "
            f"{'the compute-dtype copy' if Kind.WEIGHTS in self.run.host.kinds else 'fp32 master'}"
            + (f" ({', '.join(self.chosen)}: the plan)" if self.chosen else ""),
        ]


@dataclass(frozen=True)
class Counters:
    """The counts a step's record is measured against, taken before the step."""

    moved: tuple[int, int]  # (H2D, D2H) bytes so far
    ck_disk: int  # activation checkpoints' disk bytes so far
    ck_wait: float  # seconds the step's thread waited on their disk I/O so far
    speculation_kept: bool  # the last update's speculation was kept: this forward pass waited for it
