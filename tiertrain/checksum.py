"""CRC32C checksums of slabs (google_crc32c, over a tensor's bytes in place), and the CRC32C of a file from its
parts' (zlib's crc32_combine, with the Castagnoli polynomial): each rank checksums its byte range of a checkpoint's
chunk file, and the ranges' checksums combine into the file's."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def crc(t: "torch.Tensor") -> int:
    """The CRC32C of a CPU tensor's bytes."""
    import google_crc32c
    import torch

    return google_crc32c.value(t.view(torch.uint8).numpy())


_POLY = 0x82F63B78  # CRC32C, reflected


def _multmodp(a: int, b: int) -> int:
    """a x b modulo the polynomial (reflected bit order)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    p, out = 1 << 30, []  # x^1
    for _ in range(32):
        out.append(p)
        p = _multmodp(p, p)
    return out


_X2N = _x2n_table()


def crc_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of A + B from A's (crc1), B's (crc2) and B's length in bytes."""
    p, k, n = 1 << 31, 3, len2  # x^(8 * len2)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def combined(crcs: list[list[int]], i: int) -> int:
    """The CRC32C of the i-th slab from every rank's (crc, bytes) of its part, in rank order (host_ints' lists)."""
    crc = 0
    for r in crcs:
        crc = crc_combine(crc, r[2 * i], r[2 * i + 1])
    return crc
