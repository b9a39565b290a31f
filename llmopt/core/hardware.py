"""What this machine computes fast, and the choices that follow from it.

- `cpu_info()`: vendor, model, architecture, the instruction-set features that matter for inference (AVX2, FMA,
  F16C, AVX-512 F/BW/VL/DQ, AVX512_BF16, AVX512_FP16, AVX512_VNNI, AVX-VNNI, AMX-BF16/INT8; on Arm NEON, SVE,
  BF16, I8MM), logical CPUs and physical cores, cache sizes.
- The usable features: what the CPU has, capped by the variables that simulate a smaller CPU:
  `LLMOPT_CPU_ISA` (our compiled kernels), `ONEDNN_MAX_CPU_ISA` (oneDNN) and `ATEN_CPU_CAPABILITY` (torch's own
  kernels). A test of an AVX2-only CPU on an AVX-512 one sets all three (`avx2`, `AVX2`, `avx2`).
- `kernel_isa()`: which build of the compiled CPU kernels to load (scalar, avx2, avx512, avx512_bf16).
- `resolve_dtype("auto")`: bf16 compute only where it is fast: CUDA, and CPUs that multiply bf16 natively
  (AVX512_BF16, AMX-BF16, Arm BF16) *and* whose measured bf16 GEMM rate is at least their fp32 rate; else fp32.
  On a CPU without bf16 units torch's bf16 matmuls run 3-80x slower than fp32; with AVX512_BF16 but no AMX
  (vdpbf16ps only) oneDNN's bf16 GEMMs can still trail MKL's fp32 ones (docs/results/cpu.md).
- `measured_rates()`: memory bandwidth and fp32 / bf16 GEMM rates, measured once per machine and cached under
  $LLMOPT_HOME/hardware; `peak_flops()` combines them with the units' theoretical rate for MFU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from llmopt.core.errors import ConfigError
from llmopt.core.paths import llmopt_home

log = logging.getLogger(__name__)

# Builds of the compiled CPU kernels on x86, lowest first, with the features each needs.
X86_ISAS: dict[str, tuple[str, ...]] = {
    "scalar": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"),
}
# Features above each level (removed when a variable caps the process at that level).
_ABOVE = {
    "scalar": ("avx2", "fma", "f16c", "avx_vnni"),
    "avx2": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
    "avx512": ("avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile", "amx_fp16"),
    "avx512_bf16": (),
}
_X86_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_fp16",
                 "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")
_ARM_FEATURES = {"asimd": "neon", "sve": "sve", "sve2": "sve2", "bf16": "bf16", "i8mm": "i8mm", "asimddp": "dotprod"}
# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) and torch's (ATEN_CPU_CAPABILITY) as our levels.
_ONEDNN_LEVELS = {"SSE41": "scalar", "AVX": "scalar", "AVX2": "avx2", "AVX2_VNNI": "avx2", "AVX2_VNNI_2": "avx2",
                  "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "avx512", "AVX512_CORE_BF16": "avx512_bf16"}
_ATEN_LEVELS = {"default": "scalar", "avx2": "avx2", "avx512": "avx512_bf16", "zvector": "scalar"}


@dataclass(frozen=True)
class CpuInfo:
    arch: str  # x86_64, aarch64, ...
    vendor: str
    model: str
    features: frozenset[str]  # detected, before any cap
    logical_cpus: int  # CPUs this process may run on
    physical_cores: int
    caches: dict[str, int] = field(default_factory=dict)  # "L1d", "L2", "L3" -> bytes
    mhz: float | None = None
    # x86 "family F, model M, stepping S" (decimal, as /proc/cpuinfo gives them): two hosts a VM names alike (its
    # CPU line identical) can differ, e.g. an "AMD EPYC" of family 23 (Zen 1/2) or 25 (Zen 3/4); "" where unknown
    signature: str = ""

    @property
    def is_x86(self) -> bool:
        return self.arch in ("x86_64", "amd64", "i686")


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _size(text: str) -> int:
    match = re.match(r"(\d+)\s*([KMG]?)", text.strip())
    if not match:
        return 0
    return int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2)]


def _caches() -> dict[str, int]:
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        level, kind = _read(f"{index}/level").strip(), _read(f"{index}/type").strip()
        if level and kind != "Instruction":
            caches[f"L{level}" + ("d" if kind == "Data" else "")] = _size(_read(f"{index}/size"))
    return caches


def _torch_features() -> set[str]:
    """Where /proc/cpuinfo is missing (macOS, Windows): what torch's capability string implies."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    features = set()
    if capability in ("avx2", "avx512"):
        features |= set(X86_ISAS["avx2"])
    if capability == "avx512":
        features |= set(X86_ISAS["avx512"])
    if platform.machine().lower() in ("arm64", "aarch64"):
        features.add("neon")
    return features


@lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    arch = platform.machine().lower() or "unknown"
    text = _read("/proc/cpuinfo")
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    flags = set((fields.get("flags") or fields.get("features") or "").split())
    if arch in ("x86_64", "amd64"):
        features = {f for f in _X86_FEATURES if f in flags}
    else:
        features = {name for flag, name in _ARM_FEATURES.items() if flag in flags}
    if not text:
        features = _torch_features()
    try:
        logical = len(os.sched_getaffinity(0))
    except AttributeError:
        logical = os.cpu_count() or 1
    cores = {(m.group(1), m.group(2)) for m in re.finditer(
        r"physical id\s*:\s*(\d+).*?core id\s*:\s*(\d+)", text, re.S)}
    model = fields.get("model name") or fields.get("cpu model") or platform.processor() or arch
    vendor = fields.get("vendor_id") or fields.get("cpu implementer") or platform.system()
    mhz = float(fields["cpu mhz"]) if re.fullmatch(r"[\d.]+", fields.get("cpu mhz", "")) else None
    return CpuInfo(arch, vendor, model, frozenset(features), logical, min(len(cores) or logical, logical),
                   _caches(), mhz, _signature(fields))


def _signature(fields: dict[str, str]) -> str:
    parts = [(name, fields.get(key, "")) for name, key in (("family", "cpu family"), ("model", "model"),
                                                            ("stepping", "stepping"))]
    return ", ".join(f"{name} {value}" for name, value in parts) if all(v.isdigit() for _, v in parts) else ""


# --- what this process may use -------------------------------------------------------------------------
def _cap_level() -> str | None:
    """The lowest level any simulation variable allows (None: no cap)."""
    order = list(X86_ISAS)
    levels = []
    forced = os.environ.get("LLMOPT_CPU_ISA", "").strip().lower()
    if forced:
        if forced not in X86_ISAS:
            raise ConfigError(f"LLMOPT_CPU_ISA={forced}: choose one of {', '.join(X86_ISAS)}")
        levels.append(forced)
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if onednn in _ONEDNN_LEVELS:
        levels.append(_ONEDNN_LEVELS[onednn])
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten in _ATEN_LEVELS:
        levels.append(_ATEN_LEVELS[aten])
    return min(levels, key=order.index) if levels else None


def usable_features() -> frozenset[str]:
    """The CPU's features less those above the simulated level."""
    info = cpu_info()
    cap = _cap_level()
    if cap is None or not info.is_x86:
        return info.features
    order = list(X86_ISAS)
    removed = {f for level in order[order.index(cap):] for f in _ABOVE[level]}
    return info.features - removed


def kernel_isa() -> str:
    """The compiled CPU kernels' build for this process: the highest level whose features are all usable
    (non-x86 CPUs: the portable build, which the compiler vectorizes for the architecture's baseline)."""
    if not cpu_info().is_x86:
        return "scalar"
    features = usable_features()
    return [isa for isa, needs in X86_ISAS.items() if set(needs) <= features][-1]


def supported_kernel_isas() -> list[str]:
    """Every build this CPU can execute, lowest first (the tests run each)."""
    if not cpu_info().is_x86:
        return ["scalar"]
    return [isa for isa, needs in X86_ISAS.items() if set(needs) <= cpu_info().features]


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (as usable by this process)."""
    features = usable_features()
    return bool(features & {"avx512_bf16", "amx_bf16"}) if cpu_info().is_x86 else "bf16" in features


def native_fp16() -> bool:
    features = usable_features()
    return bool(features & {"avx512_fp16", "amx_fp16"}) if cpu_info().is_x86 else "neon" in features


# --- the compute dtype -----------------------------------------------------------------------------
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def bf16_faster() -> bool:
    """Whether bf16 compute pays on this CPU: bf16 units, and bf16 GEMMs measured at least as fast as fp32."""
    if not native_bf16():
        return False
    rates = measured_rates()
    return rates.gemm_bf16 >= rates.gemm_fp32


def check_device(device: str | torch.device) -> str:
    """The device's kind (cpu or cuda) when llmopt can run there; a ConfigError naming --device otherwise (an
    unparsable name, a device type llmopt has no kernels for, CUDA absent or the index past the last GPU)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"--device {device}: not a device name; use cpu, cuda or cuda:N", param="device") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: llmopt runs on cpu or cuda", param="device")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: this machine has no usable CUDA GPU (torch {torch.__version__}); "
                              "use --device cpu", param="device")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here",
                              param="device")
    return parsed.type


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> str:
    """'auto' -> the fastest dtype that keeps bf16-level accuracy on this device; other names pass through.
    Checks the device first (check_device): every command resolves its dtype before any work."""
    kind = check_device(device)
    if name not in DTYPE_CHOICES:
        raise ConfigError(f"--dtype {name}: choose one of {', '.join(DTYPE_CHOICES)}")
    if name != "auto":
        return name
    if kind == "cuda":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    if kind == "cpu" and bf16_faster():
        return "bfloat16"
    return "float32"


def dtype_note(requested: str, device: str | torch.device = "cpu") -> str | None:
    """One line to print about the dtype choice: what 'auto' resolved to and why, or a warning that an
    explicit half-precision dtype will be slow on this CPU; None when there is nothing to say."""
    if check_device(device) != "cpu":
        return f"dtype auto -> {resolve_dtype(requested, device)}" if requested == "auto" else None
    features = usable_features()
    bf16_units = [f for f in ("amx_bf16", "avx512_bf16", "bf16") if f in features]
    vector = kernel_isa() if cpu_info().is_x86 else ("neon" if "neon" in features else "scalar")
    if requested == "auto":
        resolved = resolve_dtype(requested, device)
        if resolved == "bfloat16":
            why = f"bf16 units: {' '.join(bf16_units)}"
        elif bf16_units:
            rates = measured_rates()
            why = (f"{' '.join(bf16_units)}, but bf16 GEMMs measured slower than fp32 here: "
                   f"{rates.gemm_bf16 / 1e9:.0f} vs {rates.gemm_fp32 / 1e9:.0f} GFLOP/s")
        else:
            why = f"no bf16 units; {vector}"
        return f"dtype auto -> {resolved} ({why})"
    if requested == "bfloat16" and not native_bf16():
        return f"warning: bfloat16 on a CPU without bf16 units ({vector}) is slow; auto would use float32"
    if requested == "bfloat16" and not bf16_faster():
        return "note: bf16 GEMMs measured slower than fp32 on this CPU; auto would use float32"
    if requested == "float16" and not native_fp16():
        return f"warning: float16 on a CPU without fp16 units ({vector}) is slow; auto would use float32"
    return None


# --- measured and theoretical rates ----------------------------------------------------------------
@dataclass
class MeasuredRates:
    bandwidth: float  # bytes/s, a streaming copy beyond the last-level cache (read + write)
    gemm_fp32: float  # FLOP/s of a [256, 1024] x [1024, 1024] linear in fp32
    gemm_bf16: float  # the same in bf16
    threads: int
    measured_at: str


def call_times(fn, repeats: int = 3, budget_s: float = float("inf"), before=None, warmups: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls after `warmups` untimed ones (first-call allocations, packing buffers),
    stopping early once the timed calls have taken `budget_s` together. `before`: called, untimed, before each timed
    call (cache_evictor(): time a call as it runs on data streamed from memory)."""
    for _ in range(warmups):
        fn()
    times: list[float] = []
    spent = 0.0
    for _ in range(repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        spent += times[-1]
        if spent > budget_s:
            break
    return times


def best_time_of(fn, repeats: int = 3, budget_s: float = float("inf"), before=None) -> float:
    """The fastest of `repeats` calls after one warm-up call (call_times)."""
    return min(call_times(fn, repeats, budget_s, before))


EVICT_MAX_BYTES = 128 << 20  # beyond this much last-level cache a model's weights may well stay cached in use


def cache_evictor():
    """A callable that reads a buffer twice the last-level cache's size: what a kernel touches next comes from
    memory, as a decoder layer's weight does in a real step (the other layers' weights went through the caches
    since). The buffer lives as long as the callable."""
    last_level = max(cpu_info().caches.values(), default=32 << 20)
    buffer = torch.ones(min(2 * last_level, EVICT_MAX_BYTES) // 4)
    return lambda: buffer.sum()


def _measure_bandwidth() -> float:
    l3 = cpu_info().caches.get("L3", 32 * 2**20)
    size = min(2**30, max(256 * 2**20, 2 * l3))  # past the last-level cache, at most 1 GiB per buffer
    src = torch.ones(size // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * size / best_time_of(lambda: dst.copy_(src))


def _measure_gemm(dtype: torch.dtype) -> float:
    m, k, n = 256, 1024, 1024
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    # best of 10: a 2-vCPU VM's neighbours moved 3 runs' best by 50% between two measurements
    return 2 * m * k * n / best_time_of(lambda: torch.nn.functional.linear(x, w), repeats=10)


def machine_key() -> list:
    """What a measurement on this machine depends on (the key of the caches of measured figures): CPU model,
    usable features, threads, torch, and the ISA caps the environment sets."""
    return [cpu_info().model, sorted(usable_features()), torch.get_num_threads(), torch.__version__,
            os.environ.get("ONEDNN_MAX_CPU_ISA"), os.environ.get("ATEN_CPU_CAPABILITY")]


def _rates_path() -> Path:
    key = json.dumps(machine_key())
    return llmopt_home() / "hardware" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def measured_rates(refresh: bool = False) -> MeasuredRates:
    """Bandwidth and GEMM rates of this machine at the current thread count: measured once (~2-5 s) and kept
    in $LLMOPT_HOME/hardware/, keyed by CPU model, usable features, threads and torch version."""
    path = _rates_path()
    if not refresh and path.is_file():
        try:
            return MeasuredRates(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass  # an older or damaged file: measure again
    rates = MeasuredRates(_measure_bandwidth(), _measure_gemm(torch.float32), _measure_gemm(torch.bfloat16),
                          torch.get_num_threads(), time.strftime("%Y-%m-%dT%H:%M:%S"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(rates)))
        tmp.replace(path)
    except OSError as exc:  # a read-only home: measure again next time
        log.info("could not cache hardware rates at %s: %s", path, exc)
    return rates


def flops_per_cycle(dtype: torch.dtype) -> int:
    """Per core and cycle, of the fastest units this process may use for `dtype` (two FMA ports assumed)."""
    features = usable_features()
    if cpu_info().is_x86:
        fp32 = 64 if "avx512f" in features else 32 if "fma" in features else 8
        if dtype == torch.bfloat16:
            return 1024 if "amx_bf16" in features else 2 * fp32 if "avx512_bf16" in features else fp32
        if dtype == torch.float16:
            return 1024 if "amx_fp16" in features else 2 * fp32 if "avx512_fp16" in features else fp32
        return fp32
    return 16 * (2 if dtype != torch.float32 and "bf16" in features else 1)  # 2 x 128-bit FMA pipes


def theoretical_flops(dtype: torch.dtype, threads: int | None = None) -> float | None:
    """cores x clock x FLOP/cycle; None where the clock is unknown."""
    info = cpu_info()
    if not info.mhz:
        return None
    cores = min(threads or torch.get_num_threads(), info.physical_cores)
    return cores * info.mhz * 1e6 * flops_per_cycle(dtype)


def peak_flops(dtype: torch.dtype) -> tuple[float, str]:
    """The FLOP/s an MFU is relative to: the theoretical rate of the units, or the measured GEMM rate where
    that is higher (a turbo clock above the reported one)."""
    rates = measured_rates()
    measured = rates.gemm_bf16 if dtype in (torch.bfloat16, torch.float16) else rates.gemm_fp32
    theory = theoretical_flops(dtype)
    if theory is not None and theory >= measured:
        return theory, f"theoretical ({flops_per_cycle(dtype)} FLOP/cycle/core)"
    return measured, "measured GEMM"


def cpu_line() -> str:
    """One line naming the CPU, for every published figure."""
    info = cpu_info()
    features = usable_features()
    shown = [f for f in (*_X86_FEATURES, *_ARM_FEATURES.values()) if f in features and f not in ("fma", "f16c")]
    simulated = f", simulated as {_cap_level()}" if _cap_level() and features != info.features else ""
    return (f"{info.model} ({info.arch}, {info.logical_cpus} CPUs, {info.physical_cores} cores): "
            f"{' '.join(shown) or 'no vector extensions'}{simulated}; kernels {kernel_isa()}, "
            f"auto dtype {resolve_dtype('auto')}")


THP_ROOT = "/sys/kernel/mm/transparent_hugepage"


def thp_mode(root: str = THP_ROOT) -> str | None:
    """Linux's transparent huge page settings as "MODE, defrag DEFRAG" (the bracketed choice of each file:
    "madvise, defrag madvise" gives huge pages only to memory that asks, as the runtime's weights and KV cache do;
    "never": none), or None where the files are absent (not Linux)."""
    chosen = {}
    for name in ("enabled", "defrag"):
        try:
            text = Path(root, name).read_text()
        except OSError:
            return None
        match = re.search(r"\[([^\]]+)\]", text)
        chosen[name] = match.group(1) if match else text.strip()
    return f"{chosen['enabled']}, defrag {chosen['defrag']}"


def hardware_facts(measure: bool = True, refresh: bool = False) -> dict:
    """Everything above as one JSON-able dict (for `llmopt env` and benchmark JSON); measure=False leaves out
    the measured rates (which `auto` still reads where the CPU has bf16 units)."""
    info = cpu_info()
    facts = {
        "cpu": cpu_line(),
        "cpu_model": info.model, "cpu_signature": info.signature, "cpu_vendor": info.vendor, "arch": info.arch,
        "logical_cpus": info.logical_cpus, "physical_cores": info.physical_cores, "cpu_mhz": info.mhz,
        "caches": {k: v for k, v in info.caches.items()},
        "features": sorted(info.features), "usable_features": sorted(usable_features()),
        "simulated_level": _cap_level(), "kernel_isa": kernel_isa(), "supported_kernel_isas": supported_kernel_isas(),
        "native_bf16": native_bf16(), "auto_dtype": resolve_dtype("auto"),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "transparent_huge_pages": thp_mode(),
    }
    if measure:
        rates = measured_rates(refresh)
        facts.update({"bandwidth_gb_s": rates.bandwidth / 1e9, "gemm_fp32_gflop_s": rates.gemm_fp32 / 1e9,
                      "gemm_bf16_gflop_s": rates.gemm_bf16 / 1e9, "rates_threads": rates.threads})
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            theory = theoretical_flops(dtype)
            facts[f"theoretical_{name}_gflop_s"] = theory / 1e9 if theory else None
    return facts
