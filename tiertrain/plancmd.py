"""What `tiertrain plan` does: its flags checked and turned into the config, budgets and machine figures a plan is
made with (as `run` plans), the plan, and for a miss the nearest plans that fit, each planned as the same command
with its arguments added. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .errors import UserError


@dataclass(frozen=True)
class PlanCommand:
    """The flags of one `tiertrain plan` command (None: not given)."""

    config_path: str
    overrides: tuple[str, ...] = ()
    host_gb: float | None = None
    gpu_gb: float | None = None
    nvme_gb: float | None = None
    nvme_dir: str | None = None
    hardware: str | None = None
    gpu: str | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    gpus: int = 1
    per_host: int | None = None

    @property
    def name(self) -> str:
        return Path(self.config_path).name.removesuffix(".toml")

    def added(self, args: list[str]) -> PlanCommand:
        """The same command with `args` added after its own, as click reads them: a flag given again takes the
        last value, `--set` adds to the others (a later one wins)."""
        changes, sets = {}, list(self.overrides)
        flags = {
            "--batch-size": ("batch_size", int),
            "--seq-len": ("seq_len", int),
            "--nvme-gb": ("nvme_gb", float),
        }
        for flag, value in zip(args[::2], args[1::2]):
            if flag == "--set":
                sets.append(value)
            else:
                key, kind = flags[flag]
                changes[key] = kind(value)
        return replace(self, overrides=tuple(sets), **changes)

    def config(self):
        """The config of the command: its file, its --set values, then --batch-size and --seq-len (which win over a
        --set of the same key); --batch-size leaves the micro-batch to the plan unless a --set fixes it."""
        from .config import load_config

        b, s = self.batch_size, self.seq_len
        sets = [
            *['train.micro_batch_size="auto"'] * bool(b),  # the config's may not divide the batch
            *self.overrides,
            *[f"train.batch_size={b}"] * bool(b),
            *[f"train.seq_len={s}"] * bool(s),
        ]
        cfg = load_config(self.config_path, sets)
        if cfg.train.init_from:  # the model it imports, as `run` plans it (its config.json replaces [model])
            from .model.hf import spec_from_hf

            cfg = cfg.imported(spec_from_hf(cfg.train.init_from, cfg.train.seq_len))
        if cfg.train.batch_size % self.gpus:
            raise UserError(
                f"train.batch_size {cfg.train.batch_size} does not split over {self.gpus} GPUs: pass a "
                f"--batch-size that is a multiple of {self.gpus}"
            )
        micro, rows = cfg.train.micro_batch_size, cfg.train.batch_size // self.gpus
        if isinstance(micro, int) and rows % micro:  # as `run --gpus` refuses it (parallel.check_batch)
            raise UserError(
                f"train.micro_batch_size {micro} does not divide a rank's {rows} rows of the batch: make it a "
                f'divisor of {rows}, or "auto"'
            )
        return cfg

    def host(self, cfg) -> float | None:
        """The host budget: --host-gb, else the config's tiers.host_gb (as `run` takes it), else none given."""
        return self.host_gb if self.host_gb is not None else cfg.tiers.host_gb or None

    def nvme(self, cfg) -> float | None:
        """The NVMe budget, as `run` takes it: --nvme-gb, else the config's tiers.nvme_gb, else (either of them 0
        too, as tiers.nvme_gb = 0 means) the free space of --nvme-dir (else of tiers.nvme_dir), else none."""
        from .plan.resolve import free_gb

        gb = self.nvme_gb or cfg.tiers.nvme_gb or None
        where = self.nvme_dir or cfg.tiers.nvme_dir
        return free_gb(where) if where and gb is None else gb

    def figures(self, cfg):
        """The machine's figures: a probe file (--hardware FILE), the reference (--hardware reference), a named GPU
        (--gpu) on the reference machine's host, or by default this machine as `run` plans for it (the probe's
        default file, else the config's [hardware] gpu, else the entry of the GPU nvidia-smi names, else the
        reference); without a GPU here, the config's [hardware] gpu as --gpu. A named GPU's plan reads nothing of
        this machine: the same on every machine."""
        from dataclasses import replace

        from .plan.gpus import gpu_spec, this_machine
        from .plan.hardware import REFERENCE, HardwareSpec, local_gpu

        if self.hardware and self.gpu:
            raise UserError(
                f"--gpu {self.gpu} and --hardware {self.hardware}: pass one (--hardware: a probe's measured "
                "figures or the reference machine; --gpu: a named GPU's published ones)"
            )
        named = cfg.hardware.gpu
        if self.hardware:
            hw = REFERENCE if self.hardware == "reference" else HardwareSpec.load(self.hardware)
            return replace(hw, source=f"{hw.source} (hardware.gpu {named!r} not used)") if named else hw
        if self.gpu:
            return gpu_spec(self.gpu, f"--gpu {self.gpu}")
        here = local_gpu()
        if here:
            return this_machine(here, name=named)
        return gpu_spec(named, f"hardware.gpu = {named}") if named else REFERENCE

    def check(self, chart: str | None) -> None:
        if self.per_host is not None and self.per_host > self.gpus:
            raise UserError(
                f"--gpus-per-host {self.per_host} is more than the job's --gpus {self.gpus}: pass at most "
                f"{self.gpus}"
            )
        if chart:
            from .charts import check_target

            check_target("--chart", chart)


def _packed(path: str) -> bool:
    """Whether data.path names a file of packed samples (as the run's loader finds: Job.segmented)."""
    if not path.endswith(".bin"):
        return False
    from .tokenfile import masked  # numpy: only where a file is named

    return masked(path)


def plan_command(cmd: PlanCommand, chart: str | None = None):
    """(the plan of `cmd` with its report, with the nearest plans that fit where it misses; the plan of one GPU at
    the same batch, for several), every flag checked first: one line for what cannot be planned."""
    from .plan.nearest import nearest
    from .plan.resolve import search

    cmd.check(chart)
    cfg = cmd.config()
    hw = cmd.figures(cfg)

    def planned(c: PlanCommand, advise: bool = True, gpus: int | None = None):
        per_host = c.per_host if gpus is None else None
        conf = c.config()
        return search(
            conf,
            hw,
            c.host(conf),
            c.gpu_gb,
            c.nvme(conf),
            c.name,
            advise=advise,
            gpus=gpus or c.gpus,
            per_host=per_host,
            segmented=_packed(conf.data.path),
        )

    def near(args: list[str]):
        try:
            return planned(cmd.added(args), False)
        except UserError:  # arguments this config refuses: not a plan that fits
            return None

    p = planned(cmd)
    one = planned(cmd, advise=False, gpus=1) if cmd.gpus > 1 else None
    if not p.fits:
        p = replace(p, nearest=nearest(cfg, bool(cmd.nvme(cfg)), near, cmd.gpus))
    return p, one
