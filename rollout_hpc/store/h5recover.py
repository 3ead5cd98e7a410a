"""Reopen an HDF5 file whose SWMR writer was killed.

A file opened for (SWMR) writing carries "file consistency flags" in its
superblock; HDF5 refuses to open it for writing again until they are cleared
(the `h5clear -s` tool does this). A SIGKILLed writer never clears them. We
clear them ourselves: rewrite the flags byte of the version 2/3 superblock and
its Jenkins lookup3 checksum. The caller must first make sure no writer is
alive (the trajectory log holds an flock on a sibling lock file for that).
"""

from __future__ import annotations

import os
from pathlib import Path

_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_M = 0xFFFFFFFF


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _M


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 `hashlittle`, the checksum HDF5 puts on metadata blocks."""
    length = len(data)
    a = b = c = (0xDEADBEEF + length + initval) & _M
    i = 0
    while length > 12:
        a = (a + int.from_bytes(data[i : i + 4], "little")) & _M
        b = (b + int.from_bytes(data[i + 4 : i + 8], "little")) & _M
        c = (c + int.from_bytes(data[i + 8 : i + 12], "little")) & _M
        a = (a - c) & _M
        a ^= _rot(c, 4)
        c = (c + b) & _M  # noqa: E702 - the mix rounds read best as in the reference
        b = (b - a) & _M
        b ^= _rot(a, 6)
        a = (a + c) & _M  # noqa: E702
        c = (c - b) & _M
        c ^= _rot(b, 8)
        b = (b + a) & _M  # noqa: E702
        a = (a - c) & _M
        a ^= _rot(c, 16)
        c = (c + b) & _M  # noqa: E702
        b = (b - a) & _M
        b ^= _rot(a, 19)
        a = (a + c) & _M  # noqa: E702
        c = (c - b) & _M
        c ^= _rot(b, 4)
        b = (b + a) & _M  # noqa: E702
        i += 12
        length -= 12
    if length == 0:
        return c
    tail = data[i:] + bytes(12 - length)
    a = (a + int.from_bytes(tail[0:4], "little")) & _M
    b = (b + int.from_bytes(tail[4:8], "little")) & _M
    c = (c + int.from_bytes(tail[8:12], "little")) & _M
    c ^= b
    c = (c - _rot(b, 14)) & _M  # noqa: E702
    a ^= c
    a = (a - _rot(c, 11)) & _M  # noqa: E702
    b ^= a
    b = (b - _rot(a, 25)) & _M  # noqa: E702
    c ^= b
    c = (c - _rot(b, 16)) & _M  # noqa: E702
    a ^= c
    a = (a - _rot(c, 4)) & _M  # noqa: E702
    b ^= a
    b = (b - _rot(a, 14)) & _M  # noqa: E702
    c ^= b
    c = (c - _rot(b, 24)) & _M  # noqa: E702
    return c


def consistency_flags(path: str | Path) -> int:
    with open(path, "rb") as f:
        head = f.read(12)
    if head[:8] != _SIGNATURE or head[8] < 2:
        return 0  # older superblocks have no flags
    return head[11]


def clear_consistency_flags(path: str | Path) -> bool:
    """Clear the superblock's open-for-write flags; returns whether any were set."""
    with open(path, "r+b") as f:
        head = f.read(12)
        if head[:8] != _SIGNATURE or head[8] not in (2, 3):
            return False
        size_of_offsets = head[9]
        sb_len = 12 + 4 * size_of_offsets  # flags, then base, extension, EOF and root addresses
        f.seek(0)
        block = bytearray(f.read(sb_len + 4))
        if block[11] == 0:
            return False
        if int.from_bytes(block[sb_len:], "little") != lookup3(bytes(block[:sb_len])):
            raise OSError(f"{path}: superblock checksum mismatch; the file is damaged beyond flag clearing")
        block[11] = 0
        block[sb_len:] = lookup3(bytes(block[:sb_len])).to_bytes(4, "little")
        f.seek(0)
        f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return True
