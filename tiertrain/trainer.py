"""What a run does: train (a step on the next batch), evaluate, save, restore and describe itself. Built from a
config: the data, the plan (assemble.plan_run, which refuses what cannot run here before anything is allocated),
the run's parts (assemble.assemble) and the initial state (a checkpoint, a Hugging Face model or a fresh init)."""

from __future__ import annotations

import copy
import functools
import time
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import paths, records, rundir
from .assemble import DTYPES, assemble, plan_run
from .checkpoint_load import load_all
from .config import Config, absolute_paths
from .data import loaders
from .errors import ConfigError, UserError, close_all, close_quietly
from .metrics import tensorboard_writer
from .model.docs import Docs
from .model.hf import HFReader, open_weights, spec_from_hf
from .modes import Home
from .optim.adamw import lr_at
from .parallel import Ranks
from .plan.gpus import from_smi
from .rows import IGNORE
from .sections import fixed
from .state import rng_state, set_rng_state
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
            close_quietly(self.close)  # the refusal is what to say (a failing disk fails twice)
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
            cfg,
            self.device,
            self.ranks,
            self.layouts,
            resume,
            updates,
            hardware,
            out,
            self.loader.host_bytes,
            self.loader.segmented,
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
        load_all(path, numels, lambda u, k: self.run.state.part(u, k, read=False), self.ranks, kinds=kinds)
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
        before = records.counters(self)  # ---- the counters before
        t0 = time.perf_counter()  # ---- the step
        mb = self.run_plan.micro_batch
        lr = lr_at(self.step, self.cfg.optim, self.cfg.train.steps)
        inputs, targets = list(inp.to(self.device).split(mb)), list(tgt.to(self.device).split(mb))
        loss, grad_norm = self.run.step.run(inputs, targets, lr, self._docs(pos), n_tokens)
        loss = float(loss)
        dt = time.perf_counter() - t0
        self.step += 1
        return records.record(self, before, loss, grad_norm, lr, dt, tgt.shape)  # ---- the counters after

    def _docs(self, pos) -> list | None:
        """Each micro-batch's segments (model.docs), from its rows' positions (None: a row is one segment)."""
        if pos is None:
            return None
        mb = self.run_plan.micro_batch
        return [Docs.build(pos[a : a + mb], self.run.step.ctx) for a in range(0, len(pos), mb)]

    def bytes_moved(self) -> tuple[int, int]:
        """(H2D, D2H) bytes so far: weights, gradients, GPU updates' state and activation checkpoints."""
        return records.bytes_moved(self.run)

    def close(self) -> None:
        """The run's threads (Run.close), then the process group this trainer made (gloo's threads abort the process
        at exit without it), each whatever the other raised; then the run's NVMe scratch stores deleted (what they
        held is in a checkpoint, or lost). Also what a refused __init__ made, whatever it had made."""
        run, group = self.run is not None, [self.ranks.close] if self.owns_ranks else []
        close_all(*([self.run.close] if run else []), *group, *([self.run.discard_scratch] if run else []))

    def describe(self) -> list[str]:
        """The run's description, a line a part (records.describe)."""
        return records.describe(self)
