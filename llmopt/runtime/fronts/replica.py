"""A replica process (an engine fed by a front's commands through a pipe) and the front's record of it: shared by
the data-parallel front (its replicas) and the disaggregated one (its prefill and decode workers)."""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict

from llmopt.core.errors import LLMOptError
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.output import RequestOutput
from llmopt.runtime.engine.stats import EngineStats
from llmopt.runtime.executor.placement import pin

PREFIX_MEMORY_BLOCKS = 1 << 16  # block hashes remembered per replica (least recently routed forgotten first)


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained hash of each full block of a prompt (as the block manager keys its prefix cache)."""
    hashes, h = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start:start + block_size])))
        hashes.append(h)
    return hashes


class PrefixMemory:
    """The block hashes of the prompts one replica was sent (LRU-bounded)."""

    def __init__(self, capacity: int = PREFIX_MEMORY_BLOCKS):
        self.capacity = capacity
        self.hashes: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: list[int]) -> int:
        """Leading blocks of `hashes` this replica was sent before."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def add(self, hashes: list[int]) -> None:
        for h in hashes:
            self.hashes[h] = None
            self.hashes.move_to_end(h)
        while len(self.hashes) > self.capacity:
            self.hashes.popitem(last=False)


class ReplicaLoop:
    """A replica process's loop: the front's commands between engine steps, its outputs sent back with the front's
    request ids. Disaggregated workers extend it (runtime.fronts.disaggregated)."""

    def __init__(self, engine: Engine, connection):
        self.engine, self.connection = engine, connection
        self.ids: dict[int, int] = {}  # local request id -> the front's
        self.local: dict[int, int] = {}

    def run(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self.connection.poll(None)  # idle: block until a command (or EOF: the front is gone)
            while self.connection.poll():
                command = self.connection.recv()
                if command is None:
                    return
                self.handle(command)
            if self.engine.has_unfinished():
                self.report(self.engine.step())

    def handle(self, command: tuple) -> None:
        handle_command(self.engine, command, self.ids, self.local, self.connection)

    def forget(self, output: RequestOutput) -> int | None:
        """The front's id of an output's request (None: not the front's), forgotten once it finished."""
        front_id = self.ids.get(output.request_id)
        if front_id is not None and output.finished:
            del self.ids[output.request_id]
            del self.local[front_id]
        return front_id

    def report(self, outputs: list[RequestOutput]) -> None:
        sent = [dataclasses.replace(o, request_id=front_id) for o in outputs
                if (front_id := self.forget(o)) is not None]
        self.connection.send(("outputs", sent, replica_status(self.engine)))


def run_replica(connection, cores: list[int], start) -> None:
    """A replica process's life: pinned to its cores, `start()` builds its ReplicaLoop (the model load), "ready" to
    the front, then the loop. A closed pipe ends it quietly; any failure goes to the front in one line (the front
    restarts it)."""
    try:
        pin(cores)
        loop = start()
        engine = loop.engine
        connection.send(("ready", {"kv_cache_info": engine.kv_cache_info(), "numerics": engine.numerics(),
                                   "pid": os.getpid()}))
        loop.run()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    except BaseException as e:  # noqa: BLE001 (one line to the front, which restarts the replica)
        try:
            connection.send(("error", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"))
        except OSError:
            pass
        raise SystemExit(1) from None


def replica_status(engine: Engine) -> dict:
    bm = engine.block_manager
    return {"waiting": engine.num_waiting, "running": engine.num_running, "usage": bm.usage,
            "preemptions": engine.scheduler.num_preemptions}


def handle_command(engine: Engine, command: tuple, ids: dict, local: dict, connection) -> None:
    kind = command[0]
    if kind == "add":
        _, front_id, prompt, params, arrival = command
        try:
            request_id = engine.add_request(prompt, params, arrival_time=arrival)
        except LLMOptError as e:
            connection.send(("rejected", front_id, str(e), e.param))
            return
        ids[request_id], local[front_id] = front_id, request_id
    elif kind == "abort":
        if command[1] in local:
            engine.abort(local[command[1]])
    elif kind == "stats":
        connection.send(("stats", engine.stats()))
    elif kind == "reset_stats":
        engine.reset_stats(clear_prefix_cache=command[1])
    elif kind == "reset":
        engine.reset()
        ids.clear()
        local.clear()


@dataclasses.dataclass
class Replica:
    index: int
    cores: list[int]
    process: object = None
    connection: object = None
    ready: bool = False
    info: dict = dataclasses.field(default_factory=dict)
    status: dict = dataclasses.field(default_factory=dict)
    outstanding: int = 0  # prompt + max_tokens of the requests it runs
    requests: set = dataclasses.field(default_factory=set)
    prefixes: PrefixMemory = dataclasses.field(default_factory=PrefixMemory)
    restarts: int = 0
    stats: EngineStats | None = None
    role: str = "replica"  # (prefill / decode under disaggregation)
