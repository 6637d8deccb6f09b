"""glibc's malloc set for a process that lives for days and allocates tensors from many threads.

By default glibc gives each thread that allocates its own arena (up to eight per core) and raises
its mmap threshold each time a large block is freed, up to 32 MiB, so that a freed activation or
scratch buffer goes back into an arena rather than to the system. A peer or an API that runs torch
from trio's worker threads and OpenMP's then holds a dozen arenas, each fragmented by tensors of
every shape, and its resident memory creeps up with no Python object behind it. Two arenas and a
fixed threshold (blocks from 128 KiB are mapped, and unmapped when freed) keep it flat.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

ARENAS = 2
MMAP_FROM = 128 * 1024
TRIM_FROM = 256 * 1024


def tune() -> bool:
    """Apply the settings to this process's malloc; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): its allocator as it is
        log.debug("malloc left at its defaults: no mallopt in %s", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(mallopt(option, value) == 1 for option, value in (
        (M_ARENA_MAX, ARENAS), (M_MMAP_THRESHOLD, MMAP_FROM), (M_TRIM_THRESHOLD, TRIM_FROM)))
