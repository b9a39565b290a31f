"""The runtime's compiled CPU kernels (csrc/*.cpp), built on first use with torch's C++ extension loader.

They are an accelerator, not a requirement: where no compiler is available (or LLMOPT_CPU_KERNELS=0) `cpu_ops()`
returns None and the runtime keeps its plain-torch path, which the kernels are tested against. Compiled with
-march=native for the machine it runs on; torch caches the build (TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions) and rebuilds when the source or flags change.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAME = "llmopt_cpu_kernels"
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("paged_attention_cpu.cpp", "fused_cpu.cpp", "int4_cpu.cpp")]


@lru_cache(maxsize=1)
def cpu_ops():
    """torch.ops.llmopt_cpu once built, else None (the reason is logged once)."""
    if os.environ.get("LLMOPT_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        load(name=NAME, sources=[str(s) for s in SOURCES], is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001  (no compiler, missing headers: the torch path serves instead)
        log.warning("llmopt CPU kernels unavailable (%s); using the plain-torch path", str(exc).splitlines()[0])
        return None
    return torch.ops.llmopt_cpu
