"""Per-step records: metrics.jsonl and the progress line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .sizes import num


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def human_count(n: float) -> str:
    for unit, k in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= k:
            return f"{n / k:.2f}{unit}"
    return str(int(n))


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def progress_line(rec: dict, total_steps: int, eta_s: float | None) -> str:
    """One step's line; `eta_s` None: not known yet (after the first step)."""
    return (
        f"step {rec['step']}/{total_steps}  loss {rec['loss']:.4f}  "
        + (f"val {rec['val_loss']:.4f}  " if "val_loss" in rec else "")
        + f"lr {rec['lr']:.2e}  "
        f"|g| {rec['grad_norm']:.3f}  {num(rec['tokens_per_s'])} tok/s  "
        f"{num(rec['model_tflops'])} TFLOP/s  ETA {format_duration(eta_s) if eta_s is not None else 'after the next step'}"
    )


def tensorboard_writer(out: Path | None):
    """A TensorBoard SummaryWriter into <out>/tensorboard (None: only checks that the package is there)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from .errors import ConfigError

        raise ConfigError(
            "train.tensorboard = true needs the tensorboard package: pip install "
            "'tiertrain[tensorboard]', or set train.tensorboard = false"
        ) from None
    return SummaryWriter(str(out / "tensorboard")) if out is not None else None


class MetricsLog:
    """Appends one JSON object per step, whole or not at all: a write that fails (a full disk) is cut back
    to the last whole line and stops the run with one line (loop.disk_failed's). Flushed per line so a killed
    run keeps what it logged. `tensorboard`: a SummaryWriter that gets every number of each record too (its
    own thread writes the event file; close() closes it)."""

    def __init__(self, path: Path, tensorboard=None):
        self.path, self.tb = path, tensorboard
        # unbuffered: no write held back
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, rec: dict) -> None:
        """Appends rec's line; a failed write is cut back to the last whole line and raised (the loop says in one
        line what there is to go on from: loop.disk_failed)."""
        data = (json.dumps(rec) + "\n").encode()
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            done = 0
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as e:
            try:
                os.ftruncate(self._fd, end)  # needs no space: the torn record goes
            except OSError:
                pass
            e.filename = e.filename or str(self.path)
            raise
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl. A torn last line (a write cut short by a crash or a full disk) is
    dropped; any other line that is not JSON, or not a record tiertrain writes (an object with its step), raises
    ValueError."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"line {i + 1} is not JSON") from None
        if not (isinstance(rec, dict) and type(rec.get("step")) is int):
            raise ValueError(f"line {i + 1} is not a record tiertrain wrote (a JSON object with its step)")
        out.append(rec)
    return out


def truncate_metrics(path: Path, step: int) -> None:
    """Drops the records after `step` (logged by the interrupted run after its last checkpoint), and a torn
    last line."""
    if not path.is_file():
        return
    from .durable import write_whole

    write_whole(path, "".join(json.dumps(r) + "\n" for r in read_metrics(path) if r["step"] <= step))


def run_summary(records: list[dict]) -> list[str]:
    """A few lines on a run: loss, throughput (medians past the first step, which has no overlap to
    lean on), where the step's time went, measured against predicted, bytes on disk, peaks."""
    from statistics import median

    if not records:
        return ["no steps logged yet"]
    steady = records[1:] or records

    def med(key: str) -> float:
        return median(r[key] for r in steady if key in r)

    out = [
        f"{len(records)} steps (up to step {records[-1]['step']}), {records[-1]['tokens']:,} tokens; loss "
        f"{records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}",
        f"median step {med('step_s'):.3f} s: {num(med('tokens_per_s'))} tokens/s, {num(med('model_tflops'))} "
        "model TFLOP/s" + (f", MFU {med('mfu'):.1%}" if any("mfu" in r for r in steady) else ""),
    ]
    split = [
        k for k in ("forward_s", "backward_s", "h2d_wait_s", "d2h_wait_s", "opt_wait_s") if k in steady[0]
    ]
    if split:
        out.append("time split (median s): " + ", ".join(f"{k[:-2]} {med(k):.3f}" for k in split))
    if any("pred_step_s" in r for r in steady):
        out.append(
            f"measured / predicted step: {med('step_s'):.3f} / {med('pred_step_s'):.3f} s "
            f"({med('step_s') / med('pred_step_s') - 1:+.0%})"
        )
    if any("nvme_read_gb" in r for r in steady):
        out.append(
            f"NVMe per update (median): read {med('nvme_read_gb'):.1f} GB, write {med('nvme_write_gb'):.1f} GB"
        )
    peaks = [
        f"{name} {max(r[k] for r in records if k in r):.1f} GB"
        for k, name in (("gpu_peak_gb", "GPU"), ("host_rss_gb", "host RSS"))
        if any(k in r for r in records)
    ]
    if peaks:
        out.append("peaks: " + ", ".join(peaks))
    return out
