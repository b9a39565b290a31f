"""Committing the CPU KV cache's memory before its blocks are first written.

The cache is allocated as zero pages the OS commits on first write (kv_cache.zeros_lazily). Committing a page
is cheap on bare metal but not on every VM: where the hypervisor backs guest memory on first touch and takes
freed memory back (free-page reporting, as Firecracker microVMs do), a first write can cost tens of ms per 2 MiB:
a decode step whose sequences all cross into new blocks then stalls for seconds, and a serving run pays it for
every never-used block it touches (docs/results/code-figures.md#kv-cache-commit). llama.cpp pays the cost once at
start (it clears its KV buffer).

Modes (EngineConfig.kv_cache_commit):
- lazy: pages are committed by the step that first writes them (the cost lands in that step).
- background: a thread at the OS's idle priority commits the cache from the first block up, the order in which
  the block manager hands out fresh blocks, with madvise(MADV_POPULATE_WRITE): pages are faulted in writable
  without their contents changing, so blocks already in use are safe. It runs only when a core is idle (while
  a server waits for requests, between steps) and stops when the cache is garbage or complete.
- startup: the whole cache is committed before the engine takes requests.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING

from llmopt.runtime.engine.config import KV_CACHE_COMMIT_MODES
from llmopt.runtime.executor.host_memory import linux_libc
from llmopt.runtime.executor.platform import Platform

if TYPE_CHECKING:
    from llmopt.runtime.executor.attention.kv_cache import KVCache

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (uapi/asm-generic/mman-common.h)
PAGE_BYTES = 4096
COMMIT_CHUNK_BYTES = 2 << 20  # per tensor per call: one transparent huge page


def _madvise():
    """libc's madvise with the GIL released during the call, or None off Linux."""
    libc = linux_libc()
    if libc is None:
        return None
    madvise = libc.madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def block_ranges(kv_cache: KVCache, first: int, stop: int) -> list[tuple[int, int]]:
    """(address, length) of blocks [first, stop) in each of the cache's CPU tensors, widened to whole pages
    (a lazily zeroed tensor's mapping covers its last page: kv_cache.zeros_lazily)."""
    ranges = []
    for layer in kv_cache.layers:
        for tensor in layer.tensors:
            if tensor.numel() == 0:  # (a host-memory cache: commit_kv_cache)
                continue
            per_block = tensor.nbytes // kv_cache.num_blocks
            begin = tensor.data_ptr() + first * per_block
            end = tensor.data_ptr() + stop * per_block
            begin -= begin % PAGE_BYTES
            end += -end % PAGE_BYTES
            ranges.append((begin, end - begin))
    return ranges


def populate(madvise, ranges: list[tuple[int, int]]) -> bool:
    """Fault the ranges in writable, contents unchanged; False when the kernel cannot (before Linux 5.14)."""
    for address, length in ranges:
        if madvise(address, length, MADV_POPULATE_WRITE) != 0:
            log.info("KV cache: madvise(MADV_POPULATE_WRITE) failed (%s); pages commit on first write",
                     os.strerror(ctypes.get_errno()))
            return False
    return True


def chunk_blocks(kv_cache: KVCache) -> int:
    """Blocks per commit call: about COMMIT_CHUNK_BYTES of the cache's largest tensor."""
    largest = max(t.nbytes for layer in kv_cache.layers for t in layer.tensors)
    return max(1, COMMIT_CHUNK_BYTES * kv_cache.num_blocks // max(largest, 1))


class KVCacheCommitter:
    """Commits a KV cache's blocks in ascending order, in a background thread at idle priority or at once.
    `committed_blocks` is how far it got; it holds the cache only weakly (a dropped engine's cache is freed)."""

    def __init__(self, kv_cache: KVCache):
        self._cache = weakref.ref(kv_cache)
        self.num_blocks = kv_cache.num_blocks
        self.chunk = chunk_blocks(kv_cache)
        self.committed_blocks = 0
        self.failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        return self.committed_blocks >= self.num_blocks

    def commit_next(self, madvise) -> bool:
        """Commit the next chunk of blocks; False when there is nothing (more) to do."""
        kv_cache = self._cache()  # (a strong reference while madvise runs: the memory stays mapped)
        if kv_cache is None or self.done or self.failed:
            return False
        stop = min(self.committed_blocks + self.chunk, self.num_blocks)
        if not populate(madvise, block_ranges(kv_cache, self.committed_blocks, stop)):
            self.failed = True
            return False
        self.committed_blocks = stop
        return True

    def commit_all(self) -> None:
        madvise = _madvise()
        while madvise is not None and self.commit_next(madvise):
            pass

    def start(self) -> None:
        madvise = _madvise()
        if madvise is None:
            return
        self._thread = threading.Thread(target=self._run, args=(madvise,), name="kv-cache-commit", daemon=True)
        self._thread.start()

    def _run(self, madvise) -> None:
        try:  # this thread only: it runs when a core would otherwise idle
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass
        while not self._stop.is_set() and self.commit_next(madvise):
            pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def commit_kv_cache(kv_cache: KVCache, mode: str) -> KVCacheCommitter | None:
    """Start committing a CPU cache's memory as `mode` says (KV_CACHE_COMMIT_MODES); None for lazy or GPU."""
    if mode not in KV_CACHE_COMMIT_MODES:
        raise ValueError(f"KV cache commit mode must be one of {', '.join(KV_CACHE_COMMIT_MODES)} (got {mode!r})")
    if mode == "lazy" or not kv_cache.layers or not Platform.of(kv_cache.layers[0].key.device).host_memory:
        return None
    committer = KVCacheCommitter(kv_cache)
    if mode == "startup":
        committer.commit_all()
    else:
        committer.start()
    return committer
