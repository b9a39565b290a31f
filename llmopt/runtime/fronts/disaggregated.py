"""Prefill/decode disaggregation (DistServe, Splitwise): P prefill workers and D decode workers, one process each on
its own cores, behind one front that is an EngineClient (`DisaggregatedEngine`), as the data-parallel front is.

A request goes to the prefill worker with the fewest outstanding prompt tokens, or one close to it that holds its
prompt's prefix (the prefix cache lives on the prefill side), and is assigned the decode worker with the fewest
outstanding tokens. The prefill worker computes the prompt and samples the first token; the prompt's KV blocks, as
its cache stores them (8-bit codes and their scales in an 8-bit cache), go to the decode worker over the pair's
two-rank gloo group (torch.distributed send / recv, tagged with the request) and land in fresh blocks there (the
block table remapped on the receiver), which reports the first token and decodes the rest. Prefills never share a
step with decodes, so a long prompt no longer stalls the tokens of the sequences decoding (TPOT jitter), at the
cost of the hand-over in TTFT.

A worker that dies fails the requests it holds (a decode worker's: those assigned to it, handed over or not) with
ReplicaFailed naming it, and is started again; each pair it was part of is rebuilt under a new generation."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from llmopt.core.errors import LLMOptError, ParallelError, ReplicaFailed
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.output import RequestOutput
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.loader import load_for_engine
from llmopt.runtime.fronts.data_parallel import DataParallelEngine
from llmopt.runtime.fronts.handover import DecodeEngine, PrefillEngine
from llmopt.runtime.fronts.replica import Replica, ReplicaLoop, replica_status, run_replica
from llmopt.runtime.executor.placement import check_host_fits, rank_cores

PAIR_TIMEOUT_S = 60.0  # a pair's rendezvous, and one hand-over's transfer, wait this long at most
TAG_MODULO = 1 << 30  # gloo tags are ints: a request's tag is its front id modulo this
PREFILL, DECODE = "prefill", "decode"


def pair_key(one: Replica, other: Replica) -> str:
    """The store prefix of the group of a prefill worker and a decode worker (either order): a restarted worker
    (another generation) gets a new one."""
    prefill, decode = (one, other) if one.role == PREFILL else (other, one)
    return f"llmopt-pd/{prefill.index}.{prefill.restarts}/{decode.index}.{decode.restarts}"


# --- the hand-over's payload ---------------------------------------------------------------------------------------
def kv_layout(runner) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape of one block, dtype) of each cache tensor, layer by layer: what runner.read_kv_blocks returns."""
    return [(tuple(t.shape[1:]), t.dtype) for layer in runner.kv_cache for t in layer.tensors]


def block_bytes(layout) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout)


def read_payload(runner, block_ids: list[int], layout) -> torch.Tensor:
    """These blocks' contents as one flat uint8 tensor (gloo sends one tensor per message), read straight into
    it: the cache tensors' blocks one after another, as unpack_kv views them."""
    payload = torch.empty(len(block_ids) * block_bytes(layout), dtype=torch.uint8, device=runner.device)
    runner.read_kv_blocks(block_ids, out=unpack_kv(payload, layout, len(block_ids)))
    return payload


def unpack_kv(payload: torch.Tensor, layout, num_blocks: int) -> list[torch.Tensor]:
    """Views [num_blocks, *shape] of a payload (read_payload's), one per cache tensor of `layout`."""
    parts, offset = [], 0
    for shape, dtype in layout:
        size = num_blocks * math.prod(shape) * dtype.itemsize
        parts.append(payload[offset:offset + size].view(dtype).view(num_blocks, *shape))
        offset += size
    return parts


class PairLinks:
    """This worker's two-rank gloo groups, one per worker of the other role, each built in a thread: a rendezvous
    waits for the peer, which may still be loading (the prefill side is rank 0)."""

    def __init__(self, store_port: int, rank: int):
        self.store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                                   timeout=timedelta(seconds=PAIR_TIMEOUT_S))
        self.rank = rank
        self.links: dict[int, tuple[str, threading.Thread, dict]] = {}

    def connect(self, peer: int, key: str) -> None:
        box: dict = {}

        def build():
            try:
                box["group"] = dist.ProcessGroupGloo(dist.PrefixStore(key, self.store), self.rank, 2,
                                                     timedelta(seconds=PAIR_TIMEOUT_S))
            except Exception as e:  # noqa: BLE001 (reported when the link is used)
                box["error"] = e

        thread = threading.Thread(target=build, daemon=True, name=f"llmopt-{key}")
        thread.start()
        self.links[peer] = (key, thread, box)

    def group(self, peer: int) -> tuple[str, object]:
        """(key, group) of the link to `peer`, waiting for its rendezvous (bounded)."""
        key, thread, box = self.links[peer]
        thread.join(PAIR_TIMEOUT_S)
        if "group" not in box:
            raise ParallelError(f"the KV hand-over link {key} did not come up: {box.get('error', 'timed out')}")
        return key, box["group"]


# --- the workers ---------------------------------------------------------------------------------------------------
class _Worker(ReplicaLoop):
    """A disaggregated worker's loop: the replica's, with its links to the other role's workers and the layout of
    its cache's blocks (the hand-over's payload)."""

    def __init__(self, engine: Engine, links: PairLinks, connection):
        super().__init__(engine, connection)
        self.links = links
        self.layout = kv_layout(engine.runner)
        self.block_bytes = block_bytes(self.layout)

    def handle(self, command: tuple) -> None:
        if command[0] == "connect":
            self.links.connect(command[1], command[2])
        else:
            super().handle(command)


class PrefillWorker(_Worker):
    """Computes prompts and their first token; hands each prompt's KV to its decode worker."""

    def __init__(self, engine: Engine, links: PairLinks, connection):
        super().__init__(engine, links, connection)
        self.decode_of: dict[int, int] = {}  # local id -> its decode worker, for requests that go on decoding
        self.kv: dict[int, torch.Tensor] = {}  # local id -> its prompt's KV payload, read before the blocks are freed
        self.sending: list[tuple[object, torch.Tensor]] = []  # (gloo work, payload) in flight
        engine.on_prefilled = self.capture

    def capture(self, seq) -> None:
        if seq.seq_id in self.decode_of:
            num_blocks = math.ceil(seq.num_prompt_tokens / self.engine.block_manager.block_size)
            self.kv[seq.seq_id] = read_payload(self.engine.runner, seq.block_table[:num_blocks], self.layout)

    def handle(self, command: tuple) -> None:
        if command[0] != "add":
            if command[0] == "reset":
                self.decode_of.clear()
                self.kv.clear()
            return super().handle(command)
        _, front_id, prompt, params, arrival, decode = command
        try:
            local = self.engine.add_request(prompt, dataclasses.replace(params, max_tokens=1), arrival)
        except LLMOptError as e:
            self.connection.send(("rejected", front_id, str(e), e.param))
            return
        self.ids[local], self.local[front_id] = front_id, local
        if params.max_tokens > 1:
            self.decode_of[local] = decode

    def report(self, outputs: list[RequestOutput]) -> None:
        final = []
        for output in outputs:
            decode, kv = self.decode_of.pop(output.request_id, None), self.kv.pop(output.request_id, None)
            front_id = self.forget(output)
            if front_id is None:
                continue
            if output.finish_reason == "length" and decode is not None and kv is not None:
                self.hand_over(front_id, output, decode, kv)
            else:  # it ended with its first token (EOS, a stop, max_tokens 1, abort): the front's final output
                final.append(dataclasses.replace(output, request_id=front_id))
        self.sending = [(work, payload) for work, payload in self.sending if not work.is_completed()]
        self.connection.send(("outputs", final, replica_status(self.engine)))

    def hand_over(self, front_id: int, output: RequestOutput, decode: int, payload: torch.Tensor) -> None:
        try:
            key, group = self.links.group(decode)
            self.sending.append((group.send([payload], 1, front_id % TAG_MODULO), payload))
        except (RuntimeError, ParallelError) as e:
            self.connection.send(("failed", front_id, f"the KV hand-over failed: {str(e).splitlines()[0]}"))
            return
        num_blocks = payload.numel() // self.block_bytes
        self.connection.send(("prefilled", front_id, output.new_token_ids[0], num_blocks, output.num_cached_tokens,
                              key))


class DecodeWorker(_Worker):
    """Receives handed-over prompts' KV and decodes them."""

    def handle(self, command: tuple) -> None:
        if command[0] != "adopt":
            return super().handle(command)
        _, front_id, prompt, first_token, params, arrival, prefill, num_blocks, cached = command
        try:
            payload = torch.empty(num_blocks * self.block_bytes, dtype=torch.uint8)
            _, group = self.links.group(prefill)
            group.recv([payload], 0, front_id % TAG_MODULO).wait(timedelta(seconds=PAIR_TIMEOUT_S))
            blocks = unpack_kv(payload, self.layout, num_blocks)
            local = self.engine.add_prefilled(prompt, first_token, params, blocks, arrival, cached)
        except (RuntimeError, LLMOptError) as e:
            self.connection.send(("failed", front_id, f"the KV hand-over failed: {str(e).splitlines()[0]}"))
            return
        self.ids[local], self.local[front_id] = front_id, local


WORKERS = {PREFILL: PrefillWorker, DECODE: DecodeWorker}
ENGINES = {PREFILL: PrefillEngine, DECODE: DecodeEngine}


def worker_main(role: str, load_args: dict, config: EngineConfig, cores: list[int], record_steps: bool,
                store_port: int, peers: dict[int, str], connection) -> None:
    """A worker's process: its links to the other role's workers (rendezvous in the background), its engine,
    then the loop."""

    def start() -> _Worker:
        links = PairLinks(store_port, 0 if role == PREFILL else 1)
        for peer, key in peers.items():
            links.connect(peer, key)
        model, tokenizer, _ = load_for_engine(config=config, **load_args)
        engine = ENGINES[role](model, tokenizer, config, record_steps=record_steps)
        return WORKERS[role](engine, links, connection)

    run_replica(connection, cores, start)


# --- the front -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    arrival: float
    prefill: int  # worker indices
    decode: int
    cost: int  # prompt + max_tokens: the decode worker's outstanding tokens
    handed_over: bool = False
    aborted: bool = False


class DisaggregatedEngine(DataParallelEngine):
    """config.disaggregation = (P, D) workers of MODEL behind the Engine's interface."""

    def __init__(self, model_name: str, config: EngineConfig, dtype: str = "float32", device: str = "cpu",
                 trust_remote_code: bool = False, record_steps: bool = True):
        self._pending: dict[int, _Request] = {}
        self._num_handed_over = 0  # since the last reset_stats: each also counted finished by its prefill worker
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=PAIR_TIMEOUT_S))
        base = dataclasses.replace(config, disaggregate=None, pd_cores=None)
        # decode workers write handed-over KV into fresh blocks: their own prefix cache would never hit
        self.worker_configs = {PREFILL: base, DECODE: dataclasses.replace(base, enable_prefix_cache=False)}
        super().__init__(model_name, config, dtype, device, trust_remote_code, record_steps)

    # --- workers ----------------------------------------------------------------------------------------
    def _make_replicas(self) -> list[Replica]:
        num_prefill, num_decode = self.config.disaggregation
        cores = rank_cores(self.config.pd_cores, num_prefill + num_decode, param="pd_cores")
        check_host_fits(num_prefill + num_decode, f"{num_prefill} prefill + {num_decode} decode workers",
                        "disaggregate", self.config, self.weight_bytes)
        return [Replica(i, c, role=PREFILL if i < num_prefill else DECODE) for i, c in enumerate(cores)]

    def _pool(self, role: str) -> list[Replica]:
        return [r for r in self.replicas if r.role == role]

    def _pools(self) -> list[list[Replica]]:
        return [self._pool(PREFILL), self._pool(DECODE)]

    def _describe(self, replica: Replica) -> str:
        first = self._pool(replica.role)[0].index
        return f"{replica.role} worker {replica.index - first}"

    def _process(self, replica: Replica, connection) -> tuple:
        other = DECODE if replica.role == PREFILL else PREFILL
        peers = {p.index: pair_key(replica, p) for p in self._pool(other)}
        return (worker_main, f"llmopt-pd-{replica.role}{replica.index}",
                (replica.role, self.load_args, self.worker_configs[replica.role], replica.cores, self.record_steps,
                 self.store.port, peers, connection))

    def _dispatch(self, replica: Replica, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            _, outputs, replica.status = message
            self._outputs.extend(o for o in outputs if o.request_id in self._pending)
        elif kind == "prefilled":
            self._hand_over(replica, *message[1:])
        elif kind == "failed":
            _, front_id, text = message
            if front_id in self._pending:
                self._failures[front_id] = ParallelError(f"{self._describe(replica)}: {text}")
        else:
            super()._dispatch(replica, message)

    def _hand_over(self, prefill: Replica, front_id: int, first_token: int, num_blocks: int, cached: int,
                   key: str) -> None:
        """A prompt is computed and its KV sent: the request moves to its decode worker."""
        request = self._pending.get(front_id)
        if request is None:
            return  # it failed meanwhile
        decode = self.replicas[request.decode]
        prefill.requests.discard(front_id)
        prefill.outstanding -= len(request.prompt)
        request.handed_over = True
        self._num_handed_over += 1
        decode.requests.add(front_id)
        self._requests[front_id] = (decode.index, request.cost)
        if request.aborted:
            self._outputs.append(RequestOutput(front_id, [], "", True, "abort", arrival_time=request.arrival,
                                               num_prompt_tokens=len(request.prompt)))
        elif decode.connection is None or key != pair_key(prefill, decode):
            self._failures[front_id] = ReplicaFailed(f"{self._describe(decode)} restarted during the KV hand-over: "
                                                     "send the request again")
        else:
            decode.connection.send(("adopt", front_id, request.prompt, first_token, request.params, request.arrival,
                                    prefill.index, num_blocks, cached))

    def _lost(self, replica: Replica, cause: str) -> None:
        """A worker died: fail what it holds (a decode worker: every request assigned to it; those still being
        prefilled are aborted there), restart it, and have its peers link to the new process."""
        if replica.role == DECODE:
            held = {f for f, r in self._pending.items() if r.decode == replica.index}
        else:
            held = {f for f, r in self._pending.items() if r.prefill == replica.index and not r.handed_over}
        for front_id in held:
            request = self._pending[front_id]
            prefill = self.replicas[request.prefill]
            if replica.role == DECODE and not request.handed_over and prefill.connection is not None:
                prefill.connection.send(("abort", front_id))
            self._finished(front_id)
        replica.requests = held
        restarts = replica.restarts
        super()._lost(replica, cause)
        if replica.restarts != restarts:  # started again: a new generation, new pairs
            for peer in self._pool(DECODE if replica.role == PREFILL else PREFILL):
                if peer.connection is not None:
                    peer.connection.send(("connect", replica.index, pair_key(replica, peer)))

    # --- the Engine interface ---------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> int:
        params = self._admissible(prompt_token_ids, params)
        decode = min(self._ready(self._pool(DECODE)), key=lambda r: r.outstanding)
        prefill = self._route(prompt_token_ids, self._pool(PREFILL))
        front_id, self._next_id = self._next_id, self._next_id + 1
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        request = _Request(list(prompt_token_ids), params, arrival, prefill.index, decode.index,
                           len(prompt_token_ids) + params.max_tokens)
        prefill.connection.send(("add", front_id, request.prompt, params, arrival, decode.index))
        prefill.requests.add(front_id)
        prefill.outstanding += len(request.prompt)
        decode.outstanding += request.cost
        self._pending[front_id] = request
        self._requests[front_id] = (prefill.index, request.cost)
        return front_id

    def _finished(self, front_id: int) -> None:
        request = self._pending.pop(front_id, None)
        self._requests.pop(front_id, None)
        if request is None:
            return
        prefill, decode = self.replicas[request.prefill], self.replicas[request.decode]
        if not request.handed_over:
            prefill.requests.discard(front_id)
            prefill.outstanding -= len(request.prompt)
        decode.requests.discard(front_id)
        decode.outstanding -= request.cost

    def abort(self, request_id: int) -> bool:
        request = self._pending.get(request_id)
        if request is not None:
            request.aborted = True
        return super().abort(request_id)

    def reset(self) -> None:
        super().reset()
        self._pending.clear()

    def stats(self):
        """Every worker's counters, added; a handed-over request counts finished once (on its decode worker),
        not also on its prefill worker, where it finished with its first token."""
        total = super().stats()
        total.num_finished -= self._num_handed_over
        if self._num_handed_over:
            total.finish_reasons["length"] = total.finish_reasons.get("length", 0) - self._num_handed_over
            if total.finish_reasons["length"] == 0:
                del total.finish_reasons["length"]
        return total

    def reset_stats(self, clear_prefix_cache: bool = False) -> None:
        super().reset_stats(clear_prefix_cache)
        self._num_handed_over = 0

    def kv_cache_info(self) -> dict:
        """A decode worker's cache (each has its own, as large): it bounds how many sequences decode at once."""
        decode = self._pool(DECODE)[0]
        info = dict(decode.info.get("kv_cache_info", {}))
        num_prefill, num_decode = self.config.disaggregation
        info["replicas"] = len(self.replicas)
        info["summary"] = (f"{num_prefill} prefill + {num_decode} decode workers, each decode worker: "
                           f"{info.get('summary', '')}")
        return info

    def numerics(self) -> dict:
        return {**self._pool(DECODE)[0].info.get("numerics", {}), "disaggregate": self.config.disaggregate}
