"""CRC-32C (Castagnoli), the shared-memory weight transport's faster checksum, and the
combination rule that lets it be taken in parallel pieces.

CRC-32C is computed by the `crc32c` package (the SSE4.2 / ARMv8 CRC instruction where the CPU
has one, a table otherwise): about twice the speed of ISA-L's CRC-32 on data in cache here,
so a shared-memory push's two checksum passes stop being the largest part of its time. Any
language has it (Go's hash/crc32 Castagnoli table, Java's java.util.zip.CRC32C, Rust's
crc32c). The library has no combine, so `crc32c_combine` is zlib's (1.2.12+) algorithm for
any reflected CRC, with the Castagnoli polynomial:

    crc(A || B) = (crc(A) * x^(8 |B|)) mod P  xor  crc(B)

where the product is carry-less multiplication of polynomials over GF(2) modulo P (bit-
reflected, so the lowest bit holds the highest power), and x^(8 |B|) is assembled from the
table of x^(2^k) mod P by the bits of |B|.
"""

from __future__ import annotations

import functools

from crc32c import crc32c  # crc32c(data, value=0): of any buffer, continuing from value

__all__ = ["crc32c", "crc32c_combine"]

POLY = 0x82F63B78  # the Castagnoli polynomial, bit-reflected


def _multiply(a: int, b: int) -> int:
    """a * b modulo P (both reflected polynomials of degree below 32)."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multiply(table[-1], table[-1]))  # x^(2^(k+1)) = (x^(2^k))^2
    return table


_X_TO_2_TO = _powers()


@functools.lru_cache(maxsize=1024)
def _shift(length: int) -> int:
    """x^(8 * length) mod P: the factor that moves a CRC past `length` bytes."""
    power, k = 1 << 31, 3  # x^0; length bytes are 2^3 * length bits
    while length:
        if length & 1:
            power = _multiply(_X_TO_2_TO[k % 32], power)
        length >>= 1
        k += 1
    return power


def crc32c_combine(first: int, second: int, second_length: int) -> int:
    """CRC-32C of A || B from crc32c(A), crc32c(B) and B's length in bytes."""
    return _multiply(_shift(second_length), first) ^ second
