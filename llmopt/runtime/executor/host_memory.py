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

import psutil
import torch
from torch import nn

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


HUGE_PAGE_BYTES = 2 << 20  # x86-64's transparent huge page
TENSOR_ALIGN = 64  # bytes: each weight in the huge-page arena starts on a cache line
TRIM_EVERY_BYTES = 256 << 20  # weights moved between two returns of the freed heap to the OS
MOVE_MIN_BYTES = HUGE_PAGE_BYTES  # weights smaller than one huge page in all stay where they are


def huge_page_zeros(nbytes: int) -> torch.Tensor | None:
    """An anonymous mapping of at least nbytes (zero-filled, committed on first write) advised into huge pages
    from a 2 MiB boundary, as a uint8 tensor that keeps the mapping alive; None where mmap or madvise cannot."""
    import mmap

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    whole = torch.frombuffer(region, dtype=torch.uint8)  # (holds a reference to the mapping)
    offset = -whole.data_ptr() % HUGE_PAGE_BYTES  # the first huge page boundary inside it
    return whole[offset:offset + nbytes]


def _plain_cpu_tensors(module: nn.Module):
    """The module's parameters, buffers and tensor attributes (a detached view of a weight kept for one kernel)
    that live in ordinary CPU memory: not oneDNN's prepacked weights, which are opaque tensors, nor inference
    tensors, which cannot be moved outside inference mode, nor the buffers a linear method reads only for
    prefill-sized steps (its `prefill_only_buffers`: other layouts of the same codes, read by compute-bound GEMMs;
    an int4 artifact's decode reads a quarter of its layers' bytes)."""
    for sub in module.modules():
        prefill_only = set(getattr(sub, "prefill_only_buffers", ()))
        buffers = [t for name, t in sub._buffers.items() if name not in prefill_only]
        attributes = [value for value in vars(sub).values() if isinstance(value, torch.Tensor)]
        for tensor in [*sub._parameters.values(), *buffers, *attributes]:
            if (tensor is not None and tensor.device.type == "cpu" and tensor.layout == torch.strided
                    and not tensor.is_inference()):
                yield tensor


def _weight_storages(module: nn.Module, sharing: tuple[nn.Module, ...]) -> dict[int, list[torch.Tensor]]:
    """Every plain CPU tensor of `module`, grouped by the storage it views (a tied head and its embedding share
    one), keyed by that storage's address; with the tensors of `sharing` that view one of those storages."""
    storages: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for owner in (module, *sharing):
        for tensor in _plain_cpu_tensors(owner):
            key = tensor.untyped_storage().data_ptr()
            if id(tensor) in seen or (owner is not module and key not in storages):
                continue
            seen.add(id(tensor))
            storages.setdefault(key, []).append(tensor)
    return storages


def weights_to_huge_pages(module: nn.Module, sharing: tuple[nn.Module, ...] = ()) -> int:
    """Move the module's CPU weights into one mapping advised into transparent huge pages; returns the bytes moved
    (0 where the OS gives no such mapping, or LLMOPT_WEIGHTS_HUGE_PAGES=0).

    A decode step streams every weight once, and torch's weights come from malloc in 4 KiB pages: the hardware
    prefetchers stop at each 4 KiB page boundary and every page costs a TLB entry. From 2 MiB pages the same read
    is faster (docs/results/code-figures.md#weights-in-huge-pages). Each tensor keeps its identity (its storage
    is swapped in place with `set_`), so references taken at build time stay valid. sharing: modules whose tensors
    may view the same memory (the checkpoint's model the runtime's was built from): those views move with it, so
    nothing holds the old memory, which goes back to the OS as the move goes (at most TRIM_EVERY_BYTES held
    twice)."""
    if os.environ.get("LLMOPT_WEIGHTS_HUGE_PAGES", "1") == "0":
        return 0
    storages = _weight_storages(module, sharing)
    offsets, total = {}, 0
    for key, tensors in storages.items():
        offsets[key] = total
        total += -(-tensors[0].untyped_storage().nbytes() // TENSOR_ALIGN) * TENSOR_ALIGN
    arena = huge_page_zeros(total) if total >= MOVE_MIN_BYTES else None
    if arena is None:
        return 0
    since_trim = 0
    for key, tensors in storages.items():
        since_trim += _move_storage(tensors, arena, offsets[key])
        if since_trim >= TRIM_EVERY_BYTES:
            release_free_heap()
            since_trim = 0
    release_free_heap()
    return total


@torch.no_grad()
def _move_storage(tensors: list[torch.Tensor], arena: torch.Tensor, offset: int) -> int:
    """Copy the storage these tensors view to arena[offset:] and point each of them there (same offsets, sizes,
    strides); returns its bytes."""
    old = tensors[0].untyped_storage()
    nbytes = old.nbytes()
    arena[offset:offset + nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
    start = arena.storage_offset() + offset
    for tensor in tensors:
        size = tensor.element_size()
        tensor.set_(arena.untyped_storage(), start // size + tensor.storage_offset(), tensor.size(), tensor.stride())
    return nbytes


def release_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim: free chunks inside the heap too, not only
    its top, which keep_freed_host_memory keeps); nothing elsewhere."""
    libc = linux_libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        trim(0)


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


def host_available_bytes() -> int:
    """Bytes of host memory this process may still take: the host's available memory (psutil), no more than its
    memory cgroup leaves (a container's limit)."""
    host = psutil.virtual_memory().available
    cgroup = cgroup_memory_headroom()
    return host if cgroup is None else min(host, cgroup)


# a second copy of a weight in another layout (a faster kernel for some row counts) is made only while this fraction
# of the host's memory stays available after it: the KV cache and the rest of the machine come first
SECOND_COPY_SPARE_FRACTION = 0.5


def room_for_second_copy(nbytes: int) -> bool:
    """Whether a weight's second copy of `nbytes` leaves SECOND_COPY_SPARE_FRACTION of the host's memory available
    (a 135M model's copies fit anywhere; a 7B bf16 model's 13.5 GB on a 24 GiB machine leaves no room for them)."""
    return host_available_bytes() - nbytes >= SECOND_COPY_SPARE_FRACTION * psutil.virtual_memory().total


def _cgroup_room(directory: str, limit_file: str, usage_file: str) -> int | None:
    try:
        limit = Path(directory, limit_file).read_text().strip()
        usage = int(Path(directory, usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= NO_CGROUP_LIMIT:
        return None
    return max(int(limit) - usage, 0)
