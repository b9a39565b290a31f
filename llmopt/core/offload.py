"""Compressing a model larger than memory: its weights stay in their safetensors files and one decoder layer
at a time is read into memory (fp32), compressed, handed to a sink (which writes it) and dropped again.

Reads use plain file I/O, not a memory map: a mapped file's touched pages count in the process's resident set
until unmapped, which would make the memory bound depend on the page cache. Calibration activations [S, T, H]
that would not fit in their share of the budget are spilled to a file and read back one batch at a time.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from llmopt.core.errors import ConfigError, ModelLoadError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

# safetensors header dtype -> torch dtype
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}

CHUNK_BYTES = 16 * 2**20  # a tensor is read and converted this much at a time

# The share of --max-memory the calibration activations may take in memory before they go to disk: the rest
# is for one layer in fp32, its lower-precision copy, the algorithm's statistics (Hessians) and the results.
ACTIVATION_SHARE = 0.25


def parse_memory(text: str, what: str = "--max-memory") -> int:
    """'600MB', '2GiB', '1.5GB', '512000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match[2].upper() if match else None
    if match is None or unit not in _UNITS or float(match[1]) <= 0:
        raise ConfigError(f"{what} {text!r}: give a size such as 600MB, 2GB or 1.5GiB", param=what)
    return int(float(match[1]) * _UNITS[unit])


def format_bytes(n: int) -> str:
    if n < 10**6:
        return f"{n / 1e3:.0f} kB"
    return f"{n / 1e6:.0f} MB" if n < 10**9 else f"{n / 1e9:.2f} GB"


class SafetensorsWeights:
    """The tensors of a folder of safetensors files, read one at a time on request."""

    def __init__(self, path: str | Path):
        from llmopt.core.models import check_safetensors

        self.path = Path(path)
        self.entries: dict[str, tuple[Path, int, dict]] = {}  # key -> (file, data start, header entry)
        for file, header in check_safetensors(self.path).items():
            with file.open("rb") as f:
                data_start = 8 + int.from_bytes(f.read(8), "little")
            for key, meta in header.items():
                if key != "__metadata__":
                    self.entries[key] = (file, data_start, meta)

    def _decompressed(self, module: str, dtype: torch.dtype | None) -> torch.Tensor:
        from llmopt.core.contract import sparse24, sparse_bitmask

        unstructured = f"{module}.row_offsets" in self.entries
        kind = sparse_bitmask.BitmaskWeight if unstructured else sparse24.Sparse24Weight
        suffixes = sparse_bitmask.SUFFIXES if unstructured else sparse24.COMPRESSED_SUFFIXES
        parts = {suffix: self.get(f"{module}.{suffix}") for suffix in suffixes}
        return kind.from_tensors(parts).decompress(dtype)

    def get(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `key`, floats in `dtype` (None: as stored), in memory of its own (a linear's `.weight`
        stored compressed: decompressed). Converted in chunks
        of CHUNK_BYTES: reading a large tensor (the embeddings) into another dtype never holds both copies."""
        if key not in self.entries:
            module = key.removesuffix(".weight")
            if key.endswith(".weight") and f"{module}.bitmask" in self.entries:  # stored compressed (sparse)
                return self._decompressed(module, dtype)
            raise ModelLoadError(f"{self.path} lacks tensor {key}: the checkpoint is incomplete")
        file, data_start, meta = self.entries[key]
        stored = _DTYPES.get(meta["dtype"])
        if stored is None:
            raise ModelLoadError(f"{file}: tensor {key} has dtype {meta['dtype']}, which llmopt cannot read")
        dtype = dtype if dtype is not None and stored.is_floating_point else stored
        out = torch.empty(meta["shape"], dtype=dtype)
        flat, size = out.view(-1), stored.itemsize
        begin, end = meta["data_offsets"]
        step = max(CHUNK_BYTES // size, 1) * size
        with file.open("rb") as f:
            f.seek(data_start + begin)
            for offset in range(0, end - begin, step):
                buffer = bytearray(min(step, end - begin - offset))
                f.readinto(buffer)
                first = offset // size
                flat[first: first + len(buffer) // size] = torch.frombuffer(buffer, dtype=stored)
        return out


def meta_model(config) -> nn.Module:
    """The transformers model of `config` with every weight on the meta device (no memory), its computed
    buffers (rotary frequencies) real."""
    from transformers import AutoModelForCausalLM

    from llmopt.core.models import rebuild_meta_buffers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rebuild_meta_buffers(model)
    return model.eval()


def onload(module: nn.Module, prefix: str, weights: SafetensorsWeights, dtype: torch.dtype = torch.float32) -> None:
    """Give `module` (at path `prefix` in the model) its weights from the files, floats in `dtype`."""
    state = {name: weights.get(f"{prefix}.{name}" if prefix else name, dtype)
             for name, tensor in module.state_dict().items() if tensor.is_meta}
    module.load_state_dict(state, strict=False, assign=True)


def offload(module: nn.Module) -> None:
    """Drop `module`'s weights (back to the meta device)."""
    module.to("meta")


def limit_heap_retention(threshold_bytes: int = 2**20) -> None:
    """Make glibc give every allocation of `threshold_bytes` or more its own mapping, returned to the OS when
    freed. By default the threshold grows to the largest block freed (up to 32 MB), after which a layer's
    weights come from the heap, whose freed blocks stay resident: RSS grew by ~10 MB per layer without this
    (measured, a 38-layer model: 1.26 GB peak, 0.78 GB with it)."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-3, threshold_bytes)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


class LayerIO(Protocol):
    """Where a layer-by-layer run gets each decoder layer's weights and where they go when it is done."""

    def onload(self, index: int, layer: nn.Module) -> None:
        """Before layer `index` is used."""

    def offload(self, index: int, layer: nn.Module) -> None:
        """After layer `index` is final (compressed, its outputs computed)."""

    def inputs_captured(self) -> None:
        """The first layer's inputs are known: what runs before the layers (embeddings) is no longer needed."""


class SpilledActivations:
    """Hidden states [S, T, H] kept in a file and read / written by rows of the first dimension, standing in for
    the tensor the calibration pipeline indexes as `hidden[rows]` and `hidden[rows] = value`."""

    def __init__(self, tensor: torch.Tensor, folder: str | Path | None = None):
        self.shape, self.dtype = tensor.shape, tensor.dtype
        self.row_bytes = tensor[0].numel() * tensor.element_size()
        handle, name = tempfile.mkstemp(prefix="llmopt-activations-", suffix=".bin", dir=folder)
        os.unlink(name)  # the file lives as long as its descriptor: nothing is left behind on any exit
        self.fd = handle
        os.ftruncate(self.fd, self.row_bytes * self.shape[0])
        for row in range(self.shape[0]):  # row by row: no second full copy in memory
            self[slice(row, row + 1)] = tensor[row: row + 1]

    def _span(self, rows: slice) -> tuple[int, int]:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("spilled activations are read by contiguous rows")
        return start, stop

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop = self._span(rows)
        out = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        read = os.preadv(self.fd, [view], start * self.row_bytes)
        if read != len(view):
            raise OSError(f"spilled activations: read {read} of {len(view)} bytes")
        return out

    def __setitem__(self, rows: slice, value: torch.Tensor) -> None:
        start, stop = self._span(rows)
        data = value.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes()
        if len(data) != (stop - start) * self.row_bytes:
            raise ValueError("spilled activations: a write must cover exactly the rows it names")
        os.pwrite(self.fd, data, start * self.row_bytes)

    def clone(self) -> "SpilledActivations":
        copy = SpilledActivations(self[slice(0, 1)].expand(self.shape[0], *self.shape[1:]))
        for row in range(self.shape[0]):
            copy[slice(row, row + 1)] = self[slice(row, row + 1)]
        return copy

    def __del__(self):
        try:
            os.close(self.fd)
        except (OSError, AttributeError):
            pass


def keep_activations(hidden: torch.Tensor, budget_bytes: int | None, streams: int):
    """`hidden` itself, or its spilled stand-in when `streams` copies of it would exceed `budget_bytes`."""
    if budget_bytes is None or hidden.numel() * hidden.element_size() * streams <= budget_bytes:
        return hidden
    return SpilledActivations(hidden)
