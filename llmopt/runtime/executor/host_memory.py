"""Host allocator settings for serving on CPU.

torch's CPU tensors come straight from malloc. With glibc's defaults a prefill step's large activations
(a 2048-token chunk's gate/up output is 12.6 MB for SmolLM2) are served by fresh mmaps or by heap memory that
was trimmed back to the OS at the previous step's end, so each step touches new pages: ~150k page faults per
8k-token prefill, ~0.35 s of kernel time in a 64-request benchmark run. vLLM's CPU backend asks for tcmalloc
through LD_PRELOAD for the same reason; here glibc is told to keep what it frees instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from functools import lru_cache

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts: blocks below it come from the heap
TRIM_THRESHOLD = 2**31 - 1  # never give the heap's free top back to the OS


@lru_cache(maxsize=1)
def keep_freed_host_memory() -> bool:
    """Make glibc reuse freed memory for large blocks (once per process); False where that is not possible
    (not glibc, or LLMOPT_KEEP_HOST_MEMORY=0). The process then keeps its peak footprint, as a server does."""
    if os.environ.get("LLMOPT_KEEP_HOST_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt  # glibc's; musl has none
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.info("mallopt refused the thresholds; host allocations keep glibc's defaults")
    return done
