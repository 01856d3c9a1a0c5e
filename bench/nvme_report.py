"""The markdown report of bench/nvme.py, from its JSON record (`python -m bench.nvme_report FILE.json`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tiertrain.plan.hardware import HardwareSpec
from tiertrain.plan.times import disk_time


def _placement(pl: dict) -> str:
    nv = ", ".join(
        f"{k} {v:.1f} GB ({pl['nvme_units'][k]}/{pl['units']} units)" for k, v in pl["nvme_gb"].items()
    )
    host = ", ".join(f"{k} {v:.1f}" for k, v in pl["host_gb"].items())
    return f"NVMe: {nv or 'nothing'}; host GB: {host}; staging ring {pl['ring_gb']:.1f} GB"


def report(rec: dict) -> str:
    res, errors = rec["results"], rec["errors"]
    probe = res.get("probe") or {}
    spec = probe.get("spec", {})
    disk = probe.get("disk", {})
    rr, rw = spec.get("disk_read_gbs", float("nan")), spec.get("disk_write_gbs", float("nan"))
    rm = spec.get("disk_mixed_gbs") or 0.0
    disk_hw = HardwareSpec(disk_read_gbs=rr, disk_write_gbs=rw, disk_mixed_gbs=rm)

    def io_floor(read_gb: float, write_gb: float) -> float:
        """One disk's seconds for these bytes at the probed rates: the planner's own disk time."""
        return disk_time(read_gb * 1e9, write_gb * 1e9, disk_hw)

    lines = [
        "# NVMe tier: tiertrain vs DeepSpeed ZeRO-3 with its optimizer on NVMe",
        "",
        f"- date: {rec['date']}",
        f"- hardware: {spec.get('gpu')}, {spec.get('cpu_count')} CPUs, {spec.get('host_ram_gb', 0):.0f} GB RAM",
        f"- command: `python -m bench.nvme {' '.join(rec['argv'][1:])}`",
        "- disk measured in this run (4 GiB, direct I/O; backend/threads: read / write / both at once GB/s): "
        + ", ".join(
            f"{io} {v[0]:.2f} / {v[1]:.2f}" + (f" / {v[2]:.2f}" if len(v) > 2 else "")
            for io, v in disk.items()
        )
        + f"; the disk's rates are the best of these (read {rr:.2f}, write {rw:.2f}, both {rm:.2f}); "
        f"the runs use {probe.get('io', '?')}",
        "",
    ]
    for stage, err in errors.items():
        lines.append(f"- **{stage} failed**: `{err}`")
    ds = {r["batch"]: r for r in res.get("deepspeed") or []}
    tt = res.get("tiertrain") or []
    lines += [
        "## Side by side (same batch, same GPU, one after another)",
        "",
        "| system | batch | tokens/step | tokens/s | vs DeepSpeed | host peak RSS GB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(list(ds.values()) + tt, key=lambda r: (r["batch"], r["system"])):
        d = ds.get(r["batch"])
        ratio = f"{r['tokens_per_s'] / d['tokens_per_s']:.2f}x" if d and r is not d else ""
        lines.append(
            f"| {r['system']} | {r['batch']} | {r['tokens']} | {r['tokens_per_s']:,.0f} | {ratio} | "
            f"{r['host_peak_rss_gb']:.1f} |"
        )
    if tt:
        lines += [
            "",
            f"tiertrain placement: {_placement(tt[0]['placement'])}",
            "",
            "## tiertrain's disk",
            "",
            "I/O floor = the disk's time for the bytes at the rates measured above: max(read / read rate, "
            "write / write rate, (read + write) / both-at-once rate) (without that rate: read / read rate + "
            "write / write rate). Disk use = that floor / the I/O window (first read issued to last write "
            "landed, per update). Bytes are those of one whole update.",
            "",
            "| batch | I/O threads | step s | read GB | write GB | I/O window s | disk GB/s in window | disk use | "
            "I/O floor s | step / floor | predicted step s | predicted / measured |",
            "|" + " --- |" * 12,
        ]
        for r in tt:
            floor = io_floor(r["nvme_read_gb"], r["nvme_write_gb"])
            window = r["nvme_io_s"] or float("nan")
            gbs = (r["nvme_read_gb"] + r["nvme_write_gb"]) / window
            pred = r.get("pred_step_s", float("nan"))
            lines.append(
                f"| {r['batch']} | {r.get('io_threads', 8)} | {r['step_s']:.2f} | {r['nvme_read_gb']:.1f} | "
                f"{r['nvme_write_gb']:.1f} | "
                f"{r['nvme_io_s']:.2f} | {gbs:.2f} | {floor / window:.0%} | {floor:.2f} | "
                f"{r['step_s'] / floor if floor else float('nan'):.2f} | {pred:.2f} | {pred / r['step_s']:.2f} |"
            )
    ck = res.get("checkpoint")
    if ck:
        lines += [
            "",
            "## Checkpoint with part of the state on NVMe",
            "",
            f"- --host-gb {ck['host_gb']:.1f}: {_placement(ck['placement'])}",
            f"- checkpoint: {ck['checkpoint_gb']:.1f} GB (master, exp_avg, exp_avg_sq; CRC32C per chunk), "
            f"written at {ck['write_gbs']:.2f} GB/s (fsynced, renamed), read back at {ck['read_gbs']:.2f} GB/s "
            f"(trainer rebuilt and resumed in {ck['resume_s']:.0f} s)",
            f"- the step after the save, taken before and after the resume: loss {ck['loss_after_save']!r} "
            f"vs {ck['loss_after_resume']!r}: {'bit-identical' if ck['identical'] else 'DIFFERENT'}",
        ]
    big = res.get("big")
    if big:
        b = big[0]
        lines += [
            "",
            f"## State larger than RAM: {b['params'] / 1e9:.2f} B parameters",
            "",
            f"- {_placement(b['placement'])}; trainer built in {b['setup_s']:.0f} s; host peak RSS "
            f"{max(r['host_peak_rss_gb'] for r in big):.1f} GB",
            "",
            "| step | step s | tokens/s | NVMe read GB | NVMe write GB | exposed update s | predicted step s |",
            "|" + " --- |" * 7,
        ]
        for r in big:
            lines.append(
                f"| {r['step']} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {r.get('nvme_read_gb', 0):.1f} | "
                f"{r.get('nvme_write_gb', 0):.1f} | {r['opt_wait_s']:.2f} | {r.get('pred_step_s', float('nan')):.2f} |"
            )
    least = res.get("least")
    if least:
        b = least[0]
        lines += [
            "",
            f"## The least host budget: {b['params'] / 1e9:.2f} B parameters",
            "",
            f"- --host-gb {b['host_gb']:.2f} (least_host: the staging ring, and what costs less in RAM than "
            f"its ring), bf16 copy streaming: {_placement(b['placement'])}; "
            f"trainer built in {b['setup_s']:.0f} s; host peak RSS {max(r['host_peak_rss_gb'] for r in least):.1f} GB",
            f"- planner: step {b.get('pred_step_s', float('nan')):.2f} s, bottleneck {b.get('pred_bottleneck')}",
            "",
            "| step | step s | tokens/s | NVMe read GB | NVMe write GB | I/O window s | disk use | step / I/O floor |",
            "|" + " --- |" * 8,
        ]
        for r in least:
            rd, wr = r.get("nvme_read_gb", 0), r.get("nvme_write_gb", 0)
            floor = io_floor(rd, wr)
            window = r.get("nvme_io_s") or float("nan")
            lines.append(
                f"| {r['step']} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {rd:.1f} | {wr:.1f} | "
                f"{window:.2f} | {floor / window:.0%} | {r['step_s'] / floor if floor else float('nan'):.2f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    path = Path(sys.argv[1])
    text = report(json.loads(path.read_text()))
    path.with_suffix(".md").write_text(text)
    print(text)
