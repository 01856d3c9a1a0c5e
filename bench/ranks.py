"""Several GPUs side by side, in one call: tiertrain on one GPU and on N GPUs of one host (the same global
batch), and DeepSpeed ZeRO-3 CPU offload on the same N GPUs.

    python -m bench.ranks --config configs/llama-3b.toml --batches 8 32 --gpus 2 --out bench/results

Each system runs in its own processes, one after another: tiertrain's N ranks as `tiertrain run --gpus N`
starts them (tiertrain.launch), DeepSpeed's as its launcher would (the same environment). Every rank takes its
rows of the same random batches (bench.common.batch); `--warmup` steps, then `--steps` timed ones (median of
rank 0's). tiertrain plans with the reference figures. Writes <out>/<date>-<gpu>-<model>-gpus<N>.md and .json
with the commit, the command and each tiertrain run's resolved RunPlan.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from statistics import median

from bench.baselines import deepspeed_config
from bench.common import batch, commit, peak_rss_gb


def _rows(B: int) -> slice:
    n, r = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    return slice(r * B // n, (r + 1) * B // n)


def run_tiertrain(a) -> dict:
    """One rank of tiertrain (or the only one), at batch a.batch."""
    import torch

    from tiertrain.config import load_config
    from tiertrain.trainer import Trainer

    sets = [
        f"train.batch_size={a.batch}",
        'train.compute_dtype="bfloat16"',
        "train.steps=100000",
        "optim.lr=1e-5",
        "optim.min_lr=0.0",
        f"optim.grad_clip={a.grad_clip}",
        *a.set,
    ]
    cfg = load_config(a.config, sets)
    tr = Trainer(cfg)
    S, V, rows = cfg.train.seq_len, cfg.model.vocab_size, _rows(a.batch)
    recs = []
    for k in range(a.warmup + a.steps):
        inp, tgt = batch(a.batch, S, V, k)
        recs.append(tr.train_on(inp[rows], tgt[rows]))
    timed = recs[a.warmup :]
    out = {
        "system": f"tiertrain, {tr.ranks.size} GPU" + "s" * (tr.ranks.size > 1),
        "kind": "tiertrain",
        "gpus": tr.ranks.size,
        "batch": a.batch,
        "tokens": a.batch * S,
        "sets": sets,
        "step_s": median(r["step_s"] for r in timed),
        "losses": [r["loss"] for r in timed],
        "grad_norms": [r["grad_norm"] for r in timed],
        "pred_step_s": tr.plan.prediction.step_s,
        "plan": tr.run_plan.to_dict(),
        "bottleneck": tr.plan.prediction.bottleneck,
        "gpu_peak_gb": max(r.get("gpu_peak_gb", 0.0) for r in timed),
        "host_peak_rss_gb": peak_rss_gb(),
        **{
            k: median(r[k] for r in timed)
            for k in ("forward_s", "backward_s", "opt_wait_s", "h2d_gb", "d2h_gb")
        },
    }
    tr.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return out


def run_deepspeed(a) -> dict:
    """One rank of DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU, at batch a.batch."""
    import deepspeed
    import torch

    from tiertrain.config import load_config
    from tiertrain.model.reference import ReferenceLM

    cfg = load_config(a.config)
    spec, S, n = cfg.model, cfg.train.seq_len, int(os.environ.get("WORLD_SIZE", "1"))
    # the rank's GPU first: NCCL's communicator binds to the device current when it is made
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed()
    conf = deepspeed_config(argparse.Namespace(batches=[a.batch], micro=a.micro, grad_clip=a.grad_clip))
    conf["gradient_accumulation_steps"] = a.batch // (a.micro * n)
    with deepspeed.zero.Init(config_dict_or_path=conf, remote_device="cpu", pin_memory=True):
        model = ReferenceLM(spec, checkpoint_layers=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    rows, times = _rows(a.batch), []
    for k in range(a.warmup + a.steps):
        inp, tgt = (t[rows].cuda() for t in batch(a.batch, S, spec.vocab_size, k))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for m in range(0, inp.shape[0], a.micro):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = engine(inp[m : m + a.micro], tgt[m : m + a.micro]) / (a.micro * S)
            engine.backward(loss)
            engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {
        "system": f"DeepSpeed ZeRO-3 offload CPU, {n} GPU" + "s" * (n > 1),
        "kind": "deepspeed",
        "gpus": n,
        "batch": a.batch,
        "tokens": a.batch * S,
        "step_s": median(times[a.warmup :]),
        "gpu_peak_gb": torch.cuda.max_memory_allocated() / 1e9,
        "host_peak_rss_gb": peak_rss_gb(),
    }


def launch_worker(a, system: str, B: int, gpus: int, out: Path) -> dict | str:
    """The worker's ranks; rank 0's row, or the end of the log of a failure."""
    from tiertrain.launch import launch

    js, log = out / f".{system}-{gpus}-{B}.json", out / f".{system}-{gpus}-{B}.log"
    args = [
        "-m",
        "bench.ranks",
        "--worker",
        system,
        "--batch",
        str(B),
        "--json",
        str(js),
        "--config",
        a.config,
        "--micro",
        str(a.micro),
        "--warmup",
        str(a.warmup),
        "--steps",
        str(a.steps),
        "--grad-clip",
        str(a.grad_clip),
        *[x for s in a.set for x in ("--set", s)],
    ]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = launch(gpus, args, stdout=f, module=None)
    print(f"{system} x{gpus} batch {B}: exit {code} in {time.perf_counter() - t0:.0f} s", flush=True)
    if code or not js.exists():
        return f"exit {code}: " + " | ".join(log.read_text().strip().splitlines()[-3:])[-400:]
    row = json.loads(js.read_text())
    js.unlink()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/llama-3b.toml")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument(
        "--micro",
        type=int,
        default=4,
        help="DeepSpeed's micro-batch per GPU (tiertrain's: the config's, or --set)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--set", action="append", default=[], help="a tiertrain override, for every tiertrain run")
    p.add_argument("--systems", default="tiertrain,deepspeed")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        row = run_tiertrain(a) if a.worker == "tiertrain" else run_deepspeed(a)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(a.json).write_text(json.dumps(row))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, errors = [], {}
    for B in a.batches:
        runs = [*dict.fromkeys([("tiertrain", 1), ("tiertrain", a.gpus)])] * ("tiertrain" in a.systems) + [
            ("deepspeed", a.gpus)
        ] * ("deepspeed" in a.systems)
        for system, gpus in runs:
            r = launch_worker(a, system, B, gpus, out)
            (rows.append(r) if isinstance(r, dict) else errors.__setitem__(f"{system} x{gpus} batch {B}", r))
    write(a, out, rows, errors)


def write(a, out: Path, rows: list[dict], errors: dict[str, str]) -> None:
    import torch

    from tiertrain.config import load_config

    cfg = load_config(a.config)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    date, name = time.strftime("%Y-%m-%d"), Path(a.config).name.removesuffix(".toml")
    short = next((w for w in gpu.split() if w[:1] in "HABL" and any(c.isdigit() for c in w)), gpu.split()[-1])
    stem = out / f"{date}-{short}-{name}-gpus{a.gpus}"
    meta = {
        "date": date,
        "gpu": gpu,
        "gpus": a.gpus,
        **commit(),
        "command": "python -m bench.ranks " + " ".join(sys.argv[1:]),
    }
    stem.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "rows": rows, "errors": errors}, indent=1) + "\n"
    )
    S = cfg.train.seq_len
    title = (
        f"tiertrain on 1 and {a.gpus} GPUs vs DeepSpeed ZeRO-3 CPU offload on {a.gpus}"
        if a.gpus > 1
        else "tiertrain vs DeepSpeed ZeRO-3 CPU offload on one GPU (bench.ranks with --gpus 1)"
    )
    lines = [
        f"# {name}: {title}",
        "",
        f"- {meta['date']}, {a.gpus} x {gpu}, commit {meta['commit']}"
        + " (with uncommitted changes)" * meta["dirty"],
        f"- command: `{meta['command']}`",
        f"- seq {S}, bf16 compute, random tokens, gradient clipping {a.grad_clip:g}; {a.warmup} warm-up + "
        f"{a.steps} timed steps, median; the RunPlans are in the JSON",
        "",
        "| batch | tokens/step | system | step s | tokens/s | vs tiertrain 1 GPU | plan s | bottleneck "
        "| GPU GB | RSS GB |",
        "| --- " * 10 + "|",
    ]
    for B in a.batches:
        base = next(
            (r for r in rows if r["batch"] == B and r["kind"] == "tiertrain" and r["gpus"] == 1), None
        )
        for r in (r for r in rows if r["batch"] == B):
            vs = f"{base['step_s'] / r['step_s']:.2f}x" if base else ""
            plan = f"{r['pred_step_s']:.3g}" if r.get("pred_step_s") else ""
            lines.append(
                f"| {B} | {B * S:,} | {r['system']} | {r['step_s']:.2f} | {r['tokens'] / r['step_s']:,.0f} "
                f"| {vs} | {plan} | {r.get('bottleneck', '')} | {r['gpu_peak_gb']:.1f} "
                f"| {r['host_peak_rss_gb']:.1f} |"
            )
    lines += [""] + [f"- {k} failed: {v}" for k, v in errors.items()]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
