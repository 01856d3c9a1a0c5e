"""A few steps of a bench system under the PyTorch profiler: what each CUDA stream and the host optimizer
did in each step's forward pass (its waits for the update included) and backward pass.

    python -m bench.trace --system tiertrain --batch 4 --out /tmp/trace [--set SECTION.KEY=VALUE ...]

Writes <out>/trace-<system>-<batch>.json.gz (the profiler's Chrome trace: chrome://tracing, Perfetto) and
prints, and appends to <out>/trace.md, a table per step: for each stream (the compute stream, the weight
loads, the gradient drain, the GPU updates' copies) the seconds it was busy in each phase, and the bytes it
copied each way; for the host optimizer its seconds in the fused AdamW kernel.
"""

from __future__ import annotations

import argparse
import gzip
import json
import threading
from pathlib import Path

from tiertrain.engine.streams import Streams

PHASES = ("forward", "backward")
ROLES = Streams.NAMES
TAG = 1000  # a device-to-device copy of TAG + i bytes on a stream names it ROLES[i] in the trace


def tag_streams(streams) -> None:
    """Copies that name the streams in the trace (the profiler knows them by number only)."""
    import torch

    src = torch.zeros(TAG + len(ROLES), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for i, role in enumerate(ROLES):
        with torch.cuda.stream(getattr(streams, role)):
            dst[: TAG + i].copy_(src[: TAG + i])
    torch.cuda.synchronize()


def _union(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of the spans, clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans):
        if b > end and b > a:
            total += b - max(a, end)
            end = b
    return total


def summarize(trace: dict) -> list[dict]:
    """Per profiled step and phase: {stream: busy s}, {stream: (H2D GB, D2H GB)}.
    Streams are named by tag_streams' copies, others by their number; times in seconds."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    names = {
        e["args"].get("stream"): ROLES[e["args"]["bytes"] - TAG]
        for e in ev
        if e.get("cat") == "gpu_memcpy" and TAG <= e.get("args", {}).get("bytes", 0) < TAG + len(ROLES)
    }
    marks = {
        p: sorted(
            (e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "user_annotation" and e["name"] == p
        )
        for p in PHASES
    }
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out = []
    for k in range(min(len(v) for v in marks.values())):
        step = {}
        for p in PHASES:
            lo, hi = marks[p][k]
            busy, moved = {}, {}
            for s in sorted({e["args"].get("stream", -1) for e in gpu}):
                on = [e for e in gpu if e["args"].get("stream", -1) == s]
                name = names.get(s, f"stream {s}")
                busy[name] = _union([(e["ts"], e["ts"] + e["dur"]) for e in on], lo, hi) / 1e6
                copies = [e for e in on if e["cat"] == "gpu_memcpy" and lo <= e["ts"] < hi]
                moved[name] = tuple(
                    sum(e["args"].get("bytes", 0) for e in copies if d in e["name"]) / 1e9
                    for d in ("HtoD", "DtoH")
                )
            step[p] = {"s": (hi - lo) / 1e6, "busy": busy, "moved": moved}
        out.append(step)
    return out


def host_adamw(events: list, steps: int) -> list[dict[str, float]]:
    """Seconds the host optimizer ran in each phase of the last `steps` steps, from OptimizerThread's
    timeline (the profiler sees the main thread only)."""
    from bench.timeline import _jobs, _marks

    st, bw, nm = (_marks(events, m)[-steps:] for m in ("step", "backward", "norm"))
    spans = [(g, d) for prefix in ("", "spec ") for _, _, g, d in _jobs(events, prefix, -1e18, 1e18)]
    return [{"forward": _union(spans, s, b), "backward": _union(spans, b, n)} for s, b, n in zip(st, bw, nm)]


def table(name: str, steps: list[dict]) -> list[str]:
    lines = [
        f"### {name}",
        "",
        "| step | phase | phase s | host AdamW s | stream: busy s (H2D GB / D2H GB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for k, step in enumerate(steps):
        for p in PHASES:
            d = step[p]
            cells = ", ".join(
                f"{s}: {b:.3f}" + (" (%.1f / %.1f)" % d["moved"][s] if any(d["moved"][s]) else "")
                for s, b in d["busy"].items()
                if b > 0.0005
            )
            lines.append(f"| {k} | {p} | {d['s']:.3f} | {d.get('adamw_s', float('nan')):.3f} | {cells} |")
    return lines + [""]


def _phases(opt) -> None:
    """The trainer's step marks open and close the profiler's forward / backward ranges."""
    import torch

    main, mark, open_ = threading.main_thread(), opt.mark, {}

    def close(p):
        if p in open_:
            open_.pop(p).__exit__(None, None, None)

    def marked(event: str, unit: int = -1) -> None:
        mark(event, unit)
        if threading.current_thread() is not main:
            return
        if event in ("step", "backward"):
            close("forward")
            p = "forward" if event == "step" else "backward"
            open_[p] = torch.profiler.record_function(p)
            open_[p].__enter__()
        elif event == "norm":
            close("backward")

    opt.mark = marked


def main() -> None:
    import torch

    from bench.common import batch
    from bench.pipeline import TIERTRAIN, common
    from tiertrain.config import load_config
    from tiertrain.trainer import Trainer

    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/llama-3b.toml")
    p.add_argument("--system", default="tiertrain", choices=sorted(TIERTRAIN))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--grad-clip", type=float, default=100.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--set", nargs="*", default=[], help="more overrides, after the system's")
    p.add_argument("--out", default="/tmp/trace")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tr = Trainer(load_config(a.config, common(a, a.batch) + TIERTRAIN[a.system] + a.set))
    S, V = tr.cfg.train.seq_len, tr.cfg.model.vocab_size
    for k in range(a.warmup):
        tr.train_on(*batch(a.batch, S, V, k))
    _phases(tr.run.updates)
    acts = [torch.profiler.ProfilerActivity.CPU] + [
        torch.profiler.ProfilerActivity.CUDA
    ] * tr.run.streams.cuda
    with torch.profiler.profile(activities=acts) as prof:
        if tr.run.streams.cuda:
            tag_streams(tr.run.streams)
        recs = [tr.train_on(*batch(a.batch, S, V, a.warmup + k)) for k in range(a.steps)]
        tr.run.updates.settle()
    tr.close()
    path = out / f"trace-{a.system}-{a.batch}.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    with gzip.open(f"{path}.gz", "wt") as f:
        json.dump(trace, f)
    path.unlink()
    name = f"{a.system}, batch {a.batch}: steps {', '.join('%.3f' % r['step_s'] for r in recs)} s under the profiler"
    steps = summarize(trace)
    for step, adam in zip(steps, host_adamw(list(tr.run.updates.timeline), a.steps)):
        for p in PHASES:
            step[p]["adamw_s"] = adam[p]
    text = "\n".join(table(name, steps))
    with open(out / "trace.md", "a") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
