"""Low-precision GEMM rates on a CUDA GPU: llmopt's Triton kernels (W8A8 int8, W8A8 FP8, FP8 / NVFP4 weights
decoded in registers) against torch's own (`torch._int_mm`, `torch._scaled_mm`, a bf16 `torch.mm`) at M x N x K
(default 4096^3). Each is warmed up, then timed with CUDA events (median of --repeats).

    python benchmarks/gpu/lowprec_gpu.py --json /tmp/lowprec_gpu.json
    TRITON_INTERPRET=1 python benchmarks/gpu/lowprec_gpu.py --device cpu --size 64 64 64   (a dry run, no GPU)
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from llmopt.core.contract.rounding import quantize_rtn
from llmopt.core.contract import preset
from llmopt.core.contract.fp4 import block_scale_table, pack_nibbles, scale_bytes
from llmopt.runtime.executor.kernels.triton_lowprec import float_weight_matmul, scaled_matmul
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402


def timed(fn, repeats: int, device: str) -> float:
    """Median seconds of fn() after 3 warm-up calls (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = command_line(__doc__, default=None)
    parser.add_argument("--size", type=int, nargs=3, default=[4096, 4096, 4096], metavar=("M", "N", "K"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    m, n, k = args.size
    dev = args.device
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev) * 0.05
    a8 = torch.randint(-127, 127, (m, k), device=dev, dtype=torch.int8)
    b8 = torch.randint(-127, 127, (n, k), device=dev, dtype=torch.int8)
    ones_m, ones_n = torch.ones(m, device=dev), torch.ones(n, device=dev)
    af8, bf8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    fp8 = quantize_rtn(w.cpu(), preset("w8a16-fp8").weights)
    fp8_weight, fp8_scales = fp8.q.view(torch.float8_e4m3fn).to(dev), fp8.scales.to(dev)
    nv = quantize_rtn(w.cpu(), preset("nvfp4").weights)
    nv_codes, nv_scales = pack_nibbles(nv.q).to(dev), scale_bytes(nv.scales, "e4m3").to(dev)
    nv_table = block_scale_table("e4m3", nv.global_scale).to(dev)
    wb = w.to(torch.bfloat16)
    cases = {
        "bf16 torch.mm": lambda: torch.mm(x, wb.t()),
        "int8 torch._int_mm": lambda: torch._int_mm(a8, b8.t()),
        "int8 llmopt scaled_matmul": lambda: scaled_matmul(a8, b8, ones_m, ones_n, torch.bfloat16),
        "fp8 torch._scaled_mm": lambda: torch._scaled_mm(af8, bf8.t(), torch.ones((), device=dev),
                                                         torch.ones((), device=dev), out_dtype=torch.bfloat16),
        "fp8 llmopt scaled_matmul": lambda: scaled_matmul(af8, bf8, ones_m, ones_n, torch.bfloat16),
        "fp8 weights (bf16 inputs) llmopt": lambda: float_weight_matmul(x, fp8_weight, fp8_scales, k),
        "nvfp4 weights (bf16 inputs) llmopt": lambda: float_weight_matmul(x, nv_codes, nv_scales, 16, nv_table),
    }
    rows = []
    print(f"{'kernel':<38} {'ms':>9} {'TFLOP/s':>9}")
    for name, fn in cases.items():
        try:
            seconds = timed(fn, args.repeats, dev)
        except Exception as exc:  # noqa: BLE001  (an op this GPU or torch build lacks: say so, keep going)
            print(f"{name:<38} unavailable: {str(exc).splitlines()[0][:80]}")
            rows.append({"kernel": name, "error": str(exc).splitlines()[0]})
            continue
        tflops = 2 * m * n * k / seconds / 1e12
        print(f"{name:<38} {seconds * 1e3:>9.3f} {tflops:>9.1f}")
        rows.append({"kernel": name, "ms": seconds * 1e3, "tflops": tflops})
    if args.json:
        with open(args.json, "w") as f:
            gpu = torch.cuda.get_device_name() if dev == "cuda" else None
            json.dump({"size": [m, n, k], "gpu": gpu, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
