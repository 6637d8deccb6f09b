"""diffuse.allocator: a process whose threads all allocate at once keeps two malloc arenas, not
one per thread, so a long-lived peer's or API's memory is not spread over a dozen fragmented ones."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import ctypes, re, sys, tempfile, threading
from diffuse import allocator
if sys.argv[1] == "tuned":
    assert allocator.tune()
libc = ctypes.CDLL(None)
libc.fdopen.restype, libc.fdopen.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_char_p]
libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
barrier = threading.Barrier(8)
def work():
    barrier.wait()
    held = [bytearray(200_000) for _ in range(20)]  # allocating together: glibc gives each thread an arena
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
fd, path = tempfile.mkstemp()
out = libc.fdopen(fd, b"w")
libc.malloc_info(0, out)
libc.fclose(out)
print(len(re.findall(r'<heap nr="[0-9]+">', open(path).read())))
"""


def arenas(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_eight_threads_allocating_at_once_share_two_arenas():
    assert arenas("default") > 2  # glibc's own: an arena per contending thread
    assert arenas("tuned") == 2
