"""Side-by-side benchmark on one GPU: tiertrain vs all-in-GPU PyTorch vs DeepSpeed ZeRO-3 CPU offload.

    python -m bench.pipeline --config configs/llama-3b.toml --batches 4 8 16 32 --out bench/results

A tiertrain system is a name and a list of `--set` overrides (TIERTRAIN, or `--define NAME SET...`), on top of
the bench's own (COMMON: batch, micro-batch, bf16, the learning rate, --grad-clip); its rows record those
overrides and the RunPlan the run resolved them to. Each system runs in its own process (one after another,
same GPU), tiertrain once per batch size (the plan is made for the batch), on random tokens: `--warmup`
steps, then `--steps` timed steps (median reported). The machine's ceilings are measured first in the same
run; tiertrain plans with them (--plan-on-probe) or with the reference figures, from a file passed to it
(`~/.cache/tiertrain/hardware.json` is never read or written). Writes <out>/<date>-<gpu>-<model>.md and .json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from statistics import median

from bench import dram, timeline
from bench.common import batch, commit, peak_rss_gb, reference_model, run_worker

TIERTRAIN = {
    "tiertrain": [],  # what `tiertrain run` does with the config's defaults: the plan chooses
    # nothing speculates
    "tiertrain-nospec": ["optim.speculate_units=0", "optim.speculate_gpu_updates=false"],
    # every update by the host AdamW after the norm, the fp32 master streamed, checkpoints on the host
    "tiertrain-host-adam": [
        'tiers.stream="master"',
        'tiers.activations="host"',
        "tiers.gpu_resident_gb=0",
        "tiers.gpu_update_units=0",
        "optim.speculate_units=0",
        "optim.speculate_gpu_updates=false",
    ],
}
BASELINES = {
    "gpu": "all-in-GPU PyTorch",
    "gpu-nockpt": "all-in-GPU PyTorch, no activation checkpointing",
    "deepspeed": "DeepSpeed ZeRO-3 offload CPU",
}
SYSTEMS = ("probe", "deepspeed", "tiertrain", "gpu")


def common(a, B: int) -> list[str]:
    """The overrides every tiertrain system runs with at batch size B (its own come after: they win)."""
    return [
        f"train.batch_size={B}",
        f"train.micro_batch_size={a.micro}",
        'train.compute_dtype="bfloat16"',
        "train.steps=100000",
        "optim.lr=1e-5",
        "optim.min_lr=0.0",
        f"optim.grad_clip={a.grad_clip}",
    ]


def _row(
    system: str,
    kind: str,
    B: int,
    S: int,
    times: list[float],
    gpu_peak: float,
    flops_per_token: float,
    **extra,
) -> dict:
    t = median(times)
    return {
        "system": system,
        "kind": kind,
        "batch": B,
        "tokens": B * S,
        "step_s": t,
        "tokens_per_s": B * S / t,
        "model_tflops": flops_per_token * B * S / t / 1e12,
        "gpu_peak_gb": gpu_peak,
        "host_peak_rss_gb": peak_rss_gb(),
        **extra,
    }


def run_tiertrain(a, system: str, sets: list[str]) -> list[dict]:
    from tiertrain.config import load_config
    from tiertrain.trainer import Trainer

    (B,) = a.batches
    cfg = load_config(a.config, common(a, B) + sets)
    t0 = time.perf_counter()
    tr = Trainer(cfg, hardware=Path(a.hardware))
    setup_s = time.perf_counter() - t0
    S, V, plan = cfg.train.seq_len, cfg.model.vocab_size, tr.run_plan
    host = sorted(plan.updated("host", "host-speculated"))
    recs = [tr.train_on(*batch(B, S, V, k)) for k in range(a.warmup + a.steps)]
    # from the last warm-up step: its update runs beside the first timed forward pass
    tr.run.updates.settle()  # the worker appends no more while the log is copied
    ev = list(tr.run.updates.timeline)
    first = [i for i, (e, _, _) in enumerate(ev) if e == "step"][max(a.warmup - 1, 0)]
    t0 = ev[first][2]
    ev = [(e, u, round(t - t0, 6)) for e, u, t in ev[first:]]
    timed = recs[a.warmup :]
    med = {
        k: median(r[k] for r in timed)
        for k in ("forward_s", "backward_s", "h2d_wait_s", "d2h_wait_s", "opt_wait_s", "h2d_gb", "d2h_gb")
    }
    # with an NVMe tier: the disk's bytes and the step's waits on them
    med |= {
        k: median(r[k] for r in timed)
        for k in ("ck_disk_gb", "ck_wait_s", "nvme_read_gb", "nvme_write_gb")
        if k in timed[-1]
    }
    kept = [r.get("speculation_kept", 0) for r in recs]
    redone = [r.get("speculation_redone", 0) for r in recs]
    row = _row(
        system,
        "tiertrain",
        B,
        S,
        [r["step_s"] for r in timed],
        max(r.get("gpu_peak_gb", 0.0) for r in timed),
        cfg.model.flops_per_token(S),
        sets=sets,
        plan=plan.to_dict(),
        setup_s=setup_s,
        params=cfg.model.n_params,
        host_adam_params=sum(tr.layouts[u].numel for u in host),
        losses=[r["loss"] for r in timed],
        grad_norms=[r["grad_norm"] for r in timed],
        gpu_updates=len(plan.updated("gpu", "gpu-speculated")),
        speculated=len(plan.updated("host-speculated")),
        gpu_speculated=len(plan.updated("gpu-speculated")),
        kept=kept[-1],
        redone=redone[-1],
        pred_step_s=tr.plan.prediction.step_s if tr.plan else None,
        all_steps_s=[r["step_s"] for r in recs],
        host_kernel=bool(tr.run.updates.opt.kernel),
        timeline=timeline.summarize(ev, [lay.numel for lay in tr.layouts], set(host)),
        timeline_events=ev,
        host_units=host,
        **med,
    )
    tr.close()
    tr.discard_scratch()  # the run's NVMe scratch stores: the next system needs the disk
    return [row]


def _timed(a, B: int, S: int, V: int, step) -> tuple[list[float], float]:
    """Runs step(inputs, targets) on the GPU warm-up + timed times; (timed seconds, peak GPU GB of those)."""
    import torch

    times, peaks = [], []
    for k in range(a.warmup + a.steps):
        inp, tgt = (t.cuda() for t in batch(B, S, V, k))
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(inp, tgt)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated() / 1e9)
    return times[a.warmup :], max(peaks[a.warmup :])


def attention_kernel(a, cfg) -> str:
    """The attention kernel tiertrain's plan takes for this config on this GPU, with the figures it plans with
    (--hardware): the one the all-in-GPU baseline runs too, so that the ratio compares the rest."""
    import torch

    from tiertrain.plan.attention import choose
    from tiertrain.probe import run_hardware
    from tiertrain.sections import fixed

    tc = cfg.train
    hw = run_hardware(
        torch.device("cuda"), a.hardware and Path(a.hardware), "auto", cfg.model, "bfloat16", tc.attention
    )
    return choose(fixed(tc.attention), tc.deterministic, "bfloat16", hw)


def run_gpu(a, checkpointing: bool = True) -> list[dict]:
    import torch

    from tiertrain.config import load_config
    from tiertrain.model.attention import backends

    cfg = load_config(a.config)
    spec, S = cfg.model, cfg.train.seq_len
    kernel = attention_kernel(a, cfg)
    kernel = "" if kernel == "flash_attn" else kernel  # SDPA's only: ReferenceLM calls SDPA
    with torch.device("cuda"):
        model = reference_model(spec, checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step(inp, tgt):
        opt.zero_grad(set_to_none=True)
        for m in range(0, inp.shape[0], a.micro):
            # the backward pass recomputes checkpointed layers: the kernel holds there too
            with backends(kernel):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(inp[m : m + a.micro], tgt[m : m + a.micro]) / tgt.numel()
                loss.backward()
        if a.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()

    rows = []
    for B in a.batches:
        times, peak = _timed(a, B, S, spec.vocab_size, step)
        kind = "gpu" if checkpointing else "gpu-nockpt"
        rows.append(_row(BASELINES[kind], kind, B, S, times, peak, spec.flops_per_token(S), attention=kernel))
    return rows


def deepspeed_config(a, nvme_dir: str | None = None) -> dict:
    pin = not getattr(a, "ds_unpinned", False)  # bench.nvme has no such flag
    opt_off = {"device": "cpu", "pin_memory": pin}
    if nvme_dir:
        opt_off = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True, "buffer_count": 4}
    return {
        "train_batch_size": max(a.batches),
        "train_micro_batch_size_per_gpu": a.micro,
        "gradient_accumulation_steps": max(a.batches) // a.micro,
        "bf16": {"enabled": True},
        "gradient_clipping": getattr(a, "grad_clip", 1.0),
        "steps_per_print": 10**9,
        # the engine switches off an outer torch.autocast unless its own section asks for one
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": pin},
            "offload_optimizer": opt_off,
            "overlap_comm": True,
            "contiguous_gradients": True,
            # ZeRO-3's own F.linear ignores autocast; the plain one runs the same math
            # as the other systems
            "memory_efficient_linear": False,
        },
    }


def run_deepspeed(a, nvme_dir: str | None = None) -> list[dict]:
    for k, v in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29533"),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(k, v)
    import deepspeed
    import torch

    from tiertrain.config import load_config

    spec = load_config(a.config).model
    S = load_config(a.config).train.seq_len
    deepspeed.init_distributed()
    conf = deepspeed_config(a, nvme_dir)
    t0 = time.perf_counter()
    # each parameter partitioned to the host as it is made: a whole fp32 model beside ZeRO's own copies
    # does not fit the host's RAM from about 5B parameters on a 128 GiB machine
    pin = conf["zero_optimization"]["offload_param"]["pin_memory"]
    with deepspeed.zero.Init(config_dict_or_path=conf, remote_device="cpu", pin_memory=pin):
        model = reference_model(spec, checkpointing=True)
    if spec.is_moe:  # ZeRO-3 gathers an MoE block's experts whole: its hooks never wait on an idle expert
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(
            model, [type(m) for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
        )
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    setup_s = time.perf_counter() - t0

    def step(inp, tgt):
        for m in range(0, inp.shape[0], a.micro):
            # DeepSpeed's bf16 holds the weights in bf16 but does not cast activations: autocast does
            # (configured in torch_autocast), so all three systems run the same mixed-precision math
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = engine(inp[m : m + a.micro], tgt[m : m + a.micro]) / (a.micro * S)
            engine.backward(loss)
            engine.step()

    rows = []
    for B in a.batches:
        engine.set_train_batch_size(B)
        times, peak = _timed(a, B, S, spec.vocab_size, step)
        name = "DeepSpeed ZeRO-3 offload " + ("optimizer->NVMe" if nvme_dir else "CPU")
        rows.append(_row(name, "deepspeed", B, S, times, peak, spec.flops_per_token(S), setup_s=setup_s))
    return rows


def worker(a) -> None:
    if a.worker == "probe":
        from tiertrain.probe import probe

        out = probe()
    elif a.worker == "tiertrain":
        out = run_tiertrain(a, a.name, json.loads(a.sets))
    elif a.worker in ("gpu", "gpu-nockpt"):
        out = run_gpu(a, checkpointing=a.worker == "gpu")
    else:
        out = run_deepspeed(a)
    Path(a.json).write_text(json.dumps(out))


def systems_table(rows: list[dict]) -> list[str]:
    """Each tiertrain row's overrides and what its RunPlan resolved: the settings behind every number."""
    lines = [
        "| system | batch | --set | micro | stream | checkpoints | resident GB | updates |",
        "| --- " * 8 + "|",
    ]
    for r in rows:
        if r["kind"] == "tiertrain":
            p = r["plan"]
            modes = [u["update"] for u in p["units"]]
            counts = ", ".join(f"{modes.count(m)} {m}" for m in dict.fromkeys(modes))
            lines.append(
                f"| {r['system']} | {r['batch']} | {' '.join(r['sets']) or '(defaults)'} | {p['micro_batch']} | "
                f"{p['stream']} | {p['activations']} | {p['resident_gb']:g} | {counts} |"
            )
    return lines + [""] if len(lines) > 2 else []


def report(a, probe: dict, rows: list[dict], errors: dict[str, str], date: str, meta: dict) -> str:
    from tiertrain.config import load_config

    cfg = load_config(a.config)
    n = cfg.model.n_params
    lines = [
        f"# {Path(a.config).name.removesuffix('.toml')}: tiertrain vs all-in-GPU vs DeepSpeed ZeRO-3 CPU offload",
        "",
        f"- date: {date}",
        f"- hardware: {probe.get('gpu')} ({probe.get('gpu_mem_gb', 0):.0f} GB), {probe.get('cpu_count')} CPUs"
        if probe
        else f"- hardware: {meta['gpu']}, as the probe file says (no `probe` system in this run)"
        if meta.get("gpu")
        else "- hardware: not probed in this run (no `probe` system)",
        f"- command: `python -m bench.pipeline {' '.join(sys.argv[1:])}`",
        f"- model: {n / 1e9:.2f} B parameters, seq {cfg.train.seq_len}, micro-batch {a.micro}, bf16 compute, "
        f"random tokens; {a.warmup} warm-up + {a.steps} timed steps per point, median; gradient clipping "
        f"{a.grad_clip:g} in every system (0: off)",
        f"- ceilings measured in this run: H2D {probe.get('h2d_gbs', 0):.1f} GB/s, D2H {probe.get('d2h_gbs', 0):.1f} "
        f"GB/s, both {probe.get('bidir_gbs', 0):.1f} GB/s, pageable H2D {probe.get('pageable_h2d_gbs', 0):.1f} GB/s, "
        f"bf16 matmul {probe.get('bf16_tflops', 0):.0f} TFLOP/s, host AdamW "
        f"{probe.get('host_adam_fp32_stream_params_per_s', 0) / 1e9:.2f} G params/s (with the rounding into a "
        f"bf16 copy: {probe.get('host_adam_params_per_s', 0) / 1e9:.2f}; into a speculative update's copies: "
        f"{probe.get('host_adam_into_copies_params_per_s', 0) / 1e9:.2f}, kernel {probe.get('host_kernel', 'torch')})",
        "",
    ]
    if not probe:  # no ceilings measured: say so rather than print zeros
        lines.pop(-2)
    lines.insert(
        3,
        f"- commit: {meta.get('commit')}{' (with uncommitted changes)' if meta.get('dirty') else ''}; "
        f"tiertrain planned with {meta.get('hardware', 'the reference figures')}",
    )
    for name, err in errors.items():
        lines.append(f"- **{name}**: {err}" if err.startswith("skipped") else f"- **{name} failed**: `{err}`")
    lines += systems_table(rows)
    lines += [
        "| system | batch | tokens/step | tokens/s | model TFLOP/s | GPU peak GB | host peak RSS GB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = sorted(rows, key=lambda r: (r["batch"], r["system"]))  # every table in this order
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['batch']} | {r['tokens']} | {r['tokens_per_s']:,.0f} | "
            f"{r['model_tflops']:.0f} | {r['gpu_peak_gb']:.1f} | {r['host_peak_rss_gb']:.1f} |"
        )
    lines += [
        "",
        "## tiertrain against baselines and its floor",
        "",
        "floor = max(compute, H2D bytes / H2D rate, D2H bytes / D2H rate, params / host AdamW rate), with "
        "the AdamW rate of the variant (fp32 stream: no bf16 rounding): the probe's, or, marked *, the rate "
        "the step's own host updates after the norm reached (resident units' GPU updates left out) where higher "
        "(a ceiling is at least what was reached; 'AdamW G/s'); "
        "compute is tiertrain's own measured GPU compute time (forward + recompute + backward). "
        "sched floor = backward + max(forward, AdamW): exact clipping needs the global norm, so the "
        "update can only overlap the next forward pass (speculated units' updates overlap the backward pass: "
        "'spec.' = units speculated, +Ng: and N GPU-updated units speculated on the GPU; and of the warm-up and timed steps those kept / redone).",
        "",
        "AdamW s counts the parameters the host updates (not those of units updated on the GPU, "
        "'GPU upd.'); their state's bytes are in H2D and D2H.",
        "",
        "| system | batch | step s | vs all-in-GPU | vs DeepSpeed | GPU upd. | fwd s | bwd s | H2D s | D2H s "
        "| AdamW G/s | AdamW s | floor s | step/floor | sched floor s | step/sched | waits h2d/d2h/opt s | plan s | spec. |",
        "| --- | " + "--- | " * 18,
    ]
    by = {(r["kind"], r["batch"]): r for r in rows if r["kind"] != "tiertrain"}
    for r in rows:
        if r["kind"] != "tiertrain":
            continue
        rate, reached = dram.adam_rate(r, probe)
        adam = r.get("host_adam_params", n) / rate if rate else float("nan")
        B = r["batch"]
        gpu = by.get(("gpu-nockpt", B)) or by.get(("gpu", B))  # the faster all-in-GPU run where it fits
        ds = by.get(("deepspeed", B))
        h2d = r["h2d_gb"] / probe["h2d_gbs"] if probe.get("h2d_gbs") else float("nan")
        d2h = r["d2h_gb"] / probe["d2h_gbs"] if probe.get("d2h_gbs") else float("nan")
        comp = r["forward_s"] + r["backward_s"]
        floor = max(comp, h2d, d2h, adam)
        sched = r["backward_s"] + max(r["forward_s"], adam)
        ratio = lambda o: f"{r['tokens_per_s'] / o['tokens_per_s']:.2f}x" if o else "n/a"
        pred = f"{r['pred_step_s']:.3f}" if r.get("pred_step_s") else "n/a"
        lines.append(
            f"| {r['system']} | {B} | {r['step_s']:.3f} | {ratio(gpu)} | {ratio(ds)} | {r.get('gpu_updates', 0)} | "
            f"{r['forward_s']:.3f} | {r['backward_s']:.3f} | {h2d:.3f} | {d2h:.3f} | {rate / 1e9:.2f}{'*' if reached else ''} | "
            f"{adam:.3f} | {floor:.3f} | "
            f"{r['step_s'] / floor:.2f} | {sched:.3f} | {r['step_s'] / sched:.2f} | "
            f"{r['h2d_wait_s']:.3f}/{r['d2h_wait_s']:.3f}/{r['opt_wait_s']:.3f} | {pred} | "
            + (
                f"{r['speculated']}{'+%dg' % r['gpu_speculated'] if r.get('gpu_speculated') else ''}: "
                f"{r['kept']}/{r['redone']} |"
                if r.get("speculated") or r.get("gpu_speculated")
                else "0 |"
            )
        )
    mem = [
        f"| {r['system']} | {r['batch']} | {r['gpu_peak_gb']:.1f} | "
        f"{r['gpu_peak_gb'] / by[('gpu', r['batch'])]['gpu_peak_gb']:.2f} |"
        for r in rows
        if r["kind"] == "tiertrain" and ("gpu", r["batch"]) in by
    ]
    if mem:
        lines += [
            "",
            "| system | batch | GPU peak GB | / all-in-GPU peak |",
            "| --- | --- | --- | --- |",
        ] + mem
    lines += dram.table(rows, probe)
    lines += timeline.table(rows)
    return "\n".join(lines) + "\n"


def _write(a, out: Path, probe: dict, results: list[dict], errors: dict[str, str], meta: dict) -> str:
    # the machine, where the probe ran
    gpu = (probe.get("gpu") or meta.get("gpu") or "unprobed").replace("NVIDIA ", "").replace(" ", "")
    stem = f"{time.strftime('%Y-%m-%d')}-{gpu}-{Path(a.config).name.removesuffix('.toml').replace('llama-', 'llama')}{a.tag}"
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = report(a, probe, results, errors, date, meta)
    (out / f"{stem}.md").write_text(text)
    args = {
        "batches": a.batches,
        "micro": a.micro,
        "warmup": a.warmup,
        "steps": a.steps,
        "argv": sys.argv,
        "grad_clip": a.grad_clip,
        "config": a.config,
    }
    (out / f"{stem}.json").write_text(
        json.dumps(
            {"probe": probe, "rows": results, "errors": errors, "date": date, "args": args, **meta}, indent=1
        )
    )
    return text


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/llama-3b.toml")
    p.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--grad-clip", type=float, default=1.0, help="max global gradient norm of every system; 0: off"
    )
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated: probe, {', '.join(BASELINES)}, and tiertrain systems ({', '.join(TIERTRAIN)})",
    )
    p.add_argument(
        "--define",
        nargs="+",
        action="append",
        default=[],
        metavar=("NAME", "SET"),
        help="a tiertrain system: its name and its --set overrides (repeatable); add NAME to --systems",
    )
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument(
        "--ds-unpinned",
        action="store_true",
        help="DeepSpeed offloads into pageable memory: torch's "
        "pinned allocator rounds each block up to a power of two, which a large model's host RAM may not hold",
    )
    p.add_argument(
        "--plan-on-probe",
        action="store_true",
        help="tiertrain plans with the probe's figures, not the reference machine's",
    )
    p.add_argument(
        "--hardware-file",
        default=None,
        metavar="FILE",
        help="tiertrain (and the all-in-GPU baseline's attention kernel) plan with this `tiertrain probe` file",
    )
    p.add_argument("--tag", default="", help="appended to the result files' names")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--name", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sets", default="[]", help=argparse.SUPPRESS)
    p.add_argument("--hardware", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--from-json", default=None, metavar="FILE", help="rewrite the report of a recorded run")
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if a.from_json:
        rec = json.loads(Path(a.from_json).read_text())
        for k in ("batches", "micro", "warmup", "steps", "grad_clip", "config"):
            setattr(a, k.replace("-", "_"), rec["args"][k])
        sys.argv = rec["args"]["argv"]
        meta = {k: rec.get(k) for k in ("commit", "dirty", "hardware", "gpu") if rec.get(k) is not None}
        text = report(a, rec["probe"], rec["rows"], rec["errors"], rec["date"], meta)
        Path(a.from_json).with_suffix(".md").write_text(text)
        return print(text)
    systems = {**TIERTRAIN, **{d[0]: d[1:] for d in a.define}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from tiertrain.plan.hardware import REFERENCE, HardwareSpec

    hardware = out / ".hardware.json"  # what tiertrain plans with: the reference, or this machine's probe
    REFERENCE.save(hardware)
    meta = {**commit(), "hardware": "the reference figures"}
    if a.hardware_file:
        probed = HardwareSpec.load(a.hardware_file)
        probed.save(hardware)
        # the GPU names the result where the run has no probe of its own
        meta |= {"hardware": f"the probe file {a.hardware_file}", "gpu": probed.gpu}
    base = [
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
        "--hardware",
        str(hardware),
        *(["--ds-unpinned"] * a.ds_unpinned),
    ]
    results, errors, probe = [], {}, {}
    for system in a.systems.split(","):
        if system == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            errors[system] = "skipped: DeepSpeed is not installed (pip install deepspeed)"
            print("deepspeed: skipped, not installed", flush=True)
            continue
        if system in systems:  # one process per batch size: the plan is the batch's
            for B in a.batches:
                results += (
                    run_worker(
                        "bench.pipeline",
                        f"{system}-{B}",
                        base
                        + [
                            "--worker",
                            "tiertrain",
                            "--name",
                            system,
                            "--sets",
                            json.dumps(systems[system]),
                            "--batches",
                            str(B),
                        ],
                        out,
                        a.timeout,
                        errors,
                    )
                    or []
                )
                # after every worker: a lost machine keeps what ran
                _write(a, out, probe, results, errors, meta)
            continue
        if system != "probe" and system not in BASELINES:
            raise SystemExit(f"--systems: unknown system {system!r}; define it with --define {system} SET...")
        data = run_worker(
            "bench.pipeline",
            system,
            base + ["--worker", system, "--batches", *map(str, a.batches)],
            out,
            a.timeout,
            errors,
        )
        if system == "probe":
            probe = data or {}
            if a.plan_on_probe and data:  # tiertrain's plans reason about this machine, as measured here
                import psutil

                from tiertrain.probe import spec_of

                spec_of(data, psutil.virtual_memory().total / 1e9, "the bench's probe").save(hardware)
                meta["hardware"] = "this run's probe"
        else:
            results += data or []
        _write(a, out, probe, results, errors, meta)
    print(_write(a, out, probe, results, errors, meta))


if __name__ == "__main__":
    main()
