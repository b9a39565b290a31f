"""The engine's ranks: tensor-parallel ranks, pipeline stages, or a grid of both (distributed.sharding.ParallelGrid:
T ranks per stage, T x S processes). Rank 0 is the engine's own process (scheduler, sampling, the server); ranks
1..N-1 are worker processes, spawned here (torch.multiprocessing) or launched by `torchrun`, each loading its
share of the checkpoint (its stage's layers, narrowed to its tensor-parallel share) and serving rank 0's commands:
a step's inputs ("forward") and, under tensor parallelism, the rows to project to the vocabulary ("logits", for
stage 0's ranks). Everything else flows through the decoder's forward: tensor parallelism's collectives within a
stage (one all-reduce after o_proj and after down_proj, the embedding's all-reduce, the gather of the logits) and
the pipeline's point-to-point transfers between stages (parallel/pipeline.py).

Commands travel over one pipe per worker (spawned; a worker whose pipe closes exits, so none outlives the
engine) or a gloo broadcast (torchrun, which ends every rank when one fails). A worker that fails mid-step
exits; rank 0's collective then fails within distributed.group.COLLECTIVE_TIMEOUT_S and the engine ends with one
line naming the rank."""

from __future__ import annotations

import atexit
import logging
import os
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
from llmopt.runtime.executor.models import RuntimeCheckpoint
from llmopt.runtime.executor.platform import Platform
from llmopt.runtime.executor.placement import START_TIMEOUT_S, check_host_fits, free_port, pin, rank_cores
from llmopt.runtime.distributed.group import (
    COLLECTIVE_TIMEOUT_S, SharedMemoryAllReduce, TensorParallelGroup, backend_for, from_wire, launched_by_torchrun,
    launched_rank,
)
from llmopt.runtime.distributed.pipeline import PipelineStages
from llmopt.runtime.distributed.sharding import ParallelGrid

log = logging.getLogger(__name__)
HOT_WAIT_S = 0.05  # a worker polls this long for the next command before it sleeps (hot_receiver)


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


def join_group(rank: int, grid: ParallelGrid, init_method: str, device: torch.device) -> tuple:
    """Join the default group (its store waits START_TIMEOUT_S for every rank); returns the model's groups, whose
    collectives wait COLLECTIVE_TIMEOUT_S: (every rank, for the pipeline's transfers; this rank's stage, for
    tensor parallelism's collectives — None without tensor parallelism)."""
    world = grid.world
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=START_TIMEOUT_S))
    # every rank present (a spawned one imports torch first: seconds, or more on a busy machine) before the groups
    # whose store waits only COLLECTIVE_TIMEOUT_S are made
    dist.barrier()
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    everyone = dist.new_group(list(range(world)), timeout=timeout)
    if grid.tensor == 1 or grid.stages == 1:
        return everyone, everyone if grid.tensor > 1 else None
    # every rank makes every stage's group, in the same order (torch.distributed requires it)
    stage_groups = [dist.new_group(grid.stage_ranks(s), timeout=timeout) for s in range(grid.stages)]
    return everyone, stage_groups[grid.coordinates(rank)[0]]


def wait_joining(processes: list, connections: list, grid: ParallelGrid) -> None:
    """Rank 0, before it joins the group: wait until every spawned rank says it is joining (pinned to its cores,
    about to connect). A rank that exits or reports an error first (it could not pin its cores, import, ...) ends
    the start at once with a ParallelError naming it, instead of rank 0 waiting out the store's START_TIMEOUT_S for
    a rank that will never come."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for rank, (process, connection) in enumerate(zip(processes, connections), 1):
        while not connection.poll(0.1):
            if process.exitcode is not None:
                raise ParallelError(f"{grid.describe(rank)} exited with code {process.exitcode} while starting (its "
                                    f"error is in the log above)")
            if time.monotonic() > deadline:
                raise ParallelError(f"{grid.describe(rank)} did not start within {START_TIMEOUT_S:.0f} s")
        kind, detail = connection.recv()
        if kind == "error":
            raise ParallelError(f"{grid.describe(rank)} failed to start: {detail}")


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
    projects = runner.stages is None or runner.stages.plan.is_first  # stage 0's ranks hold the lm_head's shares
    while (command := receive()) is not None:
        kind, *args = command
        if kind == "forward":
            runner.forward(*args)
        elif kind == "logits":
            rows, as_float = args
            if projects:
                runner.decoder.logits(from_wire(rows, runner.device), as_float)
        else:
            raise ParallelError(f"unknown command {kind!r} from rank 0")


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def grid_of(config: EngineConfig) -> ParallelGrid:
    return ParallelGrid(config.tensor_parallel_size, config.pipeline_parallel_size)


def load_share(load_args: dict, grid: ParallelGrid, rank: int):
    """This rank's share of the checkpoint: its stage's layers, narrowed to its tensor-parallel slices."""
    model, _, _ = load_runtime_model(**load_args, **grid.share(rank))
    return model


def stage_all_reduce(grid: ParallelGrid, rank: int, name: str | None = None, own_tracker: bool = False):
    """The shared-memory all-reduce of this rank's stage: create it (name None) or attach to it."""
    stage, tensor_rank = grid.coordinates(rank)
    names = [grid.describe(r) for r in grid.stage_ranks(stage)]
    return SharedMemoryAllReduce(tensor_rank, grid.tensor, name, own_tracker, peer_names=names)


def stage_segments(grid: ParallelGrid) -> list[SharedMemoryAllReduce]:
    """Every stage's shared-memory all-reduce, created by rank 0 (which unlinks them at the end)."""
    return [stage_all_reduce(grid, grid.rank(stage, 0)) for stage in range(grid.stages)]


def rank_runner(model, config: EngineConfig, rank: int, shm, groups: tuple, num_blocks=None,
                workers=None) -> ModelRunner:
    """The ModelRunner of one rank: with its stage's tensor-parallel group, its pipeline stage, or both. groups:
    join_group's (every rank, this stage's ranks)."""
    grid = grid_of(config)
    _, tensor_rank = grid.coordinates(rank)
    everyone, stage_group = groups
    group = stages = None
    if grid.tensor > 1:
        group = TensorParallelGroup(tensor_rank, grid.tensor, shm, stage_group, name=grid.describe(rank))
    if grid.stages > 1:
        stages = PipelineStages(model.stage_plan, everyone, config.pipeline_micro_batches or grid.stages,
                                model.config.hidden_size, model.dtype, torch.device(model.load_args["device"]),
                                grid, tensor_rank)
    return ModelRunner(model, config, num_blocks=num_blocks, group=group, workers=workers, stages=stages)


def spawned_worker(rank: int, init_method: str, shm_name: str | None, load_args: dict, config: EngineConfig,
                   cores: list[int], spin_s: float, connection) -> None:
    """A spawned rank's process: pin, join, load its share, build its runner with rank 0's block count, then
    serve commands. A closed pipe (rank 0 gone) ends it quietly; any error is sent to rank 0 as one line."""
    grid = grid_of(config)
    try:
        pin(cores)
        connection.send(("joining", os.getpid()))  # (rank 0 joins once every rank got this far: wait_joining)
        device = torch.device(load_args["device"])
        groups = join_group(rank, grid, init_method, device)
        model = load_share(load_args, grid, rank)
        shm = stage_all_reduce(grid, rank, shm_name) if shm_name else None
        _, num_blocks = connection.recv()
        runner = rank_runner(model, config, rank, shm, groups, num_blocks)
        connection.send(("ready", os.getpid()))
        serve_commands(runner, hot_receiver(connection, spin_s))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 (reported to rank 0, which names the rank)
        try:
            connection.send(("error", _one_line(e)))
        except OSError:
            pass
        print(f"llmopt: {grid.describe(rank)}: {_one_line(e)}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


class ParallelWorkers:
    """Ranks 1..N-1 (tensor-parallel ranks, pipeline stages or both) for a rank-0 ModelRunner: `send` a command to
    them all, `stop` them. shm: the shared-memory all-reduce segments rank 0 created (unlinked at the end)."""

    def __init__(self, channel, grid: ParallelGrid, processes=None, connections=None, restore=None, shm=()):
        self.channel, self.grid, self.processes, self.connections = channel, grid, processes or [], connections or []
        self.restore, self.shm = restore, list(shm)
        self.stopped = False

    def send(self, command) -> None:
        try:
            self.channel.send(command)
        except (BrokenPipeError, ConnectionResetError, EOFError, RuntimeError) as e:
            raise ParallelError(f"a parallel worker is gone ({self.dead_ranks() or 'rank unknown'}): "
                                f"{_one_line(e)}") from e

    def dead_ranks(self) -> str:
        return ", ".join(f"{self.grid.describe(r)} (exit code {p.exitcode})" for r, p in enumerate(self.processes, 1)
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
                raise ParallelError(f"{self.grid.describe(rank)} "
                                    + (f"exited with code {process.exitcode}" if process.exitcode is not None
                                       else f"did not start within {START_TIMEOUT_S:.0f} s") + " while loading")
        kind, detail = connection.recv()
        if kind == "error":
            raise ParallelError(f"{self.grid.describe(rank)} failed to start: {detail}")

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
        for segment in self.shm:
            segment.close(unlink=True)
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.restore is not None:
            affinity, threads = self.restore
            os.sched_setaffinity(0, affinity)
            torch.set_num_threads(threads)


def check_share(model, grid: ParallelGrid) -> None:
    """Refuse a model that was not loaded as rank 0's share of `grid` (plans of the right sizes, load_args kept)."""
    checkpoint = isinstance(model, RuntimeCheckpoint)
    expected = (("tensor", "shard", checkpoint and model.shard_plan, "world", grid.tensor),
                ("pipeline", "stage", checkpoint and model.stage_plan, "stages", grid.stages))
    for kind, argument, plan, field, size in expected:
        if size > 1 and (not plan or getattr(plan, field) != size or model.load_args is None):
            raise ConfigError(f"--{kind}-parallel-size {size} needs the model loaded as a rank's share: "
                              f"load_runtime_model(..., {argument}=(rank, {size}))", param=f"{kind}_parallel_size")


def parallel_runner(model, config: EngineConfig) -> ModelRunner:
    """Rank 0's ModelRunner over its share (`model`, loaded with shard=(0, T) and/or stage=(0, S)) and ranks
    1..N-1: spawned here, or (under torchrun) already running — those enter their command loop here and exit when
    rank 0 is done."""
    grid = grid_of(config)
    check_share(model, grid)
    load_args = model.load_args
    device = torch.device(load_args["device"])
    if launched_by_torchrun():
        return _torchrun_rank(model, config, launched_rank(), device)
    world = grid.world
    cores = rank_cores(config.tp_cores, world)
    share_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    check_host_fits(world, f"{world} ranks ({grid.tensor} tensor-parallel x {grid.stages} pipeline stages)",
                    "tensor_parallel_size" if grid.tensor > 1 else "pipeline_parallel_size", config, share_bytes)
    # ranks that share cores (more ranks than cores) must not poll for commands: they would take each other's time
    exclusive = len({c for ranks in cores for c in ranks}) == sum(map(len, cores))
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    # one shared-memory all-reduce per stage's tensor-parallel group, created here and unlinked at the end
    segments = stage_segments(grid) if Platform.of(device).host_memory and grid.tensor > 1 else []
    worker_config = replace(config, speculative=None)
    processes, connections = [], []
    for rank in range(1, world):
        ours, theirs = ctx.Pipe()
        shm_name = segments[grid.coordinates(rank)[0]].name if segments else None
        process = ctx.Process(target=spawned_worker, daemon=True, name=f"llmopt-rank{rank}",
                              args=(rank, init_method, shm_name, load_args, worker_config, cores[rank],
                                    HOT_WAIT_S if exclusive else 0.0, theirs))
        process.start()
        theirs.close()
        processes.append(process)
        connections.append(ours)
    workers = ParallelWorkers(PipeChannel(connections), grid, processes, connections, pin(cores[0]), segments)
    atexit.register(workers.stop)
    try:
        wait_joining(processes, connections, grid)
        runner = rank_runner(model, config, 0, segments[0] if segments else None,
                             join_group(0, grid, init_method, device), workers=workers)
        workers.start(runner.num_blocks)
    except BaseException:
        workers.stop()
        raise
    placement = "; ".join(",".join(map(str, c)) for c in cores)
    log.info(f"parallelism: {grid.tensor} tensor-parallel rank(s) x {grid.stages} pipeline stage(s) on cores "
             f"{placement}")
    return runner


def _torchrun_rank(model, config: EngineConfig, rank: int, device: torch.device) -> ModelRunner:
    """Under torchrun: every rank runs the same command; rank 0 goes on as the engine, the others serve its
    commands here and exit when it is done."""
    grid = grid_of(config)
    world = grid.world
    if int(os.environ["WORLD_SIZE"]) != world:
        raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} processes for {world} parallel ranks "
                          f"({grid.tensor} tensor-parallel x {grid.stages} pipeline): give --nproc-per-node {world}",
                          param="tensor_parallel_size")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    local = int(os.environ.get("LOCAL_RANK", rank))
    restore = pin(rank_cores(config.tp_cores, local_world)[local])
    groups = join_group(rank, grid, "env://", device)
    commands = BroadcastChannel(dist.new_group(list(range(world)), backend="gloo", timeout=timedelta(days=365)))
    # shared memory needs every rank on this host; rank 0 creates each stage's segment and unlinks them at the end
    shared = Platform.of(device).host_memory and grid.tensor > 1 and local_world == world
    segments = stage_segments(grid) if shared and rank == 0 else []
    names = [[segment.name for segment in segments]]
    dist.broadcast_object_list(names, src=0, group=commands.group)
    stage = grid.coordinates(rank)[0]
    shm = None
    if shared:
        shm = segments[0] if rank == 0 else stage_all_reduce(grid, rank, names[0][stage], own_tracker=True)
    dist.barrier(group=commands.group)  # every rank mapped its segment before rank 0 may unlink them at the end
    if rank == 0:
        workers = ParallelWorkers(commands, grid, restore=restore, shm=segments)
        atexit.register(workers.stop)
        runner = rank_runner(model, config, rank, shm, groups, workers=workers)
        commands.send(("start", runner.num_blocks))
        return runner
    _, num_blocks = commands.recv()
    runner = rank_runner(model, replace(config, speculative=None), rank, shm, groups, num_blocks)
    try:
        serve_commands(runner, commands.recv)
    except LLMOptError as e:
        print(f"llmopt: {grid.describe(rank)}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    shm.close(unlink=False) if shm is not None else None
    dist.destroy_process_group()
    raise SystemExit(0)  # rank 0 is done: this rank's copy of the command ends here
