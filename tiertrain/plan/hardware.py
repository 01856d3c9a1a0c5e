"""HardwareSpec: the machine figures the planner reasons with, as JSON. Pure Python (no torch).

`tiertrain probe` measures them with the runtime's own code paths; without a probe file the planner
uses REFERENCE, measured on the H200 machines of bench/results/2026-11-22-H200-llama3b-pieces-*, and
says so.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ..errors import ConfigError
from ..modes import ATTENTION_KERNELS

# the process on a CPU: Python, torch, the host AdamW kernel and the NVMe tier's libraries loaded, beside the
# plan's bytes (the device's buffers and activations counted with them): the debug model's run peaks at 0.43 GB
# of RSS with 17 MiB of state and buffers, so about 0.4 GB, with a margin (test_nvme.py's
# test_peak_rss_stays_under_the_budget bounds a run by it)
CPU_PROCESS_GB = 0.5
# torch's fused kernel into copies: a copy, then the kernel in place; its rate / the rate in place (2.05-2.23
# / 3.83-4.26 G params/s on the H200 host, bench/results/2026-11-22-H200-host-adam-out-of-place.md) and the
# copy's 12 B per parameter of DRAM traffic
# the figures a hardware file may give as 0 (none, or not measured: ck_write_gbs then the disk's write rate)
MAY_BE_ZERO = ("out_of_place_dram_bytes", "ck_write_gbs", "process_gb")
TORCH_COPIES = {"out_of_place": 0.5, "out_of_place_dram_bytes": 12.0}


@dataclass
class HardwareSpec:
    gpu: str = "NVIDIA H200"
    gpu_mem_gb: float = 150.1
    host_ram_gb: float = 128.0
    cpu_count: int = 16
    h2d_gbs: float = 55.5  # pinned host -> GPU
    d2h_gbs: float = 55.4
    bidir_gbs: float = 101.3  # both directions at once, summed
    bf16_tflops: float = 776.0  # large bf16 matmul
    fp32_tflops: float = 51.1
    # the runtime's host AdamW (the one-pass kernel), medians of the probes of ten benchmark runs
    # (bench/results/2026-11-22-H200-llama3b-{pieces,final,copy-stores}-*.json)
    host_adam_params_per_s: float = 5.3e9  # fp32 master streamed (no bf16 rounding)
    host_adam_copy_params_per_s: float = 4.7e9  # with the rounding into a host bf16 copy
    # through the runtime's I/O backend (kvikio compatibility mode), 4 GiB direct I/O, best of 8-32 threads
    # (bench/results/2026-11-22-H200-nvme-disk.md)
    disk_read_gbs: float = 2.1
    disk_write_gbs: float = 2.5
    disk_mixed_gbs: float = 2.4  # reads and writes at once, summed; 0: unknown (one direction at a time)
    # the host AdamW into a speculative update's copies: its rate / the rate in place, and the DRAM bytes
    # per parameter it moves beyond an update in place; of the one-pass kernel (its stores streamed: none),
    # the same probes' median (0.90-1.13); with torch's kernel TORCH_COPIES
    out_of_place: float = 0.98
    out_of_place_dram_bytes: float = 0.0
    # Fitted: training's matmuls (a block's own work beside them: norms, rope, SwiGLU, casts) run at this fraction
    # of the probed bf16 rate, and causal attention at attention_efficiency of its kernel's (below): both fitted
    # together on the forward and backward GPU seconds of ten runs (llama-3b to llama3.1-8b, 2k to 512k tokens, on
    # the H100 and the H200: `python dev/compute_fit.py`, docs/performance.md), each pass then within 0.93-1.09x
    # (the older llama-3b at 32k on the H200, 0.82x). 0.50 before, fitted on whole steps, overpriced the compute of
    # every run at 2k-8k tokens by 12-20% (llama-5b at 8k on the H100: 15.2 s planned for 13.4 measured). The host
    # AdamW in a step runs this much slower than alone: 1, since the speculated updates fall between the units of
    # the next forward pass (the updates after the norm ran at 1.0-1.3x the probe's rate, and a step's host AdamW
    # at 0.98-1.0x it in all; 1.18 before, which made the plan take GPU updates at 8k that ran 11-16% slower than
    # the host's: bench/results/2026-11-23-H200-llama3b-gpu-updates-8k.md). The host DRAM term still prices its
    # sharing of DRAM with the PCIe copies. 0.57 was the fit; 0.70 since the dense block's kernels of 2026-11-26
    # (RoPE, RMSNorm, the residual adds), which cut a block's time outside attention 1.26x at 8k and 1.19x at 131k
    # (per token: the same scale at every length); llama-5b at 8k alone asks 0.72
    # (bench/results/2026-11-26-dense-kernels.md). Attention's kernels did not change: attention_efficiency stays.
    # Five H100 runs of that code, 8k-262k (`python dev/compute_fit.py --kernels`), ask 0.72 and 0.86; at 0.70 and
    # 0.82 each pass is within 0.98-1.09x and each step's plan within 5% (docs/performance.md).
    compute_efficiency: float = 0.70
    adam_contention: float = 1.0
    # a mixture of experts' routed matmuls (sorted rows, grouped GEMMs, the fused activation and slot sums) run
    # at these fractions of the rest's rate, forward and backward: fitted with compute_efficiency on the two
    # Qwen3-30B-A3B cuts trained on an H100 with cuDNN's attention (`python dev/compute_fit.py`: 6 blocks at
    # 8 x 8k tokens, 18 at 4 x 8k; their passes then at 1.09x / 0.88x and 0.91x / 1.08x of the measured: two runs
    # that disagree on the backward pass, bench/results/2026-11-25-issue40-experts.md). The backward's figure is
    # below dev/moe_gemm.py's (the experts' backward with its fp32 accumulation there runs at 0.35 of a dense
    # MLP's rate at 8k tokens): a whole block's backward pass costs more around the experts than the
    # microbenchmark holds, and this prices what the runs measured. (0.52, 0.17) as fitted; scaled by 0.57 / 0.70
    # with compute_efficiency's rise, since they are relative to it and the experts' kernels did not change there
    experts_speed: tuple[float, float] = (0.42, 0.14)
    # causal attention's kernels (model/attention.py), as `tiertrain probe` measures them: {kernel: [forward,
    # backward, deterministic backward]} TFLOP/s at head size 128 (32 query and 8 key/value heads, 16,384 tokens,
    # bf16) in the model's FLOPs (spec.attention_flops_per_token: the backward counted as twice the forward); 0: no
    # such pass (torch's cuDNN backward is never deterministic). Without a probe: issue 42's H100 figures (torch
    # 2.11, cuDNN 9.19; the H200 has the same SMs), flash's deterministic backward taken at 0.9x its own
    attention_tflops: dict = field(
        default_factory=lambda: {"cudnn": [630.0, 540.0, 0.0], "flash": [340.0, 280.0, 252.0]}
    )
    # the kernels' rates at other head sizes, relative to 128 (the nearest is taken): 64 from the llama-1b run at 1M
    # (0.89 / 1.24 of the fit below, bench/results/2026-11-25-issue34-long-8b.md)
    attention_head_scale: dict = field(default_factory=lambda: {"64": 0.72, "128": 1.0})
    # a step's attention reaches this fraction of the kernels' rates above (a block calls it a head group at a
    # time, beside the copies of its q, k, v and output): fitted with compute_efficiency (above); the long runs
    # (llama3.1-8b at 128k and 256k on an H100, llama-7b at 256k, llama-3b at 512k on an H200) alone needed
    # 0.82-0.88 on the cuDNN rates above. On flash's rates they would need 1.4-1.5: those runs ran cuDNN, torch
    # 2.11's own choice on Hopper (docs/performance.md)
    attention_efficiency: float = 0.82
    # the GPU's streaming multiprocessors: flash's deterministic backward keeps a dQ buffer per SM (plan.workset)
    gpu_sms: int = 132
    # the NVMe checkpoints' writer (engine/activations.py): its rate with `ck_pieces` pieces (tiers.placement
    # CK_PIECE_BYTES) in flight, the fewest that reach the disk's rate (`tiertrain probe --nvme-dir`; 0: unknown,
    # the disk's write rate); the plan sizes the checkpoints' ring by it
    ck_write_gbs: float = 0.0
    ck_pieces: int = 8
    # What the host's DRAM serves while the next forward pass runs: the PCIe copies (DMA) and the host
    # AdamW together; the same refit (not probed: bench.dram measures what the steps reached, 125-148).
    host_dram_gbs: float = 135.0
    # copies both ways at once in the forward pass (weights and GPU updates' state in, state and
    # checkpoints out, interleaved with compute) reach this fraction of bidir_gbs; same fit
    copy_efficiency: float = 0.75
    # GPU updates speculated in the backward pass: their state's copies (12 B per parameter each way) share
    # PCIe with the weights the compute waits for; that pass then reaches this fraction of the copies'
    # rate above. Fitted on the two runs of that plan with the kernel in pieces: 0.785 and 0.81 (backward
    # 0.726 s against 0.570 s predicted in bench/results/2026-11-23-H200-llama3b-front-ab.md, 0.703 in
    # ...-gpu-updates-8k.md); the 16k runs of ...-gpu-spec-ab16k.md (no probe) fell short of the plan by more
    spec_copy_efficiency: float = 0.80
    # the device computes in the host's memory with the host's cores (a CPU): keeping state or checkpoints
    # on it, updating on it, or overlapping updates with compute gains nothing, so the plan does none of them
    unified: bool = False
    # Several GPUs: each GPU's rate of all-gathers and reduce-scatters (NCCL bus bandwidth) with the other GPUs
    # of its host (NVLink), and with GPUs of other hosts (the network, per GPU). Not probed: datasheet-level
    # figures for H100/H200 NVLink 4 (450 GB/s a direction, NCCL reaches about two thirds) and 200 Gb/s links
    peer_gbs: float = 300.0
    network_gbs: float = 25.0
    # host memory of the process itself, beside what the plan places (Python, torch, the CUDA context, allocator
    # slack): part of --host-gb. On a GPU, runs under --host-gb 100 and 110 peaked at 101 and 113 GB of RSS with
    # the budget all the state's (bench/results/2026-11-24-issue24-beyond-gpu.md); HardwareSpec.cpu: a CPU's
    process_gb: float = 3.0
    source: str = "reference: H200 machines, 2026-11-22 (bench/results/2026-11-22-H200-llama3b-pieces-*.json)"

    @classmethod
    def cpu(cls, ram_gb: float, cores: int) -> "HardwareSpec":
        """A CPU as the device: its memory is the host's (no budget of its own: the run checks its working set
        with the state against the RAM). Rough figures, not probed: on a CPU the plan settles the choices, and
        its times are not predictions."""
        return cls(
            gpu="cpu",
            gpu_mem_gb=1e6,
            host_ram_gb=ram_gb,
            cpu_count=cores,
            h2d_gbs=10.0,
            d2h_gbs=10.0,
            bidir_gbs=10.0,
            bf16_tflops=0.05,
            fp32_tflops=0.1,
            host_adam_params_per_s=0.5e9,
            host_adam_copy_params_per_s=0.5e9,
            compute_efficiency=1.0,
            unified=True,
            attention_tflops={},
            process_gb=CPU_PROCESS_GB,
            source="this CPU (rough figures: on a CPU the plan's times are not predictions)",
        )

    def per_rank(self, per_host: int) -> "HardwareSpec":
        """What one of `per_host` ranks of a host has of it: a share of its RAM, cores, DRAM bandwidth and disk
        (each GPU keeps its own PCIe link)."""
        if per_host <= 1:
            return self
        n = per_host
        return replace(
            self,
            host_ram_gb=self.host_ram_gb / n,
            cpu_count=max(1, self.cpu_count // n),
            host_adam_params_per_s=self.host_adam_params_per_s / n,
            host_adam_copy_params_per_s=self.host_adam_copy_params_per_s / n,
            host_dram_gbs=self.host_dram_gbs / n,
            disk_read_gbs=self.disk_read_gbs / n,
            disk_write_gbs=self.disk_write_gbs / n,
            disk_mixed_gbs=self.disk_mixed_gbs / n,
        )

    @classmethod
    def load(cls, path: str | Path) -> "HardwareSpec":
        """A hardware file's figures. Of a probe's file (its source "tiertrain probe, ..."), the measured ones: the
        fitted ones it holds (FITTED) were the code's when it probed, so a probe made before a refit plans with the
        refit (a probe of 2026-11-25 holds compute_efficiency 0.50). A file made otherwise keeps every figure."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(
                f"hardware file {p} not found; make one with `tiertrain probe --out {p}`"
            ) from None
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"hardware file {p} is not valid JSON ({e}); re-run `tiertrain probe`"
            ) from None
        except (OSError, UnicodeDecodeError) as e:  # a directory, unreadable, not text
            raise ConfigError(
                f"hardware file {p} cannot be read ({getattr(e, 'strerror', None) or e}); pass a probe's file, "
                f"made by `tiertrain probe --out FILE`"
            ) from None
        fix = f"write one with `tiertrain probe --out {p}`"
        if not isinstance(data, dict):
            raise ConfigError(
                f"hardware file {p} holds a JSON {type(data).__name__}, not a probe's figures; {fix}"
            )
        missing = [k for k in MEASURED if k not in data]
        if missing:
            raise ConfigError(
                f"hardware file {p} is not a probe file (it has no {', '.join(missing)}); {fix}"
            )
        known = {f.name: f for f in fields(cls)}
        bad = [
            k
            for k, v in data.items()
            if k in known
            and isinstance(getattr(REFERENCE, k), (int, float))
            and not isinstance(getattr(REFERENCE, k), bool)
            and (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
                or (v == 0 and k not in MAY_BE_ZERO)  # a rate or a share the plan divides by
            )
        ]
        if bad:
            raise ConfigError(
                f"hardware file {p}: {', '.join(f'{k} = {data[k]!r}' for k in bad)} must be a finite "
                f"number, more than 0 (0 or more for {', '.join(MAY_BE_ZERO)}); {fix}"
            )
        wrong = _bad_tables(data)
        if wrong:
            raise ConfigError(f"hardware file {p}: {wrong}; {fix}")
        pairs = [k for k in data if k in known and isinstance(getattr(REFERENCE, k), tuple)]
        bad = [
            k
            for k in pairs
            if not (isinstance(data[k], list) and len(data[k]) == 2 and all(map(_number, data[k])))
        ]
        if bad:
            raise ConfigError(
                f"hardware file {p}: {', '.join(f'{k} = {data[k]!r}' for k in bad)} must be two "
                f"finite numbers, 0 or more; {fix}"
            )
        if str(data.get("source", "")).startswith(PROBE_SOURCE):
            known = {k: f for k, f in known.items() if k not in FITTED}
        # JSON has no tuples: a pair comes back as the tuple the dataclass holds, so a saved spec loads equal
        spec = cls(**{k: tuple(v) if k in pairs else v for k, v in data.items() if k in known})
        if "source" not in data:
            spec.source = f"probe file {p}"
        return spec

    def disk_note(self) -> str:
        """A run's line where its plan prices this machine's disk at the reference machine's rates (no probe
        measured it): how to measure it; "" where one did. A plan that spills was off by as much as the disks
        differ (the 18-block Qwen3-30B-A3B cut on an H100: 1.21-1.37x the plan's step, 0.86-0.96x on its probe)."""
        disk = ("disk_read_gbs", "disk_write_gbs", "disk_mixed_gbs")
        if any(getattr(self, k) != getattr(REFERENCE, k) for k in disk):
            return ""
        return (
            f"note: the plan prices the disk at the reference machine's {self.disk_read_gbs:g} GB/s read and "
            f"{self.disk_write_gbs:g} GB/s write; `tiertrain probe --nvme-dir DIR` measures this one"
        )

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _bad_tables(data: dict) -> str:
    """What is wrong with a probe file's attention tables and checkpoint writer's figures ("": nothing)."""
    rates, scale = data.get("attention_tflops", {}), data.get("attention_head_scale", {"128": 1.0})
    if not isinstance(rates, dict) or not all(
        k in ATTENTION_KERNELS and isinstance(v, list) and len(v) in (2, 3) and all(map(_number, v))
        for k, v in rates.items()
    ):
        return (
            f"attention_tflops = {json.dumps(rates)} must map kernels ({', '.join(ATTENTION_KERNELS)}) to "
            "[forward, backward, deterministic backward] TFLOP/s"
        )
    if (
        not isinstance(scale, dict)
        or not scale
        or not all(k.isdigit() and _number(v) for k, v in scale.items())
    ):
        return f"attention_head_scale = {json.dumps(scale)} must map head sizes to rates relative to 128"
    if not (isinstance(data.get("ck_pieces", 1), int) and data.get("ck_pieces", 1) >= 1):
        return f"ck_pieces = {data['ck_pieces']!r} must be a whole number of pieces, 1 or more"
    return ""


REFERENCE = HardwareSpec()
# what every probe file holds: the machine's figures `tiertrain probe` measures (a file without them is not one)
MEASURED = ("gpu", "gpu_mem_gb", "h2d_gbs", "d2h_gbs", "bf16_tflops", "host_adam_params_per_s")
# the figures fitted on the project's runs (the comments above say on which), not measured by a probe: a probe's
# file does not override them (HardwareSpec.load)
FITTED = (
    "compute_efficiency",
    "attention_efficiency",
    "adam_contention",
    "experts_speed",
    "host_dram_gbs",
    "copy_efficiency",
    "spec_copy_efficiency",
)
PROBE_SOURCE = "tiertrain probe"  # how a probe's file names its figures' source (then ", DATE")
PROBE_FILE = Path.home() / ".cache" / "tiertrain" / "hardware.json"  # written by `tiertrain probe`


def local_gpu() -> tuple[str, float] | None:
    """(name, GB of memory) of this machine's first GPU, from nvidia-smi (no torch); None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        name, mib = out.splitlines()[0].rsplit(",", 1)
        return name.strip(), float(mib) * 2**20 / 1e9
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):  # a driver that does not answer
        return None
