"""The NVMe tier on one GPU machine: tiertrain with a host budget vs DeepSpeed ZeRO-3 with its optimizer
on NVMe, a checkpoint with part of the state on NVMe written and resumed, and a model whose state does
not fit in RAM.

    python -m bench.nvme --nvme-dir /mnt/nvme --out bench/results

Stages, each its own process (peak RSS is per process), one after another:
  probe       the machine, with the disk in --nvme-dir (direct I/O): the planner's hardware file
  deepspeed   ZeRO-3, parameters offloaded to CPU, optimizer to NVMe (libaio), at each batch
  tiertrain   --host-gb = DeepSpeed's peak RSS less tiertrain's process overhead, capped so that at
              least half of the Adam moments spill; fp32 streaming when that fits, else the bf16 copy
              streams and the master spills too
  checkpoint  llama-3b with a few GB of moments on NVMe: save, one more step, resume, the same step
  big         --big (llama-7b) under --big-host-gb (96): 3 steps
  least       --config with --least-layers blocks, the bf16 copy streaming, under the least host budget:
              every slab on NVMe, the weights that stream included; 3 steps
Writes <out>/<date>-<gpu>-nvme.md and .json.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path
from statistics import median

from bench.baselines import run_deepspeed
from bench.common import batch, commit, peak_rss_gb, run_worker

OVERHEAD_GB = 3.0  # tiertrain's RSS beyond its --host-gb: Python, torch, the CUDA context (measured: 1.4-2.6)
STAGES = ("probe", "deepspeed", "tiertrain", "checkpoint", "big", "least")
# the NVMe backend of the runs (the probe's faster one, --io) and its threads (--io-threads)
IO = ["auto", 16]


def _cfg(config: str, B: int, micro: int, host_gb: float, nvme: str, stream: str, *more: str):
    from tiertrain.config import load_config

    return load_config(
        config,
        [
            *more,
            f"train.batch_size={B}",
            f"train.micro_batch_size={micro}",
            "train.steps=100000",
            'train.compute_dtype="bfloat16"',
            f'tiers.stream="{stream}"',
            'tiers.activations="gpu"',
            f"tiers.host_gb={host_gb}",
            f'tiers.nvme_dir="{nvme}"',
            f'tiers.io="{IO[0]}"',
            f"tiers.io_threads={IO[1]}",
            "optim.lr=1e-5",
            "optim.min_lr=0.0",
            "optim.warmup_steps=0",
        ],
    )


def _placement(tr) -> dict:
    from tiertrain.tiers.placement import spilled_bytes

    numels = [lay.numel for lay in tr.layouts]
    nv = spilled_bytes(numels, tr.kind_bytes(), tr.run_plan.where())
    units = {k: sum(1 for (_, kk), t in tr.run_plan.where().items() if kk == k and t == "nvme") for k in nv}
    return {
        "nvme_gb": {k: v / 1e9 for k, v in nv.items()},
        "nvme_units": units,
        "units": len(numels),
        "host_gb": {k: v / 1e9 for k, v in tr.run.host.nbytes().items()},
        "ring_gb": tr.run.nvme.ring_nbytes() / 1e9 if tr.run.nvme else 0.0,
    }


def _predict(tr, B: int) -> dict:
    from tiertrain.plan.planner import evaluate
    from tiertrain.plan.values import Budgets, Choice, Job

    c, t = tr.cfg, tr.cfg.tiers
    if tr.device.type != "cuda":
        return {}
    hw = tr.hw
    rp = tr.run_plan
    job = Job(c.model, B, c.train.seq_len, c.train.compute_dtype, name="bench")
    p = evaluate(
        job,
        Choice(rp.micro_batch, rp.stream, rp.activations, keep=0, spill=rp.spill_first),
        Budgets(t.host_gb, hw.gpu_mem_gb, 1e9),
        hw,
    )
    pr = p.prediction if p.fits else None
    return {
        "pred_step_s": pr.step_s if pr else float("inf"),
        "pred_bottleneck": pr.bottleneck if pr else "",
        "pred_nvme_s": pr.times.get("NVMe", 0) if pr else 0,
        "pred_fits": p.fits,
    }


def _steps(tr, B: int, n: int, seed0: int = 0) -> list[dict]:
    S, V = tr.cfg.train.seq_len, tr.cfg.model.vocab_size
    return [tr.train_on(*batch(B, S, V, seed0 + k)) for k in range(n)]


def run_tiertrain(a) -> list[dict]:
    from tiertrain.trainer import Trainer

    cfg = _cfg(a.config, max(a.batches), a.micro, a.host_gb, str(Path(a.nvme_dir) / "tt"), a.stream)
    t0 = time.perf_counter()
    tr = Trainer(cfg, run_name="bench", hardware=Path(a.hardware))
    setup_s, place = time.perf_counter() - t0, _placement(tr)
    rows = []
    for B in a.batches:
        recs = _steps(tr, B, a.warmup + a.steps)[a.warmup :]
        keys = (
            "step_s",
            "nvme_read_gb",
            "nvme_write_gb",
            "nvme_io_s",
            "opt_wait_s",
            "forward_s",
            "backward_s",
        )
        row = {k: median(r.get(k, 0.0) for r in recs) for k in keys}
        S = cfg.train.seq_len
        rows.append(
            {
                "system": f"tiertrain ({a.stream} stream, --host-gb {a.host_gb:.1f}, {IO[1]} I/O threads)",
                "batch": B,
                "io_threads": IO[1],
                "tokens": B * S,
                "tokens_per_s": B * S / row["step_s"],
                "host_peak_rss_gb": peak_rss_gb(),
                "setup_s": setup_s,
                "placement": place,
                "losses": [r["loss"] for r in recs],
                "plan": tr.run_plan.to_dict(),
                **row,
                **_predict(tr, B),
            }
        )
    tr.close()
    from tiertrain.tiers.nvme import discard

    discard(tr.run.nvme.store.root)  # the next run (another thread count) makes its own
    return rows


def run_checkpoint(a) -> dict:
    """Save at step 2, take step 3, resume from the save in a new trainer, take step 3 again: the same loss."""
    import torch

    from tiertrain.config import load_config
    from tiertrain.plan.hardware import REFERENCE
    from tiertrain.tiers.nvme import discard
    from tiertrain.trainer import Trainer

    state_gb = load_config(a.config).model.n_params * 16 / 1e9  # fp32 streaming: no bf16 copy
    host_gb = state_gb - a.ckpt_spill_gb + REFERENCE.process_gb  # --host-gb holds the process too
    cfg = _cfg(a.config, 4, a.micro, host_gb, str(Path(a.nvme_dir) / "ck"), "master")
    run_dir = Path(a.nvme_dir) / "ckpt-run"
    tr = Trainer(cfg, run_name="ck", hardware=Path(a.hardware))
    place = _placement(tr)
    _steps(tr, 4, 2)
    path, write_gbs = tr.save_checkpoint(run_dir)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9
    want = _steps(tr, 4, 1, seed0=2)[0]["loss"]
    tr.close()
    discard(tr.run.nvme.store.root)
    del tr
    gc.collect()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    tr = Trainer(cfg, run_name="ck", resume=path, hardware=Path(a.hardware))
    resume_s = time.perf_counter() - t0
    got = _steps(tr, 4, 1, seed0=2)[0]["loss"]
    tr.close()
    discard(tr.run.nvme.store.root)
    shutil.rmtree(run_dir)
    return {
        "host_gb": host_gb,
        "placement": place,
        "checkpoint_gb": size,
        "write_gbs": write_gbs,
        "read_gbs": tr.restore_gbs,
        "resume_s": resume_s,
        "loss_after_save": want,
        "loss_after_resume": got,
        "identical": want == got,
    }


def _three_steps(a, cfg, name: str, **extra) -> list[dict]:
    """A trainer of `cfg` (batch 4) takes 3 steps; each row with the setup time, placement, RSS and plan."""
    from tiertrain.tiers.nvme import discard
    from tiertrain.trainer import Trainer

    t0 = time.perf_counter()
    tr = Trainer(cfg, run_name=name, hardware=Path(a.hardware))
    setup_s, place = time.perf_counter() - t0, _placement(tr)
    recs = _steps(tr, 4, 3)
    pred = _predict(tr, 4)
    tr.close()
    discard(tr.run.nvme.store.root)
    return [
        {
            **r,
            "setup_s": setup_s,
            "placement": place,
            "host_peak_rss_gb": peak_rss_gb(),
            "plan": tr.run_plan.to_dict(),
            "params": cfg.model.n_params,
            **extra,
            **pred,
        }
        for r in recs
    ]


def run_big(a) -> list[dict]:
    return _three_steps(
        a, _cfg(a.big, 4, a.micro, a.big_host_gb, str(Path(a.nvme_dir) / "big"), "master"), "big"
    )


def run_least(a) -> list[dict]:
    """The least host budget of a --least-layers model with the bf16 copy streaming: every slab on NVMe,
    but those that cost less in RAM than their ring (a vocabulary much wider than a block)."""
    from tiertrain.config import load_config
    from tiertrain.plan.hardware import REFERENCE
    from tiertrain.plan.memory import slab_sizes as _layouts
    from tiertrain.tiers.placement import kind_bytes, least_host
    from tiertrain.tiers.slab import host_cost

    layers = f"model.num_hidden_layers={a.least_layers}"
    numels = _layouts(load_config(a.config, [layers]).model)
    gb = least_host(numels, kind_bytes("bfloat16", "compute"), 0, host_cost) / 1e9 + 0.001
    gb += REFERENCE.process_gb  # --host-gb holds the process too
    cfg = _cfg(a.config, 4, a.micro, gb, str(Path(a.nvme_dir) / "least"), "compute", layers)
    return _three_steps(a, cfg, "least", host_gb=gb)


def worker(a) -> None:
    if a.worker == "probe":
        from tiertrain.probe import disk_rates, probe_spec

        spec, notes = probe_spec(a.nvme_dir)
        # the disk's own rates: our O_DIRECT thread pool and kvikio, 4 GiB, at 8 / 16 / 32 threads; the best
        # is the disk's (the planner's figures, the bar the runs are held to) and its backend runs below
        rates = {}
        for io in ("posix", "kvikio"):
            for threads in (8, 16, 32):
                try:
                    rates[f"{io}/{threads}"] = disk_rates(a.nvme_dir, 4 << 30, io, threads)
                except Exception as e:  # noqa: BLE001 - kvikio needs a CUDA driver
                    notes.append(f"{io}: {e}")
                    break
        best = min(rates, key=lambda k: 1 / rates[k][0] + 1 / rates[k][1] + 2 / rates[k][2])
        spec.disk_read_gbs, spec.disk_write_gbs, spec.disk_mixed_gbs = rates[best]
        spec.save(a.hardware)  # the runs below plan with this machine's figures
        out = {
            "spec": json.loads(Path(a.hardware).read_text()),
            "notes": notes,
            "disk": rates,
            "io": best.split("/")[0],
        }
    elif a.worker == "deepspeed":
        ds = Path(a.nvme_dir) / "ds"
        ds.mkdir(parents=True, exist_ok=True)
        try:
            out = run_deepspeed(a, nvme_dir=str(ds))
        finally:
            shutil.rmtree(ds, ignore_errors=True)
    else:
        out = {"tiertrain": run_tiertrain, "checkpoint": run_checkpoint, "big": run_big, "least": run_least}[
            a.worker
        ](a)
    Path(a.json).write_text(json.dumps(out))


def choose_budget(a, ds_rss: float | None) -> tuple[float, str]:
    """(host GB, stream) for tiertrain: no more RAM than DeepSpeed used, at least half the moments spilled."""
    from tiertrain.config import load_config
    from tiertrain.plan.memory import slab_sizes as _layouts
    from tiertrain.tiers.placement import kind_bytes, ring_bytes, spill_order
    from tiertrain.tiers.slab import host_cost

    numels = _layouts(load_config(a.config).model)
    fp32 = sum(host_cost(n * 4) for n in numels)
    kb = kind_bytes("bfloat16", "master")

    def ring(kinds):
        return ring_bytes({k: max(numels) for k in kinds}, kb, host_cost)

    half = (2 * fp32 + fp32 + ring(("exp_avg", "exp_avg_sq"))) / 1e9  # master, grad, half the moments
    gb = min(half, ds_rss - OVERHEAD_GB) if ds_rss else half
    # the fp32 master streams while it fits in RAM beside its ring; below that the bf16 copy streams
    if gb * 1e9 >= fp32 + ring(spill_order(kb)[:-1]):
        return gb, "master"
    return gb, "compute"


def _run(a, stage: str, out: Path, extra: list[str]) -> tuple[object | None, str]:
    errors: dict[str, str] = {}
    data = run_worker(
        "bench.nvme",
        stage,
        [
            "--worker",
            stage,
            "--config",
            a.config,
            "--nvme-dir",
            a.nvme_dir,
            "--batches",
            *map(str, a.batches),
            "--micro",
            str(a.micro),
            "--warmup",
            str(a.warmup),
            "--steps",
            str(a.steps),
            "--big",
            a.big,
            "--big-host-gb",
            str(a.big_host_gb),
            "--ckpt-spill-gb",
            str(a.ckpt_spill_gb),
            "--least-layers",
            str(a.least_layers),
            "--hardware",
            a.hardware,
            *extra,
        ],
        out,
        a.timeout,
        errors,
    )
    return data, errors.get(stage, "")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/llama-3b.toml")
    p.add_argument("--nvme-dir", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument(
        "--host-gb", type=float, default=None, help="tiertrain's budget (default: from DeepSpeed's RSS)"
    )
    p.add_argument("--stream", default=None)
    p.add_argument("--big", default="configs/llama-7b.toml")
    p.add_argument("--big-host-gb", type=float, default=96.0)
    p.add_argument("--ckpt-spill-gb", type=float, default=6.0)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--hardware", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--io", default="auto")
    p.add_argument(
        "--io-threads", type=int, nargs="+", default=[16], help="the tiertrain stage runs once with each"
    )
    p.add_argument("--least-layers", type=int, default=8)
    a = p.parse_args()
    IO[0], IO[1] = a.io, a.io_threads[0]
    if a.worker:
        return worker(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(a.nvme_dir).mkdir(parents=True, exist_ok=True)
    a.hardware = str(out / ".hardware.json")  # the probe stage writes it; the runs plan with it
    from tiertrain.plan.hardware import REFERENCE

    REFERENCE.save(a.hardware)  # until the probe has run (or when it is not a stage)
    res, errors = {}, {}
    for stage in a.stages.split(","):
        extra = []
        if stage == "tiertrain":
            ds = res.get("deepspeed")
            gb, stream = (
                (a.host_gb, a.stream or "master")
                if a.host_gb
                else choose_budget(a, max(r["host_peak_rss_gb"] for r in ds) if ds else None)
            )
            extra = ["--host-gb", f"{gb:.2f}", "--stream", stream]
        if res.get("probe"):
            extra += ["--io", res["probe"]["io"]]
        if stage != "tiertrain":
            res[stage], err = _run(a, stage, out, extra)
            if err:
                errors[stage] = err
            continue
        for n in a.io_threads:  # one process per thread count: rows side by side
            rows, err = _run(a, stage, out, extra + ["--io-threads", str(n)])
            res[stage] = (res.get(stage) or []) + (rows or [])
            if err:
                errors[f"{stage} ({n} threads)"] = err
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    gpu = (
        ((res.get("probe") or {}).get("spec", {}).get("gpu") or "gpu").replace("NVIDIA ", "").replace(" ", "")
    )
    stem = f"{time.strftime('%Y-%m-%d')}-{gpu}-nvme"
    rec = {"date": date, "argv": sys.argv, "results": res, "errors": errors, **commit()}
    (out / f"{stem}.json").write_text(json.dumps(rec, indent=1))
    from bench.nvme_report import report

    text = report(rec)
    (out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
