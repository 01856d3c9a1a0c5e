"""Expert groups: a mixture-of-experts block whose weights go to the GPU in parts rather than whole
(RunPlan.expert_groups = G > 1): first its attention part (the attention, both norms, the router, any shared
expert, gpt-oss's down-projection biases), then its experts G groups of E / G at a time, each group a slice of the
experts' fused tensors. The block
stays one unit of the state (its slabs, their placement, its update and its activation checkpoint); only its GPU
weight slot and gradient accumulator hold one part at a time, so a block as large as gpt-oss-120b's (3.2 B
parameters) needs slots of a part's size. engine/groups.py runs such a block. Pure Python: the planner sizes parts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..tiers.slab import TENSOR_ALIGN, SlabLayout

EXPERTS = "mlp.experts."  # the fused tensors (E, ...) that the groups slice along their first dimension
# but gpt-oss's down-projection biases: added once for all experts, before the groups' rows (moe.experts), so
# that a token's sum runs in the order of a whole block's
WHOLE = "mlp.experts.down_proj_bias"


@dataclass(frozen=True)
class Piece:
    """One tensor (or one group's slice of it) of a part: elements [src, src + numel) of the unit's slab, at dst in
    the part's buffer."""

    name: str
    shape: tuple[int, ...]
    src: int
    dst: int
    numel: int


@dataclass(frozen=True)
class Part:
    pieces: tuple[Piece, ...]
    numel: int  # elements of the part's buffer
    first: int = 0  # a group's first expert
    experts: int = 0  # a group's experts; 0: the attention part

    def views(self, flat) -> dict:
        """Named views of the part's tensors in its buffer `flat`."""
        return {p.name: flat[p.dst : p.dst + p.numel].view(p.shape) for p in self.pieces}

    def norm_pieces(self) -> tuple[tuple[int, int], ...]:
        """The part's gradient as the pieces its norm is taken by, (start, numel) in its buffer: each tensor, and a
        group's expert by expert (norm_pieces)."""
        if not self.experts:
            return tuple((p.dst, p.numel) for p in self.pieces)
        return tuple(
            (p.dst + e * (p.numel // self.experts), p.numel // self.experts)
            for e in range(self.experts)
            for p in self.pieces
        )


def _part(tensors: list[tuple[str, tuple[int, ...], int, int]], first: int = 0, experts: int = 0) -> Part:
    pieces, at = [], 0
    for name, shape, src, numel in tensors:
        pieces.append(Piece(name, shape, src, at, numel))
        at = -(-(at + numel) // TENSOR_ALIGN) * TENSOR_ALIGN
    return Part(tuple(pieces), max(at, TENSOR_ALIGN), first, experts)


def unit_parts(layout: SlabLayout, n_experts: int, groups: int) -> tuple[Part, ...]:
    """A block's parts: its attention part, then its `groups` expert groups, where it has experts and groups > 1;
    () otherwise (the block goes whole)."""
    experts = [e for e in layout.entries if e.name.startswith(EXPERTS) and e.name != WHOLE]
    if groups <= 1 or not experts:
        return ()
    n = n_experts // groups
    rest = [(e.name, e.shape, e.offset, e.numel) for e in layout.entries if e not in experts]
    parts = [_part(rest)]
    for g in range(groups):
        # expert rows g*n .. (g+1)*n of each fused tensor: a contiguous slice of its slab range
        parts.append(
            _part(
                [
                    (
                        e.name,
                        (n, *e.shape[1:]),
                        e.offset + g * n * (e.numel // e.shape[0]),
                        n * e.numel // e.shape[0],
                    )
                    for e in experts
                ],
                g * n,
                n,
            )
        )
    return tuple(parts)


def norm_pieces(layout: SlabLayout, n_experts: int) -> tuple[tuple[int, int], ...]:
    """A block with experts' gradient as the pieces its norm is taken by, (start, numel) in the unit's slab: each of
    its other tensors, then each expert's rows of the fused tensors, expert by expert. Those are its parts' pieces
    (Part.norm_pieces) in the same order whatever the groups, so a block's norm, and the clipping, do not depend on
    them. () for a unit without experts: its norm is one reduction."""
    return tuple((pc.src, pc.numel) for p in unit_parts(layout, n_experts, n_experts) for pc in p.pieces)


def gaps(layout_numel: int, parts: tuple[Part, ...]) -> list[tuple[int, int]]:
    """The ranges of a unit's slab that no part's piece covers (the layout's padding): a gradient drained by parts
    writes zeros there."""
    covered = sorted((p.src, p.src + p.numel) for part in parts for p in part.pieces)
    out, at = [], 0
    for a, b in covered:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < layout_numel:
        out.append((at, layout_numel))
    return out


def group_options(n_experts: int) -> tuple[int, ...]:
    """The expert groups a plan may choose, fewest first: 1, then the powers of two that divide the experts."""
    out, g = [1], 2
    while g <= n_experts and n_experts % g == 0:
        out.append(g)
        g *= 2
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _sizes(tensors: tuple[tuple[str, tuple[int, ...]], ...], n_experts: int, groups: int) -> tuple[int, int]:
    parts = unit_parts(SlabLayout.build(list(tensors)), n_experts, groups)
    return parts[0].numel, max(p.numel for p in parts)


def block_parts(spec, groups: int) -> dict[int, tuple[int, int]]:
    """{unit: (its attention part's elements, its largest part's)} of the spec's blocks with experts, in `groups`
    groups (the planner's sizes; none where groups is 1)."""
    if groups <= 1:
        return {}
    return {
        u.index: _sizes(tuple((t.name, t.shape) for t in u.tensors), spec.num_experts, groups)
        for u in spec.units()
        if u.kind == "block" and any(t.name.startswith(EXPERTS) for t in u.tensors)
    }
