"""The planner's answers kept: `tiertrain plan --format json` over the shipped configs and the budgets of
test_planner.py gives, byte for byte, what tests/data/plans.txt recorded: one plan a line (its arguments, a tab, its
JSON on one line), so that a change reads as a diff. A change meant to alter plans rewrites the record (`python
tests/test_plans_kept.py --write`) and says why in its commit."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import pytest

RECORD = Path(__file__).parent / "data" / "plans.txt"
CONFIGS = [
    "debug",
    "llama-1b",
    "llama-3b",
    "llama-5b",
    "llama-7b",
    "llama3.1-8b",
    "mistral-7b",
    "qwen2.5-7b",
    "qwen3-8b",
    "llama-13b",
    "qwen2.5-32b",
    "llama-70b",
    "llama-120b",
]
BUDGETS = [
    ["--host-gb", "1500", "--gpu-gb", "141", "--nvme-gb", "8000"],
    ["--host-gb", "60", "--gpu-gb", "80", "--nvme-gb", "500"],
    ["--host-gb", "40"],
    ["--host-gb", "115", "--gpu-gb", "141", "--nvme-gb", "55", "--set", 'tiers.gpu_resident_gb="auto"'],
    ["--host-gb", "200", "--gpu-gb", "80"],
]
LONG = ["--config", "llama3.1-8b", "--batch-size", "1", "--set", "model.max_position_embeddings=1048576"]
MORE = [  # the choices a config fixes, the long-context plans of issue 34, several GPUs, other hardware
    [*LONG, "--seq-len", "524288", "--gpu-gb", "80", "--host-gb", "240", "--nvme-gb", "2000"],
    [*LONG, "--seq-len", "1048576", "--gpu-gb", "141", "--host-gb", "240", "--nvme-gb", "2000"],
    [
        *LONG,
        "--seq-len",
        "262144",
        "--gpu-gb",
        "80",
        "--host-gb",
        "120",
        "--nvme-gb",
        "55",
        "--set",
        'tiers.checkpoint_dtype="bfloat16"',
    ],
    [*LONG, "--seq-len", "131072", "--gpu-gb", "80", "--host-gb", "120", "--nvme-gb", "55"],
    ["--config", "llama-3b", "--host-gb", "200", "--gpus", "2"],
    ["--config", "llama-13b", "--host-gb", "400", "--nvme-gb", "1000", "--gpus", "4", "--gpus-per-host", "2"],
    ["--config", "llama-3b", "--host-gb", "200", "--set", "optim.speculate_units=4"],
    ["--config", "llama-3b", "--host-gb", "200", "--set", "optim.grad_clip=0"],
    [
        "--config",
        "llama-3b",
        "--host-gb",
        "200",
        "--set",
        'tiers.activations="host"',
        "--set",
        "train.micro_batch_size=1",
    ],
    [
        "--config",
        "llama-3b",
        "--host-gb",
        "200",
        "--set",
        'tiers.stream="master"',
        "--set",
        "tiers.gpu_update_units=3",
    ],
    ["--config", "llama-3b", "--host-gb", "200", "--set", 'train.compute_dtype="float32"'],
    [
        "--config",
        "llama-7b",
        "--host-gb",
        "60",
        "--nvme-gb",
        "500",
        "--set",
        "tiers.gpu_resident_gb=10",
        "--set",
        "train.keep_activations=2",
    ],
    ["--config", "llama-3b", "--host-gb", "5", "--nvme-gb", "100"],
    ["--config", "llama-3b", "--host-gb", "1000", "--gpu-gb", "2"],
    ["--config", "llama-3b", "--host-gb", "200", "--hardware", "SLOW_HOST"],
    ["--config", "llama-1b", "--hardware", "CPU", "--set", "train.tile_tokens=512"],
    # named GPUs (issue 43): the H100 of the llama-5b run at 8k the plan is checked against, and the 8B
    ["--config", "llama-5b", "--gpu", "h100", "--batch-size", "4", "--host-gb", "100"],
    ["--config", "llama3.1-8b", "--gpu", "h100", "--host-gb", "256"],
    ["--config", "llama-3b", "--gpu", "a100-40gb", "--host-gb", "60", "--nvme-gb", "200"],
]


def cases() -> list[list[str]]:
    return [["--config", c, *b] for c in CONFIGS for b in BUDGETS] + MORE


def answer(args: list[str], tmp: Path) -> str:
    """The JSON `tiertrain plan` prints for `args` (hardware SLOW_HOST and CPU: tests' stand-ins, as files; without
    --hardware or --gpu, the reference)."""
    from click.testing import CliRunner

    from conftest import SLOW_HOST
    from tiertrain.cli import main
    from tiertrain.plan.hardware import HardwareSpec

    files = {
        "SLOW_HOST": SLOW_HOST,
        "CPU": HardwareSpec.cpu(32.0, 2),
    }  # 32 GB: the state and the CPU's working set
    args = [str(tmp / a) if a in files else a for a in args]
    for name, hw in files.items():
        (tmp / name).write_text(json.dumps(dataclasses.asdict(hw)))
    hw = [] if "--hardware" in args or "--gpu" in args else ["--hardware", "reference"]
    r = CliRunner().invoke(main, ["plan", *args, *hw, "--format", "json"])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    return r.output


@pytest.mark.parametrize("args", cases(), ids=lambda a: " ".join(a))
def test_plan_is_as_recorded(args, tmp_path):
    """The case's JSON as recorded; where it differs, the first keys that differ are named."""
    key = " ".join(args)
    want, got = _record()[key], answer(args, tmp_path)
    if got != want:  # the line is the JSON on one line: the output is json.dumps(indent=1) of the same values
        a, b = json.loads(got), json.loads(want)
        diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)][:5]
        pytest.fail(
            f"{diff} differ, e.g. {diff[0]}: {a.get(diff[0])} != {b.get(diff[0])}"
            if diff
            else "the same values, other bytes"
        )


def test_every_case_is_recorded():
    assert sorted(_record()) == sorted(" ".join(a) for a in cases())


def _line(output: str) -> str:
    """A plan's JSON output on one line (its keys in their order); _output turns it back, byte for byte."""
    return json.dumps(json.loads(output), separators=(",", ":"))


def _output(line: str) -> str:
    return json.dumps(json.loads(line), indent=1) + "\n"


@functools.cache
def _record() -> dict[str, str]:
    pairs = (row.split("\t", 1) for row in RECORD.read_text().splitlines())
    return {args: _output(line) for args, line in pairs}


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as d:
        out = {" ".join(a): answer(a, Path(d)) for a in cases()}
    bad = [k for k, v in out.items() if not v.startswith("{")]
    assert not bad, (bad, [out[k][:300] for k in bad])
    assert all(_output(_line(v)) == v for v in out.values())  # the line keeps every byte of the output
    RECORD.write_text("".join(f"{k}\t{_line(v)}\n" for k, v in sorted(out.items())))
    print(f"{len(out)} plans recorded in {RECORD} ({RECORD.stat().st_size:,} bytes)")
