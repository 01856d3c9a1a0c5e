"""Claiming a run directory for the process that writes it (rundir.py says what a run directory holds): the lock
that one live process holds, the marker that says the directory is a run, the directory of its checkpoints under
checkpoint.dir, and the names a run writes refused where they are links. What claim() made is taken back by
release() when the run is refused before its first step."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from . import __version__
from .durable import write_json
from .errors import UserError, why
from .rundir import CKPT_MARKER, CUT, LOCK, MARKER, empty_run, left_writing, run_marker, saved_steps


class RunLock:
    """An exclusive lock on a run directory, held by the process that writes it for the run's life: the kernel's
    lock on `tiertrain-run.lock` (flock), which goes with its process however that ends, so the lock of a killed
    run is free to take; the file says who holds it."""

    def __init__(self, out: Path):
        self.path, self.fd = Path(out) / LOCK, -1

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            self._lock(
                fd, fcntl.LOCK_EX, "or stop it (Ctrl-C saves a checkpoint), then resume with --resume latest"
            )
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(
            fd,
            (
                json.dumps(
                    {
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    }
                )
                + "\n"
            ).encode(),
        )
        self.fd = fd

    def _holder(self) -> str:
        try:
            h = json.loads(self.path.read_text())
            return f"process {h['pid']} on {h['host']}, since {h['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"

    def check_free(self) -> None:
        """Refuses, naming its process, a lock a live run holds; takes nothing and makes no file."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return  # none (or not a file tiertrain could have made): no live run holds it
        try:
            self._lock(fd, fcntl.LOCK_SH, "or pass a new --out")
        finally:
            os.close(fd)

    def _lock(self, fd: int, how: int, then: str) -> None:
        """flock(fd, how) without waiting; where a live run holds the lock, one line naming its process, and
        what to do `then`."""
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise
            raise UserError(
                f"--out {self.path.parent} is in use by a live run ({self._holder()}); wait for it to end, {then}"
            ) from None

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the lock goes with the descriptor
            self.fd = -1


# what a run writes in its --out: none of them may be a link, through which it would write or delete elsewhere
OWN = (MARKER, LOCK, CUT, "config.toml", "plan.json", "metrics.jsonl", "train.log")
OWN += ("checkpoints", "abandoned", "hf", "tensorboard")  # the last two where asked for


def check_links(out: Path) -> None:
    links = [n for n in OWN if (out / n).is_symlink()]
    if links:
        raise UserError(
            f"--out {out}: {', '.join(links)} {'is a symbolic link' if len(links) == 1 else 'are symbolic links'}"
            "; tiertrain writes only its own files in --out and would write through it: remove "
            f"{'it' if len(links) == 1 else 'them'}, or pass a new --out"
        )


def _forget_checkpoint_dir(out: Path) -> None:
    """The directory claim() made in checkpoint.dir for the run in `out`, removed where it is still without a
    checkpoint: its mark, then the directory if nothing else is in it."""
    ck = run_marker(out).get("checkpoints")
    if ck and (Path(ck) / CKPT_MARKER).is_file() and not saved_steps(Path(ck)):
        (Path(ck) / CKPT_MARKER).unlink()
        try:
            Path(ck).rmdir()
        except OSError:
            pass


def claim(out: Path, ckpt_parent: str = "") -> tuple[RunLock, str]:
    """Creates `out` (or takes the empty one checked), locks it for this process, and marks it as a run; a run
    whose checkpoints go to checkpoint.dir (`ckpt_parent`) gets a new directory of its own there, which the marker
    names. A full or read-only disk is one line. Returns (the lock, what it made for release(): "dir" (the directory
    and the marker), "marker", "reused" (a new marker for a run that never took a step), or "")."""
    check_links(out)
    made = "dir" if not out.exists() else "" if (out / MARKER).is_file() else "marker"
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = RunLock(out)
        lock.acquire()  # before the marker: a run that finds the lock taken leaves what the live run made
    except OSError as e:
        raise UserError(
            f"cannot write the run directory {out}: {why(e)}; pass an --out on a disk with room"
        ) from None
    try:
        for p in out.iterdir():  # what a killed process left half written: never the run's own files
            if left_writing(p):
                p.unlink(missing_ok=True)
        if not made and empty_run(out):
            # a run that never took a step: this one starts afresh in it, with a marker of its own
            _forget_checkpoint_dir(out)
            (out / MARKER).unlink()
            made = "reused"
        if not (out / MARKER).is_file():
            marker = _marker()
            if ckpt_parent:
                marker["checkpoints"] = str(_new_checkpoint_dir(Path(ckpt_parent), out))
            write_json(out / MARKER, marker)
    except BaseException as e:  # what it made goes back: the --out as it came (a Ctrl-C here too)
        release(out, made, lock)
        if not isinstance(e, OSError):
            raise
        raise UserError(
            f"cannot write the run directory {out}: {why(e)}; pass an --out on a disk with room"
        ) from None
    return lock, made


def _marker() -> dict:
    return {
        "format": "tiertrain-run/1",
        "tiertrain_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _new_checkpoint_dir(parent: Path, out: Path) -> Path:
    """A new directory for the run's checkpoints inside the user's checkpoint.dir, marked as the run's."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        # absolute: the marker names it for runs started from any working directory
        d = Path(tempfile.mkdtemp(prefix=f"{out.resolve().name or 'run'}-", dir=parent.resolve()))
        write_json(d / CKPT_MARKER, {"format": "tiertrain-checkpoints/1", "run": str(out.resolve())})
    except OSError as e:
        raise UserError(
            f"cannot make the checkpoint directory in checkpoint.dir {parent}: {why(e)}; pass a "
            "writable directory"
        ) from None
    return d


def release(out: Path, made: str, lock: RunLock | None = None) -> None:
    """Takes back what claim() made (`made`) for a run refused before its first step, then the lock (also where
    taking back failed: a full disk)."""
    try:
        if made == "reused":  # a run that never took a step, left as it came: marked, and so reusable
            _forget_checkpoint_dir(out)
            write_json(out / MARKER, _marker())
        # the marker and the lock file are tiertrain's: the --out left as it came (or as empty as it was)
        elif made:
            _forget_checkpoint_dir(out)
            (out / MARKER).unlink(missing_ok=True)
            (out / LOCK).unlink(missing_ok=True)
        if made == "dir":
            try:
                out.rmdir()  # only if empty: anything else in it stays
            except OSError:
                pass
    finally:
        if lock is not None:
            lock.release()
