"""What fits when a plan does not: the nearest plans on the same machine, each a few `tiertrain plan` arguments to
add to the same command (a smaller batch or sequence, more micro-batches, checkpoints or state on NVMe, bf16
checkpoints, a setting the config fixes left to the plan), with its predicted step. Pure Python: the caller plans
each candidate's arguments as the command would (`plan_of`), so an entry's arguments fit as they are printed."""

from __future__ import annotations

from typing import Callable

from ..config import Config
from ..sections import AUTO
from ..sizes import budget
from .values import Miss, Near, Plan

# a setting the config fixes, which the plan may choose instead (memory it holds: the search may find room)
FIXED = (
    ("tiers", "gpu_resident_gb", "GPU-resident state"),
    ("train", "keep_activations", "kept activations"),
    ("train", "keep_attention", "kept attention outputs"),
    ("tiers", "gpu_update_units", "GPU-updated units"),
    ("optim", "speculate_units", "speculated units"),
    ("train", "tile_tokens", "tile size"),
    ("tiers", "stream", "what streams"),
)
# the changes that cost no tokens and save host or GPU memory for disk: they go together where none fits alone
DISK = ('tiers.activation_dtype="bfloat16"', 'tiers.activations="nvme"')
UNBOUNDED_NVME = "1000000"  # GB: the disk a plan with an NVMe tier would take, found with this much


def nearest(
    cfg: Config, nvme_on: bool, plan_of: Callable[[list[str]], Plan | Miss | None], gpus: int = 1
) -> tuple[Near, ...]:
    """The nearest plans that fit, the most tokens/s first: each single change that fits (of a batch, sequence or
    micro-batch: the largest that fits), and where none does, the smaller shapes beside all the changes that cost
    no tokens (bf16 checkpoints, checkpoints or state on NVMe). `plan_of(args)`: the plan of the same command with
    `args` added (None: refused); `gpus`: its ranks (a batch is a multiple of them)."""
    free = _free(cfg, nvme_on, plan_of)
    found = [n for args, what in free if (n := _near(plan_of, args, what))]
    found += _shrunk(cfg, plan_of, gpus, [], "")
    disk = [f for f in free if f[0][0] == "--nvme-gb" or f[0][-1].endswith(DISK)]
    if found or not disk:
        return tuple(sorted(found, key=lambda n: -n.tokens_per_s))
    # none fits alone: the checkpoints' and disk's changes together (each saves memory), then with a smaller shape
    base, what = [a for f in disk for a in f[0]], ", ".join(f[1] for f in disk)
    together = _near(plan_of, base, what) if len(disk) > 1 else None
    found = [together] if together else _shrunk(cfg, plan_of, gpus, base, what)
    return tuple(sorted(found, key=lambda n: -n.tokens_per_s))


def _free(cfg: Config, nvme_on: bool, plan_of) -> list[tuple[list[str], str]]:
    """The changes that keep the tokens of a step: (their arguments, in words)."""
    t = cfg.tiers
    out = []
    if t.activation_dtype == "float32":
        out.append((["--set", 'tiers.activation_dtype="bfloat16"'], "bf16 activation checkpoints"))
    if nvme_on and t.activations != "nvme":
        out.append((["--set", 'tiers.activations="nvme"'], "activation checkpoints on NVMe"))
    if not nvme_on:
        out += [spill for spill in [_nvme_tier(plan_of)] if spill]
    if t.activations not in (AUTO, "nvme"):
        out.append((["--set", 'tiers.activations="auto"'], "checkpoints where the plan puts them"))
    for sec, key, words in FIXED:
        if getattr(getattr(cfg, sec), key) != AUTO:
            out.append((["--set", f'{sec}.{key}="auto"'], f"{words} chosen by the plan"))
    return out


def _near(plan_of, args: list[str], what: str) -> Near | None:
    p = plan_of(args)
    if p is None or not p.fits:
        return None
    return Near(tuple(args), what, p.prediction.step_s, p.prediction.tokens_per_s)


def _shrunk(cfg: Config, plan_of, gpus: int, base: list[str], also: str) -> list[Near]:
    """The largest batch, sequence and micro-batch smaller than the config's that fit (each alone, beside `base`)."""
    tc, sep = cfg.train, f"; {also}" if also else ""
    batch, seq, micro = tc.batch_size, tc.seq_len, tc.micro_batch_size

    def at(args: list[str], what: str) -> Near | None:
        return _near(plan_of, [*base, *args], what + sep)

    found = [
        _largest(
            [b for b in _halves(batch) if b % gpus == 0],
            lambda b: at(["--batch-size", str(b)], f"batch {b:,} (from {batch:,})"),
        ),
        _longest(seq, lambda s: at(["--seq-len", str(s)], f"sequence {s:,} tokens (from {seq:,})")),
    ]
    if micro != AUTO and micro > 1:  # more micro-batches of fewer rows
        rows = [m for m in range(micro - 1, 0, -1) if (batch // gpus) % m == 0]
        more = f"micro-batch {{}} (from {micro}): more micro-batches"
        found.append(_largest(rows, lambda m: at(["--set", f"train.micro_batch_size={m}"], more.format(m))))
    return [n for n in found if n]


def _longest(seq: int, at) -> Near | None:
    """at(s) of the longest sequence s below `seq` that fits: of its halves (down to 128 tokens), then of the
    multiples of an eighth of that half between it and twice it."""
    half = _largest([s for s in _halves(seq) if s >= min(128, seq // 2)], at)
    if half is None:
        return None
    h = int(half.args[-1])
    step = max(16, h // 8)
    return _largest(list(range(h + step, min(seq, 2 * h), step))[::-1], at) or half


def _largest(values: list[int], near) -> Near | None:
    """near(v) of the largest of `values` (largest first) for which it is not None, fitting being monotone: the
    smallest first (where none fits, one try), then a binary search."""
    if not values or (got := near(values[-1])) is None:
        return None
    lo, hi = 0, len(values) - 1  # values[hi] fits
    while lo < hi:
        mid = (lo + hi) // 2
        tried = near(values[mid])
        if tried is not None:
            got, hi = tried, mid
        else:
            lo = mid + 1
    return got


def _halves(n: int) -> list[int]:
    out, n = [], n // 2
    while n >= 1:
        out.append(n)
        n //= 2
    return out


def _nvme_tier(plan_of) -> tuple[list[str], str] | None:
    """An NVMe tier as large as the plan with one takes, where it fits: (its arguments, in words)."""
    p = plan_of(["--nvme-gb", UNBOUNDED_NVME])
    if p is None or not p.fits:
        return None
    mem = p.memory
    disk = (sum(mem.nvme.values()) + mem.nvme_checkpoints) * p.per_host
    size = budget(max(disk, 1e9) * 1.01)  # a margin: the plan at this budget may choose differently
    return ["--nvme-gb", size], f"state or checkpoints on NVMe: an NVMe tier of {size} GB"
