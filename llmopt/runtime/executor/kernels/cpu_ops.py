"""The runtime's compiled CPU kernels (csrc/*.cpp), built on first use with torch's C++ extension loader.

The same sources are built once per instruction set, each with explicit flags (never -march=native) under its
own name, so a kernel cache made on one CPU never runs instructions another lacks:
- scalar: the plain loops (any CPU; on Arm the compiler vectorizes them for NEON);
- avx2: 8-lane AVX2 + FMA + F16C (Haswell and later, AMD Zen);
- avx512: AVX-512 F/BW/VL/DQ (Skylake-SP, Cascade Lake);
- avx512_bf16: plus AVX512_BF16 dot products (Cooper Lake, Sapphire Rapids and later, AMD Zen 4 and later).
`cpu_ops()` loads the build for the features this process may use (core.hardware.kernel_isa: LLMOPT_CPU_ISA
forces a lower one); each build registers its ops as torch.ops.llmopt_cpu_<isa>, so tests load several side by
side.

They are an accelerator, not a requirement: where no compiler is available (or LLMOPT_CPU_KERNELS=0)
`cpu_ops()` returns None and the runtime keeps its plain-torch path, which the kernels are tested against.
torch caches each build (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) and rebuilds when the source
or flags change; one process builds a folder at a time, and a build killed midway is no reason to wait
(build_lock.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

from llmopt.core.hardware import X86_ISAS, cpu_info, kernel_isa
from llmopt.runtime.executor.kernels.build_lock import exclusive_build

log = logging.getLogger(__name__)

GEMV_MAX_ROWS = 8  # rows of x [M, K] one pass of ops.gemv over the weight serves; more go 8 at a time (fused_cpu.cpp)
# The built-in rule (the batch-1 lm_head's, and the dense linears' under --linear-kernels fixed; measured plans
# choose per CPU, linear/dense.py): row counts of an fp32 matmul that ops.gemv runs faster than BLAS (speculative
# verification at batch 1): MKL's sgemm is as fast as a matrix-vector product up to 2 rows, then slower from 4 (it
# packs the weight); gemv streams each weight row once for all rows. Weights taller than wide keep BLAS
# (docs/results/code-figures.md#gemv-rows).
GEMV_BATCHED_ROWS = range(3, GEMV_MAX_ROWS + 1)

# Two translation units built in parallel: the attention kernels, and every other source included by
# kernels_unity.cpp (ATen's headers parsed twice per build instead of eight times: half the build time).
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_attention_cpu.cpp", "kernels_unity.cpp")]
_X86_FLAGS = {
    "scalar": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512_bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16", "-mavx512vnni"],  # every CPU with AVX512_BF16 has AVX512_VNNI
}


def isa_flags(isa: str) -> list[str]:
    if isa not in X86_ISAS:
        raise ValueError(f"unknown kernel ISA {isa!r}")
    return _X86_FLAGS[isa] if cpu_info().is_x86 else []


def gemv_row_streams(isa: str) -> int:
    """Weight rows `gemv` streams at once for one input row (csrc/fused_cpu.cpp, built in): 4 with early requests
    on Intel AVX-512 CPUs, 1 on AMD's (a single sequential stream is faster there, the weights from memory) and in
    every AVX2 or portable build (docs/results/code-figures.md#gemv-streams). The same bits either way."""
    return 4 if isa in ("avx512", "avx512_bf16") and cpu_info().vendor == "GenuineIntel" else 1


def gemv_pair_streams(isa: str) -> int:
    """Weight rows the AVX2 build's `gemv` streams at once against two input rows (csrc/fused_cpu.cpp; the same
    bits either way): 2 on Intel (4 independent accumulation chains), 1 on AMD, as for one input row (on AMD two
    rows at once made 2 inputs slower than 3: docs/results/code-figures.md#gemv-streams)."""
    return 1 if cpu_info().vendor == "AuthenticAMD" else 2


@lru_cache(maxsize=1)
def sources_digest() -> str:
    """A digest of every file in csrc/, passed as a flag: torch's loader rebuilds when the sources it is given or
    the flags change, and this makes a change to a header or to a source kernels_unity.cpp includes one of them.
    (The linear kernels' measured choices are keyed by it too.)"""
    digest = hashlib.sha256()
    for source in sorted((Path(__file__).parent / "csrc").iterdir()):
        digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()[:16]


@lru_cache(maxsize=None)
def _load(isa: str):
    from torch.utils.cpp_extension import _get_build_directory, load

    name = f"llmopt_cpu_kernels_{isa}"
    folder = Path(_get_build_directory(name, verbose=False))
    if not any(folder.glob(f"{name}*.so")):  # (a silent pause of minutes invites an interrupt)
        log.warning("building llmopt's CPU kernels (%s) in %s: once per machine and version, 1-4 min", isa, folder)
    # (torch's own lock file would make this wait forever after a build that was killed: build_lock.py)
    with exclusive_build(folder):
        load(name=name, sources=[str(s) for s in SOURCES], is_python_module=False,
             extra_cflags=["-O3", "-fopenmp", *isa_flags(isa), f"-DLLMOPT_NS=llmopt_cpu_{isa}",
                           f"-DLLMOPT_ISA={isa}", f"-DLLMOPT_SOURCES={sources_digest()}",
                           f"-DLLMOPT_GEMV_STREAMS={gemv_row_streams(isa)}",
                           f"-DLLMOPT_GEMV_PAIR_STREAMS={gemv_pair_streams(isa)}"],
             extra_ldflags=["-fopenmp"], verbose=False)
    return getattr(torch.ops, f"llmopt_cpu_{isa}")


@lru_cache(maxsize=None)
def cpu_ops(isa: str | None = None):
    """torch.ops.llmopt_cpu_<isa> for `isa` (default: this process's kernel_isa()) once built, else None (the
    reason is logged once)."""
    if os.environ.get("LLMOPT_CPU_KERNELS", "1") == "0":
        return None
    isa = isa or kernel_isa()
    try:
        return _load(isa)
    except Exception as exc:  # noqa: BLE001  (no compiler, missing headers: the torch path serves instead)
        log.warning("llmopt CPU kernels (%s) unavailable (%s); using the plain-torch path", isa,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def decode_graph_class():
    """The compiled decode graph class of this process's build (csrc/decode_graph_cpu.cpp:
    torch.classes.llmopt_cpu_<isa>.DecodeGraph), or None without the compiled kernels."""
    if cpu_ops() is None:
        return None
    return getattr(torch.classes, f"llmopt_cpu_{kernel_isa()}").DecodeGraph
