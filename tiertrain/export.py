"""`tiertrain export`: a checkpoint's fp32 master weights as a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from .checkpoint_load import load, read_meta
from .config import config_from_dict
from .errors import UserError
from .model.hf import write_hf
from .modes import Kind
from .rundir import disk_free, resolve, run_of
from .tiers.slab import SlabLayout


def export_hf(source: str, to: str, dtype: str = "float32", shard_bytes: int = 5 << 30) -> list[str]:
    """`source`: a checkpoint, or a run directory (its newest checkpoint). Reads a unit at a time. The files a
    run kept from its --init-from model (<run>/hf: tokenizer, generation config) go along."""
    path = resolve(source, None, what="export")
    meta = read_meta(path)
    spec = config_from_dict(meta["config"], [], str(path), legacy=True).model
    need, (free, _) = spec.n_params * (4 if dtype == "float32" else 2), disk_free(Path(to))
    if need > free:  # before a byte is written: a full disk midway costs the minutes the shards took
        raise UserError(
            f"--to {to}: the export's weights need {need / 1e9:.2f} GB in {dtype} and that disk has "
            f"{free / 1e9:.2f} GB free; pass a --to on a disk with room"
            + (", or --dtype bfloat16 (half the bytes)" if dtype == "float32" and need / 2 <= free else "")
        )
    units = spec.units()

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for unit in units:
            lay = SlabLayout.build([(t.name, t.shape) for t in unit.tensors])
            flat = torch.empty(lay.numel, dtype=torch.float32)
            load(path, Kind.MASTER, unit.index, flat)
            views = lay.views(flat)
            for t in unit.tensors:
                yield t.hf_name, views[t.name]

    run = run_of(path)
    # the tokenizer and generation config of its --init-from model
    hf = run / "hf" if run is not None else None
    return write_hf(
        Path(to), spec, tensors(), dtype, shard_bytes, hf if hf is not None and hf.is_dir() else None
    )
