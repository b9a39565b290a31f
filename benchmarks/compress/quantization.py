"""Quantization quality and cost on SmolLM2-135M: fp32 vs RTN / GPTQ / GPTQ+act-order / AWQ.

Each row runs `llmopt quantize` and `llmopt eval ppl` in subprocesses (so peak RSS is per row) and is
appended to the JSON as soon as it finishes; `--resume` skips rows already there.

    python benchmarks/compress/quantization.py --json docs/results/data/quantization.json \
        --markdown docs/results/quantization.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmopt.core.hardware import cpu_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import emit, load_rows, row_parser, save_rows

MODEL = "smollm2-135m"
EVAL_SETS = ("wikitext2", "pystdlib")
SETTINGS = {  # name -> quantize options
    "w4g64-sym": ["--bits", "4", "--group-size", "64", "--sym"],
    "w4g64-asym": ["--bits", "4", "--group-size", "64", "--asym"],
    "w3g64-sym": ["--bits", "3", "--group-size", "64", "--sym"],
    "w8-channel": ["--bits", "8", "--group-size", "-1", "--sym"],
}
METHODS = {  # name -> (method options, calibration)
    "RTN": (["--method", "rtn"], None),
    "GPTQ": (["--method", "gptq", "--no-act-order", "--no-gptaq"], "c4"),
    "GPTQ+act-order": (["--method", "gptq", "--act-order", "--no-gptaq"], "c4"),
    "GPTAQ": (["--method", "gptq", "--act-order", "--gptaq"], "c4"),  # llmopt's default GPTQ
    "AWQ": (["--method", "awq"], "c4"),
    "RTN+mse": (["--method", "rtn", "--mse"], None),
}
# The order rows run in: the headline comparisons first, so an interrupted run still answers the targets.
PLAN = [
    ("fp32", "-", None),
    ("RTN", "w4g64-sym", None), ("GPTQ+act-order", "w4g64-sym", "c4"), ("AWQ", "w4g64-sym", "c4"),
    ("GPTAQ", "w4g64-sym", "c4"), ("GPTAQ", "w4g64-sym", "c4,pystdlib"), ("GPTAQ", "w4g64-sym", "pystdlib"),
    ("GPTAQ", "w3g64-sym", "pystdlib"),
    ("GPTQ", "w4g64-sym", "c4"),
    ("GPTQ+act-order", "w4g64-sym", "pystdlib"), ("GPTQ+act-order", "w4g64-sym", "c4,pystdlib"),
    ("RTN", "w3g64-sym", None), ("GPTQ+act-order", "w3g64-sym", "c4"), ("GPTQ+act-order", "w3g64-sym", "pystdlib"),
    ("AWQ", "w3g64-sym", "c4"), ("GPTQ", "w3g64-sym", "c4"),
    ("RTN+mse", "w4g64-sym", None),
    ("RTN", "w4g64-asym", None), ("GPTQ+act-order", "w4g64-asym", "c4"), ("AWQ", "w4g64-asym", "c4"),
    ("GPTQ", "w4g64-asym", "c4"),
    ("RTN", "w8-channel", None), ("GPTQ+act-order", "w8-channel", "c4"), ("AWQ", "w8-channel", "c4"),
    ("GPTQ", "w8-channel", "c4"),
]


def plan() -> list[dict]:
    return [{"name": method if method == "fp32" else f"{method} {setting}" + (f" [{calib}]" if calib else ""),
             "method": method, "setting": setting, "calib": calib} for method, setting, calib in PLAN]


def run_json(args: list[str]) -> tuple[dict, float]:
    """Run an llmopt command in a subprocess; (its JSON, wall s)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "llmopt", *args], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"llmopt {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout), wall


def evaluate(model: str, max_tokens: int) -> dict:
    out = {}
    for dataset in EVAL_SETS:
        facts, _ = run_json(["eval", "ppl", model, "--dataset", dataset, "--seqlen", "512",
                                "--max-tokens", str(max_tokens), "--batch-size", "4", "--json"])
        out[dataset] = facts["ppl"]
    return out


def run_row(row: dict, args, workdir: Path) -> dict:
    if row["method"] == "fp32":
        return {**row, "ppl": evaluate(MODEL, args.eval_tokens)}
    options, _ = METHODS[row["method"]]
    out = workdir / row["name"].replace(" ", "_").replace("[", "").replace("]", "").replace(",", "+")
    cmd = ["quantize", MODEL, *options, *SETTINGS[row["setting"]], "-o", str(out), "--overwrite", "--json",
           "--num-samples", str(args.num_samples), "--seqlen", "512"]
    if row["calib"]:
        cmd += ["--calib", row["calib"]]
    if row["method"] == "AWQ" and row["setting"] != "w4g64-sym" and row["setting"] != "w4g64-asym":
        cmd += ["--format", "compressed-tensors"]  # AWQ's own format is 4-bit grouped only
    if args.compute_dtype and row["calib"]:
        cmd += ["--calib-dtype", args.compute_dtype]
    facts, wall = run_json(cmd)
    return {**row, "command": "llmopt " + " ".join(cmd), "quantize_wall_s": facts["quantize_wall_s"],
            "total_wall_s": round(wall, 1), "peak_rss_bytes": facts["peak_rss_bytes"], "artifact_bytes": facts["artifact_weights_bytes"],
            "quantized_linear_ratio": facts["quantized_linear_ratio"], "ppl": evaluate(str(out), args.eval_tokens)}


def markdown(results: list[dict], args) -> str:
    fp = next((r for r in results if r["method"] == "fp32"), None)
    rtn = {r["setting"]: r for r in results if r["method"] == "RTN"}
    lines = [
        "| variant | calibration | " + " | ".join(f"ppl {d}" for d in EVAL_SETS) + " | "
        + " | ".join(f"loss vs RTN {d}" for d in EVAL_SETS) + " | quantize s | peak RSS GB | artifact MB | q-linear / fp16 |",
        "|---|---|" + "---:|" * (2 * len(EVAL_SETS) + 4),
    ]
    for r in results:
        ppl = " | ".join(f"{r['ppl'][d]:.3f}" for d in EVAL_SETS)
        ratios = []
        for d in EVAL_SETS:
            base = rtn.get(r["setting"])
            if fp and base and r["method"] not in ("fp32", "RTN"):
                ratios.append(f"{(r['ppl'][d] - fp['ppl'][d]) / (base['ppl'][d] - fp['ppl'][d]):.2f}x")
            else:
                ratios.append("-")
        if r["method"] == "fp32":
            cost = "- | - | - | -"
        else:
            cost = (f"{r['quantize_wall_s']:.0f} | {r['peak_rss_bytes'] / 2**30:.2f} | {r['artifact_bytes'] / 2**20:.1f} | "
                    f"{r['quantized_linear_ratio']:.3f}")
        lines.append(f"| {r['method']} {r['setting'] if r['setting'] != '-' else ''} | {r['calib'] or '-'} | {ppl} | "
                     f"{' | '.join(ratios)} | {cost} |")
    return "\n".join(lines)


def main() -> None:
    parser = row_parser(__doc__.splitlines()[0], "docs/results/data/quantization.json")
    parser.add_argument("--compute-dtype", default=None, help="calibration forward dtype (default: llmopt's)")
    args = parser.parse_args()
    results = load_rows(args.json, args.resume)
    done = {r["name"] for r in results}
    rows = [r for r in plan() if not args.only or any(s in r["name"] for s in args.only.split(";"))]
    with tempfile.TemporaryDirectory(prefix="llmopt-bench-") as tmp:
        for row in rows:
            if row["name"] in done:
                continue
            start = time.perf_counter()
            result = run_row(row, args, Path(tmp))
            result["cpu"] = cpu_line()
            results.append(result)
            save_rows(args.json, results)
            print(f"{row['name']:<40} {result['ppl']}  ({time.perf_counter() - start:.0f} s)", flush=True)
    order = {r["name"]: i for i, r in enumerate(plan())}
    results.sort(key=lambda r: order.get(r["name"], 999))
    emit(markdown(results, args), args.markdown)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
