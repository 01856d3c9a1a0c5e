"""The training loop of `tiertrain run`: steps, metrics, checkpoints, and stopping on a signal."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from . import rundir
from .config import LIFTED
from .errors import UserError, close_all, why
from .metrics import MetricsLog, format_duration, progress_line, tensorboard_writer
from .model.hf import carry_files
from .signals import StopSignals
from .trainer import Trainer


def fit(
    tr: Trainer, out: Path, echo: Callable[[str], None] = print, hf_from: Path | None = None
) -> list[dict]:
    """Trains to train.steps, checkpointing every checkpoint.every steps and always at the end.
    SIGINT / SIGTERM finish the current step, save a checkpoint and return. A resumed trainer
    (step > 0) continues metrics.jsonl from its step. Of several ranks, rank 0 writes the run's files and logs;
    the others train beside it. `hf_from`: the tokenizer and generation config a run started from another run's
    checkpoint takes from that run (its <run>/hf), for the export."""
    shown = echo
    if not tr.ranks.first:
        return _train(tr, out, lambda line: None, None)
    log = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(tr.cfg.to_toml())
        (out / "plan.json").write_text(tr.plan_json())
        source = tr.cfg.train.init_from if not tr.step else ""
        source = source or (
            str(hf_from) if hf_from and hf_from.is_dir() and not (out / "hf").exists() else ""
        )
        if source:  # its tokenizer and generation config, for the export
            _, left = carry_files(source, out / "hf")
            if left:
                shown(
                    f"warning: {', '.join(left)} of {source} link outside it: not copied for the "
                    "export; copy them into the exported directory yourself"
                )
        ignored = [
            k for k, v in tr.cfg.model_sets.items() if k not in LIFTED and getattr(tr.cfg.model, k, v) != v
        ]
        if tr.cfg.train.init_from and ignored:  # config.json gave [model]: say which --set values went unused
            shown(
                f"warning: --set {', '.join(f'model.{k}' for k in ignored)} not used: with --init-from the model's "
                f"config.json gives [model], of which --set changes only {', '.join(LIFTED)}"
            )
        cut = rundir.cut_timeline(out, tr.step) if tr.step else None  # one timeline: latest is this one's
        log = MetricsLog(out / "metrics.jsonl", tensorboard_writer(out) if tr.cfg.train.tensorboard else None)
        echo = TrainLog(out / "train.log", shown)
    except OSError as e:
        _close(tr, log)
        raise UserError(
            f"cannot write the run directory {out}: {why(e)}; free space or pass another --out"
        ) from None
    except ValueError as e:
        _close(tr, log)
        raise UserError(
            f"{out / 'metrics.jsonl'}: {e}; was it edited? Restore it or start a new --out"
        ) from None
    except BaseException:  # a signal (TermInterrupts) before the loop's own handler: the scratch stores go
        _close(tr, log)
        raise
    if cut:
        echo(cut)
    try:
        return _train(tr, out, echo, log)
    finally:
        echo.close()


def _train(tr: Trainer, out: Path, echo: Callable[[str], None], log: MetricsLog | None) -> list[dict]:
    tc, every = tr.cfg.train, tr.cfg.checkpoint.every
    history, clock = [], Eta(tr.step, tc.steps)
    with StopSignals() as stop:  # from here a signal stops the run with a checkpoint
        if tr.step:
            echo(f"resumed at step {tr.step} of {tc.steps}")
        for line in tr.describe():
            echo(line)
        try:
            # a signal stops every rank
            while tr.step < tc.steps and not tr.ranks.any_failed(bool(stop.signal)):
                rec = tr.train_step()
                evals = tr.val is not None and (
                    tc.eval_every and tr.step % tc.eval_every == 0 or tr.step == tc.steps
                )
                if evals:
                    with clock.paused():  # the ETA counts training steps only
                        rec["val_loss"] = tr.evaluate()
                if log:
                    log.write(rec)
                history.append(rec)
                clock.stepped(rec["step"])
                if rec["step"] % tc.log_every == 0 or rec["step"] in (clock.first + 1, tc.steps) or evals:
                    _show(rec, tc.steps, clock.eta(rec["step"]), echo)
                if (
                    every
                    and tr.step % every == 0
                    and tr.step < tc.steps
                    and not tr.ranks.any_failed(bool(stop.signal))
                ):
                    _checkpoint(tr, out, echo)
            # a stop saves, the end as checkpoint.final says: the process's last save
            if (history or not rundir.checkpoints(out)) and (tr.step < tc.steps or tr.cfg.checkpoint.final):
                _checkpoint(tr, out, echo, last=True)
        except OSError as e:  # a disk failed mid-run (EIO): one line, with what there is to go on from
            _close(tr, log)
            raise UserError(disk_failed(e, out)) from None
        except BaseException:
            _close(tr, log)
            raise
        _close(tr, log, echo)
    echo(_ending(tr, out, stop.signal, history, clock.since_start()))
    return history


def _show(rec: dict, steps: int, eta: float | None, echo: Callable[[str], None]) -> None:
    """The step's progress line, and on a GPU the measured times against the plan's."""
    echo(progress_line(rec, steps, eta))
    if "pred_step_s" in rec and rec["step"] > 1:
        echo(
            "  measured / predicted s: "
            + ", ".join(
                f"{k} {rec[k + '_s']:.3f}/{rec['pred_' + k + '_s']:.3f}"
                for k in ("step", "forward", "backward", "opt_wait")
            )
        )


def _ending(tr: Trainer, out: Path, signal_name: str | None, history: list[dict], took: float) -> str:
    """The run's last line: how to go on after a stop, or what it reached."""
    steps = tr.cfg.train.steps
    if signal_name and tr.step >= steps:  # the last step's checkpoint is the final one: nothing to continue
        return f"stopped by {signal_name} after the last step, {steps}: the run is done; metrics in {out / 'metrics.jsonl'}"
    if signal_name or tr.step < steps:
        how = (
            f"tiertrain run --resume latest --out {out}"
            if tr.cfg.checkpoint.state == "full"
            else f"tiertrain run --resume {out} --out NEW_DIR (its checkpoint holds the weights only: a new run)"
        )
        return f"stopped by {signal_name or 'a signal to another rank'} after step {tr.step}; continue with: {how}"
    last = history[-1] if history else {}
    return (
        f"done: {steps} steps in {format_duration(took)}"
        + (f", final loss {last['loss']:.4f}" if history else "")
        + (f", validation loss {last['val_loss']:.4f}" if "val_loss" in last else "")
        + f"; metrics in {out / 'metrics.jsonl'}"
    )


class Eta:
    """The time left, from the steps after the first (which builds and warms up), evaluations left out."""

    def __init__(self, first: int, steps: int):
        self.first, self.steps = first, steps
        self.t_run = self.t_start = time.perf_counter()

    @contextmanager
    def paused(self):
        t0 = time.perf_counter()
        yield
        self.t_start += time.perf_counter() - t0

    def stepped(self, step: int) -> None:
        if step == self.first + 1:
            self.t_start = time.perf_counter()

    def eta(self, step: int) -> float | None:
        done = step - self.first - 1
        return (time.perf_counter() - self.t_start) / done * (self.steps - step) if done else None

    def since_start(self) -> float:
        return time.perf_counter() - self.t_run


def _close(tr: Trainer, log: MetricsLog | None = None, warn: Callable[[str], None] | None = None) -> None:
    """The metrics log and the run's threads and files closed, each whatever another raised, then its scratch
    stores deleted (the state is in the checkpoint now, or lost with the error). What closing meets is a warning
    (`warn`: the run ended well, its checkpoints whole) or nothing (None: an error stops the run, and it is the
    one to say; often the same failed write again)."""
    try:
        close_all(*([log.close] if log else []), tr.close)
    except Exception as e:  # noqa: BLE001 - said or left to the error that stopped the run
        if warn is not None:
            what = why(e) if isinstance(e, OSError) else e
            warn(f"warning: closing the run failed ({what}); its checkpoints are whole")


def disk_failed(e: OSError, out: Path | None = None) -> str:
    """A disk's failure in one line: what failed, and, mid-run (`out`: the run directory), the checkpoint to go on
    from, if any; in the setup (None) there is nothing of the run to go on from."""
    where = f" ({e.filename})" if e.filename else ""
    try:
        saved = rundir.checkpoints(out) if out is not None else []
    except OSError:  # the run directory's disk itself
        saved = []
    go = (
        f"its last checkpoint, {saved[-1].name}, is whole: once the disk is fixed, go on with --resume latest"
        if saved
        else f"{'it saved no checkpoint: ' if out is not None else ''}once the disk is fixed, run it again"
    )
    return f"the run stopped on a disk error: {why(e)}{where}; {go}"


def _checkpoint(tr: Trainer, out: Path, echo: Callable[[str], None], last: bool = False) -> None:
    path, rate = tr.save_checkpoint(out, last)
    echo(f"checkpoint {path} ({rate:.2f} GB/s)")


class TrainLog:
    """The progress lines, shown and appended to <out>/train.log (a resumed run continues it). A failed write
    (a full disk) stops the log with one warning; metrics.jsonl stops the run."""

    def __init__(self, path: Path, echo: Callable[[str], None]):
        self.path, self.echo = path, echo
        self.f = open(path, "a", encoding="utf-8", buffering=1)  # line-buffered: a killed run keeps its lines

    def __call__(self, line: str) -> None:
        self.echo(line)
        if self.f is None:
            return
        try:
            self.f.write(line + "\n")
        except OSError as e:
            self.close()
            self.echo(f"warning: writing {self.path} failed ({why(e)}); the run goes on without it")

    def close(self) -> None:
        if self.f is not None:
            try:
                self.f.close()
            except OSError:
                pass
            self.f = None
