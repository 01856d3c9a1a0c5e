"""bench.pipeline's report: the systems' settings, tokens/s, each tiertrain row against the baselines and its
floors, memory, the host's DRAM and the optimizer's timeline; and the .md and .json files it writes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench import dram, timeline


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


def write(a, out: Path, probe: dict, results: list[dict], errors: dict[str, str], meta: dict) -> str:
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
