"""When does dequantizing an int4 weight whole and running the dense GEMM beat aten's int4 kernel on CPU?

SmolLM2-135M's linear shapes, bf16 activations, w4 g64 codes; rows M = tokens in the step. Three ways: aten's
int4 kernel, the torch dequantization + GEMM, the compiled dequantization (kernels/csrc/int4_cpu.cpp) + GEMM.
Prints a table and writes docs/results/data/int4_matmul.json. Int4PackedLinear.dequantize_min_rows and
compiled_dequantize_min_rows come from these crossovers.

    python benchmarks/kernels/int4_matmul.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"q/o (576 -> 576)": (576, 576), "k/v (576 -> 192)": (192, 576), "gate/up (576 -> 1536)": (1536, 576),
          "down (1536 -> 576)": (576, 1536)}
ROWS = (1, 4, 8, 16, 32, 64, 256, 4096)


def main() -> None:
    from llmopt.core.contract.rounding import quantize_rtn
    from llmopt.core.contract import QuantScheme
    from llmopt.core.hardware import cpu_line
    from llmopt.eval.bench import best_time  # best of 5 calls
    from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
    from llmopt.runtime.executor.kernels.quant_matmul import int4_dequantize, int4_matmul
    from llmopt.runtime.executor.linear import make_linear as quantized_linear

    ops = cpu_ops()

    rows_out = []
    print(f"threads {torch.get_num_threads()}; ms per call (int4 kernel / torch dequantize + GEMM / compiled "
          "dequantize + GEMM)")
    for label, (n, k) in SHAPES.items():
        layer = quantized_linear(quantize_rtn(torch.randn(n, k), QuantScheme(4, 64, True)), torch.bfloat16)
        cells = []
        weight = torch.empty(n, k, dtype=torch.bfloat16)

        def compiled(x, layer=layer, weight=weight):
            ops.int4_dequantize_out(layer.nibbles, layer.scales_and_offsets, layer.kernel_group, weight)
            return F.linear(x, weight)

        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            kernel = best_time(lambda: int4_matmul(x, layer.packed, layer.scales_and_offsets, layer.kernel_group), "cpu")
            dense = best_time(lambda: F.linear(x, int4_dequantize(layer.nibbles, layer.scales_and_offsets,
                                                               layer.kernel_group)), "cpu")
            fast = best_time(lambda: compiled(x), "cpu") if ops is not None else float("nan")
            rows_out.append({"shape": label, "rows": m, "int4_kernel_ms": kernel * 1e3, "dequantize_gemm_ms": dense * 1e3,
                             "compiled_dequantize_gemm_ms": fast * 1e3})
            cells.append(f"M={m}: {kernel * 1e3:.2f}/{dense * 1e3:.2f}/{fast * 1e3:.2f}")
        print(f"{label:22s} " + "  ".join(cells))
    out = Path(__file__).resolve().parents[2] / "docs" / "results" / "int4_matmul.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_line(), "threads": torch.get_num_threads(), "rows": rows_out}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
