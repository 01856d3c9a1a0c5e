"""Where each (unit, kind) slab lives when the host budget is smaller than the state.

Policy (SPILL_ORDER): spill what each step touches least, first. Adam moments (`exp_avg`, then `exp_avg_sq`: read
and written once per step, by the optimizer only), then the fp32 master when a compute-dtype copy
streams (then only the optimizer reads and writes it), then gradients (written by the D2H, read by
the optimizer), and last the weights that stream (read by the forward and the backward pass, written
by the optimizer): the compute-dtype copy, or the fp32 master when it is what streams. Within a kind, units
spill from the last to the first: the optimizer reaches them last, which leaves the most time to read
them ahead. Every kind can spill, so the least host budget is the staging ring alone, or the ring and
the units too wide to be worth a ring their width (least_host). The plan may spill the gradients first instead
(SPILL_ORDERS, RunPlan.spill_first), where that takes the disk's work off the next forward pass.
Pure Python: the planner uses it too.
"""

from __future__ import annotations

import functools

from ..modes import STATE, Home, Kind

SPILL_ORDER = (Kind.EXP_AVG, Kind.EXP_AVG_SQ, Kind.MASTER, Kind.GRAD, Kind.WEIGHTS)
# the orders a plan may take (RunPlan.spill_first). Moments first costs the disk a read and a write of each spilled
# slab after the norm, beside the next forward pass; gradients first, a write in the backward pass and a read after
# the norm: where the forward pass is short against the backward one (long sequences), that halves the disk's
# bytes beside it
SPILL_ORDERS: dict[str, tuple[str, ...]] = {
    "moments": SPILL_ORDER,
    "gradients": (Kind.GRAD, Kind.EXP_AVG, Kind.EXP_AVG_SQ, Kind.MASTER, Kind.WEIGHTS),
}
RING_SLOTS = 4  # staging buffers per spilled kind: read 2 units ahead, one in use, one writing back;
# the streamed kind has twice that: its own for the forward and backward passes' reads
READ_AHEAD = RING_SLOTS - 2  # units whose spilled slabs the optimizer's ring reads ahead (Staging's depth)


def streamed_kind(kb: dict[str, int]) -> str:
    """The kind whose slab carries the weights to the GPU."""
    return Kind.WEIGHTS if Kind.WEIGHTS in kb else Kind.MASTER


def spill_order(kb: dict[str, int], first: str = "moments") -> tuple[str, ...]:
    """The kinds of `kb` in the order they spill: SPILL_ORDERS[first], with the streamed kind last."""
    s = streamed_kind(kb)
    return tuple(k for k in SPILL_ORDERS[first] if k in kb and k != s) + (s,)


def kind_bytes(dtype: str, stream: str) -> dict[str, int]:
    """Bytes per parameter of each kind of slab: fp32 master, moments and gradient, and a compute-dtype
    copy when bf16 weights stream from the host (`stream = "compute"`)."""
    copy = stream == "compute" and dtype == "bfloat16"
    return {
        Kind.MASTER: 4,
        Kind.EXP_AVG: 4,
        Kind.EXP_AVG_SQ: 4,
        Kind.GRAD: 4,
        **({Kind.WEIGHTS: 2} if copy else {}),
    }


def host_state_bytes(numels: list[int], kb: dict[str, int], where, cost, skip=()) -> dict[str, int]:
    """Host bytes of each kind's slabs that `where` places on the host, as allocated (`cost`); units in
    `skip` (resident on the GPU) left out. The planner and the run's budget checks share it."""
    out: dict[str, int] = {}
    for (u, k), tier in where.items():
        if tier == Home.HOST and u not in skip:
            out[k] = out.get(k, 0) + cost(numels[u] * kb[k])
    return out


@functools.lru_cache(maxsize=4096)  # the planner asks for every unit of every candidate: blocks share a size
def copy_bytes(numel: int, cost) -> int:
    """Host bytes of one unit's copies for a speculative update: its fp32 master and moments (modes.STATE)."""
    return len(STATE) * cost(numel * 4)


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
    return [u for u in range(n_units) if all(where.get((u, k), Home.HOST) == Home.HOST for k in kinds)]


def alternate_from_last(units: list[int], k: int) -> list[int]:
    """`k` of `units`, in the order they are taken: every other one from the last, then those between
    (from the last too). Speculated updates take their units so: the host's and the GPU's work in the
    backward pass then falls between units left to the next forward pass, which overlaps it instead of
    waiting for it at its start and running idle through its end."""
    back = units[::-1]
    return (back[0::2] + back[1::2])[:k]


def gpu_updated(ram: list[int], k: int, speculated: bool) -> list[int]:
    """The `k` units of `ram` (update_candidates) updated on the GPU. The first ones when they update as
    their weights load in the next forward pass (the host optimizer then starts on the units that pass
    reaches last); every other one from the last when their update is speculated in the backward pass:
    their gradients land first, and the host's speculated units, taken the same way from the rest, fall
    between them, so the PCIe copies and the host AdamW both start early in that pass."""
    if not speculated:
        return ram[:k]
    return sorted(alternate_from_last(ram, k))


CK_PIECE_BYTES = 64 << 20  # activation checkpoints on NVMe move in pieces of this many bytes (a file each)
CK_RING_PIECES = (
    8  # pinned buffers of a piece each, shared by the checkpoints' writes and reads (the default)
)


def ck_ring_bytes(pieces: int = CK_RING_PIECES) -> int:
    """Host bytes of the NVMe checkpoints' ring of `pieces` pinned buffers (RunPlan.ck_pieces)."""
    return CK_PIECE_BYTES * pieces


def ck_disk_bytes(micro_bytes: int, micros: int) -> int:
    """Disk bytes of one block's checkpoint on NVMe: each micro-batch's in whole pieces."""
    return micros * -(-micro_bytes // CK_PIECE_BYTES) * CK_PIECE_BYTES


def ring_bytes(widths: dict[str, int], kb: dict[str, int], cost) -> int:
    """Host bytes of the staging ring: for each spilled kind, RING_SLOTS buffers as wide as its widest
    spilled unit (`widths`, in elements), twice that for the streamed kind. The staging and the reader allocate
    exactly this."""
    s = streamed_kind(kb)
    return RING_SLOTS * sum(cost(n * kb[k]) * (2 if k == s else 1) for k, n in widths.items())


def ring_widths(numels: list[int], where: dict[tuple[int, str], str]) -> dict[str, int]:
    """{kind: elements of its widest slab on NVMe}, for the kinds with one."""
    out: dict[str, int] = {}
    for (u, k), tier in where.items():
        if tier == Home.NVME:
            out[k] = max(out.get(k, 0), numels[u])
    return out


def disk_bytes(numels: list[int], kb: dict[str, int], where: dict[tuple[int, str], str]) -> int:
    """Bytes the NVMe store takes for this placement: a row per spilled slab, each as wide as its kind's
    widest spilled unit (tiers.nvme.NvmeStore)."""
    width = ring_widths(numels, where)
    return sum(width[k] * kb[k] for (_, k), tier in where.items() if tier == Home.NVME)


def _spill_sequence(numels: list[int], kb: dict[str, int], cap: int, first: str) -> list[tuple[int, str]]:
    """The slabs in the order they spill: kinds by spill_order, each kind's units from the last to the
    first; units wider than `cap` elements never spill."""
    order = spill_order(kb, first)
    return [(u, k) for k in order for u in reversed(range(len(numels))) if 0 < numels[u] <= cap]


def _walk(
    numels: list[int], kb: dict[str, int], total: float, cost, budget: float = 0.0, first: str = "moments"
) -> tuple[list[tuple[tuple, int, int]], float]:
    """(the placements place_within considers that fit `budget`, as (rank, cap, j): the first j slabs of the cap's
    spill sequence on NVMe, the rest and their staging ring in RAM; the least host bytes any of them needs). A rank
    is lower for a placement that stops earlier in the kind order, then for fewer bytes spilled; along one sequence
    it only grows, so each cap's sequence stops at the first placement within `budget`."""
    order = spill_order(kb, first)
    costs = {k: [cost(n * kb[k]) for n in numels] for k in order}  # each slab's host bytes, once
    fits, least = [], total
    for cap in sorted({n for n in numels if n}, reverse=True):
        units = [u for u in reversed(range(len(numels))) if 0 < numels[u] <= cap]
        host, widths, ring, j = total, {}, 0, 0
        for rank, k in enumerate(order):  # _spill_sequence's order: kind by kind, each from the last unit
            paid, widest = costs[k], 0
            for u in units:
                j += 1
                host -= paid[u]
                if numels[u] > widest:  # the ring grows only with a wider slab of a kind
                    widest = widths[k] = numels[u]
                    ring = ring_bytes(widths, kb, cost)
                least = min(least, host + ring)
                if host + ring <= budget:
                    fits.append(((rank, total - host), cap, j))
                    break
            else:
                continue
            break
    return fits, least


def place_within(
    numels: list[int], kb: dict[str, int], host_budget: float, fixed: float, cost, first: str = "moments"
) -> tuple[dict[tuple[int, str], str] | None, int, float]:
    """(placement, staging ring bytes, host bytes of the whole state + `fixed`). Everything stays on the
    host when it fits beside `fixed` (no ring then). Otherwise the fewest slabs spill, in policy order,
    for the state left in RAM and the ring to fit. A ring buffer is as wide as the widest slab of its
    kind that spills, so a unit much wider than the rest (a big vocabulary's embedding or head) may
    cost less host memory kept in RAM than spilled through a ring its width: each width is tried as
    the widest that spills, and the placement that stops earliest in the spill order (then spills the
    fewest bytes) wins. `first`: the kind order (SPILL_ORDERS). (None, 0, total) when nothing fits: least_host
    says what would."""
    total = sum(cost(n * b) for n in numels for b in kb.values()) + fixed
    if total <= host_budget:
        return place(numels, kb), 0, total
    fits, _ = _walk(numels, kb, total, cost, host_budget, first)
    if not fits:
        return None, 0, total
    _, cap, j = min(fits)
    where = place(numels, kb)
    where.update({uk: Home.NVME for uk in _spill_sequence(numels, kb, cap, first)[:j]})
    return where, ring_bytes(ring_widths(numels, where), kb, cost), total


def read_ahead_bytes(numels: list[int], kb: dict[str, int], where: dict[tuple[int, str], str]) -> int:
    """Disk bytes the ring reads ahead of the optimizer as the backward pass starts (Staging.start): the
    spilled slabs of the first READ_AHEAD units with any, but their gradients (drained late in that pass) and
    compute-dtype copies (written whole, never read)."""
    units = set(sorted({u for (u, _), t in where.items() if t == Home.NVME and numels[u]})[:READ_AHEAD])
    return sum(
        numels[u] * kb[k]
        for (u, k), t in where.items()
        if t == Home.NVME and u in units and k not in (Kind.GRAD, Kind.WEIGHTS)
    )


def late_gradient_bytes(
    numels: list[int], kb: dict[str, int], where: dict[tuple[int, str], str], resident=()
) -> int:
    """Disk bytes the optimizer waits for at the norm: the spilled gradient of the first unit it updates (the first
    not resident), if spilled. The backward pass drains that unit last, so its write to disk ends as the norm comes
    and the update reads it back at once, with the next forward pass waiting for the unit."""
    first = next((u for u in range(len(numels)) if u not in resident), None)
    if first is None or where.get((first, Kind.GRAD)) != Home.NVME:
        return 0
    return numels[first] * kb[Kind.GRAD]


def least_host(numels: list[int], kb: dict[str, int], fixed: float, cost) -> float:
    """The smallest host budget place_within can meet, `fixed` included. Most often every slab on NVMe
    and the ring in RAM; but a kind's ring can cost more than the slabs it saves (a unit too wide,
    or too few units spilled of a kind that streams, whose ring is twice as deep)."""
    total = sum(cost(n * b) for n in numels for b in kb.values()) + fixed
    return _walk(numels, kb, total, cost)[1]


def place(numels: list[int], kind_bytes: dict[str, int]) -> dict[tuple[int, str], str]:
    """Every slab on the host."""
    return {(u, k): Home.HOST for u in range(len(numels)) for k in kind_bytes}


def spilled_bytes(
    numels: list[int], kind_bytes: dict[str, int], where: dict[tuple[int, str], str]
) -> dict[str, int]:
    out: dict[str, int] = {}
    for (u, k), tier in where.items():
        if tier == Home.NVME:
            out[k] = out.get(k, 0) + numels[u] * kind_bytes[k]
    return out
