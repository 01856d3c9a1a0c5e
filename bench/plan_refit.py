"""The planner's predictions against recorded benchmark runs, each planned on its own probe, with the
fitted constants of the reference or others:

    python -m bench.plan_refit RUN.json ... [--set compute_efficiency=0.5 --set host_dram_gbs=135]
                                            [--dram-bytes 28]

`--dram-bytes B`: each run's host_dram_gbs from its own probe instead, the host AdamW kernel's fp32 rate
times B bytes per parameter.

Each tiertrain row is planned as `run` plans it (`placing.settle`: the row's GB resident, 6 if it names
none, the plan's stream, checkpoints, speculation and GPU updates, clipping on) and its predicted step set
beside the measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path

from tiertrain.config import load_config
from tiertrain.plan.planner import Budgets, plan
from tiertrain.plan.probe import spec_of


def rows(paths: list[str], dram_bytes: float = 0.0, **constants) -> list[tuple[str, int, float, float]]:
    """(run, batch, predicted step s, measured step s) of every tiertrain row of the runs; `dram_bytes`: see
    the module's docstring."""
    spec = load_config("llama-3b").model
    out = []
    for path in paths:
        run = json.loads(Path(path).read_text())
        hw = dataclasses.replace(spec_of(run["probe"], 128.0, path), **constants)
        if dram_bytes:
            hw.host_dram_gbs = hw.host_adam_params_per_s * dram_bytes / 1e9
        for r in run["rows"]:
            if not r["system"].startswith("tiertrain"):
                continue
            res = re.search(r"([\d.]+) GB resident", r["system"])
            p = plan(spec, r["batch"], 2048, "bfloat16", Budgets(1e9, hw.gpu_mem_gb, None, float(res[1]) if res else 6.0), hw, name="run",
                     advise=False, gpu_updates=-1, clipping=run["args"]["grad_clip"] > 0, micro=run["args"]["micro"])
            out.append((Path(path).stem, r["batch"], p.step_s, r["step_s"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a HardwareSpec constant")
    ap.add_argument("--dram-bytes", type=float, default=0.0, help="host_dram_gbs from each probe: its fp32 "
                    "host AdamW rate x this many bytes per parameter")
    a = ap.parse_args()
    constants = {k: float(v) for k, v in (s.split("=", 1) for s in a.set)}
    got = rows(a.runs, a.dram_bytes, **constants)
    print("| run | batch | predicted step s | measured step s | predicted / measured |\n| --- | --- | --- | --- | --- |")
    for name, b, pred, meas in got:
        print(f"| {name} | {b} | {pred:.3f} | {meas:.3f} | {pred / meas:.2f} |")
    errs = [math.log(p / m) for *_, p, m in got]
    print(f"\nrms log error {math.sqrt(sum(e * e for e in errs) / len(errs)):.3f}, "
          f"range {min(p / m for *_, p, m in got):.2f}-{max(p / m for *_, p, m in got):.2f}")


if __name__ == "__main__":
    main()
