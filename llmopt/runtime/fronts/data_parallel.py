"""Data parallelism: N engine replicas, one process each on its own cores, behind one front that is an EngineClient
(`DataParallelEngine`, runtime/engine/client.py), so the OpenAI server and the bench drive it as they drive one
engine.

Routing (as SGLang's router and vLLM's DP coordinator do it): each request goes to the replica with the fewest
outstanding tokens (prompt + max_tokens of the requests it runs), unless a replica within AFFINITY_SLACK_TOKENS of
that load already holds a longer prefix of the prompt in its prefix cache: the front remembers the chained block
hashes of the prompts it sent each replica (an approximation of the replica's cache: evictions are not seen).

A replica that dies fails only its own requests (`ReplicaFailed`, raised by the next `step()`), and is started
again; the front stays up. Replicas read the front's commands from a pipe and exit when it closes, so none
outlives the front."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from llmopt.core.errors import ConfigError, LLMOptError, ParallelError, ReplicaFailed, RequestsFailed
from llmopt.core.io import weights_bytes
from llmopt.core.models import load_config, load_tokenizer, model_limits, resolve_model
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine, check_request, check_token_ids
from llmopt.runtime.engine.output import RequestOutput
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.engine.scheduler import check_schedulable
from llmopt.runtime.engine.stats import EngineStats
from llmopt.runtime.executor.loader import load_for_engine
from llmopt.runtime.executor.placement import START_TIMEOUT_S, check_host_fits, rank_cores
from llmopt.runtime.fronts.replica import PrefixMemory, Replica, ReplicaLoop, block_hashes, run_replica

log = logging.getLogger(__name__)
AFFINITY_SLACK_TOKENS = 2048  # a replica holding the prefix takes the request while this close to the least loaded
POLL_S = 0.002  # a step waits this long for the replicas' outputs
MAX_RESTARTS = 3  # a replica that dies more often than this stays down
REPLY_TIMEOUT_S = 30.0


def replica_main(index: int, load_args: dict, config: EngineConfig, cores: list[int], record_steps: bool,
                 connection) -> None:
    """A data-parallel replica's process: its engine, fed by the front's commands."""

    def start() -> ReplicaLoop:
        model, tokenizer, _ = load_for_engine(config=config, **load_args)
        return ReplicaLoop(Engine(model, tokenizer, config, record_steps=record_steps), connection)

    run_replica(connection, cores, start)


class _Usage:
    def __init__(self, front: DataParallelEngine):
        self.front = front

    @property
    def usage(self) -> float:
        values = [r.status.get("usage", 0.0) for r in self.front.replicas if r.ready]
        return sum(values) / len(values) if values else 0.0


class _Preemptions:
    def __init__(self, front: DataParallelEngine):
        self.front = front

    @property
    def num_preemptions(self) -> int:
        return sum(r.status.get("preemptions", 0) for r in self.front.replicas)


class DataParallelEngine:
    """config.data_parallel_size replicas of MODEL behind the Engine's interface (add_request, step, abort, ...)."""

    def __init__(self, model_name: str, config: EngineConfig, dtype: str = "float32", device: str = "cpu",
                 trust_remote_code: bool = False, record_steps: bool = True):
        self.config = config
        source = resolve_model(model_name)
        model_config = load_config(source, trust_remote_code)
        self.tokenizer = load_tokenizer(source, trust_remote_code)
        self.max_context, self.vocab_size = model_limits(model_config)
        self.load_args = dict(name=model_name, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        self.weight_bytes = weights_bytes(source.path) if source.path is not None else 0  # (each process's)
        self.replica_config = dataclasses.replace(config, data_parallel_size=1)
        self.record_steps = record_steps
        self.replicas = self._make_replicas()
        self._context = mp.get_context("spawn")
        self._lock = threading.RLock()  # one reader of the replicas' pipes at a time
        self._requests: dict[int, tuple[int, int]] = {}  # front id -> (replica, outstanding tokens)
        self._outputs: list[RequestOutput] = []
        self._failures: dict[int, LLMOptError] = {}  # request -> why it failed, reported by the next step
        self._next_id = 0
        self._start_failure: str | None = None
        self.block_manager, self.scheduler = _Usage(self), _Preemptions(self)
        self.runner = None  # (no model in this process)
        self.closed = False
        atexit.register(self.close)
        try:
            for replica in self.replicas:
                self._start(replica)
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    # --- replicas -------------------------------------------------------------------------------
    def _make_replicas(self) -> list[Replica]:
        size = self.config.data_parallel_size
        cores = rank_cores(self.config.dp_cores, size, param="dp_cores")
        check_host_fits(size, f"{size} data-parallel replicas", "data_parallel_size", self.config, self.weight_bytes)
        return [Replica(i, c) for i, c in enumerate(cores)]

    def _describe(self, replica: Replica) -> str:
        """How messages name a replica."""
        return f"data-parallel replica {replica.index}"

    def _process(self, replica: Replica, connection) -> tuple:
        """(target, process name, args) of a replica's process."""
        return (replica_main, f"llmopt-dp-replica{replica.index}",
                (replica.index, self.load_args, self.replica_config, replica.cores, self.record_steps, connection))

    def _start(self, replica: Replica) -> None:
        ours, theirs = self._context.Pipe()
        target, name, args = self._process(replica, theirs)
        replica.process = self._context.Process(target=target, name=name, args=args)
        replica.process.start()
        theirs.close()
        replica.connection, replica.ready, replica.status = ours, False, {}

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(r.ready for r in self.replicas):
            self._receive(0.2)
            if self._start_failure is not None:
                raise ParallelError(f"a worker failed to start: {self._start_failure}")
            if time.monotonic() > deadline:
                raise ParallelError(f"the engine's workers did not start within {START_TIMEOUT_S:.0f} s")

    def _receive(self, timeout: float) -> None:
        """Read every message the replicas have sent (waiting up to `timeout` for the first)."""
        with self._lock:
            live = {r.connection: r for r in self.replicas if r.connection is not None}
            sentinels = {r.process.sentinel: r for r in self.replicas if r.process is not None}
            for ready in wait([*live, *sentinels], timeout):
                replica = live.get(ready) or sentinels[ready]
                if replica.connection is None or ready not in (replica.connection, replica.process.sentinel):
                    continue  # (a replica already found dead, and restarted, in this loop)
                try:
                    while replica.connection.poll():
                        self._dispatch(replica, replica.connection.recv())
                except (EOFError, OSError):
                    self._lost(replica, "its pipe closed")
                    continue
                if ready == replica.process.sentinel and replica.connection is not None \
                        and not replica.process.is_alive():
                    self._lost(replica, f"exit code {replica.process.exitcode}")

    def _dispatch(self, replica: Replica, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            _, outputs, replica.status = message
            self._outputs.extend(outputs)
        elif kind == "ready":
            replica.ready, replica.info = True, message[1]
        elif kind == "rejected":
            _, front_id, text, param = message
            self._failures[front_id] = ConfigError(text, param=param)
        elif kind == "stats":
            replica.stats = message[1]
        elif kind == "error":
            self._lost(replica, message[1])

    def _lost(self, replica: Replica, cause: str) -> None:
        """A replica died: fail its requests, start it again (up to MAX_RESTARTS times)."""
        replica.connection.close()
        replica.connection = None
        replica.process.join(timeout=5)
        lost = sorted(replica.requests)
        for front_id in lost:
            self._requests.pop(front_id, None)
        replica.requests, replica.outstanding, replica.prefixes = set(), 0, PrefixMemory()
        message = (f"{self._describe(replica)} (pid {replica.process.pid}) died ({cause}); "
                   f"its {len(lost)} request(s) failed")
        log.error(message)
        if not replica.ready:
            self._start_failure = message
        failure = ReplicaFailed(message + ": send the request again")
        self._failures.update({front_id: failure for front_id in lost})
        if replica.restarts < MAX_RESTARTS and not self.closed:
            replica.restarts += 1
            self._start(replica)

    # --- the Engine interface -------------------------------------------------------------------
    def _admissible(self, prompt_token_ids: list[int], params: SamplingParams | None) -> SamplingParams:
        """The request's params once the checks every front makes before routing pass; the workers' news read first
        (a worker that died or started again while the front was idle)."""
        params = params or SamplingParams()
        check_request(prompt_token_ids, params, True, self.vocab_size, self.max_context)
        check_schedulable(len(prompt_token_ids), self.config)
        self._receive(0.0)
        return params

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> int:
        params = self._admissible(prompt_token_ids, params)
        replica = self._route(prompt_token_ids)
        front_id, self._next_id = self._next_id, self._next_id + 1
        cost = len(prompt_token_ids) + params.max_tokens
        replica.connection.send(("add", front_id, prompt_token_ids, params,
                                 time.perf_counter() if arrival_time is None else arrival_time))
        replica.requests.add(front_id)
        replica.outstanding += cost
        self._requests[front_id] = (replica.index, cost)
        return front_id

    def _ready(self, pool: list[Replica]) -> list[Replica]:
        """The replicas of `pool` that take requests now; when none does, ReplicaFailed (one is starting again:
        retry) or ParallelError (every one died more than MAX_RESTARTS times: the engine cannot serve)."""
        ready = [r for r in pool if r.ready and r.connection is not None]
        if ready:
            return ready
        kind = self._describe(pool[0]).rsplit(" ", 1)[0]
        starting = [r for r in pool if r.connection is not None]
        if starting:
            r = starting[0]
            raise ReplicaFailed(f"no {kind} is running: {self._describe(r)} is starting again after it died "
                                f"(restart {r.restarts} of {MAX_RESTARTS}): retry in a few seconds")
        raise ParallelError(f"every {kind} died more than {MAX_RESTARTS} times: the engine cannot serve "
                            f"(see the log for why they died); start it again")

    def _route(self, prompt: list[int], pool: list[Replica] | None = None) -> Replica:
        """The least loaded ready replica (of `pool`, default all), or one close to it that holds a longer prefix
        of the prompt."""
        ready = self._ready(self.replicas if pool is None else pool)
        hashes = block_hashes(prompt, self.config.block_size)
        least = min(r.outstanding for r in ready)
        best = max(ready, key=lambda r: (r.prefixes.match(hashes) if r.outstanding - least <= AFFINITY_SLACK_TOKENS
                                         else -1, -r.outstanding))
        best.prefixes.add(hashes)
        return best

    def poll(self) -> None:
        """Read what the replicas sent while no request ran (a replica ready again, one that died); raises
        ParallelError once every replica of a role is down for good, so an idle server never looks healthy while it
        could answer nothing."""
        self._receive(0.0)
        for pool in self._pools():
            if all(r.connection is None for r in pool):
                self._ready(pool)  # (raises: none runs, none is starting again)

    def _pools(self) -> list[list[Replica]]:
        """The groups of which one replica must run for a request to be served (here: all, as one group)."""
        return [self.replicas]

    def unavailable(self) -> str | None:
        """Why no request can be served now (a role with no replica running: one is starting again), else None."""
        for pool in self._pools():
            try:
                self._ready(pool)
            except LLMOptError as e:
                return str(e)
        return None

    def step(self) -> list[RequestOutput]:
        """Outputs the replicas produced since the last call (waiting up to POLL_S for some). Requests that failed
        on their own (their replica died, or refused them) raise RequestsFailed once, naming each."""
        if self._failures:
            failures, self._failures = self._failures, {}
            for front_id in failures:
                self._finished(front_id)
            raise RequestsFailed(failures)
        self._receive(0.0 if self._outputs else POLL_S)
        outputs, self._outputs = self._outputs, []
        for output in outputs:
            if output.finished:
                self._finished(output.request_id)
        return outputs

    def _finished(self, front_id: int) -> None:
        index, cost = self._requests.pop(front_id, (None, 0))
        if index is not None:
            replica = self.replicas[index]
            replica.requests.discard(front_id)
            replica.outstanding -= cost

    def abort(self, request_id: int) -> bool:
        entry = self._requests.get(request_id)
        if entry is None:
            return False
        self.replicas[entry[0]].connection.send(("abort", request_id))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._outputs or self._failures)

    @property
    def num_live_requests(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        return sum(r.status.get("waiting", 0) for r in self.replicas)

    @property
    def num_running(self) -> int:
        return sum(r.status.get("running", 0) for r in self.replicas)

    def check_token_ids(self, token_ids, param: str) -> None:
        check_token_ids(token_ids, self.vocab_size, param)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        return Engine.generate(self, prompts, params)

    def stream(self):
        return Engine.stream(self)

    def _broadcast(self, command) -> None:
        for replica in self.replicas:
            if replica.connection is not None:
                try:
                    replica.connection.send(command)
                except OSError:  # it exited (a signal to the whole group): the next receive reports it
                    pass

    def stats(self) -> EngineStats:
        """Every replica's counters, added (their step records concatenated)."""
        if self.closed:
            raise ParallelError("the data-parallel replicas are stopped: read their statistics before close()")
        with self._lock:
            for replica in self.replicas:
                replica.stats = None
            self._broadcast(("stats",))
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            while any(r.stats is None and r.connection is not None for r in self.replicas):
                if time.monotonic() > deadline:
                    raise ParallelError("a data-parallel replica did not report its statistics within "
                                        f"{REPLY_TIMEOUT_S:.0f} s")
                self._receive(0.01)
        parts = [r.stats for r in self.replicas if r.stats is not None]
        total = EngineStats()
        for part in parts:
            total.steps += part.steps
            total.num_preemptions += part.num_preemptions
            total.prefix_cache_queries += part.prefix_cache_queries
            total.prefix_cache_hits += part.prefix_cache_hits
            total.num_finished += part.num_finished
            for reason, count in part.finish_reasons.items():
                total.finish_reasons[reason] = total.finish_reasons.get(reason, 0) + count
        return total

    def reset_stats(self, clear_prefix_cache: bool = False) -> None:
        self._broadcast(("reset_stats", clear_prefix_cache))
        if clear_prefix_cache:
            for replica in self.replicas:
                replica.prefixes = PrefixMemory()

    def reset(self) -> None:
        self._broadcast(("reset",))
        self._requests.clear()
        self._outputs.clear()
        for replica in self.replicas:
            replica.requests, replica.outstanding = set(), 0

    def kv_cache_info(self) -> dict:
        """Replica 0's cache (each replica has its own, as large), and the replica count."""
        info = dict(self.replicas[0].info.get("kv_cache_info", {}))
        info["replicas"] = len(self.replicas)
        info["summary"] = f"{len(self.replicas)} data-parallel replicas, each: {info.get('summary', '')}"
        return info

    def numerics(self) -> dict:
        return {**self.replicas[0].info.get("numerics", {}), "data_parallel_size": len(self.replicas)}

    def close(self) -> None:
        """Stop every replica (also at interpreter exit)."""
        if self.closed:
            return
        self.closed = True
        self._broadcast(None)
        for replica in self.replicas:
            if replica.process is None or replica.process.pid is None:  # (never started: a signal during the start)
                continue
            replica.process.join(timeout=10)
            if replica.process.exitcode is None:
                replica.process.kill()
                replica.process.join(timeout=5)
            if replica.connection is not None:
                replica.connection.close()
                replica.connection = None
