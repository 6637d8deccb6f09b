"""glibc's malloc set for a process that lives for days and allocates from many threads.

By default glibc gives each thread that allocates while another holds an arena its own arena (up
to eight per core). A peer or an API runs torch from trio's worker threads and OpenMP's, so it
would hold a dozen arenas, each fragmented by tensors of every shape, and keep memory that no
object uses. Two arenas keep that bounded. glibc's mmap threshold is left to adapt: fixing it low
(so freed blocks go back to the system at once) made every large batch tensor a fresh mapping,
and batched decoding measurably slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_ARENA_MAX = -8
ARENAS = 2


def tune() -> bool:
    """Apply the setting to this process's malloc; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): its allocator as it is
        log.debug("malloc left at its defaults: no mallopt in %s", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt(M_ARENA_MAX, ARENAS) == 1
