"""Fits the planner's two compute efficiencies (HardwareSpec.compute_efficiency: the matmuls' share of the probed
bf16 rate; attention_efficiency: causal attention's share of its kernel's rate) on the GPU compute the runs in
bench/results measured: each run's forward and backward seconds against plan.times.compute_work's FLOPs of the
same shape (its micro-batch, tile, kept blocks and kernel, read from its result file), least squares on the
relative error. Head size 128 only (the llama-1b run at 64 checks attention_head_scale). Needs no GPU.

    python dev/compute_fit.py            # the table, the fit, and each run's planned compute at the fit
    python dev/compute_fit.py --kernels  # the same on the runs of the dense kernels' code (2026-11-26)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tiertrain.config import load_config  # noqa: E402
from tiertrain.plan.hardware import REFERENCE, HardwareSpec  # noqa: E402
from tiertrain.plan.resolve import job_of  # noqa: E402
from tiertrain.plan.times import compute_work  # noqa: E402

RESULTS = ROOT / "bench" / "results"
H100 = RESULTS / "2026-11-25-H100-probe.json"
# (result file, system, batch, the machine's figures): the runs whose forward and backward the bench timed apart,
# on the code of 2026-11-24 and later (the GPU compute of a block as today's)
RUNS = (
    ("2026-11-24-H100-llama5b-clip1", "tiertrain", 16, H100),
    ("2026-11-25-H100-llama5b-8k", "cli", 16, H100),
    ("2026-11-24-H200-llama3b-defaults-clip1", "tiertrain", 16, None),
    ("2026-11-24-H200-llama3.1-8b", "tiertrain", 2, None),
    ("2026-11-24-H200-llama3b-32k-batch1", "tiertrain", 1, None),
    ("2026-11-25-unprobed-llama3.1-8b-131072-long-131072", "long", 1, H100),
    ("2026-11-25-H100-llama3.1-8b-128k-spread", "long", 1, H100),
    ("2026-11-25-H100-llama3.1-8b-256k", "long", 1, H100),
    ("2026-11-24-H200-llama7b-256k", "long", 1, None),
    ("2026-11-24-H200-llama3b-512k", "long", 1, None),
    ("2026-11-24-H200-llama1b-1m", "long", 1, None),
)
# the runs of the code with the dense block's kernels (2026-11-26: RoPE, fused RMSNorm), H100s, each planned with
# its machine's probe (bench/results/2026-11-26-issue42-read-ahead.md); they check the rescale to 0.70
PROBE_A, PROBE_B = RESULTS / "2026-11-26-H100-probe-a.json", RESULTS / "2026-11-26-H100-probe-b.json"
KERNEL_RUNS = (
    ("2026-11-26-H100-llama5b-8k-kernels-after", "cli", 16, H100),
    ("2026-11-26-H10080GBHBM3-llama3b-32768-32k-batch1", "tiertrain", 1, PROBE_A),
    ("2026-11-26-H10080GBHBM3-llama3.1-8b-131072-long-131072", "long", 1, PROBE_A),
    ("2026-11-26-H10080GBHBM3-llama3.1-8b-131072-ahead-after-131072", "after", 1, PROBE_B),
    ("2026-11-26-H10080GBHBM3-llama3.1-8b-262144-long-262144", "long", 1, PROBE_A),
)
# the Qwen3-30B-A3B cuts on the H100, on the experts of 2026-11-25's fused activation and slot sums, cuDNN's
# attention (bench/results/2026-11-25-issue40-experts.md): (config, --set, measured forward and backward s); their
# shape is the plan's
MOE_RUNS = (
    ("bench/configs/qwen3-30b-a3b-6l.toml", ["train.batch_size=8"], 0.280, 1.660),
    ("qwen3-30b-a3b", ["model.num_hidden_layers=18", "train.batch_size=4"], 0.404, 1.789),
)
MOE_KERNEL = "cudnn"
# the CLI runs of llama-5b at 8k: their logs' measured forward and backward, their shape (the plan file's of
# bench/results/2026-11-25-issues41-43.md; the later run's log says micro-batches of 2 and 23 of its 24 blocks
# recomputed, bench/results/2026-11-26-dense-kernels.md)
PLAN_8K = json.loads((RESULTS / "2026-11-25-H100-llama5b-8k-plan.json").read_text())
CLI_8K = {
    "2026-11-25-H100-llama5b-8k": {"forward_s": 3.224, "backward_s": 10.200, "plan": PLAN_8K},
    "2026-11-26-H100-llama5b-8k-kernels-after": {
        "forward_s": 2.668,
        "backward_s": 8.732,
        "plan": {"micro_batch": 2, "tile": 0, "kept": 1},
    },
}


def load(name: str, system: str, batch: int) -> tuple[dict, object]:
    """(the run's row: forward_s, backward_s, plan), its config."""
    if system == "cli":
        sets = ["train.seq_len=8192", "model.max_position_embeddings=8192", f"train.batch_size={batch}"]
        return CLI_8K[name], load_config("llama-5b", sets)
    d = json.loads((RESULTS / f"{name}.json").read_text())
    row = next(r for r in d["rows"] if r["system"] == system and r["batch"] == batch)
    config = d["args"]["config"]
    stem = Path(config).stem
    sets = [f"train.batch_size={batch}", f"train.micro_batch_size={row['plan']['micro_batch']}"]
    if config.startswith("/tmp/"):  # bench/long.sh's config: a shipped one at one length, a sequence a step
        stem, length = stem.rsplit("-", 1)
        sets = [f"train.seq_len={length}", f"model.max_position_embeddings={length}", "train.batch_size=1"]
        sets.append("train.micro_batch_size=1")
    return row, load_config(stem, sets)


def work(row: dict, cfg) -> dict[str, float]:
    """compute_work of the run's shape: its micro-batch, its tile (an MLP-only tile recomputes no q/k/v), the blocks
    its plan did not recompute."""
    p = row["plan"]
    units = p.get("units")
    if units is not None:
        kept = sum(1 for u in units if u["name"].startswith("layers.") and not u.get("recompute", True))
    else:
        kept = p.get("kept", 0) or 0
    rp = SimpleNamespace(
        tile=p.get("tile") or 0, micro_batch=p["micro_batch"], expert_groups=p.get("expert_groups", 1)
    )
    return compute_work(job_of(cfg, "fit"), kept, rp, REFERENCE.experts_speed)


def terms(w: dict, hw: HardwareSpec, scale: float) -> np.ndarray:
    """Seconds of each pass at efficiency 1 (rows: forward, backward; columns: matmuls, attention), cuDNN's rates
    (the kernel these runs ran: torch 2.11's choice on Hopper, or the plan's)."""
    mm = hw.bf16_tflops * 1e12
    fa, ba = (x * 1e12 * scale for x in hw.attention_tflops["cudnn"][:2])
    return np.array(
        [
            [w["matmul fwd"] / mm, w["attention fwd"] / fa],
            [w["matmul bwd"] / mm, w["attention recompute"] / fa + w["attention bwd"] / ba],
        ]
    )


def experts(e: float, a: float) -> None:
    """The mixtures of experts at efficiencies (e, a): their planned passes with experts_speed, and the experts'
    speeds (forward, backward) the two runs ask for by least squares."""
    from dataclasses import replace

    from tiertrain.plan.resolve import search

    hw = replace(REFERENCE, compute_efficiency=e, attention_efficiency=a)
    A, b = [], []
    print(
        f"| mixture of experts (H100, {MOE_KERNEL}) | measured fwd / bwd s | planned (the reference's constants), "
        f"experts_speed {hw.experts_speed} |"
    )
    print("| --- | --- | --- |")
    for config, sets, fwd, bwd in MOE_RUNS:
        sets = sets + ["train.seq_len=8192", "train.micro_batch_size=1", f'train.attention="{MOE_KERNEL}"']
        cfg = load_config(config, sets)
        p = search(cfg, hw, 120, hw.gpu_mem_gb, 50, "fit", advise=False)  # the shape: its tile
        job, rp, kept = p.job, p.run_plan, 0  # both runs recomputed every block (their plans kept none)
        fa, ba = (x * 1e12 * a for x in hw.attention_tflops[MOE_KERNEL][:2])
        mm = hw.bf16_tflops * 1e12 * e
        base = compute_work(job, kept, rp, (1.0, 1.0))  # the experts at the dense rate
        att = np.array(
            [base["attention fwd"] / fa, base["attention recompute"] / fa + base["attention bwd"] / ba]
        )
        dense = np.array([base["matmul fwd"], base["matmul bwd"]]) / mm
        # the routed experts' seconds at the dense rate: their forward (in both passes), their backward (twice it)
        ex_f = job.rows * job.seq_len * job.spec.expert_flops_per_token / 3 / mm
        ex_b = 2 * ex_f
        w = compute_work(job, kept, rp, hw.experts_speed)  # the planner's compute (plan.times._compute)
        planned = (
            w["matmul fwd"] / mm + w["attention fwd"] / fa,
            w["matmul bwd"] / mm + w["attention recompute"] / fa + w["attention bwd"] / ba,
        )
        print(
            f"| {Path(config).stem} {sets[0]} | {fwd:.3f} / {bwd:.3f} | {planned[0] / fwd:.2f}x / "
            f"{planned[1] / bwd:.2f}x |"
        )
        # measured - dense - attention = ex_f (1/sf - 1) [+ ex_f (1/sf - 1) + ex_b (1/sb - 1) backward]
        A += [[ex_f / fwd, 0.0], [ex_f / bwd, ex_b / bwd]]
        rest = np.array([fwd, bwd]) - dense - att
        b += [rest[0] / fwd + ex_f / fwd, rest[1] / bwd + (ex_f + ex_b) / bwd]
    inv, *_ = np.linalg.lstsq(np.array(A), np.array(b), rcond=None)
    print(f"experts_speed the runs ask for: ({1 / inv[0]:.2f}, {1 / inv[1]:.2f})")


def main() -> None:
    kernels = "--kernels" in sys.argv
    rows, A, b, names = [], [], [], []
    for name, system, batch, probe in KERNEL_RUNS if kernels else RUNS:
        row, cfg = load(name, system, batch)
        hw = HardwareSpec.load(probe) if probe else REFERENCE
        head = cfg.model.hd
        scale = REFERENCE.attention_head_scale[str(min((64, 128), key=lambda h: abs(h - head)))]
        t = terms(work(row, cfg), hw, scale)
        measured = np.array([row["forward_s"], row["backward_s"]])
        rows.append((name, cfg.train.seq_len, t, measured, head))
        if head == 128:
            A.append(t / measured[:, None])
            b.append(np.ones(2))
            names.append(name)
    inv, *_ = np.linalg.lstsq(np.concatenate(A), np.concatenate(b), rcond=None)
    e, a = 1 / inv
    print(
        f"fit on {len(names)} runs (forward and backward each): compute_efficiency {e:.3f}, "
        f"attention_efficiency {a:.3f}"
    )
    now = np.array([1 / REFERENCE.compute_efficiency, 1 / REFERENCE.attention_efficiency])
    print("| run | tokens | measured fwd / bwd s | planned (the reference's constants) | at the fit |")
    print("| --- | --- | --- | --- | --- |")
    for name, seq, t, m, head in rows:
        p0, p1 = t @ now, t @ inv
        print(
            f"| {name}{' (head 64)' if head != 128 else ''} | {seq:,} | {m[0]:.3f} / {m[1]:.3f} | "
            f"{p0[0] / m[0]:.2f}x / {p0[1] / m[1]:.2f}x | {p1[0] / m[0]:.2f}x / {p1[1] / m[1]:.2f}x |"
        )
    if not kernels:  # the experts' runs are of the code before the dense kernels
        print()
        experts(REFERENCE.compute_efficiency, REFERENCE.attention_efficiency)


if __name__ == "__main__":
    main()
