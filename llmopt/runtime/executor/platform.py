"""What the runtime does differently by device type, decided once here (as vLLM's `current_platform`) rather than
by `device.type` checks at each call site: where the memory the KV cache may take comes from, whether tensors
live in host memory (huge pages, committing the cache, threads that follow the free cores, shared-memory
all-reduce), the fast path's fused element-wise ops, and the fast path's default."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.runtime.executor.host_memory import host_available_bytes
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.kernels.triton_support import triton_available


@dataclass(frozen=True)
class Platform:
    device: torch.device

    @classmethod
    def of(cls, device: torch.device | str) -> Platform:
        return cls(torch.device(device))

    @property
    def host_memory(self) -> bool:
        """Tensors live in the host's memory (the CPU): pages, NUMA, cores and processes are the runtime's concern."""
        return self.device.type == "cpu"

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def memory_name(self) -> str:
        return "host" if self.host_memory else "device"

    def available_memory(self) -> int:
        """Bytes the KV cache may be taken from: free device memory on CUDA, available host memory elsewhere (no
        more than the process's memory cgroup leaves: a container's limit)."""
        if self.cuda:
            return torch.cuda.mem_get_info(self.device)[0]
        return host_available_bytes()

    @property
    def fast_by_default(self) -> bool:
        """Whether the fast path (fused and compiled kernels; not bit-equal to transformers in fp32) is the default
        when not asked: wherever fused kernels exist — the compiled ones on CPU, Triton's on CUDA — so a layer is a
        handful of calls; elsewhere the exact path's torch ops (the fast path's torch ops would buy nothing)."""
        return self.host_memory or (self.cuda and triton_available())

    @property
    def logits_to_host(self) -> bool:
        """Whether a step's logits are read whole on the host (the CPU, where they already are: its compiled argmax),
        or stay on the device, where the greedy argmax runs and only the token ids cross (the logits too only when a
        row samples or reports log-probabilities)."""
        return self.host_memory

    @property
    def captures_steps(self) -> bool:
        """Whether decode steps are captured as graphs here by default (CUDA graphs)."""
        return self.cuda

    def step_graph_capture(self):
        """How decode steps are captured as graphs here (executor/step_graphs.py): CUDA graphs on CUDA, else None
        (the CPU runs its own compiled decode graph: models/decode_graph.py)."""
        if self.cuda:
            from llmopt.runtime.executor.step_graphs import CudaGraphCapture

            return CudaGraphCapture(self.device)
        return None

    def fused_ops(self):
        """The fast path's fused element-wise ops: the compiled CPU kernels, the Triton ones on CUDA where Triton is
        installed, else None (the torch ops)."""
        if self.host_memory:
            return cpu_ops()
        if self.cuda and triton_available():
            from llmopt.runtime.executor.kernels.triton_fused import TritonFusedOps

            return TritonFusedOps()
        return None
