"""The GPU runtime's targets, met or missed, from the JSON files scripts/gpu_check.sh wrote (printed last by it):
each target with the figure measured, or why it was not.

    python benchmarks/gpu/targets.py /tmp/llmopt-gpu          (the folder gpu_check.sh's RESULTS names)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402


def load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def step_ms(steps: dict | None, model_index: int, path: str, batch: int = 1) -> float | None:
    """gpu_step.json's ms per step of the model-th model on `path` at `batch`."""
    if steps is None:
        return None
    models = list(dict.fromkeys(row["model"] for row in steps["rows"]))
    if model_index >= len(models):
        return None
    for row in steps["rows"]:
        if row["model"] == models[model_index] and row["path"] == path:
            return row.get(f"B={batch} ms/step")
    return None


def kernel_ms(lowprec: dict | None, name: str) -> float | None:
    if lowprec is None:
        return None
    return next((row.get("ms") for row in lowprec["rows"] if row["kernel"] == name), None)


def rows_of(folder: Path) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met: True / False / None when not measured)."""
    steps, lowprec, sparse = (load(folder, n) for n in ("gpu_step.json", "lowprec_gpu.json", "sparse_gpu.json"))
    rows = []
    graphs, eager = step_ms(steps, 0, "graphs"), step_ms(steps, 0, "exact")
    rows.append(("SmolLM2 shape fp16, batch-1 decode step <= 1.5 ms",
                 "not measured" if graphs is None else f"{graphs:.3f} ms (exact eager path {eager} ms)",
                 None if graphs is None else graphs <= 1.5))
    int4 = step_ms(steps, 1, "graphs")
    rows.append(("W4A16 batch-1 step >= 2.5x faster than fp16 (SmolLM2 shape here; the target is at 8B)",
                 "not measured" if None in (int4, graphs) else f"{graphs / int4:.2f}x",
                 None if None in (int4, graphs) else graphs / int4 >= 2.5))
    for label, ours, theirs, floor in (
            ("W8A8 int8 >= 0.9x torch._int_mm at 4096^3", "int8 llmopt scaled_matmul", "int8 torch._int_mm", 0.9),
            ("FP8 >= 0.9x torch._scaled_mm at 4096^3", "fp8 llmopt scaled_matmul", "fp8 torch._scaled_mm", 0.9),
            ("FP8 weights at 4096 rows >= 0.8x the bf16 GEMM", "fp8 weights (bf16 inputs) llmopt", "bf16 torch.mm",
             0.8),
            ("NVFP4 weights at 4096 rows >= 0.8x the bf16 GEMM", "nvfp4 weights (bf16 inputs) llmopt",
             "bf16 torch.mm", 0.8)):
        a, b = kernel_ms(lowprec, ours), kernel_ms(lowprec, theirs)
        rows.append((label, "not measured" if None in (a, b) else f"{b / a:.2f}x",
                     None if None in (a, b) else b / a >= floor))
    if sparse is None:
        rows.append(("2:4 never slower than dense", "not measured", None))
    else:
        worst = max((r for r in sparse["rows"] if "2:4" in r["linear"]), key=lambda r: r["vs_dense"])
        rows.append(("2:4 never slower than dense", f"worst {worst['vs_dense']:.2f}x ({worst['linear']}, "
                     f"{worst['rows']} rows)", worst["vs_dense"] <= 1.0))
    for label in ("Llama-3.1-8B shape fp16 batch-1 MBU >= 0.83", "8B shape 64 x 128/128 >= 3x transformers' "
                  "static-cache generate", "W4A16 at 1 row >= 60% of HBM read bandwidth (8B shapes)"):
        rows.append((label, "not measured: this check runs the SmolLM2 shape only", None))
    return rows


def main() -> None:
    parser = command_line(__doc__, default=None)
    parser.add_argument("folder", help="gpu_check.sh's RESULTS folder")
    args = parser.parse_args()
    rows = rows_of(Path(args.folder))
    width = max(len(t) for t, _, _ in rows)
    print(f"{'target':<{width}}  {'status':<12}  measured")
    for target, measured, met in rows:
        status = "not measured" if met is None else ("met" if met else "MISSED")
        print(f"{target:<{width}}  {status:<12}  {measured}")
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(("target", "measured", "met"), r)) for r in rows], indent=1))


if __name__ == "__main__":
    main()
