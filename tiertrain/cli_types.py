"""The CLI's click pieces: its refusals in one line, and flag types checked before a command runs."""

from __future__ import annotations

import re
import sys

import click

from .sections import MOST_GB


class OneLine(click.Group):
    """click's own refusals (a flag's value out of range, an unknown option) as tiertrain's: one line, exit 2."""

    def main(self, args=None, prog_name=None, **extra):
        extra.pop("standalone_mode", None)
        try:
            code = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # a bare `tiertrain` (click 8.2+): its help, as asked
                click.echo(e.format_message(), err=True)
                sys.exit(e.exit_code)
            where = f" (see `{e.ctx.command_path} --help`)" if getattr(e, "ctx", None) else ""
            click.echo(
                f"error: {e.format_message()}{where if isinstance(e, click.UsageError) else ''}", err=True
            )
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


class _Gb(click.ParamType):
    """A number of GB: finite, from 0 to the most any budget takes (click's FloatRange lets nan through)."""

    name = "GB"

    def convert(self, value, param, ctx):
        try:
            gb = float(value)
        except ValueError:
            gb = float("nan")
        if not 0 <= gb <= MOST_GB:  # nan compares false
            raise click.UsageError(f"{param.opts[0]} {value}: pass a number of GB from 0 to {MOST_GB:g}", ctx)
        return gb


GB = _Gb()


class _ShardSize(click.ParamType):
    """A size as transformers spells --max-shard-size (5GB, 500MB, 2GiB), in bytes."""

    name = "SIZE"
    SCALE = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMG]i?B)\s*", value, re.IGNORECASE)
        if not m:
            raise click.UsageError(f"--max-shard-size {value!r}: write a size like 5GB, 500MB or 2GiB", ctx)
        size = int(float(m.group(1)) * self.SCALE[m.group(2).upper()])
        if size < 1:  # a shard holds at least its largest tensor, whatever the size: 0 is a typo
            raise click.UsageError(f"--max-shard-size {value!r}: pass a positive size, like 5GB", ctx)
        return size


SHARD_SIZE = _ShardSize()
