"""Issue 42's step targets against the attention kernel's rate: how fast would attention have to run for llama3.1-8b
to step in 45 s at 131k tokens and in 130 s at 262k on one H100 (as bench/long.sh runs them), and what do the
measured runs allow whatever is recomputed?

Two answers, both from what is recorded:
- the plan's: the H100 probe's figures with cuDNN's attention rates scaled until tiertrain's own plan (within
  4.2-4.5% of these runs) predicts the target; everything else (the matmuls, the links, the updates) as probed;
- the runs': a step is at least its forward pass plus its backward pass without the recompute, the floor of a run
  that kept every activation and recomputed nothing (it would need hundreds of GB more); the recompute is the
  forward pass again, so that floor is the measured backward's time.

    python dev/attention_need.py [--out FILE.json]   # pure Python, no GPU, a few seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import commit  # noqa: E402
from tiertrain.plancmd import PlanCommand, plan_command  # noqa: E402

RES = ROOT / "bench/results"
# tokens, target step s, issue 42's measured run (bench/long.sh's 8b-128k and 8b-256k), the probe of its machine
# (2026-11-26-issue42-read-ahead.md), its --set
RUNS = [
    (
        131072,
        45.0,
        "2026-11-26-H10080GBHBM3-llama3.1-8b-131072-rerun-after-131072.json",
        "2026-11-26-H100-probe-c.json",
        [],
    ),
    (
        262144,
        130.0,
        "2026-11-26-H10080GBHBM3-llama3.1-8b-262144-long-262144.json",
        "2026-11-26-H100-probe-a.json",
        ['tiers.activation_dtype="bfloat16"'],
    ),
]
NVME_GB = 55.0  # the device's disk, as bench/long.sh's other runs budget it


def predicted(tokens: int, sets: list[str], probe: dict, scale: float) -> tuple[float, float]:
    """(step s, model TFLOP/s) the plan predicts with cuDNN's attention `scale` times as fast as probed."""
    figures = dict(probe, attention_tflops=dict(probe["attention_tflops"]))
    figures["attention_tflops"]["cudnn"] = [r * scale for r in probe["attention_tflops"]["cudnn"]]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(figures, f)
        f.flush()
        cmd = PlanCommand(
            "llama3.1-8b",
            overrides=(
                f"model.max_position_embeddings={tokens}",
                "train.micro_batch_size=1",
                'train.attention="cudnn"',
                *sets,
            ),
            host_gb=120.0,
            nvme_gb=NVME_GB,
            hardware=f.name,
            batch_size=1,
            seq_len=tokens,
        )
        p, _ = plan_command(cmd)
    if not p.fits:
        raise SystemExit(f"{tokens} tokens: the plan does not fit ({p.why})")
    return p.prediction.step_s, p.prediction.model_tflops


def needed(tokens: int, target: float, sets: list[str], probe: dict) -> float:
    """The least scale of cuDNN's rates at which the plan's step is at most `target` (bisection, to 0.5%)."""
    lo, hi = 1.0, 4.0
    while hi / lo > 1.005:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if predicted(tokens, sets, probe, mid)[0] > target else (lo, mid)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the figures as JSON")
    args = ap.parse_args()
    rows = []
    for tokens, target, result, probe_file, sets in RUNS:
        probe = json.loads((RES / probe_file).read_text())
        fwd, bwd = probe["attention_tflops"]["cudnn"][:2]
        run = json.loads((RES / result).read_text())["rows"][0]
        step0, tflops0 = predicted(tokens, sets, probe, 1.0)
        scale = needed(tokens, target, sets, probe)
        model_flops = run["model_tflops"] * run["step_s"]  # TFLOP a step
        rows.append(
            {
                "tokens": tokens,
                "target_step_s": target,
                "measured": result,
                "probe": probe_file,
                "cudnn_tflops_probed": [fwd, bwd],
                "run_planned_step_s": run["pred_step_s"],
                "step_s": run["step_s"],
                "forward_s": run["forward_s"],
                "backward_s": run["backward_s"],
                "planned_step_s": step0,
                "planned_model_tflops": tflops0,
                # nothing recomputed: forward + (backward - the forward it recomputes) = the backward's time
                "no_recompute_floor_s": run["backward_s"],
                "no_recompute_model_tflops": model_flops / run["backward_s"],
                "cudnn_scale_needed": scale,
                "cudnn_tflops_needed": [fwd * scale, bwd * scale],
            }
        )
    for r in rows:
        print(
            f"{r['tokens']:,} tokens, target {r['target_step_s']:.0f} s: measured {r['step_s']:.1f} s "
            f"(forward {r['forward_s']:.1f}, backward {r['backward_s']:.1f}); planned {r['planned_step_s']:.1f} s "
            f"(the run's plan {r['run_planned_step_s']:.1f} s); cuDNN probed at "
            f"{r['cudnn_tflops_probed'][0]:.0f} / {r['cudnn_tflops_probed'][1]:.0f} TFLOP/s; "
            f"nothing recomputed at least {r['no_recompute_floor_s']:.1f} s "
            f"({r['no_recompute_model_tflops']:.0f} model TFLOP/s); the plan meets the target with cuDNN "
            f"{r['cudnn_scale_needed']:.2f}x as fast: {r['cudnn_tflops_needed'][0]:.0f} / "
            f"{r['cudnn_tflops_needed'][1]:.0f} TFLOP/s"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"code": commit(), "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
