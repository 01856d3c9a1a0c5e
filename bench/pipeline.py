"""Side-by-side benchmark on one GPU: tiertrain vs all-in-GPU PyTorch vs DeepSpeed ZeRO-3 CPU offload.

    python -m bench.pipeline --config configs/llama-3b.toml --batches 4 8 16 32 --out bench/results

Each system runs in its own process (one after another, same GPU), on random tokens, at every batch
size: `--warmup` steps, then `--steps` timed steps (median reported). The machine's ceilings are
measured first in the same run, and tiertrain's step time is set beside its floor. Writes
<out>/<date>-<gpu>-<model>.md and .json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from bench import dram, timeline

# (stream, activation checkpoints, tiers.gpu_resident_gb, tiers.gpu_update_units). tiertrain: fp32 master
# streamed and cast on the GPU, checkpoints on the host (the least host DRAM traffic and GPU memory),
# as many units updated on the GPU as the plan finds best for the batch (-1: a process per batch size,
# each planned for its own). tiertrain-host-adam: every update by the host AdamW. tiertrain-copy: a host
# bf16 copy streamed, checkpoints on the GPU. res11 / res24: the first units' whole state on the GPU
# (11 GB keeps the GPU peak under a third of the all-in-GPU run's at 8k; 24 GB is half the state).
# (stream, checkpoints, resident GB, GPU-updated units, speculated units[, GPU updates speculated]); the
# systems other than auto do not speculate (optim.speculate_units = 0), as before it existed; the GPU
# updates' speculation (optim.speculate_gpu_updates) follows the host's unless given
TIERTRAIN = {"tiertrain": ("master", "host", 0.0, -1, 0), "tiertrain-host-adam": ("master", "host", 0.0, 0, 0),
             "tiertrain-copy": ("compute", "gpu", 0.0, 0, 0),
             "tiertrain-res11": ("master", "host", 11.0, 0, 0), "tiertrain-res24": ("master", "host", 24.0, 0, 0),
             # 8 GB resident and the rest as planned: the GPU peak stays under a third of all-in-GPU's at 8k
             "tiertrain-res8": ("master", "host", 8.0, -1, 0),
             # what `tiertrain run` does with the config's defaults: the plan chooses for each batch
             "tiertrain-auto": ("auto", "auto", 0.0, -1, -1),
             # the same without speculation
             "tiertrain-auto-nospec": ("auto", "auto", 0.0, -1, 0),
             # with 6 GB resident: the plan's GPU total stays under a third of the all-in-GPU run's at 8k
             "tiertrain-auto-res6": ("auto", "auto", 6.0, -1, -1),
             # and 10 GB: at 8k about all a third of the all-in-GPU run's peak (17.2 GB) leaves room for
             "tiertrain-auto-res10": ("auto", "auto", 10.0, -1, -1),
             # with 14 or 16 units speculated whatever the plan says (the planner's check at 8k)
             "tiertrain-auto-res6-spec14": ("auto", "auto", 6.0, -1, 14, -1),
             "tiertrain-auto-res6-spec16": ("auto", "auto", 6.0, -1, 16, -1),
             # the same with the GPU updates as their weights load (as before they could be speculated)
             "tiertrain-auto-res6-fwdgpu": ("auto", "auto", 6.0, -1, -1, 0),
             # and with them speculated in the backward pass whatever the plan says
             "tiertrain-auto-res6-bwdgpu": ("auto", "auto", 6.0, -1, -1, 1),
             # with torch's fused kernel for the host AdamW (an update into copies: a copy, then the kernel)
             "tiertrain-auto-res6-torchadam": ("auto", "auto", 6.0, -1, -1, None, "torch"),
             # with the fp32 master streamed whatever the plan says
             "tiertrain-auto-res6-fp32": ("master", "auto", 6.0, -1, -1),
             # the fp32 master streamed with 6 units updated on the GPU as their weights load, or 8 speculated
             # in the backward pass: what the plan chose at 8k on some probes (the planner's check)
             "tiertrain-res6-gpu6": ("master", "gpu", 6.0, 6, -1, 0),
             "tiertrain-res6-gpu8-spec": ("master", "gpu", 6.0, 8, -1, 1),
             # and the GPU memory the plan leaves for resident units (the whole state, where it fits)
             "tiertrain-auto-resident": ("auto", "auto", -1.0, -1, -1)}
SYSTEMS = ("probe", "deepspeed", "tiertrain-auto", "tiertrain", "tiertrain-host-adam", "gpu")


def _batch(B: int, S: int, V: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, V, (B, S + 1), generator=g)
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def _row(system: str, B: int, S: int, times: list[float], gpu_peak: float, flops_per_token: float, **extra) -> dict:
    t = median(times)
    return {"system": system, "batch": B, "tokens": B * S, "step_s": t, "tokens_per_s": B * S / t,
            "model_tflops": flops_per_token * B * S / t / 1e12, "gpu_peak_gb": gpu_peak,
            "host_peak_rss_gb": _peak_rss_gb(), **extra}


def tiertrain_config(a, batch: int, stream: str, activations: str, resident_gb: float = 0.0, gpu_updates: int = 0,
                     speculate: int = 0, gpu_spec: int | None = None, host_kernel: str = "auto"):
    """The config of a TIERTRAIN system (its tuple's fields) at this batch size."""
    from tiertrain.config import load_config

    def auto(v, none=-1):  # the tuples' -1 (0 for the micro-batch): "auto" in the config
        return '"auto"' if v == none else v

    spec_gpu = speculate if gpu_spec is None else gpu_spec
    return load_config(a.config, [f"train.micro_batch_size={auto(a.micro, 0)}", f"train.batch_size={batch}",
                                  'train.compute_dtype="bfloat16"', f'tiers.activations="{activations}"',
                                  f'tiers.stream="{stream}"', "train.steps=100000", "optim.lr=1e-5", "optim.min_lr=0.0",
                                  f"tiers.gpu_resident_gb={auto(resident_gb)}",
                                  f"tiers.gpu_update_units={auto(gpu_updates)}",
                                  f"optim.grad_clip={a.grad_clip}", f"optim.speculate_units={auto(speculate)}",
                                  "optim.speculate_gpu_updates="
                                  + (auto(spec_gpu) if spec_gpu == -1 else str(bool(spec_gpu)).lower()),
                                  f'optim.host_kernel="{host_kernel}"'])


def run_tiertrain(a, stream: str, activations: str, resident_gb: float = 0.0, gpu_updates: int = 0,
                  speculate: int = 0, gpu_spec: int | None = None, host_kernel: str = "auto") -> list[dict]:
    from tiertrain.trainer import Trainer

    cfg = tiertrain_config(a, max(a.batches), stream, activations, resident_gb, gpu_updates, speculate, gpu_spec,
                           host_kernel)
    t0 = time.perf_counter()
    tr = Trainer(cfg)
    setup_s = time.perf_counter() - t0
    S, V = cfg.train.seq_len, cfg.model.vocab_size
    auto = "the plan's choice: " if stream == "auto" else ""
    stream, activations, resident_gb = tr.run_plan.stream, tr.run_plan.activations, tr.run_plan.resident_gb
    host = [u for u in range(len(tr.layouts)) if tr.where[(u, "master")] != "gpu" and u not in tr.deferred]
    host_params = sum(tr.layouts[u].numel for u in host)
    rows = []
    for B in a.batches:
        before = (tr.optim.kept, tr.optim.redone)
        tr.optim.timeline.clear()
        recs = [tr.train_on(*_batch(B, S, V, k)) for k in range(a.warmup + a.steps)][a.warmup:]
        # from the last warm-up step: its update runs beside the first timed forward pass
        tr.optim.wait_all()  # the worker appends no more while the log is copied
        ev = list(tr.optim.timeline)
        first = [i for i, (e, _, _) in enumerate(ev) if e == "step"][max(a.warmup - 1, 0)]
        t0 = ev[first][2]
        ev = [(e, u, round(t - t0, 6)) for e, u, t in ev[first:]]
        med = {k: median(r[k] for r in recs) for k in ("forward_s", "backward_s", "h2d_wait_s", "d2h_wait_s",
                                                       "opt_wait_s", "h2d_gb", "d2h_gb")}
        name = f"tiertrain ({auto}{'fp32' if stream == 'master' else 'bf16 copy'} stream, {activations} ckpt" + \
            (f", {resident_gb:g} GB resident" if resident_gb else "") + \
            (f", {len(tr.optim.speculated)} units speculated" if tr.optim.speculated else "") + \
            (", GPU updates speculated" if tr.optim.gpu_speculated else "") + \
            ("" if tr.optim.opt.kernel else ", torch's host AdamW") + \
            (", GPU updates as planned)" if gpu_updates < 0 else ", host AdamW only)" if stream == "master" else ")")
        rows.append(_row(name, B, S, [r["step_s"] for r in recs],
                         max(r.get("gpu_peak_gb", 0.0) for r in recs), cfg.model.flops_per_token(S), setup_s=setup_s,
                         params=cfg.model.n_params, host_adam_params=host_params, losses=[r["loss"] for r in recs],
                         grad_norms=[r["grad_norm"] for r in recs],
                         gpu_updates=len(tr.deferred), speculated=len(tr.optim.speculated),
                         gpu_speculated=len(tr.optim.gpu_speculated),
                         kept=tr.optim.kept - before[0], redone=tr.optim.redone - before[1],
                         pred_step_s=tr.plan.step_s if tr.plan and B == cfg.train.batch_size else None,
                         timeline=timeline.summarize(ev, [lay.numel for lay in tr.layouts], set(host)),
                         timeline_events=ev, host_units=host,
                         **med))
    tr.close()
    return rows


def _timed(a, B: int, S: int, V: int, step) -> tuple[list[float], float]:
    """Runs step(inputs, targets) on the GPU warm-up + timed times; (timed seconds, peak GPU GB of those)."""
    import torch

    times, peaks = [], []
    for k in range(a.warmup + a.steps):
        inp, tgt = (t.cuda() for t in _batch(B, S, V, k))
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(inp, tgt)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated() / 1e9)
    return times[a.warmup:], max(peaks[a.warmup:])


def run_gpu(a) -> list[dict]:
    import torch

    from tiertrain.config import load_config
    from tiertrain.model.reference import ReferenceLM

    spec = load_config(a.config).model
    S = load_config(a.config).train.seq_len
    with torch.device("cuda"):
        model = ReferenceLM(spec, checkpoint_layers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step(inp, tgt):
        opt.zero_grad(set_to_none=True)
        for m in range(0, inp.shape[0], a.micro):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(inp[m:m + a.micro], tgt[m:m + a.micro]) / tgt.numel()
            loss.backward()
        if a.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()

    rows = []
    for B in a.batches:
        times, peak = _timed(a, B, S, spec.vocab_size, step)
        rows.append(_row("all-in-GPU PyTorch", B, S, times, peak, spec.flops_per_token(S)))
    return rows


def deepspeed_config(a, nvme_dir: str | None = None) -> dict:
    opt_off = {"device": "cpu", "pin_memory": True}
    if nvme_dir:
        opt_off = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True, "buffer_count": 4}
    return {
        "train_batch_size": max(a.batches), "train_micro_batch_size_per_gpu": a.micro,
        "gradient_accumulation_steps": max(a.batches) // a.micro,
        "bf16": {"enabled": True}, "gradient_clipping": a.grad_clip, "steps_per_print": 10 ** 9,
        # the engine switches off an outer torch.autocast unless its own section asks for one
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": opt_off, "overlap_comm": True, "contiguous_gradients": True,
                              # ZeRO-3's own F.linear ignores autocast; the plain one runs the same math
                              # as the other systems
                              "memory_efficient_linear": False},
    }


def run_deepspeed(a, nvme_dir: str | None = None) -> list[dict]:
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    import deepspeed
    import torch

    from tiertrain.config import load_config
    from tiertrain.model.reference import ReferenceLM

    spec = load_config(a.config).model
    S = load_config(a.config).train.seq_len
    deepspeed.init_distributed()
    model = ReferenceLM(spec, checkpoint_layers=True)
    t0 = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=deepspeed_config(a, nvme_dir))
    setup_s = time.perf_counter() - t0

    def step(inp, tgt):
        for m in range(0, inp.shape[0], a.micro):
            # DeepSpeed's bf16 holds the weights in bf16 but does not cast activations: autocast does
            # (configured in torch_autocast), so all three systems run the same mixed-precision math
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = engine(inp[m:m + a.micro], tgt[m:m + a.micro]) / (a.micro * S)
            engine.backward(loss)
            engine.step()

    rows = []
    for B in a.batches:
        engine.set_train_batch_size(B)
        times, peak = _timed(a, B, S, spec.vocab_size, step)
        name = "DeepSpeed ZeRO-3 offload " + ("optimizer->NVMe" if nvme_dir else "CPU")
        rows.append(_row(name, B, S, times, peak, spec.flops_per_token(S), setup_s=setup_s))
    return rows


def worker(a) -> None:
    if a.worker == "probe":
        from tiertrain.plan.probe import probe

        out = probe()
    elif a.worker in TIERTRAIN:
        out = run_tiertrain(a, *TIERTRAIN[a.worker])
    elif a.worker == "gpu":
        out = run_gpu(a)
    else:
        out = run_deepspeed(a)
    Path(a.json).write_text(json.dumps(out))


def report(a, probe: dict, rows: list[dict], errors: dict[str, str], date: str) -> str:
    from tiertrain.config import load_config

    cfg = load_config(a.config)
    n = cfg.model.n_params
    lines = [f"# {Path(a.config).stem}: tiertrain vs all-in-GPU vs DeepSpeed ZeRO-3 CPU offload", "",
             f"- date: {date}",
             f"- hardware: {probe.get('gpu')} ({probe.get('gpu_mem_gb', 0):.0f} GB), {probe.get('cpu_count')} CPUs",
             f"- command: `python -m bench.pipeline {' '.join(sys.argv[1:])}`",
             f"- model: {n / 1e9:.2f} B parameters, seq {cfg.train.seq_len}, micro-batch {a.micro}, bf16 compute, "
             f"random tokens; {a.warmup} warm-up + {a.steps} timed steps per point, median; gradient clipping "
             f"{a.grad_clip:g} in every system (0: off)",
             f"- ceilings measured in this run: H2D {probe.get('h2d_gbs', 0):.1f} GB/s, D2H {probe.get('d2h_gbs', 0):.1f} "
             f"GB/s, both {probe.get('bidir_gbs', 0):.1f} GB/s, pageable H2D {probe.get('pageable_h2d_gbs', 0):.1f} GB/s, "
             f"bf16 matmul {probe.get('bf16_tflops', 0):.0f} TFLOP/s, host AdamW "
             f"{probe.get('host_adam_fp32_stream_params_per_s', 0) / 1e9:.2f} G params/s (with the rounding into a "
             f"bf16 copy: {probe.get('host_adam_params_per_s', 0) / 1e9:.2f}; into a speculative update's copies: "
             f"{probe.get('host_adam_into_copies_params_per_s', 0) / 1e9:.2f}, kernel {probe.get('host_kernel', 'torch')})", ""]
    for name, err in errors.items():
        lines.append(f"- **{name}**: {err}" if err.startswith("skipped") else f"- **{name} failed**: `{err}`")
    lines += ["| system | batch | tokens/step | tokens/s | model TFLOP/s | GPU peak GB | host peak RSS GB |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    rows = sorted(rows, key=lambda r: (r["batch"], r["system"]))  # every table in this order
    for r in rows:
        lines.append(f"| {r['system']} | {r['batch']} | {r['tokens']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['model_tflops']:.0f} | {r['gpu_peak_gb']:.1f} | {r['host_peak_rss_gb']:.1f} |")
    lines += ["", "## tiertrain against baselines and its floor", "",
              "floor = max(compute, H2D bytes / H2D rate, D2H bytes / D2H rate, params / host AdamW rate), with "
              "the AdamW rate of the variant (fp32 stream: no bf16 rounding): the probe's, or, marked *, the rate "
              "the step's own host updates after the norm reached (resident units' GPU updates left out) where higher "
              "(a ceiling is at least what was reached; 'AdamW G/s'); "
              "compute is tiertrain's own measured GPU compute time (forward + recompute + backward). "
              "sched floor = backward + max(forward, AdamW): exact clipping needs the global norm, so the "
              "update can only overlap the next forward pass (speculated units' updates overlap the backward pass: "
              "'spec.' = units speculated, +Ng: and N GPU-updated units speculated on the GPU; and of the warm-up and timed steps those kept / redone).", "",
              "AdamW s counts the parameters the host updates (not those of units updated on the GPU, "
              "'GPU upd.'); their state's bytes are in H2D and D2H.", "",
              "| system | batch | step s | vs all-in-GPU | vs DeepSpeed | GPU upd. | fwd s | bwd s | H2D s | D2H s "
              "| AdamW G/s | AdamW s | floor s | step/floor | sched floor s | step/sched | waits h2d/d2h/opt s | plan s | spec. |",
              "| --- | " + "--- | " * 18]
    by = {(r["system"], r["batch"]): r for r in rows}
    for r in rows:
        if not r["system"].startswith("tiertrain"):
            continue
        rate, reached = dram.adam_rate(r, probe)
        adam = r.get("host_adam_params", n) / rate if rate else float("nan")
        B = r["batch"]
        gpu = by.get(("all-in-GPU PyTorch", B))
        ds = by.get(("DeepSpeed ZeRO-3 offload CPU", B))
        h2d = r["h2d_gb"] / probe["h2d_gbs"] if probe.get("h2d_gbs") else float("nan")
        d2h = r["d2h_gb"] / probe["d2h_gbs"] if probe.get("d2h_gbs") else float("nan")
        comp = r["forward_s"] + r["backward_s"]
        floor = max(comp, h2d, d2h, adam)
        sched = r["backward_s"] + max(r["forward_s"], adam)
        ratio = lambda o: f"{r['tokens_per_s'] / o['tokens_per_s']:.2f}x" if o else "n/a"
        pred = f"{r['pred_step_s']:.3f}" if r.get("pred_step_s") else "n/a"
        lines.append(f"| {r['system']} | {B} | {r['step_s']:.3f} | {ratio(gpu)} | {ratio(ds)} | {r.get('gpu_updates', 0)} | "
                     f"{r['forward_s']:.3f} | {r['backward_s']:.3f} | {h2d:.3f} | {d2h:.3f} | {rate / 1e9:.2f}{'*' if reached else ''} | "
                     f"{adam:.3f} | {floor:.3f} | "
                     f"{r['step_s'] / floor:.2f} | {sched:.3f} | {r['step_s'] / sched:.2f} | "
                     f"{r['h2d_wait_s']:.3f}/{r['d2h_wait_s']:.3f}/{r['opt_wait_s']:.3f} | {pred} | "
                     + (f"{r['speculated']}{'+%dg' % r['gpu_speculated'] if r.get('gpu_speculated') else ''}: "
                        f"{r['kept']}/{r['redone']} |" if r.get("speculated") or r.get("gpu_speculated") else "0 |"))
    mem = [f"| {r['system']} | {r['batch']} | {r['gpu_peak_gb']:.1f} | "
           f"{r['gpu_peak_gb'] / by[('all-in-GPU PyTorch', r['batch'])]['gpu_peak_gb']:.2f} |"
           for r in rows
           if r["system"].startswith("tiertrain") and ("all-in-GPU PyTorch", r["batch"]) in by]
    if mem:
        lines += ["", "| system | batch | GPU peak GB | / all-in-GPU peak |", "| --- | --- | --- | --- |"] + mem
    lines += dram.table(rows, probe)
    lines += timeline.table(rows)
    return "\n".join(lines) + "\n"


def _write(a, out: Path, probe: dict, results: list[dict], errors: dict[str, str]) -> str:
    gpu = probe.get("gpu", "cpu").replace("NVIDIA ", "").replace(" ", "")
    stem = f"{time.strftime('%Y-%m-%d')}-{gpu}-{Path(a.config).stem.replace('llama-', 'llama')}"
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = report(a, probe, results, errors, date)
    (out / f"{stem}.md").write_text(text)
    args = {"batches": a.batches, "micro": a.micro, "warmup": a.warmup, "steps": a.steps, "argv": sys.argv,
            "grad_clip": a.grad_clip}
    (out / f"{stem}.json").write_text(json.dumps({"probe": probe, "rows": results, "errors": errors, "date": date,
                                                  "args": args}, indent=1))
    return text


def _run_worker(a, system: str, batches: list[int], out: Path, errors: dict[str, str]):
    """One worker process; its JSON output, or None (the reason in `errors`)."""
    tag = system + ("" if batches == a.batches else f"-{batches[0]}")
    js = out / f".{tag}.json"
    cmd = [sys.executable, "-m", "bench.pipeline", "--worker", system, "--json", str(js), "--config", a.config,
           "--batches", *map(str, batches), "--micro", str(a.micro), "--warmup", str(a.warmup),
           "--steps", str(a.steps), "--grad-clip", str(a.grad_clip)]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        ok = r.returncode == 0 and js.exists()
        log = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        ok, log = False, f"timed out after {a.timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    (out / f".{tag}.log").write_text(log if isinstance(log, str) else str(log))
    print(f"{tag}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s", flush=True)
    if not ok:
        errors[tag] = (log.strip().splitlines() or ["no output"])[-1][:300]
        return None
    data = json.loads(js.read_text())
    js.unlink()
    return data


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/llama-3b.toml")
    p.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm of every system; 0: off")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--plan-on-probe", action="store_true",
                   help="tiertrain plans with the probe's figures (written where `tiertrain probe` writes them), "
                        "not the reference machine's")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--from-json", default=None, metavar="FILE", help="rewrite the report of a recorded run")
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if a.from_json:
        rec = json.loads(Path(a.from_json).read_text())
        a.batches, a.micro, a.warmup, a.steps = rec["args"]["batches"], rec["args"]["micro"], rec["args"]["warmup"], rec["args"]["steps"]
        a.grad_clip = rec["args"].get("grad_clip", 1.0)
        sys.argv = rec["args"]["argv"]
        from tiertrain.config import load_config
        from tiertrain.plan.planner import _layouts

        numels = _layouts(load_config(a.config).model)
        for r in rec["rows"]:  # the summary as the current code makes it, from the recorded marks
            host = timeline.host_units(r, numels) if r.get("timeline_events") else None
            if host is not None:
                r["timeline"] = timeline.summarize(r["timeline_events"], numels, host)
        text = report(a, rec["probe"], rec["rows"], rec["errors"], rec["date"])
        Path(a.from_json).with_suffix(".md").write_text(text)
        return print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results, errors, probe = [], {}, {}
    for system in a.systems.split(","):
        if system == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            errors[system] = "skipped: DeepSpeed is not installed (pip install deepspeed)"
            print("deepspeed: skipped, not installed", flush=True)
            continue
        per_batch = system in TIERTRAIN and TIERTRAIN[system][3] < 0  # planned for each batch size
        for batches in [[b] for b in a.batches] if per_batch else [a.batches]:
            data = _run_worker(a, system, batches, out, errors)
            if system == "probe":
                probe = data or {}
                if a.plan_on_probe and data:  # tiertrain's plans reason about this machine, as measured here
                    import psutil

                    from tiertrain.placing import HARDWARE_FILE
                    from tiertrain.plan.probe import spec_of

                    spec_of(data, psutil.virtual_memory().total / 1e9, "the bench's probe").save(HARDWARE_FILE)
            else:
                results += data or []
            text = _write(a, out, probe, results, errors)  # after every worker: a lost machine keeps what ran
    print(text)


if __name__ == "__main__":
    main()
