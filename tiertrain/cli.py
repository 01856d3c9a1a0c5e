"""Command line: tiertrain run | prepare."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from . import __version__
from .errors import UserError


def _fail(err: Exception) -> None:
    click.echo(f"error: {err}", err=True)
    sys.exit(2)


@click.group()
@click.version_option(__version__, prog_name="tiertrain")
def main() -> None:
    """Full-precision training of models larger than GPU memory on one GPU."""


@main.command()
@click.option("--config", "config_path", default=None, metavar="FILE",
              help="TOML config file, or a shipped name (debug, llama-3b, ...). Default: the debug model.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one config value (a TOML literal); repeatable.")
@click.option("--out", default=None, metavar="DIR", help="Run directory. Default: runs/<config>-<time>.")
@click.option("--host-gb", type=float, default=None, help="Hard budget of host memory (tiers.host_gb).")
@click.option("--nvme-dir", default=None, metavar="DIR", help="Directory of the NVMe tier (tiers.nvme_dir).")
@click.option("--nvme-gb", type=float, default=None, help="Most the NVMe tier may use (tiers.nvme_gb).")
def run(config_path: str | None, overrides: tuple[str, ...], out: str | None, host_gb: float | None,
        nvme_dir: str | None, nvme_gb: float | None) -> None:
    """Train a model."""
    import json

    from .config import load_config
    from .trainer import Trainer

    flags = {"host_gb": host_gb, "nvme_dir": nvme_dir, "nvme_gb": nvme_gb}
    overrides += tuple(f"tiers.{k}={json.dumps(v)}" for k, v in flags.items() if v is not None)
    try:
        cfg = load_config(config_path, list(overrides))
        stem = Path(config_path).stem if config_path else "debug"
        out_dir = Path(out) if out else Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        if (out_dir / "metrics.jsonl").exists():
            raise UserError(f"--out {out_dir} already holds a run (metrics.jsonl); pass a new --out directory")
        if out_dir.exists() and not out_dir.is_dir():
            raise UserError(f"--out {out_dir} is a file; pass a directory")
        Trainer(cfg, run_name=out_dir.name).fit(out_dir, echo=click.echo)
    except UserError as e:
        _fail(e)


@main.command()
@click.argument("inputs", nargs=-1, required=True, metavar="TEXT_FILE...")
@click.option("--out", required=True, metavar="FILE.bin", help="Token file to write.")
@click.option("--tokenizer", default=None, metavar="TOKENIZER_JSON",
              help="A local Hugging Face tokenizer.json. Default: byte-level (ids 0-255, 256 ends a file).")
def prepare(inputs: tuple[str, ...], out: str, tokenizer: str | None) -> None:
    """Tokenize text files into a token file for data.path."""
    from .data import prepare as do_prepare

    try:
        if not out.endswith(".bin"):
            raise UserError(f"--out {out}: token files written by prepare end in .bin")
        count, vocab = do_prepare(list(inputs), out, tokenizer)
    except UserError as e:
        _fail(e)
    click.echo(f"wrote {count:,} tokens (vocabulary {vocab:,}) to {out}; train on it with --set data.path=\"{out}\"")
