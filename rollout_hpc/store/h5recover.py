"""Reopen an HDF5 file whose SWMR writer was killed, and read one that is damaged.

A file opened for (SWMR) writing carries "file consistency flags" in its
superblock; HDF5 refuses to open it for writing again until they are cleared
(the `h5clear -s` tool does this). A SIGKILLed writer never clears them. We
clear them ourselves: rewrite the flags byte of the version 2/3 superblock and
its Jenkins lookup3 checksum. The caller must first make sure no writer is
alive (the trajectory log holds an flock on a sibling lock file for that).

A damaged file (truncated, overwritten, bit rot) is read as far as it goes: `superblock_damage` says
whether it can be opened at all, `open_swmr_reader` opens it without HDF5's SWMR retry loop (by default
a damaged metadata block makes a SWMR reader retry 100 times with exponential sleeps: hours), and
`first_unreadable` finds where each dataset stops being readable.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import h5py

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
    if len(head) < 12 or head[:8] != _SIGNATURE or head[8] < 2:
        return 0  # older superblocks have no flags; a file this short has no superblock to clear
    return head[11]


def superblock_damage(path: str | Path) -> str | None:
    """Why the file cannot be opened as HDF5 at all (no signature, superblock cut or failing its checksum),
    or None. Only version 2/3 superblocks (libver='latest', what SWMR files have) are checked in full."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(64)
    if len(head) < 12 or head[:8] != _SIGNATURE:
        return f"not an HDF5 file: {size} bytes without the HDF5 signature at the start"
    if head[8] not in (2, 3):
        return None
    sb_len = 12 + 4 * head[9]
    if len(head) < sb_len + 4:
        return f"truncated to {size} bytes, inside its superblock"
    if int.from_bytes(head[sb_len : sb_len + 4], "little") != lookup3(head[:sb_len]):
        return "its superblock fails its checksum (overwritten or damaged)"
    return None


def stored_eof(path: str | Path) -> int | None:
    """The end-of-file address a version 2/3 superblock records (None for other superblocks)."""
    with open(path, "rb") as f:
        head = f.read(64)
    if len(head) < 12 or head[:8] != _SIGNATURE or head[8] not in (2, 3):
        return None
    o = head[9]
    base, eof = (int.from_bytes(head[12 + i * o : 12 + (i + 1) * o], "little") for i in (0, 2))
    return base + eof


@functools.cache
def _set_read_attempts():
    """H5Pset_metadata_read_attempts of the HDF5 library h5py runs on (h5py does not wrap it), or None."""
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "/libhdf5" in line and "libhdf5_hl" not in line}
        for lib in libs:
            fn = ctypes.CDLL(lib).H5Pset_metadata_read_attempts
            fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.c_uint], ctypes.c_int
            return fn
    except (OSError, AttributeError):
        pass
    return None


# A SWMR reader retries a metadata block that fails its checksum (the writer may be rewriting it) with
# sleeps doubling from 1 ns: 24 attempts wait about 30 ms in all (for each damaged block; 30 attempts
# measured 1.1 s), HDF5's default of 100 waits for hours.
READ_ATTEMPTS = 24


def open_swmr_reader(path: str | Path) -> h5py.File:
    """h5py.File(path, "r", libver="latest", swmr=True, locking=False) that gives up on a damaged
    metadata block within seconds instead of retrying for hours."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    fapl.set_file_locking(False, True)
    set_attempts = _set_read_attempts()
    if set_attempts is not None:
        set_attempts(fapl.id, READ_ATTEMPTS)
    fid = h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ, fapl=fapl)
    return h5py.File(fid)


# What h5py raises for data or metadata it cannot read (a filter failing on a cut chunk, a bad checksum).
READ_ERRORS = (OSError, KeyError, ValueError, RuntimeError)


def first_unreadable(ds: h5py.Dataset, extent: int, read: bool) -> int:
    """The first index along axis 0, below `extent`, from which `ds` cannot be read (`extent` if none).

    read=False only walks the chunk index and checks that every chunk lies inside the file (cheap: finds a
    truncation); read=True also reads and decompresses every chunk (finds flipped or zeroed bytes)."""
    if extent <= 0:
        return 0
    size = os.path.getsize(ds.file.filename)
    if ds.chunks is None:
        offset = ds.id.get_offset()
        if offset is None or offset + ds.id.get_storage_size() > size:
            return 0
        return extent if not read or _readable(ds, 0, extent) else 0
    rows = ds.chunks[0]
    bad = extent
    try:
        chunks: list[tuple[int, int, int]] = []
        ds.id.chunk_iter(lambda c: chunks.append((c.chunk_offset[0], c.byte_offset, c.size)))
    except READ_ERRORS:
        return 0  # the chunk index itself is unreadable
    present = {start for start, _, _ in chunks}
    for start, offset, nbytes in chunks:
        if start < bad and offset + nbytes > size:
            bad = start
    # a chunk the index lost below the extent would read as fill values (a 1-D log column is always written
    # in full; a 2-D table may have chunks never written: columns added later)
    for start in range(0, min(bad, extent), rows) if ds.ndim == 1 else ():
        if start not in present:
            bad = start
            break
    if read:
        for start in range(0, min(bad, extent), rows):
            if not _readable(ds, start, min(start + rows, extent)):
                return start
    return bad


def _readable(ds: h5py.Dataset, lo: int, hi: int) -> bool:
    try:
        ds[lo:hi]
    except READ_ERRORS:
        return False
    return True


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
