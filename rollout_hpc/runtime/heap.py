"""Keep the memory a step frees inside the rank, for the next step to reuse, instead of handing it back to the kernel.

glibc's malloc returns freed memory to the kernel in two ways: a block above the mmap threshold is its own mapping,
unmapped when freed; and free space at the top of the heap beyond the trim threshold is trimmed. Both thresholds
adapt, but only as high as the largest mapped block freed so far (128 KiB at first). A rank's steps allocate and
free the same tensors again and again, so every step's new memory came back as page faults, one per 4 KiB, each
with a zeroed page: measured on the quickstart's colocated run (tools/bench_e2e.py's task, 2 cores) ~2,300 faults
a step on the generator and ~3,000 on the trainer (the plain single-process loop: ~580), and 5 and 27 with the
ceilings below. Setting either threshold alone turns the other's adaptation off: it takes both.

The ceilings are the ones glibc's own adaptation stops at on 64-bit (32 MiB, and twice that to trim): blocks
larger than 32 MiB are still mapped and unmapped, and at most 64 MiB of free heap top stays with the process. A
user's own allocator settings win: GLIBC_TUNABLES with glibc.malloc.*, the MALLOC_*_ variables, or another
allocator preloaded (jemalloc, tcmalloc)."""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where glibc's adaptation stops
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # the adaptation keeps trim at twice the mmap threshold


def user_has_allocator_settings(environ=os.environ) -> bool:
    """Whether the user chose malloc settings (or another allocator) for this process: then they stand."""
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return True
    if any(k.startswith("MALLOC_") and k.endswith("_") for k in environ):  # MALLOC_TRIM_THRESHOLD_ etc.
        return True
    preload = environ.get("LD_PRELOAD", "")
    return any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc"))


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to their adaptive ceilings in this process. True if set; False where
    the user set their own, or the C library is not glibc (musl, macOS: nothing to do)."""
    if user_has_allocator_settings():
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
    except (ValueError, OSError):
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
