"""Which kernel a quantized linear runs for a step of M input rows (tokens), chosen by timing on this machine.

A method with several kernels ("paths") declares
- `row_paths()` -> {path name: the most rows it is timed at (None: every bucket)}, the paths this layer can run
  here (its dtype, the compiled kernels present);
- `default_path(rows)`: the built-in choice (used before a plan exists and under `--linear-kernels fixed`);
- `run_path(name, x2d)`: the product by that path;
- `row_plan_key()`: what the timing depends on (method, dtype, shape, group size).
`plan_linears(decoder, mode)` gives each such layer a RowPlan at engine start. "measured" times every path at
each of ROW_BUCKETS on the layer's own weight and keeps the fastest (the default unless another is at least
MARGIN faster: the machines are noisy), once per shape per machine: the choices are kept in
$LLMOPT_HOME/kernels/, keyed by CPU, features, threads, torch and the kernels' sources, and recorded with every
bench result (Engine.numerics). No path changes what is computed beyond rounding order (fp32 accumulation), but
for one choice: above 16 rows the 8-bit inputs' path of `int4-q8-cpu` and `int8-q8-cpu` is timed against their
float paths (which are the more precise; q8_inputs.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from llmopt.core.errors import ConfigError
from llmopt.core.hardware import best_time_of, cache_evictor, kernel_isa, machine_key
from llmopt.core.io import write_json
from llmopt.core.paths import llmopt_home
from llmopt.runtime.engine.config import LINEAR_KERNEL_MODES

log = logging.getLogger(__name__)

# a step of M rows takes the choice of the first bucket >= M (the last one's beyond it: prefill chunks, up to
# --max-num-batched-tokens, where a kernel that wins at 256 rows may lose to the dense GEMM)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
MARGIN = 0.05  # another path replaces the default only when faster by this fraction
TIMING_REPEATS = 5  # best of, after one warm-up call
TIMING_BUDGET_S = 0.05  # per path and bucket: fewer repeats for slow calls


def tile_bytes() -> int:
    """Bytes of dequantized weight per tile of the tiled paths (kernels/csrc/tiled_gemm.h): a quarter of the L2
    cache (the tile, the rows' inputs and outputs and the GEMM's packing buffers share it), 64-512 KiB."""
    from llmopt.core.hardware import cpu_info

    return min(512 << 10, max(64 << 10, cpu_info().caches.get("L2", 1 << 20) // 4))


TILE_BYTES = tile_bytes()


class RowPlan:
    """bucket -> path name; `path(rows)` looks the choice up in `by_rows`, a table indexed by row count (a list
    index per call: it runs for every linear of every step; row counts past its end take its last entry)."""

    def __init__(self, choices: dict[int, str]):
        self.choices = dict(sorted((int(b), p) for b, p in choices.items()))  # (the JSON store's keys are text)
        buckets = list(self.choices)
        self.by_rows = [self.choices[next((b for b in buckets if b >= rows), buckets[-1])]
                        for rows in range(buckets[-1] + 1)]

    def path(self, rows: int) -> str:
        return self.by_rows[rows] if rows < len(self.by_rows) else self.by_rows[-1]

    def to_json(self) -> dict[str, str]:
        return {str(b): p for b, p in self.choices.items()}


def fixed_plan(layer: nn.Module) -> RowPlan:
    return RowPlan({b: layer.default_path(b) for b in ROW_BUCKETS})


def choose(times: dict[str, float], default: str) -> str:
    """The fastest path, but the default where it is within MARGIN of it (timing noise should not flip it)."""
    fastest = min(times, key=times.get)
    return default if default in times and times[default] <= times[fastest] * (1 + MARGIN) else fastest


def measure_plan(layer: nn.Module, buckets=ROW_BUCKETS) -> tuple[RowPlan, dict]:
    """Times every path of `layer` at each bucket; returns the plan and the times (bucket -> path -> seconds)."""
    paths = layer.row_paths()
    generator = torch.Generator().manual_seed(0)
    choices, times = {}, {}
    # each timed call reads the weight from memory, as in a step of the real model, whose other layers' weights
    # evict it (timed in cache, MKL's sgemv beat the gemv kernel at 1 row, and lost in use:
    # docs/results/code-figures.md#timing-from-memory)
    evict = None  # (made at the first bucket with a choice: 2x the last-level cache, up to 128 MB)
    with torch.inference_mode():
        for rows in buckets:
            x = torch.randn(rows, layer.in_features, generator=generator).to(layer.dtype)
            candidates = layer.candidate_paths(rows, paths)
            if len(candidates) == 1:  # nothing to choose (a dense prefill chunk's GEMM would cost ~1 s to time)
                choices[rows], times[rows] = candidates[0], {}
                continue
            evict = evict or cache_evictor()
            timed = {name: best_time_of(lambda name=name, x=x: layer.run_path(name, x), TIMING_REPEATS,
                                          TIMING_BUDGET_S, before=evict)
                     for name in candidates}
            choices[rows], times[rows] = choose(timed, layer.default_path(rows)), timed
    return RowPlan(choices), times


# --- the per-machine store of measured choices ---------------------------------------------------------
_lock = threading.Lock()


@lru_cache(maxsize=1)
def _kernel_sources_digest() -> str:
    """The compiled kernels' sources (cpu_ops.sources_digest) and the paths' Python."""
    from llmopt.runtime.executor.kernels.cpu_ops import sources_digest

    digest = hashlib.sha256(sources_digest().encode())
    for module in sorted(Path(__file__).parent.glob("*.py")):  # the paths themselves
        digest.update(module.name.encode() + module.read_bytes())
    return digest.hexdigest()


def store_path() -> Path:
    key = json.dumps([*machine_key(), kernel_isa(), _kernel_sources_digest()])
    return llmopt_home() / "kernels" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


@lru_cache(maxsize=None)
def _stored(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}  # a damaged file: measure again


def _save(path: Path, entries: dict) -> None:
    try:
        write_json(path, entries, indent=1)
    except OSError as exc:  # a read-only home: measure again next time
        log.info("could not keep the linear kernels' choices at %s: %s", path, exc)


def plan_for(layer: nn.Module, mode: str, path: Path | None = None) -> RowPlan:
    """The layer's plan under `mode` (measured: from the store at `path`, default store_path(), else timed now
    and stored)."""
    if mode == "fixed":
        return fixed_plan(layer)
    path = path or store_path()
    key = layer.row_plan_key()
    with _lock:
        entries = _stored(path)
        if key not in entries:
            plan, times = measure_plan(layer)
            entries[key] = plan.to_json()
            log.info("linear kernels for %s: %s (ms: %s)", key, entries[key],
                     {b: {p: round(1e3 * s, 3) for p, s in t.items()} for b, t in times.items()})
            on_disk = _stored.__wrapped__(path)  # another process may have added shapes meanwhile
            _save(path, {**on_disk, **entries})
        return RowPlan(entries[key])


def plan_linears(decoder: nn.Module, mode: str) -> dict[str, dict[str, str]]:
    """Gives every layer of `decoder` that has several paths its plan; returns {layer key: {bucket: path}} (what
    the engine records)."""
    if mode not in LINEAR_KERNEL_MODES:
        raise ConfigError(f"--linear-kernels must be one of {', '.join(LINEAR_KERNEL_MODES)} (got {mode!r})",
                          param="linear_kernels")
    chosen, path = {}, store_path() if mode == "measured" else None
    for module in decoder.modules():
        if hasattr(module, "row_paths") and hasattr(module, "set_row_plan"):
            plan = plan_for(module, mode, path)
            module.set_row_plan(plan)
            chosen[module.row_plan_key()] = plan.to_json()
    return chosen


class RowPathsMixin:
    """For a LinearMethod with several paths: `_matmul` runs the plan's path for the step's row count (the
    built-in default until the engine sets a plan)."""

    _row_plan: RowPlan | None = None
    _path_table: list | None = None  # rows -> the bound _path_ method the plan chose (one list index per call)

    def set_row_plan(self, plan: RowPlan) -> None:
        available = self.row_paths()
        if not set(plan.choices.values()) <= set(available):  # a stored plan naming a path absent here
            plan = fixed_plan(self)
        self._row_plan = plan
        # (every linear of every step looks its path up: one list index instead of a formatted name's lookup and
        # another call frame, x 120 linears per batch-1 decode step)
        calls = {name: self._path_call(name) for name in set(plan.by_rows)}
        self._path_table = [calls[name] for name in plan.by_rows]

    def _path_call(self, name: str):
        """The callable the plan's table holds for path `name`: the method's `_bind_<name>()` where it has one (the
        kernel op with its weights already in hand: no module attribute lookups and no frame per call, which at
        batch-1 decode are a few us x 120 linears a step), else the bound `_path_<name>`. Bound at engine start,
        after every weight is in place."""
        bind = getattr(self, f"_bind_{name}", None)
        return bind() if bind is not None else getattr(self, f"_path_{name}")

    def graph_kernels(self) -> dict[str, tuple[str, list[torch.Tensor], list[int]]]:
        """{path: (the kernel op it calls, the tensors and ints that op takes after x)} for the paths a decode
        graph (kernels/csrc/decode_graph_cpu.cpp) can call itself: the same op with the same arguments."""
        return {}

    def path_for(self, rows: int) -> str:
        """The path a step of `rows` rows runs: its plan's, else the default."""
        return self._row_plan.path(rows) if self._row_plan is not None else self.default_path(rows)

    def graph_call(self, rows: int) -> tuple[str, list[torch.Tensor], list[int], torch.Tensor | None] | None:
        """(op, tensors, ints, bias) of the path this layer runs for a step of `rows` rows (its plan's, else the
        default), or None where a decode graph cannot call that path."""
        kernel = self.graph_kernels().get(self.path_for(rows))
        return None if kernel is None else (*kernel, self.bias)

    def forward_2d(self):
        """The forward for [T, in] inputs in the layer's dtype (the fast path's calls): the plan's path straight,
        without forward()'s reshape, casts and bias (a layer with a bias keeps forward)."""
        return self.forward if self.bias is not None else self._matmul

    def candidate_paths(self, rows: int, paths: dict[str, int | None]) -> list[str]:
        """The paths timed for a step of `rows` (those of `paths`, row_paths(), whose limit allows it)."""
        return [name for name, most in paths.items() if most is None or rows <= most]

    def row_plan_key(self) -> str:
        """What the timing depends on: method, dtype, shape, and the method's own details (`plan_key_detail`)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.name}|{dtype}|{self.out_features}x{self.in_features}{self.plan_key_detail()}"

    def plan_key_detail(self) -> str:
        return ""

    def run_path(self, name: str, x2d: torch.Tensor) -> torch.Tensor:
        return getattr(self, f"_path_{name}")(x2d)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        rows, table = x2d.shape[0], self._path_table
        if table is None:
            return self.run_path(self.default_path(rows), x2d)
        return table[rows if rows < len(table) else -1](x2d)
