"""Command line: tiertrain run | export | prepare | plan | probe | report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import __version__
from .cli_prepare import prepare as prepare_command
from .cli_types import GB, SHARD_SIZE, OneLine
from .errors import UserError, why


def _fail(err: Exception, ranks=None) -> None:
    """One line, exit 2. Of several ranks: the failing rank's, with its number; an error every rank meets alike
    by rank 0 alone; a rank stopping for another's failure says nothing."""
    from .errors import ElsewhereError, Everywhere

    several = ranks is not None and ranks.size > 1
    if not (several and (isinstance(err, ElsewhereError) or isinstance(err, Everywhere) and not ranks.first)):
        mine = several and not isinstance(err, Everywhere)
        click.echo(f"error: {f'rank {ranks.rank}: ' if mine else ''}{err}", err=True)
    sys.exit(2)


@click.group(cls=OneLine, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tiertrain")
def main() -> None:
    """Full-precision training of models larger than GPU memory, on one GPU or several."""


@main.command()
@click.option(
    "--config",
    "config_path",
    default=None,
    metavar="FILE",
    help="TOML config file, or a shipped name (debug, llama-3b, ...). Default: the debug model; with --init-from "
    "`finetune` (fine-tuning settings, the model's own sizes); with --resume the checkpoint's own config.",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override one config value (a TOML literal); repeatable.",
)
@click.option("--out", default=None, metavar="DIR", help="Run directory. Default: runs/<config>-<time>.")
@click.option(
    "--host-gb",
    type=GB,
    default=None,
    help="Hard budget of the process's whole host memory, its own included (tiers.host_gb).",
)
@click.option(
    "--gpu",
    default=None,
    metavar="NAME",
    help="Plan with a named GPU's published figures when no probe file measured this machine (hardware.gpu; "
    "`tiertrain plan --help` lists them). Default: the figures of the GPU the run finds.",
)
@click.option("--nvme-dir", default=None, metavar="DIR", help="Directory of the NVMe tier (tiers.nvme_dir).")
@click.option("--nvme-gb", type=GB, default=None, help="Most the NVMe tier may use (tiers.nvme_gb).")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Sequences per step (train.batch_size); the micro-batch is then the plan's unless a --set names it.",
)
@click.option(
    "--seq-len", type=click.IntRange(min=1), default=None, help="Tokens per sequence (train.seq_len)."
)
@click.option(
    "--save-every", type=int, default=None, metavar="N", help="Checkpoint every N steps (checkpoint.every)."
)
@click.option(
    "--resume",
    default=None,
    metavar="latest|PATH",
    help="Continue a run: `latest` (the newest checkpoint of --out), a checkpoint or a run directory.",
)
@click.option(
    "--init-from",
    default=None,
    metavar="HF_DIR",
    help="Start from a local Hugging Face model (config.json + safetensors) instead of a random init.",
)
@click.option(
    "--hardware",
    default=None,
    metavar="FILE",
    help="JSON from `tiertrain probe` for the plan. Default: probe's default file if present, else the "
    "published figures of the GPU found (or of --gpu NAME).",
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Train on N GPUs of this host, one rank each: the job `torchrun --nproc-per-node N -m tiertrain "
    "run` runs. --host-gb and --nvme-gb are the host's.",
)
def run(
    config_path: str | None,
    overrides: tuple[str, ...],
    out: str | None,
    host_gb: float | None,
    nvme_dir: str | None,
    nvme_gb: float | None,
    batch_size: int | None,
    seq_len: int | None,
    save_every: int | None,
    resume: str | None,
    init_from: str | None,
    hardware: str | None,
    gpus: int | None,
    gpu: str | None,
) -> None:
    """Train a model."""
    import os

    paths = {"--out": out, "--init-from": init_from, "--resume": resume, "--nvme-dir": nvme_dir}
    for flag, v in {**paths, "--config": config_path, "--hardware": hardware}.items():
        if v is not None and not v.strip():  # an unset shell variable: not "not given"
            _fail(UserError(f"{flag} is empty; pass a path, or leave {flag} out"))
    here = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE"))
    if gpus and here is not None and str(gpus) != here:  # torchrun's ranks, or a WORLD_SIZE left in the shell
        _fail(
            UserError(
                f"--gpus {gpus}: this process is one rank of a job that already has {here} on this host "
                "(WORLD_SIZE is set); unset WORLD_SIZE to launch the ranks, or leave --gpus out under torchrun"
            )
        )
    if gpus and gpus > 1 and "WORLD_SIZE" not in os.environ:
        import torch

        from .launch import launch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if 0 < have < gpus and not os.environ.get("TIERTRAIN_DIST_BACKEND"):  # NCCL takes one GPU per rank
            _fail(
                UserError(
                    f"--gpus {gpus}: this host has {have} GPU{'s' * (have > 1)}; pass --gpus {have} or "
                    "fewer, or torchrun across hosts"
                )
            )
        sys.exit(launch(gpus, _without_gpus(sys.argv[1:])))
    from .parallel import Ranks

    try:
        ranks = Ranks.from_env()
    except UserError as e:  # a WORLD_SIZE without the rest of a job
        _fail(e)
    except Exception as e:  # noqa: BLE001 - torch's own rendezvous errors (a port taken since it was picked)
        if os.environ.get("WORLD_SIZE", "1") == "1" or "DistNetworkError" not in type(e).__name__:
            raise
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        _fail(UserError(f"the ranks cannot meet at {where} ({str(e).splitlines()[0][:120]}); run it again"))
    from .start import start

    flags = {
        "tiers.host_gb": host_gb,
        "tiers.nvme_dir": nvme_dir,
        "tiers.nvme_gb": nvme_gb,
        "train.batch_size": batch_size,
        "train.seq_len": seq_len,
        "checkpoint.every": save_every,
        "train.init_from": init_from,
        "hardware.gpu": gpu,
    }
    # --batch-size as `plan` takes it (its nearest plans name it): the config's micro-batch may not divide it
    auto = ('train.micro_batch_size="auto"',) if batch_size is not None else ()
    overrides = auto + overrides + tuple(f"{k}={json.dumps(v)}" for k, v in flags.items() if v is not None)
    if (
        init_from and not config_path and not resume
    ):  # the model's own [model], a fine-tune's [train] and [optim]
        config_path = "finetune"
    try:
        start(config_path, overrides, out, resume, init_from, hardware, ranks, click.echo)
    except UserError as e:
        _fail(e, ranks)
    except OSError as e:  # a disk failed while the run was set up (EIO; the training loop says its own)
        from .loop import disk_failed

        _fail(UserError(disk_failed(e)), ranks)
    except Exception as e:  # noqa: BLE001 - re-raised unless a peer's exit broke a collective
        if ranks.size > 1 and _peer_gone(e):
            sys.exit(2)  # the rank that failed says why
        raise
    finally:
        ranks.close()


def _peer_gone(e: Exception) -> bool:
    """A collective failed because another rank's process is gone (it failed, and says so itself)."""
    import torch.distributed as dist

    return isinstance(e, getattr(dist, "DistError", ())) or any(
        w in str(e) for w in ("by peer", "remote worker")
    )


def _without_gpus(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--gpus":
            skip = True
        elif not a.startswith("--gpus="):
            out.append(a)
    return out


@main.command()
@click.argument("source", metavar="RUN_DIR|CHECKPOINT")
@click.option(
    "--to", "to", required=True, metavar="OUT_DIR", help="New directory for the Hugging Face model."
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default="float32",
    show_default=True,
    help="Dtype of the exported weights (the master weights are fp32).",
)
@click.option(
    "--max-shard-size",
    type=SHARD_SIZE,
    default="5GB",
    show_default=True,
    metavar="SIZE",
    help="Largest safetensors file, as transformers spells it: 5GB, 500MB, 2GiB.",
)
def export(source: str, to: str, dtype: str, max_shard_size: int) -> None:
    """Write a checkpoint as a Hugging Face model (config.json + safetensors, and the tokenizer and
    generation config of an --init-from model) that transformers loads."""
    from .export import export_hf
    from .signals import TermInterrupts

    try:
        with TermInterrupts():  # the export's temporary directory goes, as for Ctrl-C
            files = export_hf(source, to, dtype, max_shard_size)
    except UserError as e:
        _fail(e)
    except OSError as e:  # the --to path's disk: full, read-only, or a file where a directory goes
        _fail(
            UserError(f"cannot write --to {to}: {why(e)}; pass a new directory on a writable disk with room")
        )
    click.echo(f"wrote {to}: config.json and {len(files)} safetensors file(s) in {dtype}")


main.add_command(prepare_command)


@main.command()
@click.option(
    "--config", "config_path", required=True, metavar="FILE", help="TOML config, or a shipped name."
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="Override a config value, as `run --set` does (repeatable).",
)
@click.option(
    "--host-gb",
    type=GB,
    default=None,
    help="The process's whole host memory, its own (Python, torch, the CUDA context: about 3 GB) included. "
    "Default: tiers.host_gb, else the RAM of the machine planned for.",
)
@click.option("--gpu-gb", type=GB, default=None, help="GPU memory budget. Default: the GPU's memory.")
@click.option(
    "--nvme-gb",
    type=GB,
    default=None,
    help="NVMe tier size. Default (or 0): tiers.nvme_gb, else --nvme-dir's free space.",
)
@click.option(
    "--nvme-dir",
    default=None,
    metavar="DIR",
    help="NVMe directory (default: tiers.nvme_dir): its free space is the NVMe budget where none is given.",
)
@click.option(
    "--gpu",
    default=None,
    metavar="NAME",
    help="Plan for a named GPU (h100, h100-pcie, h200, gh200, a100-80gb, a100-40gb, l40s, rtx4090, rtx5090, "
    "b200, mi300x, ...: docs/gpus.md) on the reference machine's host: its published figures, scaled as the "
    "reference's measured rates. Default: [hardware] gpu, else this machine (see --hardware).",
)
@click.option(
    "--hardware",
    default=None,
    metavar="FILE",
    help="JSON from `tiertrain probe`, or `reference` (the H200 machine). Default: on a machine with a GPU, "
    "what `run` plans with (probe's file if there is one, else the figures of the GPU nvidia-smi names, with "
    "this machine's RAM); without a GPU, the reference.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="Sequences per step (train.batch_size); the micro-batch is then the plan's unless a --set names it.",
)
@click.option(
    "--seq-len", type=click.IntRange(min=1), default=None, help="Tokens per sequence (train.seq_len)."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["md", "json"]),
    default="md",
    show_default=True,
    help="The report as Markdown, or as JSON (plan.json's keys).",
)
@click.option(
    "--chart",
    default=None,
    metavar="FILE.png",
    help="Also draw the time split and memory per tier; of a plan that does not fit, each budget's demand.",
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="GPUs (ranks) of the run; the report then says the scaling against one and what bounds it.",
)
@click.option(
    "--gpus-per-host",
    type=click.IntRange(min=1),
    default=None,
    help="Of them, on each host (sharing its RAM, cores and disk; the budgets are a host's). Default: all.",
)
def plan(
    config_path,
    overrides,
    host_gb,
    gpu_gb,
    nvme_gb,
    nvme_dir,
    gpu,
    hardware,
    batch_size,
    seq_len,
    fmt,
    chart,
    gpus,
    gpus_per_host,
) -> None:
    """Capacity plan: what fits, where every slab lives, how fast, what limits it; where it does not fit, by how
    much and the nearest plans that do. Needs no torch."""
    from .plan.report import to_json, to_markdown
    from .plancmd import PlanCommand, plan_command

    cmd = PlanCommand(
        config_path,
        overrides,
        host_gb,
        gpu_gb,
        nvme_gb,
        nvme_dir,
        hardware,
        gpu,
        batch_size,
        seq_len,
        gpus,
        gpus_per_host,
    )
    try:
        p, one = plan_command(cmd, chart)
        if chart:
            from .charts import plan_chart

            plan_chart(p, chart)
    except UserError as e:
        _fail(e)
    if fmt == "json":  # the chart's path in the JSON: stdout stays one JSON document
        click.echo(to_json(p, one, chart))
    else:
        click.echo(to_markdown(p, one) + (f"\nchart: {chart}" if chart else ""))
    if not p.fits:
        sys.exit(1)


@main.command()
@click.argument("run_dir", metavar="RUN_DIR")
@click.option("--out", default=None, metavar="FILE.png", help="Where to draw. Default: RUN_DIR/report.png")
def report(run_dir: str, out: str | None) -> None:
    """Summarize a run from its metrics.jsonl, and plot loss, tokens/s and the measured time split."""
    from .metrics import read_metrics, run_summary

    path = Path(run_dir) / "metrics.jsonl"
    try:
        from .charts import check_target

        target = check_target("--out", out) if out else Path(run_dir) / "report.png"
        if not path.is_file():
            raise UserError(f"{run_dir} holds no metrics.jsonl; pass the --out directory of a run")
        try:
            records = read_metrics(path)
        except ValueError as e:
            raise UserError(f"{path}: {e}; was it edited?") from None
        for line in run_summary(records):
            click.echo(line)
        if records:
            from .charts import run_chart

            run_chart(records, target, f"{Path(run_dir).resolve().name}")
            click.echo(f"chart: {target}")
    except UserError as e:
        _fail(e)


@main.command()
@click.option(
    "--out", default=None, metavar="FILE", help="Where to save. Default: ~/.cache/tiertrain/hardware.json"
)
@click.option(
    "--nvme-dir",
    default=None,
    metavar="DIR",
    help="Measure the disk here (direct I/O, the runtime's backend).",
)
def probe(out: str | None, nvme_dir: str | None) -> None:
    """Measure this machine for the planner, with the runtime's own code paths."""
    import os

    from .probe import probe_spec

    target = Path(out) if out else Path.home() / ".cache" / "tiertrain" / "hardware.json"
    try:
        if nvme_dir and not (Path(nvme_dir).is_dir() and os.access(nvme_dir, os.W_OK)):
            raise UserError(
                f"--nvme-dir {nvme_dir} is not a writable directory; create it, or pass the "
                "directory the NVMe tier will use"
            )
        spec, notes = probe_spec(nvme_dir)
    except UserError as e:
        _fail(e)
    spec.save(target)
    for n in notes:
        click.echo(n)
    click.echo(f"saved {target}")
