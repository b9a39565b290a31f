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
from pathlib import Path

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts: blocks below it come from the heap
TRIM_THRESHOLD = 2**31 - 1  # never give the heap's free top back to the OS


@lru_cache(maxsize=1)
def linux_libc() -> ctypes.CDLL | None:
    """The C library on Linux (its calls release the GIL; errno kept for ctypes.get_errno), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@lru_cache(maxsize=1)
def keep_freed_host_memory() -> bool:
    """Make glibc reuse freed memory for large blocks (once per process); False where that is not possible
    (not glibc, or LLMOPT_KEEP_HOST_MEMORY=0). The process then keeps its peak footprint, as a server does."""
    libc = linux_libc()
    if os.environ.get("LLMOPT_KEEP_HOST_MEMORY", "1") == "0" or libc is None:
        return False
    try:
        mallopt = libc.mallopt  # glibc's; musl has none
    except AttributeError:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.info("mallopt refused the thresholds; host allocations keep glibc's defaults")
    return done


CGROUP_ROOT = "/sys/fs/cgroup"
NO_CGROUP_LIMIT = 1 << 60  # cgroup v1 writes ~2^63 for "none", v2 writes "max"


def cgroup_memory_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT) -> int | None:
    """Bytes this process's memory cgroup (v2 or v1) and every cgroup above it still allow, or None without a
    limit. A container's limit is not in the host's available memory (psutil's figure), and a KV cache sized from
    the host's and then committed (EngineConfig.kv_cache_commit) would get the container killed."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    headroom = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: memory.max / memory.current
            files, base = ("memory.max", "memory.current"), root
        elif "memory" in controllers.split(","):  # v1
            files, base = ("memory.limit_in_bytes", "memory.usage_in_bytes"), os.path.join(root, "memory")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the process's cgroup, then each one above it
            room = _cgroup_room(os.path.join(base, *parts[:depth]), *files)
            if room is not None:
                headroom = room if headroom is None else min(headroom, room)
    return headroom


def _cgroup_room(directory: str, limit_file: str, usage_file: str) -> int | None:
    try:
        limit = Path(directory, limit_file).read_text().strip()
        usage = int(Path(directory, usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= NO_CGROUP_LIMIT:
        return None
    return max(int(limit) - usage, 0)
