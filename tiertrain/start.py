"""What `tiertrain run` does on one rank before and around the training loop: the run directory checked, locked,
healed and marked (rank 0), the config (the checkpoint's own on a resume), stale scratch stores discarded, the
trainer built, then loop.fit; every refusal one line, before anything is allocated, every rank stopping together."""

from __future__ import annotations

import time
from pathlib import Path

from . import runclaim, rundir
from .checkpoint import whole
from .checkpoint_load import read_meta
from .config import config_from_dict, load_config
from .errors import UserError, close_quietly
from .loop import fit
from .signals import TermInterrupts
from .tiers.nvme import discard_stale
from .trainer import Trainer


def start(config_path, overrides, out, resume, init_from, hardware, ranks, echo) -> None:
    """`run` on one rank of the job (`overrides`: the --set values, the flags' among them). Rank 0 alone checks the
    run directory, takes its lock, finishes what a killed process of the run left half done, and marks it; the
    first rank of each host discards the scratch stores the run's killed processes left there."""
    with TermInterrupts():  # a scheduler's stop in the setup: what the run made goes, as for a Ctrl-C
        _start(config_path, overrides, out, resume, init_from, hardware, ranks, echo)


def _start(config_path, overrides, out, resume, init_from, hardware, ranks, echo) -> None:
    ckpt, out_dir, made, lock, cfg, fresh = None, None, "", None, None, None
    with ranks.together(UserError) as agreed:
        if hardware and not Path(hardware).is_file():
            raise UserError(
                f"--hardware {hardware} is not a file; write one with `tiertrain probe --out FILE`"
            )
        if resume and init_from:
            raise UserError("--init-from starts a new run; --resume continues one: pass only one of them")
        if not resume:  # every rank meets a bad config alike: the job's one line, without a rank's number
            fresh = load_config(config_path, list(overrides))
        if ranks.first:
            out_dir, lock, made, ckpt = claim(
                resume, Path(out) if out else None, config_path, overrides, fresh
            )
    trainer = None

    def give_back() -> None:
        """A run stopped before its loop: its scratch store, and its claim on --out, each whatever the other
        raised; raising nothing over the refusal or interrupt that stopped it."""
        close_quietly(
            *([trainer.close] if trainer is not None else []),
            *([lambda: runclaim.release(out_dir, made, lock)] if ranks.first else []),
        )

    try:
        # every rank stops together where any failed, with the lowest one's words (rank 0 gives --out back)
        agreed.raise_any(ranks.rank)
        out_dir = Path(ranks.share(str(out_dir)))
        ckpt = Path(ranks.share(str(ckpt))) if resume else None
        with ranks.together(UserError) as agreed:
            cfg = _config(config_path, overrides, ckpt, out_dir, ranks, fresh)
        if not agreed.failed:
            with ranks.together(UserError) as agreed:
                trainer = Trainer(
                    cfg,
                    run_name=str(out_dir.resolve()),
                    resume=ckpt,
                    out=out_dir,
                    ranks=ranks,
                    hardware=Path(hardware) if hardware else None,
                )
    # a fault of tiertrain's (its traceback) or an interrupt gives back what the run made, as a refusal does
    except BaseException:
        give_back()
        raise
    if agreed.failed:
        give_back()
        agreed.raise_any(ranks.rank)
    source = rundir.run_of(ckpt) if ckpt is not None else None  # a run started from another run's checkpoint
    hf_from = source / "hf" if source is not None and not rundir.same(source, out_dir) else None
    try:
        fit(trainer, out_dir, echo=echo, hf_from=hf_from)
    finally:
        if lock is not None:
            lock.release()


def _config(config_path, overrides, ckpt: Path | None, out_dir: Path, ranks, fresh=None):
    """The run's config: the file given, else a resumed checkpoint's own; its paths checked (rank 0), and the scratch
    stores killed processes left discarded (the first rank of each host; the others wait for it, before they make
    any)."""
    if ckpt is not None:
        meta = read_meta(ckpt)
        cfg = _resumed(config_path, overrides, ckpt, meta)
        cfg.train.init_from = ""  # the checkpoint holds the weights
        cfg.check_model()  # its [model] is the imported one now: a --set train.seq_len meets its positions
    else:
        cfg = fresh  # a new run's, read by start()
    if cfg.tiers.nvme_dir and ranks.local_rank == 0:  # killed runs' stores go, though this run be refused
        discard_stale(cfg.tiers.nvme_dir)
    if ckpt is not None:
        was = meta["config"].get("checkpoint", {}).get("dir", "")
        own = rundir.run_of(ckpt)
        # the run's marker names where its checkpoints live; a resume into a new --out is a new run, whose
        # checkpoints go where its config says (claim made the directory)
        if cfg.checkpoint.dir != was and own is not None and rundir.same(own, out_dir):
            raise UserError(
                f"checkpoint.dir = {cfg.checkpoint.dir!r}: a resumed run keeps its checkpoints where they were "
                f"({was or 'in its --out'}); leave checkpoint.dir as it was, or resume into a new --out, whose "
                "checkpoints go to the checkpoint.dir you set"
            )
        if whole(meta) and cfg.train.steps <= meta["step"]:  # it would train nothing, and save nothing new
            raise UserError(
                f"train.steps = {cfg.train.steps}: the checkpoint is at step {meta['step']}, so the resumed run "
                f"has no step to take; raise train.steps (--set train.steps=N, N above {meta['step']})"
            )
    if ranks.first:
        rundir.check_paths(out_dir, cfg.tiers.nvme_dir, cfg.checkpoint.dir)
    return cfg


def _resumed(config_path, overrides, ckpt: Path, meta: dict):
    """A resumed run's config: the file given, else the checkpoint's own, with the --set values."""
    if config_path:
        return load_config(config_path, list(overrides), new=False)
    return config_from_dict(meta["config"], list(overrides), str(ckpt), legacy=True, new=False)


def claim(resume: str | None, out: Path | None, config_path: str | None, overrides, fresh=None) -> tuple:
    """Rank 0's part of `run` before anything is read or allocated: the run directory it writes (checked, locked and
    marked: runclaim.claim), and the checkpoint it resumes from (after what a killed process of the same run left
    half done is finished). Returns (run directory, its lock, what claim made, the checkpoint or None)."""
    if not resume:
        stem = Path(config_path).name.removesuffix(".toml") if config_path else "debug"
        target = out or Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        runclaim.RunLock(target).check_free()  # a live run's --out: its process named, not "stopped"
        if fresh.tiers.nvme_dir:  # killed runs' stores go, though this --out be refused
            discard_stale(fresh.tiers.nvme_dir)
        rundir.check_new(target)
        lock, made = runclaim.claim(target, fresh.checkpoint.dir)
        return target, lock, made, None
    given = Path(resume) if resume != "latest" else None
    if given is None and out is None:
        raise UserError("--resume latest needs --out DIR, the run to continue")
    own = out if given is None else rundir.run_of(given) if (given / "zarr.json").is_file() else given
    target = out or own
    if target is None:
        raise UserError(
            f"{given} is not inside a run's checkpoints/ directory; pass --out, a new directory for the "
            "resumed run"
        )
    mine = own is not None and rundir.same(own, target)
    if not mine:
        rundir.check_fork(target, own or given)  # a resume writes into its own run, or into a new empty --out
    elif not rundir.is_run(target):
        raise UserError(
            f"{target} holds no tiertrain run to resume; pass --resume a run directory or one of its "
            "checkpoints"
        )
    ckpt_parent = ""
    if not mine:  # a new run: its checkpoints go where its config says, in a directory of its own
        ckpt = given if (given / "zarr.json").is_file() else rundir.resolve(resume, None)
        ckpt_parent = _resumed(config_path, overrides, ckpt, read_meta(ckpt)).checkpoint.dir
    lock, made = runclaim.claim(target, ckpt_parent)
    try:
        if mine:
            rundir.check_metrics(target)  # before heal, whose cut of the timeline reads them
            rundir.heal(target)  # a save or a cut of the timeline that a killed process of this run left
            ckpt = rundir.resolve(resume, target if given is None else None)
        meta = read_meta(ckpt)
        rundir.check_resume(ckpt, target, new_run=not whole(meta))
    except BaseException:
        runclaim.release(target, made, lock)
        raise
    return target, lock, made, ckpt
