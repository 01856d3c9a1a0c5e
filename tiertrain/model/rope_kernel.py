"""model/rope.py's Triton kernel, in a module of its own: triton is imported only where the kernel runs."""

import triton
import triton.language as tl


@triton.jit
def _bf16(v):
    """v (fp32) rounded to bf16's nearest, ties to even, in fp32: integer arithmetic on the bits, which the
    compiler can neither fold away with the cast back nor fuse with the product before or the sum after. A NaN
    stays one (its bits would carry into the sign)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))


@triton.jit
def rope(x, cos, sin, y, t, heads, cs_b, cs_t, HALF: tl.constexpr, NH: tl.constexpr, BH: tl.constexpr,
         BACKWARD: tl.constexpr):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    b, pos = tok // t, tok % t
    h = tl.arange(0, NH)[:, None]
    c = tl.arange(0, BH)[None, :]
    inside = (h < heads) & (c < HALF)
    at = tok * heads * 2 * HALF + h * 2 * HALF + c
    x1 = tl.load(x + at, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(x + at + HALF, mask=inside, other=0.0).to(tl.float32)
    row = b * cs_b + pos * cs_t + c
    half = c < HALF
    c1 = _bf16(tl.load(cos + row, mask=half, other=0.0))
    c2 = _bf16(tl.load(cos + row + HALF, mask=half, other=0.0))
    s1 = _bf16(tl.load(sin + row, mask=half, other=0.0))
    s2 = _bf16(tl.load(sin + row + HALF, mask=half, other=0.0))
    a1, a2 = _bf16(x1 * c1), _bf16(x2 * c2)
    if BACKWARD:  # the adjoint: the rotated halves' gradients come back from the other half
        y1 = a1 + _bf16(x2 * s2)
        y2 = a2 - _bf16(x1 * s1)
    else:
        y1 = a1 - _bf16(x2 * s1)
        y2 = a2 + _bf16(x1 * s2)
    tl.store(y + at, y1.to(tl.bfloat16), mask=inside)
    tl.store(y + at + HALF, y2.to(tl.bfloat16), mask=inside)
