"""Where each (unit, kind) slab lives when the host budget is smaller than the state.

Policy: spill what each step touches least, first. Adam moments (`exp_avg`, then `exp_avg_sq`: read
and written once per step, by the optimizer only), then the fp32 master when a compute-dtype copy
streams (then only the optimizer reads and writes it), then gradients (written by the D2H, read by
the optimizer), and last the weights that stream (read by the forward and the backward pass, written
by the optimizer): the compute-dtype copy, or the fp32 master when it is what streams. Within a kind, units
spill from the last to the first: the optimizer reaches them last, which leaves the most time to read
them ahead. Every kind can spill, so the least host budget is the staging ring alone.
Pure Python: the planner uses it too.
"""
from __future__ import annotations

SPILL_ORDER = ("exp_avg", "exp_avg_sq", "master", "grad", "weights")
RING_SLOTS = 4  # staging buffers per spilled kind: read 2 units ahead, one in use, one writing back;
# the streamed kind has twice that: its own for the forward and backward passes' reads


def streamed_kind(kb: dict[str, int]) -> str:
    """The kind whose slab carries the weights to the GPU."""
    return "weights" if "weights" in kb else "master"


def spill_order(kb: dict[str, int]) -> tuple[str, ...]:
    """The kinds of `kb` in the order they spill: SPILL_ORDER, with the streamed kind last."""
    s = streamed_kind(kb)
    return tuple(k for k in SPILL_ORDER if k in kb and k != s) + (s,)


def kind_bytes(dtype: str, stream: str) -> dict[str, int]:
    """Bytes per parameter of each kind of slab: fp32 master, moments and gradient, and a compute-dtype
    copy when bf16 weights stream from the host (`stream = "compute"`)."""
    copy = stream == "compute" and dtype == "bfloat16"
    return {"master": 4, "exp_avg": 4, "exp_avg_sq": 4, "grad": 4, **({"weights": 2} if copy else {})}


def resident_units(numels: list[int], kb: dict[str, int], gpu_bytes: float) -> list[int]:
    """Units whose whole state lives on the GPU (`tiers.gpu_resident_gb`): the first units, in forward
    order, whose slabs of every kind fit `gpu_bytes`. Their update runs on the GPU; the host optimizer
    starts with the first streamed unit, which leaves it the most of the next forward pass to hide in."""
    out, used = [], 0
    for u, n in enumerate(numels):
        used += n * sum(kb.values())
        if used > gpu_bytes:
            break
        out.append(u)
    return out


def update_candidates(where: dict[tuple[int, str], str], kinds, n_units: int) -> list[int]:
    """Units that may be updated on the GPU as their weights stream in (tiers.gpu_update_units), in
    forward order: those with every slab in host RAM (resident units update there anyway; spilled
    slabs pass through the staging ring on the host optimizer's schedule). The first ones are taken:
    the host optimizer then starts on the units the next forward pass reaches last."""
    return [u for u in range(n_units) if all(where.get((u, k), "host") == "host" for k in kinds)]


def ring_bytes(numels: list[int], kinds: tuple[str, ...], kb: dict[str, int], cost) -> int:
    """Host bytes of the staging ring when `kinds` spill (each buffer as wide as the widest unit)."""
    s = streamed_kind(kb)
    return RING_SLOTS * sum(cost(max(numels) * kb[k]) * (2 if k == s else 1) for k in kinds)


def place_within(numels: list[int], kb: dict[str, int], host_budget: float, fixed: float,
                 cost) -> tuple[dict[tuple[int, str], str] | None, int, float]:
    """(placement, staging ring bytes, host bytes of the whole state + `fixed`). Everything stays on the
    host when it fits beside `fixed` (no ring then); otherwise slabs spill by policy: the moments
    first (a ring for two kinds), then each further kind of spill_order with its ring; placement None
    when even every slab on NVMe cannot fit."""
    total = sum(cost(n * b) for n in numels for b in kb.values()) + fixed
    if total <= host_budget:
        return place(numels, kb, None), 0, total
    kinds = spill_order(kb)
    for n in range(2, len(kinds) + 1):
        ring = ring_bytes(numels, kinds[:n], kb, cost)
        try:
            return place(numels, kb, host_budget - fixed - ring, cost, kinds[:n]), ring, total
        except ValueError:
            continue
    return None, ring, total


def least_host(numels: list[int], kb: dict[str, int], fixed: float, cost) -> float:
    """The smallest host budget place_within can meet: every slab on NVMe, the ring and `fixed` in RAM."""
    return fixed + ring_bytes(numels, spill_order(kb), kb, cost)


def place(numels: list[int], kind_bytes: dict[str, int], host_budget: float | None,
          cost=None, kinds: tuple[str, ...] | None = None) -> dict[tuple[int, str], str]:
    """{(unit, kind): "host" | "nvme"}: the fewest slabs of `kinds` spilled, in policy order, so that what
    stays fits `host_budget` bytes (None: no budget, everything on the host). `cost(nbytes)` is what a
    slab of nbytes takes from the host (an allocator may round it up); by default its size."""
    cost = cost or (lambda n: n)
    where = {(u, k): "host" for u in range(len(numels)) for k in kind_bytes}
    if host_budget is None:
        return where
    left = sum(cost(n * b) for n in numels for b in kind_bytes.values()) - host_budget
    for kind in (k for k in kinds or spill_order(kind_bytes) if k in kind_bytes):
        for u in reversed(range(len(numels))):
            if left <= 0:
                return where
            where[(u, kind)] = "nvme"
            left -= cost(numels[u] * kind_bytes[kind])
    if left > 0:
        raise ValueError("the state does not fit even with those kinds on NVMe")
    return where


def spilled_bytes(numels: list[int], kind_bytes: dict[str, int], where: dict[tuple[int, str], str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (u, k), tier in where.items():
        if tier == "nvme":
            out[k] = out.get(k, 0) + numels[u] * kind_bytes[k]
    return out
