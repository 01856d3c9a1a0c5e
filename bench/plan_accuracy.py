"""Planner predictions against a recorded benchmark run: python -m bench.plan_accuracy RESULTS.json

Uses the run's own probe figures as the hardware spec (and the fitted constants of
tiertrain/plan/hardware.py), plans each tiertrain row's exact setting, prints a markdown table.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tiertrain.config import load_config
from tiertrain.plan.hardware import HardwareSpec
from tiertrain.plan.planner import Budgets, evaluate


def main() -> None:
    run = json.loads(Path(sys.argv[1]).read_text())
    pr = run["probe"]
    hw = HardwareSpec(gpu=pr["gpu"], gpu_mem_gb=pr["gpu_mem_gb"], h2d_gbs=pr["h2d_gbs"], d2h_gbs=pr["d2h_gbs"],
                      bf16_tflops=pr["bf16_tflops"], fp32_tflops=pr["fp32_tflops"],
                      host_adam_params_per_s=pr["host_adam_fp32_stream_params_per_s"],
                      host_adam_copy_params_per_s=pr["host_adam_params_per_s"], source=sys.argv[1])
    spec = load_config("llama-3b").model
    print("| setting | batch | predicted step s | measured step s | error | predicted GPU GB | measured GPU GB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in run["rows"]:
        if not r["system"].startswith("tiertrain"):
            continue
        stream = "master" if "fp32" in r["system"] else "compute"
        act = "host" if "host ckpt" in r["system"] else "gpu"
        p = evaluate(spec, r["batch"], 2048, "bfloat16", run["args"]["micro"], stream, act, Budgets(), hw)
        print(f"| {r['system']} | {r['batch']} | {p.step_s:.3f} | {r['step_s']:.3f} | "
              f"{(p.step_s - r['step_s']) / r['step_s']:+.1%} | {p.gpu_total / 1e9:.1f} | {r['gpu_peak_gb']:.1f} |")


if __name__ == "__main__":
    main()
