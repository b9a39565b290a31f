"""Hardware specs for the capacity planner: what a device computes and moves per second, its memory, and its
links. Datasheet figures for GPUs (dense tensor-core rates, no 2:4 sparsity), measured ones for this CPU (the
rates `llmopt env` prints), or a custom spec from a JSON / YAML file (`--hardware-file`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError, model_validator

from llmopt.core.errors import ConfigError, file_problem
from llmopt.core.registry import Registry

# compute dtypes a spec may give a rate for (FLOP/s); a weight scheme computes in one of them
COMPUTE_DTYPES = ("fp32", "bf16", "fp8", "int8", "fp4")


class HardwareSpec(BaseModel):
    """One device. Rates are peaks; the efficiencies say what fraction of them a well-tuned engine reaches on
    large GEMMs (compute) and on streaming its weights and KV cache (bandwidth)."""

    # (no NaN or infinity anywhere: a rate of inf or nan would predict anything)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str
    kind: str = Field("gpu", pattern="^(gpu|cpu)$")
    memory_gib: float = Field(gt=0)  # per device
    bandwidth_gb_s: float = Field(gt=0)  # memory bandwidth, GB/s (1e9 bytes)
    flops_tflops: dict[str, PositiveFloat]  # compute dtype -> dense TFLOP/s (1e12)
    compute_efficiency: float = Field(0.6, gt=0, le=1)
    bandwidth_efficiency: float = Field(0.8, gt=0, le=1)
    link_gb_s: float = Field(gt=0)  # per direction between two devices of one node (NVLink, PCIe, shared memory)
    link_latency_us: float = Field(ge=0)  # one collective or transfer's fixed cost
    step_overhead_ms: float = Field(0.0, ge=0)  # fixed cost of one engine step (launches, scheduling, Python)
    layer_overhead_us: float = Field(0.0, ge=0)  # fixed cost per decoder layer per step (per-op dispatch)
    activation_dtype: str = "bf16"  # what weight-only schemes compute in (the engine's dtype)
    max_devices: int = Field(8, ge=1)  # devices one node holds (TP and PP stay within a node here)
    memory_utilization: float = Field(0.9, gt=0, le=1)  # of memory_gib, for weights + KV cache + activations
    source: str = ""

    @model_validator(mode="after")
    def _known_dtypes(self):
        unknown = (set(self.flops_tflops) | {self.activation_dtype}) - set(COMPUTE_DTYPES)
        if unknown or "bf16" not in self.flops_tflops:
            raise ValueError(f"flops_tflops and activation_dtype take {', '.join(COMPUTE_DTYPES)} (bf16's rate "
                             f"required); got {', '.join(sorted(unknown or self.flops_tflops))}")
        return self

    def flops(self, dtype: str) -> float:
        """FLOP/s the device reaches in `dtype` (efficiency applied); a dtype without its own units runs at bf16's
        rate (fp8/fp4 weights on a device without fp8/fp4 tensor cores are converted to bf16 and multiplied there),
        fp32 at half bf16's where not given."""
        rates = self.flops_tflops
        dtype = self.activation_dtype if dtype == "activations" else dtype
        rate = rates.get(dtype) or (rates["bf16"] / 2 if dtype == "fp32" else rates["bf16"])
        return rate * 1e12 * self.compute_efficiency

    @property
    def bandwidth(self) -> float:
        """Bytes/s the device streams (efficiency applied)."""
        return self.bandwidth_gb_s * 1e9 * self.bandwidth_efficiency

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30 * self.memory_utilization


HARDWARE: Registry = Registry("hardware spec")

# Datasheets (dense rates, SXM parts): NVIDIA H200 (141 GB HBM3e, 4.8 TB/s, BF16 989 TFLOPS, FP8/INT8 1,979),
# H100 SXM (80 GB HBM3, 3.35 TB/s, same tensor rates), A100 SXM 80 GB (2.039 TB/s, BF16 312, INT8 624, no FP8),
# L4 (24 GB GDDR6, 300 GB/s, BF16 121, FP8/INT8 242.5; PCIe Gen4 x16 between cards). NVLink 4: 900 GB/s per GPU
# in both directions together (450 each way); NVLink 3 (A100): 600 (300 each way).
_GPUS = {
    "h200": dict(memory_gib=141e9 / 2**30, bandwidth_gb_s=4800, flops_tflops={"bf16": 989, "fp8": 1979, "int8": 1979,
                 "fp32": 67}, link_gb_s=450, link_latency_us=8, source="NVIDIA H200 SXM datasheet"),
    "h100": dict(memory_gib=80, bandwidth_gb_s=3350, flops_tflops={"bf16": 989, "fp8": 1979, "int8": 1979, "fp32": 67},
                 link_gb_s=450, link_latency_us=8, source="NVIDIA H100 SXM datasheet"),
    "a100": dict(memory_gib=80, bandwidth_gb_s=2039, flops_tflops={"bf16": 312, "int8": 624, "fp32": 19.5},
                 link_gb_s=300, link_latency_us=10, source="NVIDIA A100 SXM 80GB datasheet"),
    "l4": dict(memory_gib=24, bandwidth_gb_s=300, flops_tflops={"bf16": 121, "fp8": 242.5, "int8": 242.5,
               "fp32": 30.3}, link_gb_s=32, link_latency_us=15, max_devices=8, source="NVIDIA L4 datasheet"),
}
# A GPU engine with CUDA graphs: ~0.3 ms of fixed cost per step (scheduling, sampling, the host round trip)
GPU_STEP_OVERHEAD_MS = 0.3
for _name, _fields in _GPUS.items():
    HARDWARE.add(_name, HardwareSpec(name=_name, step_overhead_ms=GPU_STEP_OVERHEAD_MS, **_fields))


# The runtime on a CPU: its fixed costs (Python and dispatch, per step and per decoder layer), the share of the
# measured GEMM rate its prefill and batched decode reach (smaller GEMMs than the measured one, plus attention,
# norms and sampling in between: the GPUs' default), and of the copy bandwidth its decode reads at. Set once,
# then checked against the runtime's measurements (benchmarks/runtime/planner.py; docs/results/planner.md).
CPU_STEP_OVERHEAD_MS = 1.0
CPU_LAYER_OVERHEAD_US = 150.0
CPU_COMPUTE_EFFICIENCY = 0.6
CPU_BANDWIDTH_EFFICIENCY = 0.9
CPU_LINK_GB_S, CPU_LINK_LATENCY_US = 10.0, 10.0  # the shared-memory all-reduce: ~10 us for a row (parallel.md)


def this_cpu() -> HardwareSpec:
    """This machine's CPU as one device: the measured copy bandwidth and GEMM rates (core.hardware, cached per
    machine), with the runtime's efficiencies and fixed costs on a CPU (above). Parallel ranks on a CPU share it:
    each gets an even share of its cores, bandwidth and memory (the planner divides; `max_devices` is its core
    count); weight-only schemes compute in the dtype `auto` picks here. Links: the shared-memory all-reduce."""
    import psutil

    from llmopt.core.hardware import cpu_info, cpu_line, measured_rates, resolve_dtype

    rates = measured_rates()
    activations = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}[resolve_dtype("auto")]
    return HardwareSpec(
        name="cpu", kind="cpu", memory_gib=psutil.virtual_memory().total / 2**30,
        bandwidth_gb_s=rates.bandwidth / 1e9, flops_tflops={"fp32": rates.gemm_fp32 / 1e12,
                                                            "bf16": rates.gemm_bf16 / 1e12},
        compute_efficiency=CPU_COMPUTE_EFFICIENCY, bandwidth_efficiency=CPU_BANDWIDTH_EFFICIENCY,
        link_gb_s=CPU_LINK_GB_S, link_latency_us=CPU_LINK_LATENCY_US, step_overhead_ms=CPU_STEP_OVERHEAD_MS,
        layer_overhead_us=CPU_LAYER_OVERHEAD_US, activation_dtype=activations,
        max_devices=max(1, cpu_info().physical_cores), source=f"measured: {cpu_line()}")


def hardware_spec(name: Optional[str] = None, path: Optional[str] = None) -> HardwareSpec:
    """--hardware NAME (h200, h100, a100, l4, cpu) or --hardware-file FILE (JSON or YAML with HardwareSpec's
    fields)."""
    if path is not None:
        return _spec_file(Path(path))
    if name == "cpu":
        return this_cpu()
    if name not in HARDWARE:
        raise ConfigError(f"unknown --hardware {name!r}: choose one of {', '.join([*HARDWARE.names(), 'cpu'])} or "
                          "give --hardware-file", param="hardware")
    return HARDWARE.get(name)


def _spec_file(path: Path) -> HardwareSpec:
    from llmopt.core.io import read_mapping_file

    what = f"--hardware-file {path}"
    fields = read_mapping_file(path, what, f"a mapping with {', '.join(SPEC_REQUIRED_KEYS)} (optional: the other "
                                           f"keys of `llmopt plan --help`)")
    try:
        return HardwareSpec(**{"name": path.stem, **fields})
    except ValidationError as e:
        problem = file_problem(e, SPEC_FILE_KEYS, SPEC_REQUIRED_KEYS)
        raise ConfigError(f"{what}: {problem}", param="hardware_file") from None


# the keys a --hardware-file may hold (HardwareSpec's fields), and those it must (`name` defaults to the file's stem)
SPEC_FILE_KEYS = tuple(HardwareSpec.model_fields)
SPEC_REQUIRED_KEYS = tuple(k for k, f in HardwareSpec.model_fields.items() if f.is_required() and k != "name")
