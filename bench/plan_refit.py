"""The planner's predictions against recorded benchmark runs, each planned on its own probe, with the
fitted constants of the reference or others:

    python -m bench.plan_refit RUN.json ... [--set compute_efficiency=0.5 --set host_dram_gbs=135]

Each tiertrain row is planned as `run` plans it (`placing.settle`: 6 GB resident, the plan's stream,
checkpoints, speculation and GPU updates, clipping on) and its predicted step set beside the measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from tiertrain.config import load_config
from tiertrain.plan.planner import Budgets, plan
from tiertrain.plan.probe import spec_of


def rows(paths: list[str], **constants) -> list[tuple[str, int, float, float]]:
    """(run, batch, predicted step s, measured step s) of every tiertrain row of the runs."""
    spec = load_config("llama-3b").model
    out = []
    for path in paths:
        run = json.loads(Path(path).read_text())
        hw = dataclasses.replace(spec_of(run["probe"], 128.0, path), **constants)
        for r in run["rows"]:
            if not r["system"].startswith("tiertrain"):
                continue
            p = plan(spec, r["batch"], 2048, "bfloat16", Budgets(1e9, hw.gpu_mem_gb, None, 6.0), hw, name="run",
                     advise=False, gpu_updates=-1, clipping=run["args"]["grad_clip"] > 0, micro=run["args"]["micro"])
            out.append((Path(path).stem, r["batch"], p.step_s, r["step_s"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a HardwareSpec constant")
    a = ap.parse_args()
    constants = {k: float(v) for k, v in (s.split("=", 1) for s in a.set)}
    got = rows(a.runs, **constants)
    print("| run | batch | predicted step s | measured step s | predicted / measured |\n| --- | --- | --- | --- | --- |")
    for name, b, pred, meas in got:
        print(f"| {name} | {b} | {pred:.3f} | {meas:.3f} | {pred / meas:.2f} |")
    errs = [math.log(p / m) for *_, p, m in got]
    print(f"\nrms log error {math.sqrt(sum(e * e for e in errs) / len(errs)):.3f}, "
          f"range {min(p / m for *_, p, m in got):.2f}-{max(p / m for *_, p, m in got):.2f}")


if __name__ == "__main__":
    main()
