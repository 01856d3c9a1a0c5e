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
import sys
import time
from pathlib import Path
from statistics import median

from bench import timeline
from bench.baselines import BASELINES, result_row, run_deepspeed, run_gpu
from bench.common import batch, commit, run_worker
from bench.pipeline_report import report, write

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
    row = result_row(
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
    return [row]


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
                write(a, out, probe, results, errors, meta)
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
        write(a, out, probe, results, errors, meta)
    print(write(a, out, probe, results, errors, meta))


if __name__ == "__main__":
    main()
