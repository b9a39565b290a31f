"""`llmopt env`: the CPU and what it computes fast, versions, device, threads, and where data and models are found."""

from __future__ import annotations

from typing import Annotated

import typer

from llmopt.cli.options import JsonOpt
from llmopt.cli.output import print_json, print_table


def env(
    as_json: JsonOpt = False,
    measure: Annotated[bool, typer.Option(
        "--measure/--no-measure", help="Show the memory bandwidth and GEMM rates (measured once per machine, a "
        "few seconds, then cached).")] = True,
    remeasure: Annotated[bool, typer.Option("--remeasure", help="Measure the rates again.")] = False,
) -> None:
    """Print the CPU (features, kernel ISA, the dtype `auto` resolves to, measured rates), versions, the compute
    device, threads and the data and model locations."""
    from llmopt.core.environment import environment_facts
    from llmopt.core.hardware import hardware_facts

    facts = {**hardware_facts(measure=measure or remeasure, refresh=remeasure), **environment_facts(),
             **runtime_facts()}
    if as_json:
        print_json(facts)
    else:
        print_table("llmopt environment", {k: (", ".join(v) if isinstance(v, list) else
                                               ", ".join(f"{n} {b // 1024} KiB" for n, b in v.items())
                                               if isinstance(v, dict) else v) for k, v in facts.items()})


def runtime_facts() -> dict:
    """The runtime's registered plug-ins, and the attention backend an engine on this machine's CPU starts with."""
    from llmopt.runtime.executor.attention import ATTENTION_BACKENDS, select_attention_backend
    from llmopt.runtime.executor.linear import LINEAR_METHODS
    from llmopt.runtime.executor.linear.w8a8_cpu import int_mm_exact, onednn_int8_gemm

    fast, exact = (select_attention_backend("auto", "cpu", "kv", f).name for f in (True, False))
    gemm = ("oneDNN, prepacked (AMX-INT8)" if onednn_int8_gemm() else "torch._int_mm" if int_mm_exact()
            else "a float64 matmul (torch._int_mm's sums are not exact here)")
    return {"attention_backends": ATTENTION_BACKENDS.names(), "linear_methods": LINEAR_METHODS.names(),
            "attention_backend_cpu": f"{fast} (fast path), {exact} (--no-fast-path)",
            "w8a8_int8_gemm_cpu": f"compiled GEMV up to 8 rows, then {gemm}"}
