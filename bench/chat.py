"""Fine-tuning on conversations against plain text at the same shape (issue 41): the tokens/s of `tiertrain run` on
rows of packed conversations (each attending only to itself through the variable-length kernel, the assistant's
tokens trained) and on rows cut from a stream of the same tokens (attention over the whole row, every token
trained), and optionally on that stream with its documents kept apart (data.document_mask).

    python -m bench.chat --config llama3.1-8b --seq-len 8192 --batch 8 --out bench/results

The data is synthetic and needs no tokenizer: conversations of --lengths tokens (200 to 4,000, uniform) of random
ids below the model's vocabulary, each a few turns, a user's (not trained) then an assistant's (trained): what
`prepare --chat` writes, and the token ids change none of the compute. The plain text is the same tokens as one
stream. Each system runs `python -m tiertrain run --config ... --set data.path=...` in its own process, one after
another (--rounds times, alternating), --warmup steps and then --steps timed ones; a system's figure is the median
tokens_per_s (every position of a row, padding included: the packing's fill is reported beside it) of its timed
steps. Writes <out>/<date>-<gpu>-chat-<config>-<seq>.md and .json with the commands, the plans and the commit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import numpy as np

from bench.common import commit

SYSTEMS = {
    "chat": ("conversations.bin", []),  # packed, each conversation alone, the assistant's tokens trained
    "text": ("text.bin", []),  # the same tokens as a stream: rows cut from it, attention over the whole row
    "text-docs": ("text.bin", ["data.document_mask=true"]),  # the stream with its documents kept apart
}


def conversations(
    path: Path, text: Path, n: int, lengths: tuple[int, int], vocab: int, seed: int = 0
) -> dict:
    """Writes n synthetic conversations (token file with sample starts and loss mask) and the same tokens as a
    stream; returns their counts."""
    from tiertrain.tokenfile import TokenWriter

    rng = np.random.default_rng(seed)
    conv = TokenWriter(path, vocab, samples=True, masked=True)
    flat = TokenWriter(text, vocab, samples=True)
    tokens = trained = 0
    for _ in range(n):
        size = int(rng.integers(lengths[0], lengths[1] + 1))
        ids = rng.integers(0, vocab, size)
        mask = np.zeros(size, dtype=np.uint8)
        at = 0
        while at < size:  # a user's turn of 20-300 tokens, then an assistant's of 50-800
            user = int(rng.integers(20, 301))
            answer = int(rng.integers(50, 801))
            mask[at + user : at + user + answer] = 1
            at += user + answer
        mask[-1] = 1  # the last turn's end trains
        conv.add(ids, mask, start=True)
        flat.add(ids, start=True)
        tokens, trained = tokens + size, trained + int(mask[1:].sum())
    conv.close()
    flat.close()
    return {"conversations": n, "tokens": tokens, "trained_tokens": trained}


def run_system(a, name: str, data: Path, extra: list[str], work: Path) -> dict:
    """One `tiertrain run` of `name`; its timed steps' median tokens/s, step time, peak GPU memory, its data line."""
    out = work / f"run-{name}-{time.time_ns()}"
    sets = [
        f'data.path="{data}"',
        f"train.seq_len={a.seq_len}",
        f"train.batch_size={a.batch}",
        f"train.micro_batch_size={a.micro}",
        f"train.steps={a.warmup + a.steps}",
        "train.log_every=1",
        "checkpoint.final=false",
        *a.set,
        *extra,
    ]
    cmd = [
        sys.executable,
        "-m",
        "tiertrain",
        "run",
        "--config",
        a.config,
        *[x for s in sets for x in ("--set", s)],
    ]
    cmd += [
        *(["--host-gb", str(a.host_gb)] if a.host_gb else []),
        *(["--nvme-dir", a.nvme_dir] if a.nvme_dir else []),
    ]
    cmd += ["--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    if r.returncode != 0:
        raise SystemExit(f"{name}: `{' '.join(cmd)}` failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][a.warmup :]
    line = next((x for x in r.stdout.splitlines() if x.startswith("batch: ")), "")
    return {
        "system": name,
        "command": " ".join(cmd),
        "tokens_per_s": median(x["tokens_per_s"] for x in recs),
        "step_s": median(x["step_s"] for x in recs),
        "gpu_peak_gb": max((x.get("gpu_peak_gb", 0.0) for x in recs), default=0.0),
        "losses": [x["loss"] for x in recs],
        "data": line.partition("data: ")[2],
        "plan": _plan(json.loads((out / "plan.json").read_text())),
    }


def _plan(p: dict) -> dict:
    """The run's plan (<out>/plan.json, `tiertrain plan --format json`'s keys) without its per-unit table."""
    return {k: v for k, v in p.items() if k not in ("units", "placement", "clipped_times")}


def report(a, rows: list[dict], data: dict, gpu: str) -> str:
    base = median(r["tokens_per_s"] for r in rows if r["system"] == "text")
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["system"], []).append(r)
    lines = [
        f"# Conversations against plain text: {a.config}, {a.batch} x {a.seq_len} tokens per step, {gpu}",
        "",
        f"`python -m bench.chat {' '.join(sys.argv[1:])}` at commit {data['commit']['commit']}"
        + (" (uncommitted changes)" if data["commit"]["dirty"] else "")
        + f"; {data['data']['conversations']:,} synthetic conversations of {a.lengths[0]:,} to {a.lengths[1]:,} "
        f"tokens ({data['data']['tokens']:,} tokens, {data['data']['trained_tokens']:,} trained).",
        "",
        "| system | tokens/s (median of runs) | step s | plan s | / text | GPU peak GB | rows |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rs in by.items():
        tps = median(r["tokens_per_s"] for r in rs)
        each = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in rs)
        lines.append(
            f"| {name} | {tps:,.0f} ({each}) | "
            f"{median(r['step_s'] for r in rs):.2f} | {(rs[0]['plan'] or {}).get('step_s', float('nan')):.2f} | "
            f"{tps / base:.3f} | {max(r['gpu_peak_gb'] for r in rs):.1f} | "
            f"{rs[0]['data']} |"
        )
    lines += ["", "Commands:", "", *[f"- `{r['command']}`" for r in rows], ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="llama3.1-8b")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro", default='"auto"', help="train.micro_batch_size (a TOML literal)")
    p.add_argument("--lengths", type=int, nargs=2, default=[200, 4000], metavar=("LEAST", "MOST"))
    p.add_argument(
        "--conversations", type=int, default=None, help="default: enough for every step, twice over"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--systems", default="chat,text", help=f"of {', '.join(SYSTEMS)}")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for every system")
    p.add_argument("--host-gb", type=float, default=None, help="`tiertrain run --host-gb`")
    p.add_argument("--nvme-dir", default=None, help="`tiertrain run --nvme-dir`")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--out", default="bench/results")
    a = p.parse_args()
    from tiertrain.config import load_config

    vocab = load_config(a.config).model.vocab_size
    n = a.conversations or 2 * (a.warmup + a.steps) * a.batch * a.seq_len // (sum(a.lengths) // 2) + 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-chat-") as tmp:
        work = Path(tmp)
        data = conversations(work / SYSTEMS["chat"][0], work / SYSTEMS["text"][0], n, tuple(a.lengths), vocab)
        rows = []
        for _ in range(a.rounds):
            for name in a.systems.split(","):
                file, extra = SYSTEMS[name]
                rows.append(run_system(a, name, work / file, extra, work))
                print(f"{name}: {rows[-1]['tokens_per_s']:,.0f} tokens/s ({rows[-1]['data']})", flush=True)
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        gpu = "cpu"
    meta = {"commit": commit(), "data": data, "argv": sys.argv[1:], "gpu": gpu}
    name = Path(a.config).stem if a.config.endswith(".toml") else a.config  # a shipped name keeps its dots
    stem = f"{time.strftime('%Y-%m-%d')}-{gpu.replace(' ', '_')}-chat-{name}-{a.seq_len}"
    (out / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    (out / f"{stem}.md").write_text(report(a, rows, meta, gpu))
    print(f"wrote {out / stem}.md and .json")


if __name__ == "__main__":
    main()
