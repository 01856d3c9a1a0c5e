"""The host DRAM a tiertrain step moves, against the rate the host AdamW kernel moves it at alone.

Every byte of a step's state passes through one host's DRAM: the PCIe copies (weights in, gradients and
the GPU updates' state out) and the host AdamW (28 bytes per parameter: master, moments and gradient
read, master and moments written; with a bf16 copy streamed to the GPU, 2 more: its write, with
streamed stores, so no read for ownership of its lines). The DRAM ceiling is the kernel's own
standalone traffic: its fp32 rate in the probe times 28 bytes, or what the step's own host updates after
the norm moved where that is more (`adam_rate`). The issue's floor leaves DRAM out; this table says how
near a step is to it."""

from __future__ import annotations

ADAM_BYTES = 28  # per host-updated parameter, fp32 stream
COPY_BYTES = 2  # and with a bf16 copy: written (streamed stores: its lines are not read first)


def fp32_stream(row: dict) -> bool:
    """A tiertrain row's run streamed the fp32 master (no host bf16 copy to write), as its RunPlan says."""
    return row["plan"]["stream"] == "master"


def adam_bytes(row: dict) -> int:
    """Host DRAM bytes of one parameter's host AdamW in a tiertrain row's variant."""
    return ADAM_BYTES + (0 if fp32_stream(row) else COPY_BYTES)


def step_bytes(row: dict) -> float:
    """Host DRAM bytes of one step of a tiertrain row."""
    return (row["h2d_gb"] + row["d2h_gb"]) * 1e9 + row["host_adam_params"] * adam_bytes(row)


def reached_rate(row: dict) -> float:
    """Params/s the step's own host updates after the norm reached (its timeline's upd_gparams_s; 0: none)."""
    return (row.get("timeline") or {}).get("upd_gparams_s", 0.0) * 1e9


def adam_rate(row: dict, probe: dict) -> tuple[float, bool]:
    """(params/s, taken from the step) of the host AdamW ceiling for a row's variant (fp32 stream: no bf16
    copy): the probe's rate, or the rate the step's own updates after the norm reached (its timeline's
    upd_gparams_s: the same kernel and variant, in place, beside the forward pass's copies) where that is
    higher. A ceiling is at least what was reached: the probe runs minutes away from the step, on a host
    whose DRAM other tenants share (it read 3.7-5.9 G params/s on one day)."""
    probed = probe.get(
        "host_adam_fp32_stream_params_per_s" if fp32_stream(row) else "host_adam_params_per_s", 0.0
    )
    reached = reached_rate(row)
    return max(probed, reached), reached > probed


def dram_rate(row: dict, probe: dict) -> float:
    """The host DRAM ceiling, bytes/s: the AdamW kernel's own traffic, at the probe's fp32 rate or at the
    rate the step's updates reached (adam_rate), whichever moved more."""
    probed = probe.get("host_adam_fp32_stream_params_per_s", 0.0) * ADAM_BYTES
    return max(probed, reached_rate(row) * adam_bytes(row))


def table(rows: list[dict], probe: dict) -> list[str]:
    rate = probe.get("host_adam_fp32_stream_params_per_s", 0) * ADAM_BYTES
    rows = [r for r in rows if r["kind"] == "tiertrain" and "host_adam_params" in r]
    if not rows or not rate:
        return []
    lines = [
        "",
        "## host DRAM",
        "",
        f"DRAM GB: the bytes a step moves through host DRAM (PCIe copies + host AdamW, {ADAM_BYTES} B per "
        f"parameter, {ADAM_BYTES + COPY_BYTES} with a bf16 copy); DRAM floor: those bytes at the host AdamW "
        f"kernel's own DRAM rate alone ({rate / 1e9:.0f} GB/s: its fp32 rate in the probe x {ADAM_BYTES} B, or, "
        "where more, the step's own updates after the norm at their rate: 'ceiling GB/s'); "
        "GB/s: what the step reached.",
        "",
        "| system | batch | step s | DRAM GB | GB/s | ceiling GB/s | DRAM floor s | step/DRAM floor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        b, ceil = step_bytes(r), dram_rate(r, probe)
        lines.append(
            f"| {r['system']} | {r['batch']} | {r['step_s']:.3f} | {b / 1e9:.1f} | "
            f"{b / r['step_s'] / 1e9:.0f} | {ceil / 1e9:.0f} | {b / ceil:.3f} | {r['step_s'] / (b / ceil):.2f} |"
        )
    return lines
