"""Named GPUs: the published figures of the common training GPUs, as the HardwareSpec a plan for one uses (`--gpu
NAME`, `[hardware] gpu`, or the GPU nvidia-smi names here when no probe file measured this machine). Pure Python.

Datasheets give peaks; the planner's rates are what the runtime reaches. So each published peak is scaled by the
share of its own peak the reference H200 machine measured (REFERENCE: its bf16 matmul, fp32 matmul, PCIe copies
each way and both at once), and where the project measured a GPU (the H100's probe) its measured figures are
used instead. The host's figures (RAM, cores, host AdamW, DRAM, disk) are the reference machine's: a GPU's name
does not say what host it sits in (a GH200's host is its Grace CPU: its RAM and cores are the superchip's).
docs/gpus.md lists every figure and where it comes from.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import ConfigError
from . import hardware
from .hardware import REFERENCE, HardwareSpec

# the H200's datasheet peaks, of which the reference machine measured REFERENCE's rates
H200_BF16_PEAK = 989.4  # dense bf16 TFLOP/s (H200 SXM datasheet; 1,979 with sparsity)
H200_FP32_PEAK = 66.9  # fp32 TFLOP/s
PCIE5 = 63.0  # GB/s each way of a PCIe 5.0 x16 link (32 GT/s x 16 lanes, 128b/130b); PCIe 4.0: half
PCIE4 = PCIE5 / 2
# what one GPU's all-gathers and reduce-scatters reach of its GPU-to-GPU link, each way (REFERENCE.peer_gbs, 300,
# of NVLink 4's 450 GB/s)
PEER_SHARE = REFERENCE.peer_gbs / 450.0
GIB = 2**30 / 1e9
# GPU memory torch can allocate of a datasheet's nominal GiB: the H100 80 GB reports 85.02 GB (79.2 GiB), and
# of nvidia-smi's total: 81,559 MiB there
USABLE = 85.017493504 / (80 * GIB)
SMI_USABLE = 85.017493504e9 / (81559 * 2**20)


@dataclass(frozen=True)
class Gpu:
    """One named GPU: its datasheet figures, and the figures the project measured on it (HardwareSpec fields)."""

    key: str  # the name --gpu takes
    name: str  # in words
    memory_gb: float  # GPU memory torch reports (GB, 1e9 B)
    bf16_peak: float  # dense bf16 TFLOP/s, with fp32 accumulation (the datasheet's)
    fp32_peak: float  # fp32 TFLOP/s (non-tensor)
    link: str  # the host link, in words
    link_gbs: float  # the host link's GB/s each way (the datasheet's)
    peer_gbs: float  # the GPU-to-GPU link's GB/s each way (NVLink; without one, the host link)
    smi: str  # a regular expression matching the names nvidia-smi and torch give it (case-insensitive)
    measured: dict = field(default_factory=dict)  # HardwareSpec fields the project measured on this GPU
    host: dict = field(default_factory=dict)  # HardwareSpec fields of a host that comes with the GPU (GH200)
    note: str = ""

    def spec(self) -> HardwareSpec:
        """The HardwareSpec of this GPU on the reference machine's host: each datasheet figure at the share of its
        peak the reference H200 reached, the figures measured on this GPU as measured."""
        link = self.link_gbs / PCIE5
        rates = {
            "gpu": self.name,
            "gpu_mem_gb": self.memory_gb,
            "bf16_tflops": self.bf16_peak * REFERENCE.bf16_tflops / H200_BF16_PEAK,
            "fp32_tflops": self.fp32_peak * REFERENCE.fp32_tflops / H200_FP32_PEAK,
            "h2d_gbs": link * REFERENCE.h2d_gbs,
            "d2h_gbs": link * REFERENCE.d2h_gbs,
            "bidir_gbs": link * REFERENCE.bidir_gbs,
            "peer_gbs": self.peer_gbs * PEER_SHARE,
            # the attention kernels' rates (the reference's are the H100's and H200's) at this GPU's share of peak
            "attention_tflops": {
                k: [x * self.bf16_peak / H200_BF16_PEAK for x in v]
                for k, v in REFERENCE.attention_tflops.items()
            },
        }
        return replace(REFERENCE, **(rates | self.measured | self.host))

    def source(self, how: str) -> str:
        """What the plan's figures are, for the report's hardware line; `how`: how this GPU was named."""
        seen = "measured on the project's " + self.name if self.measured else "datasheet peaks"
        return (
            f"{self.name} ({how}): {seen}, scaled as the reference H200 machine's measured rates "
            f"(docs/gpus.md); host figures of "
            + ("its Grace CPU and the reference machine" if self.host else "the reference machine")
        )


def _h100_measured() -> dict:
    """The H100 machine's probe (bench/results/2026-11-25-H100-probe.json): GPU memory, PCIe, matmul rates."""
    return {
        "gpu_mem_gb": 85.017493504,
        "h2d_gbs": 54.75,
        "d2h_gbs": 54.90,
        "bidir_gbs": 88.71,
        "bf16_tflops": 770.95,
        "fp32_tflops": 51.52,
    }


# the reference machine's own figures: the H200 plans as the reference does
_H200_MEASURED = {
    k: getattr(REFERENCE, k)
    for k in ("gpu_mem_gb", "h2d_gbs", "d2h_gbs", "bidir_gbs", "bf16_tflops", "fp32_tflops")
}
_GRACE = {"host_ram_gb": 480.0, "cpu_count": 72}  # GH200 480GB: 72 Neoverse V2 cores, 480 GB of LPDDR5X
C2C = 450.0  # NVLink-C2C: 900 GB/s both ways

# fmt: off
GPUS = (
    Gpu("h100", "H100 SXM 80GB", 85.017493504, 989.4, 66.9, "PCIe 5.0 x16", PCIE5, 450.0,
        r"\bh100(?!.*(pcie|nvl))", _h100_measured()),
    Gpu("h100-pcie", "H100 PCIe 80GB", 80 * GIB * USABLE, 756.5, 51.2, "PCIe 5.0 x16", PCIE5, 300.0,
        r"\bh100.*pcie"),
    Gpu("h100-nvl", "H100 NVL 94GB", 94 * GIB * USABLE, 835.5, 60.0, "PCIe 5.0 x16", PCIE5, 300.0, r"\bh100.*nvl"),
    Gpu("h200", "H200 SXM 141GB", REFERENCE.gpu_mem_gb, 989.4, 66.9, "PCIe 5.0 x16", PCIE5, 450.0,
        r"\bh200(?!.*nvl)", _H200_MEASURED),
    Gpu("h200-nvl", "H200 NVL 141GB", REFERENCE.gpu_mem_gb, 835.5, 60.0, "PCIe 5.0 x16", PCIE5, 450.0,
        r"\bh200.*nvl"),
    Gpu("gh200", "GH200 480GB (96 GB HBM3)", 96 * GIB * USABLE, 989.4, 66.9, "NVLink-C2C", C2C, 450.0,
        r"gh200(?!.*(144|hbm3e))", host=_GRACE),
    Gpu("gh200-144g", "GH200 144GB HBM3e", 144 * GIB * USABLE, 989.4, 66.9, "NVLink-C2C", C2C, 450.0,
        r"gh200.*(144|hbm3e)", host=_GRACE),
    Gpu("a100-80gb", "A100 80GB", 80 * GIB * USABLE, 312.0, 19.5, "PCIe 4.0 x16", PCIE4, 300.0, r"a100.*80"),
    Gpu("a100-40gb", "A100 40GB", 40 * GIB * USABLE, 312.0, 19.5, "PCIe 4.0 x16", PCIE4, 300.0, r"a100.*40"),
    Gpu("l40s", "L40S 48GB", 46068 * 2**20 / 1e9 * SMI_USABLE, 362.05, 91.6, "PCIe 4.0 x16", PCIE4,
        PCIE4, r"l40s", note="48 GB with ECC on: 46,068 MiB"),
    Gpu("rtx4090", "GeForce RTX 4090 24GB", 24 * GIB * USABLE, 165.2, 82.6, "PCIe 4.0 x16", PCIE4, PCIE4,
        r"rtx 4090"),
    Gpu("rtx5090", "GeForce RTX 5090 32GB", 32 * GIB * USABLE, 209.5, 104.8, "PCIe 5.0 x16", PCIE5, PCIE5,
        r"rtx 5090"),
    Gpu("b200", "B200 180GB", 180 * GIB * USABLE, 2250.0, 75.0, "PCIe 5.0 x16", PCIE5, 900.0, r"\bb200"),
    Gpu("mi300x", "Instinct MI300X 192GB", 192 * GIB * USABLE, 1307.4, 163.4, "PCIe 5.0 x16", PCIE5, 448.0,
        r"mi300x", note="torch's ROCm build"),
)
# fmt: on
BY_KEY = {g.key: g for g in GPUS}
ALIASES = {"h100-sxm": "h100", "h200-sxm": "h200", "a100": "a100-80gb", "4090": "rtx4090", "5090": "rtx5090"}


def known() -> str:
    return ", ".join(BY_KEY)


def named(name: str) -> Gpu:
    """The entry `name` names (--gpu, [hardware] gpu): a key, an alias, or a name nvidia-smi gives; one line listing
    the known names otherwise."""
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    got = BY_KEY.get(ALIASES.get(key, key)) or from_smi(name)
    if got is None:
        raise ConfigError(
            f"unknown GPU {name!r}; known GPUs: {known()} (or measure this one: tiertrain probe)"
        )
    return got


def from_smi(name: str) -> Gpu | None:
    """The entry of the GPU nvidia-smi (or torch) calls `name`, e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
    "NVIDIA GeForce RTX 4090"; None for a GPU the table does not know."""
    text = re.sub(r"[-_]", " ", name.lower())
    hits = [g for g in GPUS if re.search(g.smi, text)]
    return hits[0] if len(hits) == 1 else None


def gpu_spec(name: str, how: str) -> HardwareSpec:
    """The figures a plan for the GPU `name` uses, on the reference machine's host; `how`: how it was named."""
    g = named(name)
    return replace(g.spec(), source=g.source(how))


def this_machine(gpu: tuple[str, float], path: str | Path | None = None, name: str = "") -> HardwareSpec:
    """The figures a machine with this GPU (nvidia-smi's or torch's name, GB) plans with: a probe file measured the
    machine, so the file `path`, else the one `tiertrain probe` saves by default, wins; else the GPU `name` names
    ([hardware] gpu), else the entry of the GPU's own name, else the reference's rates; with this machine's RAM
    and cores, and the GPU's memory (within its entry's: nvidia-smi counts what the driver keeps)."""
    import psutil

    if path is None and hardware.PROBE_FILE.is_file():
        path = hardware.PROBE_FILE
    if path:
        probed = HardwareSpec.load(path)
        # of this GPU, the memory torch reported to the probe, as to the run: nvidia-smi counts what the driver keeps
        mem = min(gpu[1], probed.gpu_mem_gb) if probed.gpu == gpu[0] else gpu[1]
        hw = replace(probed, gpu_mem_gb=mem)
        return replace(hw, source=f"{hw.source} (hardware.gpu {name!r} not used)") if name else hw
    entry = named(name) if name else from_smi(gpu[0])
    base = entry.spec() if entry else REFERENCE
    mem = min(gpu[1], base.gpu_mem_gb) if entry else gpu[1]
    ram = psutil.virtual_memory().total / 1e9
    here = f"this machine's {gpu[0]} ({mem:.1f} GB) and {ram:.0f} GB of RAM"
    how = f"hardware.gpu = {name}" if name else "the GPU here"
    return replace(
        base,
        gpu=gpu[0],
        gpu_mem_gb=mem,
        host_ram_gb=ram,
        cpu_count=os.cpu_count() or 1,
        source=f"{entry.source(how)}; with {here}"
        if entry
        else f"reference rates (no probe file: `tiertrain probe` measures this machine), with {here}",
    )
