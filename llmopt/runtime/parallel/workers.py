"""The engine's tensor-parallel ranks or pipeline stages: rank 0 is the engine's own process (scheduler,
sampling, the server); ranks 1..N-1 are worker processes, spawned here (torch.multiprocessing) or launched by
`torchrun`, each loading its share of the checkpoint (a tensor-parallel share, or a stage's layers) and serving
rank 0's commands: a step's inputs ("forward") and, under tensor parallelism, the rows to project to the
vocabulary ("logits"). Everything else flows through the decoder's forward: tensor parallelism's collectives (one
all-reduce after o_proj and after down_proj, the embedding's all-reduce, the gather of the logits) or the
pipeline's point-to-point transfers (parallel/pipeline.py).

Commands travel over one pipe per worker (spawned; a worker whose pipe closes exits, so none outlives the
engine) or a gloo broadcast (torchrun, which ends every rank when one fails). A worker that fails mid-step
exits; rank 0's collective then fails within parallel.group.COLLECTIVE_TIMEOUT_S and the engine ends with one
line naming the rank."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmopt.core.errors import ConfigError, LLMOptError, ParallelError
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.executor.loader import load_runtime_model
from llmopt.runtime.executor.model_runner import ModelRunner
from llmopt.runtime.parallel.group import (
    COLLECTIVE_TIMEOUT_S, SharedMemoryAllReduce, TensorParallelGroup, backend_for, from_wire, launched_by_torchrun,
)
from llmopt.runtime.parallel.pipeline import PipelineStages

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # a worker's import + load on a slow machine; a dead worker is noticed at once
HOT_WAIT_S = 0.05  # a worker polls this long for the next command before it sleeps (hot_receiver)


def rank_cores(spec: str | None, world: int, available: list[int] | None = None,
               param: str = "tp_cores") -> list[list[int]]:
    """Each rank's (or replica's) CPU cores: --tp-cores / --dp-cores "0-3;4-7" (one list each, `;`-separated;
    ranges and commas), or an even split of the cores this process may run on."""
    flag = "--" + param.replace("_", "-")
    available = sorted(available if available is not None else os.sched_getaffinity(0))
    if spec:
        ranks = [sorted({c for part in text.split(",") if part for c in _core_range(part, flag)})
                 for text in spec.split(";")]
        if len(ranks) != world or not all(ranks):
            raise ConfigError(f"{flag} {spec!r}: give {world} non-empty core lists separated by ';'", param=param)
        return ranks
    if len(available) < world:
        return [available] * world  # more ranks than cores: they share
    return [available[r * len(available) // world:(r + 1) * len(available) // world] for r in range(world)]


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


class PipeChannel:
    """Rank 0's commands to spawned workers, one pipe each."""

    def __init__(self, connections):
        self.connections = connections

    def send(self, command) -> None:
        for c in self.connections:
            c.send(command)


class BroadcastChannel:
    """Rank 0's commands to torchrun-launched ranks: a gloo broadcast on a group without a deadline (an idle
    server sends nothing for hours)."""

    def __init__(self, group):
        self.group = group

    def send(self, command) -> None:
        dist.broadcast_object_list([command], src=0, group=self.group)

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def join_group(rank: int, world: int, init_method: str, device: torch.device):
    """Join the default group (its store waits START_TIMEOUT_S for every rank); returns the model's group,
    whose collectives wait COLLECTIVE_TIMEOUT_S."""
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=START_TIMEOUT_S))
    # every rank present (a spawned one imports torch first: seconds, or more on a busy machine) before the group
    # whose store waits only COLLECTIVE_TIMEOUT_S is made
    dist.barrier()
    return dist.new_group(list(range(world)), timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def hot_receiver(connection, spin_s: float = HOT_WAIT_S):
    """connection.recv, polling without sleeping for up to spin_s first: between the steps of a busy engine the
    next command comes within a millisecond, and a sleeping process's wake-up (tens of us, milliseconds on a
    loaded VM) would delay every all-reduce of the step that follows. The rank owns its core, so polling costs
    no one else; an idle engine's ranks sleep after spin_s."""
    def receive():
        deadline = time.monotonic() + spin_s
        while not connection.poll(0):
            if time.monotonic() > deadline:
                break
        return connection.recv()

    return receive


def serve_commands(runner: ModelRunner, receive) -> None:
    """A worker's loop: run each command of rank 0 until it sends None."""
    while (command := receive()) is not None:
        kind, *args = command
        if kind == "forward":
            runner.forward(*args)
        elif kind == "logits":
            rows, as_float = args
            runner.decoder.logits(from_wire(rows, runner.device), as_float)
        else:
            raise ParallelError(f"unknown command {kind!r} from rank 0")


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def pipelined(config: EngineConfig) -> bool:
    return config.pipeline_parallel_size > 1


def world_size(config: EngineConfig) -> int:
    return config.pipeline_parallel_size if pipelined(config) else config.tensor_parallel_size


def load_share(load_args: dict, config: EngineConfig, rank: int, world: int):
    """This rank's share of the checkpoint: its tensor-parallel slices, or its stage's layers."""
    share = {"stage": (rank, world)} if pipelined(config) else {"shard": (rank, world)}
    model, _, _ = load_runtime_model(**load_args, **share)
    return model


def rank_runner(model, config: EngineConfig, rank: int, world: int, shm, process_group, num_blocks=None,
                workers=None) -> ModelRunner:
    """The ModelRunner of one rank: with its tensor-parallel group, or its pipeline stage."""
    if pipelined(config):
        plan = model.stage_plan
        stages = PipelineStages(plan, process_group, config.pipeline_micro_batches or world,
                                model.config.hidden_size, model.dtype, torch.device(model.load_args["device"]))
        return ModelRunner(model, config, num_blocks=num_blocks, workers=workers, stages=stages)
    group = TensorParallelGroup(rank, world, shm, process_group)
    return ModelRunner(model, config, num_blocks=num_blocks, group=group, workers=workers)


def spawned_worker(rank: int, world: int, init_method: str, shm_name: str | None, load_args: dict,
                   config: EngineConfig, cores: list[int], connection) -> None:
    """A spawned rank's process: pin, join, load its share, build its runner with rank 0's block count, then
    serve commands. A closed pipe (rank 0 gone) ends it quietly; any error is sent to rank 0 as one line."""
    try:
        pin(cores)
        device = torch.device(load_args["device"])
        process_group = join_group(rank, world, init_method, device)
        model = load_share(load_args, config, rank, world)
        shm = SharedMemoryAllReduce(rank, world, shm_name) if shm_name else None
        _, num_blocks = connection.recv()
        runner = rank_runner(model, config, rank, world, shm, process_group, num_blocks)
        connection.send(("ready", os.getpid()))
        serve_commands(runner, hot_receiver(connection))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 (reported to rank 0, which names the rank)
        try:
            connection.send(("error", _one_line(e)))
        except OSError:
            pass
        print(f"llmopt: tensor-parallel rank {rank}: {_one_line(e)}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


class ParallelWorkers:
    """Ranks 1..N-1 (tensor-parallel ranks or pipeline stages) for a rank-0 ModelRunner: `send` a command to them
    all, `stop` them."""

    def __init__(self, channel, processes=None, connections=None, restore=None, shm=None):
        self.channel, self.processes, self.connections = channel, processes or [], connections or []
        self.restore, self.shm = restore, shm
        self.stopped = False

    def send(self, command) -> None:
        try:
            self.channel.send(command)
        except (BrokenPipeError, ConnectionResetError, EOFError, RuntimeError) as e:
            raise ParallelError(f"a tensor-parallel worker is gone ({self.dead_ranks() or 'rank unknown'}): "
                                f"{_one_line(e)}") from e

    def dead_ranks(self) -> str:
        return ", ".join(f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.processes, 1)
                         if p.exitcode is not None)

    def start(self, num_blocks: int) -> None:
        """Hand the workers rank 0's block count; wait until each has built its runner."""
        self.send(("start", num_blocks))
        for rank, connection in enumerate(self.connections, 1):
            self._wait_ready(rank, connection)

    def _wait_ready(self, rank: int, connection) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        process = self.processes[rank - 1]
        while not connection.poll(0.2):
            if process.exitcode is not None or time.monotonic() > deadline:
                raise ParallelError(f"tensor-parallel rank {rank} "
                                    + (f"exited with code {process.exitcode}" if process.exitcode is not None
                                       else f"did not start within {START_TIMEOUT_S:.0f} s") + " while loading")
        kind, detail = connection.recv()
        if kind == "error":
            raise ParallelError(f"tensor-parallel rank {rank} failed to start: {detail}")

    def stop(self) -> None:
        """Tell every worker to exit, then make sure none is left."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self.channel.send(None)
        except Exception:  # noqa: BLE001 (a worker already gone: the kill below)
            pass
        for process in self.processes:
            process.join(timeout=5)
            if process.exitcode is None:
                process.kill()
                process.join(timeout=5)
        for connection in self.connections:
            connection.close()
        if self.shm is not None:
            self.shm.close(unlink=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.restore is not None:
            affinity, threads = self.restore
            os.sched_setaffinity(0, affinity)
            torch.set_num_threads(threads)


def parallel_runner(model, config: EngineConfig) -> ModelRunner:
    """Rank 0's ModelRunner over its share (`model`, loaded with shard=(0, N) or stage=(0, N)) and ranks 1..N-1:
    spawned here, or (under torchrun) already running — those enter their command loop here and exit when rank 0
    is done."""
    world = world_size(config)
    plan = getattr(model, "stage_plan" if pipelined(config) else "shard_plan", None)
    load_args = getattr(model, "load_args", None)
    if plan is None or getattr(plan, "stages", getattr(plan, "world", None)) != world or load_args is None:
        kind = ("pipeline", "stage") if pipelined(config) else ("tensor", "shard")
        raise ConfigError(f"--{kind[0]}-parallel-size {world} needs the model loaded as a rank's share: "
                          f"load_runtime_model(..., {kind[1]}=(rank, {world}))", param=f"{kind[0]}_parallel_size")
    device = torch.device(load_args["device"])
    if launched_by_torchrun():
        return _torchrun_rank(model, config, plan.rank, world, device)
    cores = rank_cores(config.tp_cores, world)
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    shm = SharedMemoryAllReduce(0, world) if device.type == "cpu" and not pipelined(config) else None
    worker_config = replace(config, speculative=None)
    processes, connections = [], []
    for rank in range(1, world):
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=spawned_worker, daemon=True, name=f"llmopt-tp-rank{rank}",
                              args=(rank, world, init_method, shm.name if shm else None, load_args, worker_config,
                                    cores[rank], theirs))
        process.start()
        theirs.close()
        processes.append(process)
        connections.append(ours)
    workers = ParallelWorkers(PipeChannel(connections), processes, connections, pin(cores[0]), shm)
    atexit.register(workers.stop)
    try:
        runner = rank_runner(model, config, 0, world, shm, join_group(0, world, init_method, device),
                             workers=workers)
        workers.start(runner.num_blocks)
    except BaseException:
        workers.stop()
        raise
    placement = "; ".join(",".join(map(str, c)) for c in cores)
    log.info(f"{'pipeline' if pipelined(config) else 'tensor'} parallelism: {world} ranks on cores {placement}")
    return runner


def _torchrun_rank(model, config: EngineConfig, rank: int, world: int, device: torch.device) -> ModelRunner:
    """Under torchrun: every rank runs the same command; rank 0 goes on as the engine, the others serve its
    commands here and exit when it is done."""
    if int(os.environ["WORLD_SIZE"]) != world:
        raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} processes for {world} parallel ranks: give "
                          f"--nproc-per-node {world}", param="tensor_parallel_size")
    local = int(os.environ.get("LOCAL_RANK", rank))
    restore = pin(rank_cores(config.tp_cores, int(os.environ.get("LOCAL_WORLD_SIZE", world)))[local])
    process_group = join_group(rank, world, "env://", device)
    commands = BroadcastChannel(dist.new_group(list(range(world)), backend="gloo", timeout=timedelta(days=365)))
    shared = device.type == "cpu" and not pipelined(config)
    shm = SharedMemoryAllReduce(0, world) if shared and rank == 0 else None
    names = [shm.name if shm else None]
    dist.broadcast_object_list(names, src=0, group=commands.group)
    if shared and rank != 0:
        shm = SharedMemoryAllReduce(rank, world, names[0], own_tracker=True)
    dist.barrier(group=commands.group)  # every rank mapped the segment before rank 0 may unlink it at the end
    if rank == 0:
        workers = ParallelWorkers(commands, restore=restore, shm=shm)
        atexit.register(workers.stop)
        runner = rank_runner(model, config, rank, world, shm, process_group, workers=workers)
        commands.send(("start", runner.num_blocks))
        return runner
    _, num_blocks = commands.recv()
    runner = rank_runner(model, replace(config, speculative=None), rank, world, shm, process_group, num_blocks)
    try:
        serve_commands(runner, commands.recv)
    except LLMOptError as e:
        print(f"llmopt: tensor-parallel rank {rank}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    shm.close(unlink=False) if shm is not None else None
    dist.destroy_process_group()
    raise SystemExit(0)  # rank 0 is done: this rank's copy of the command ends here
