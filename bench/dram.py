"""The host DRAM a tiertrain step moves, against the rate the host AdamW kernel moves it at alone.

Every byte of a step's state passes through one host's DRAM: the PCIe copies (weights in, gradients and
the GPU updates' state out) and the host AdamW (28 bytes per parameter: master, moments and gradient
read, master and moments written; with a bf16 copy streamed to the GPU, 2 more: its write, with
streamed stores, so no read for ownership of its lines). The DRAM ceiling is the kernel's own
standalone traffic: its fp32 rate in the probe times 28 bytes. The issue's floor leaves DRAM out; this
table says how near a step is to it."""
from __future__ import annotations

ADAM_BYTES = 28  # per host-updated parameter, fp32 stream
COPY_BYTES = 2   # and with a bf16 copy: written (streamed stores: its lines are not read first)


def step_bytes(row: dict) -> float:
    """Host DRAM bytes of one step of a tiertrain row."""
    per = ADAM_BYTES + (0 if "fp32 stream" in row["system"] else COPY_BYTES)
    return (row["h2d_gb"] + row["d2h_gb"]) * 1e9 + row["host_adam_params"] * per


def table(rows: list[dict], probe: dict) -> list[str]:
    rate = probe.get("host_adam_fp32_stream_params_per_s", 0) * ADAM_BYTES
    rows = [r for r in rows if r["system"].startswith("tiertrain") and "host_adam_params" in r]
    if not rows or not rate:
        return []
    lines = ["", "## host DRAM", "",
             f"DRAM GB: the bytes a step moves through host DRAM (PCIe copies + host AdamW, {ADAM_BYTES} B per "
             f"parameter, {ADAM_BYTES + COPY_BYTES} with a bf16 copy); DRAM floor: those bytes at the host AdamW "
             f"kernel's own DRAM rate alone ({rate / 1e9:.0f} GB/s: its fp32 rate in the probe x {ADAM_BYTES} B); "
             "GB/s: what the step reached.", "",
             "| system | batch | step s | DRAM GB | GB/s | DRAM floor s | step/DRAM floor |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        b = step_bytes(r)
        lines.append(f"| {r['system']} | {r['batch']} | {r['step_s']:.3f} | {b / 1e9:.1f} | "
                     f"{b / r['step_s'] / 1e9:.0f} | {b / rate:.3f} | {r['step_s'] / (b / rate):.2f} |")
    return lines
