"""The tensor-parallel group of ranks: torch.distributed process groups (gloo on CPU, NCCL on CUDA) and the two
collectives a decoder step needs, an all-reduce of partial sums and a gather of vocabulary shards.

On CPU, ranks on one host add small tensors through shared memory (`SharedMemoryAllReduce`), as vLLM's CPU
backend does: gloo's all-reduce on a loopback socket, twice per layer per step, costs more than a whole decode
step (docs/results/parallel.md); tensors above the buffer's size, and every other collective, go through gloo."""

from __future__ import annotations

import os
import time
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

from llmopt.core.errors import ParallelError
from llmopt.core.io import process_alive
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops

# A collective waits this long for its peers before the engine gives up on them (a rank killed or hung
# mid-step): the engine then ends with one line naming the rank, well within 30 s.
COLLECTIVE_TIMEOUT_S = 20.0
SHM_ALL_REDUCE_BYTES = 1 << 20  # per rank per buffer: a decode step's [64, hidden] partial sums fit
PEER_CHECK_S = 0.5  # how often a waiting rank checks that its peers' processes still live


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def launched_by_torchrun() -> bool:
    """Whether this process is one of several that torchrun (or another launcher setting its variables) started."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def launched_rank() -> int:
    """This process's rank under torchrun, else 0."""
    return int(os.environ["RANK"]) if launched_by_torchrun() else 0


class SharedMemoryAllReduce:
    """All-reduce (sum) of small fp tensors among the ranks of one host through one shared-memory segment.

    Layout: a header of int64 per rank [sequence number, pid], then per rank two buffers (alternating by the
    sequence's parity) of SHM_ALL_REDUCE_BYTES. A rank copies its tensor into its buffer, then publishes the
    sequence number; once every rank has published it, each adds all buffers in rank order (so every rank gets
    the same bits). Two buffers suffice: a rank reaching call n + 2 has seen every peer enter call n + 1, which
    a peer does only after it finished reading call n's buffers. The header's stores are ordered after the
    data's on x86 (total store order); waits poll, with a deadline and a liveness check of the peers."""

    HEADER = 2  # int64 per rank

    def __init__(self, rank: int, world: int, name: str | None = None, own_tracker: bool = False,
                 peer_names: list[str] | None = None):
        """name None: create the segment (rank 0, who unlinks it at the end); else attach to it. own_tracker: this
        process has its own multiprocessing resource tracker (torchrun; spawned children share their parent's),
        which must not unlink the segment when this process exits. peer_names: how errors name each rank of the
        group (ParallelGrid.describe of its global rank)."""
        self.rank, self.world = rank, world
        self.peer_names = peer_names or [f"tensor-parallel rank {r}" for r in range(world)]
        header_bytes = 8 * self.HEADER * world
        size = header_bytes + 2 * world * SHM_ALL_REDUCE_BYTES
        if name is None:
            self.shm = shared_memory.SharedMemory(create=True, size=size)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
            if own_tracker:
                _untrack(self.shm)
        self.name = self.shm.name
        self.header = np.ndarray((world, self.HEADER), dtype=np.int64, buffer=self.shm.buf)
        raw = torch.frombuffer(self.shm.buf, dtype=torch.uint8, offset=header_bytes,
                               count=2 * world * SHM_ALL_REDUCE_BYTES)
        self.buffers = raw.view(2, world, SHM_ALL_REDUCE_BYTES)
        self.region = torch.frombuffer(self.shm.buf, dtype=torch.uint8)  # the whole segment, for the compiled op
        self.ops = cpu_ops()
        self.sequence = 0
        if name is None:
            self.header[:] = 0
        self.header[rank, 1] = os.getpid()

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and x.numel() * x.element_size() <= SHM_ALL_REDUCE_BYTES

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (the compiled op when the CPU kernels are built)."""
        self.sequence += 1
        seq = self.sequence
        if self.ops is not None:
            started = time.monotonic()
            missing = self.ops.shm_all_reduce_(x, self.region, self.rank, self.world, seq, SHM_ALL_REDUCE_BYTES,
                                               PEER_CHECK_S, False)
            while missing:  # a peer late by PEER_CHECK_S: is it alive, and within the deadline?
                self._check_peer(missing - 1, time.monotonic() - started > COLLECTIVE_TIMEOUT_S)
                missing = self.ops.shm_all_reduce_(x, self.region, self.rank, self.world, seq,
                                                   SHM_ALL_REDUCE_BYTES, PEER_CHECK_S, True)
            return x
        nbytes = x.numel() * x.element_size()
        slots = self.buffers[seq % 2, :, :nbytes]  # [world, nbytes]
        slots[self.rank].copy_(x.view(-1).view(torch.uint8))
        self.header[self.rank, 0] = seq
        self._wait_for(seq)
        parts = slots.view(x.dtype).view(self.world, *x.shape)
        torch.sum(parts, dim=0, out=x) if self.world > 2 else torch.add(parts[0], parts[1], out=x)
        return x

    def _wait_for(self, seq: int) -> None:
        counters = self.header[:, 0]
        started = checked = time.monotonic()
        while not (counters >= seq).all():
            now = time.monotonic()
            if now - checked > PEER_CHECK_S:
                checked = now
                late = int(np.argmin(counters >= seq))
                self._check_peer(late, now - started > COLLECTIVE_TIMEOUT_S)

    def _check_peer(self, rank: int, expired: bool) -> None:
        """Raise if the late rank's process is gone, or it is late past the deadline."""
        pid = int(self.header[rank, 1])
        if pid and not process_alive(pid):
            raise ParallelError(f"{self.peer_names[rank]} (pid {pid}) exited in the middle of a step")
        if expired:
            raise ParallelError(f"{self.peer_names[rank]} did not reach the step's all-reduce within "
                                f"{COLLECTIVE_TIMEOUT_S:.0f} s")

    def close(self, unlink: bool) -> None:
        self.header = self.buffers = self.region = None
        try:
            self.shm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with the process
            pass
        if unlink:
            self.shm.unlink()


def _untrack(shm: shared_memory.SharedMemory) -> None:
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")
    except Exception:  # noqa: BLE001 (the tracker's internals: a leak warning at worst)
        pass


class TensorParallelGroup:
    """This process's rank in the tensor-parallel group and the decoder's collectives over it."""

    def __init__(self, rank: int, world: int, shm: SharedMemoryAllReduce | None = None, process_group=None,
                 name: str | None = None):
        """rank, world: within the group (a pipeline stage's ranks under pipeline parallelism too). shm: the host's
        shared-memory all-reduce (CPU), else every collective goes through process_group. name: how errors name
        this rank."""
        self.rank, self.world = rank, world
        self.name = name or f"rank {rank}"
        self.shm, self.process_group = shm, process_group
        self.num_all_reduces = 0  # counted for the bench's communication share
        self.all_reduce_seconds = 0.0

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (in place; every rank gets the same bits)."""
        started = time.perf_counter()
        try:
            if self.shm is not None and self.shm.fits(x):
                self.shm.all_reduce_(x)
            else:
                dist.all_reduce(x, group=self.process_group)
        except RuntimeError as e:  # gloo / NCCL: a peer's connection closed, or the timeout
            raise ParallelError(f"tensor-parallel all-reduce failed on {self.name}: "
                                f"{str(e).splitlines()[0]}") from e
        self.num_all_reduces += 1
        self.all_reduce_seconds += time.perf_counter() - started
        return x

    def gather_vocab(self, local: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """[R, widths[rank]] logits of this rank's vocabulary share -> [R, sum(widths)] on rank 0 (None on the
        others). Shares are padded to the widest for the gather."""
        width = max(widths)
        padded = local if local.shape[-1] == width else torch.nn.functional.pad(local, (0, width - local.shape[-1]))
        padded = padded.contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.world)] if self.rank == 0 else None
        try:
            dist.gather(padded, parts, group=self.process_group, group_dst=0)
        except RuntimeError as e:
            raise ParallelError(f"tensor-parallel gather failed on {self.name}: {str(e).splitlines()[0]}") from e
        if self.rank != 0:
            return None
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=-1)


def to_wire(t: torch.Tensor) -> tuple:
    """A CPU tensor as (bytes, shape, dtype name) for a pipe: pickled as raw bytes, not as shared memory."""
    t = t.detach().cpu().contiguous()
    return t.view(-1).view(torch.uint8).numpy().tobytes(), tuple(t.shape), str(t.dtype).removeprefix("torch.")


def from_wire(wire: tuple, device: torch.device | str = "cpu") -> torch.Tensor:
    data, shape, dtype = wire
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).view(shape).to(device)
