"""Where an engine's processes run: each rank's or replica's CPU cores (--tp-cores, --dp-cores, ...), pinning a
process to them, whether the host has the cores and memory for that many processes, a free port for their
rendezvous."""

from __future__ import annotations

import os
import socket

import torch

from llmopt.core.errors import ConfigError
from llmopt.runtime.engine.config import PROCESSES_PER_CORE, EngineConfig
from llmopt.runtime.executor.host_memory import host_available_bytes

START_TIMEOUT_S = 300.0  # a process's import + load on a slow machine; a dead process is noticed at once
# an engine process's memory before its weights and KV cache (the interpreter, torch, the kernels): what a
# data-parallel replica of a tiny model measured on its own (unique set size), rounded down
ENGINE_PROCESS_BYTES = 300 << 20


def rank_cores(spec: str | None, world: int, available: list[int] | None = None,
               param: str = "tp_cores") -> list[list[int]]:
    """Each rank's (or replica's) CPU cores: --tp-cores / --dp-cores "0-3;4-7" (one list each, `;`-separated;
    ranges and commas), or an even split of the cores this process may run on. A core this process may not run on
    is refused here, before any process starts (a rank pinned to it would die at start)."""
    flag = "--" + param.replace("_", "-")
    available = sorted(available if available is not None else os.sched_getaffinity(0))
    if spec:
        ranks = [sorted({c for part in text.split(",") if part for c in _core_range(part, flag)})
                 for text in spec.split(";")]
        if len(ranks) != world or not all(ranks):
            raise ConfigError(f"{flag} {spec!r}: give {world} non-empty core lists separated by ';'", param=param)
        missing = sorted({c for cores in ranks for c in cores} - set(available))
        if missing:
            raise ConfigError(f"{flag} {spec!r}: core{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(map(str, missing))} {'are' if len(missing) > 1 else 'is'} not among the "
                              f"cores this process may run on ({_core_list(available)}): give cores from those",
                              param=param)
        return ranks
    if len(available) < world:
        return [available] * world  # more ranks than cores: they share
    return [available[r * len(available) // world:(r + 1) * len(available) // world] for r in range(world)]


def _core_list(cores: list[int]) -> str:
    """Sorted cores as ranges: [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def check_host_fits(processes: int, what: str, param: str, config: EngineConfig, weight_bytes: int,
                    cores: int | None = None, available: int | None = None) -> None:
    """Refuse, before any process starts, an engine of more processes than this host can run: more than
    PROCESSES_PER_CORE per core this process may use (unless config.oversubscribe), or more memory than is available
    (each process: ENGINE_PROCESS_BYTES, `weight_bytes` of weights and an explicit --kv-cache-bytes). `what` names
    the processes ("4 data-parallel replicas"), `param` the option that asked for them."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    flag = "--" + param.replace("_", "-")
    if processes > PROCESSES_PER_CORE * cores and not config.oversubscribe:
        raise ConfigError(f"{flag}: {what} is more than {PROCESSES_PER_CORE} processes per core on this host "
                          f"({cores} cores this process may use): give at most {PROCESSES_PER_CORE * cores}, or "
                          f"--oversubscribe to start them anyway", param=param)
    if available is None:
        available = host_available_bytes()
    each = ENGINE_PROCESS_BYTES + weight_bytes + (config.kv_cache_bytes or 0)
    if processes * each > available:
        raise ConfigError(f"{flag}: {what} need about {processes * each / 2**30:,.1f} GiB ({each / 2**30:,.2f} GiB "
                          f"each: the process, its weights{' and its KV cache' if config.kv_cache_bytes else ''}), "
                          f"more than the {available / 2**30:,.1f} GiB of memory available: start fewer",
                          param=param)


def _core_range(text: str, flag: str) -> range:
    try:
        first, _, last = text.partition("-")
        return range(int(first), int(last or first) + 1)
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a core number or range like 0-3",
                          param=flag[2:].replace("-", "_")) from None


def pin(cores: list[int]) -> tuple[set[int], int]:
    """Run this thread (and the torch threads it starts) on `cores`; returns what to restore."""
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
