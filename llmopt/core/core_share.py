"""Threads that follow the cores actually free.

A parallel region gives each of torch's threads an equal share and waits for the last one. When another process
keeps one of this process's cores busy, the thread on that core runs at half speed (or less, while its peers spin
waiting for it), and every region waits for it: beside one busy single-threaded process a bench with a thread
per core kept a fraction of its quiet throughput, less than with one thread fewer (docs/results/reliability.md).
`CoreShare.limited()` runs one unit of work (an engine step, a calibrated layer) with as many threads as cores are
left: it measures, at most once per ADAPT_INTERVAL_S, how much of this process's cores other processes used
(/proc/stat, less this process's own time; niced processes are not counted: they yield to this one), and puts
torch's thread count back after the unit, so nothing outside it sees a change.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Iterator

import torch

ADAPT_INTERVAL_S = 1.0  # between measurements: /proc/stat counts in ticks of 10 ms
# /proc/stat's per-CPU columns: user nice system idle iowait irq softirq steal; what other processes' running
# takes from this one (niced time left out: a niced process yields its core)
_BUSY_COLUMNS = (0, 2, 5, 6, 7)


def _cpu_ticks(cores: set[int]) -> int | None:
    """Busy ticks of `cores` since boot (None where /proc/stat is not readable: not Linux)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            fields = rest.split()
            total += sum(int(fields[i]) for i in _BUSY_COLUMNS if i < len(fields))
    return total


def _own_ticks() -> int:
    """This process's CPU time (all its threads) in ticks."""
    times = os.times()
    return round((times.user + times.system) * os.sysconf("SC_CLK_TCK"))


class CoreShare:
    """The thread count the cores other processes leave free allow, measured every `interval_s`; `limited()` runs
    a unit of work (an engine step, a calibrated layer) with it, and puts torch's count back after."""

    def __init__(self, interval_s: float = ADAPT_INTERVAL_S):
        self.cores = set(os.sched_getaffinity(0))
        self.interval_s = interval_s
        self.tick = os.sysconf("SC_CLK_TCK")
        self.free = float(len(self.cores))  # cores left to this process, as last measured
        self._last = self._sample()

    def _sample(self) -> tuple[float, int | None, int]:
        return time.monotonic(), _cpu_ticks(self.cores), _own_ticks()

    def measure(self) -> float:
        """The cores other processes left free on this process's, over the last interval_s (the last measurement
        until that much time has passed)."""
        if self._last[1] is None or time.monotonic() - self._last[0] < self.interval_s:  # (most calls stop here)
            return self.free
        now = self._sample()
        if now[1] is not None:
            others = ((now[1] - self._last[1]) - (now[2] - self._last[2])) / self.tick / (now[0] - self._last[0])
            self.free = len(self.cores) - min(max(others, 0.0), len(self.cores))
        self._last = now
        return self.free

    def threads(self, ceiling: int) -> int:
        """Threads for the next unit of work: the free cores, rounded, between 1 and `ceiling`."""
        return max(1, min(ceiling, int(self.measure() + 0.5)))

    @contextmanager
    def limited(self) -> Iterator[int]:
        """Run the block with threads(torch's count now), restoring torch's count after; yields the count."""
        before = torch.get_num_threads()
        threads = self.threads(before) if before > 1 else before
        if threads == before:
            yield threads
            return
        torch.set_num_threads(threads)
        try:
            yield threads
        finally:
            torch.set_num_threads(before)
