"""Lower precision on SmolLM2-135M: W8A8 int8 (RTN / GPTQ, with and without SmoothQuant), FP8 and FP4 against fp32 —
WikiText-2 perplexity, and the runtime's speed (engine throughput and batch-1 TPOT) in one run against the dense model.

Each row runs `llmopt quantize`, `llmopt eval ppl` and `llmopt bench` in subprocesses and is appended to the JSON
as soon as it finishes; `--resume` skips rows already there.

    python benchmarks/compress/lowprec.py --json docs/results/data/lowprec.json --markdown docs/results/lowprec-table.md
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from llmopt.core.hardware import cpu_line
from quantization import run_json
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import emit, load_rows, row_parser, save_rows

MODEL = "smollm2-135m"
W8A8 = ["--scheme", "w8a8-int8"]
GPTQ = ["--method", "gptq"]  # llmopt's default GPTQ (act-order, GPTAQ)
ROWS = {  # name -> quantize options (None: the dense model)
    "fp32": None,
    # (--smoothquant-alpha none: the scheme alone, without the pre-passes it runs by default)
    "W8A8 RTN": [*W8A8, "--method", "rtn", "--smoothquant-alpha", "none"],
    "W8A8 GPTQ": [*W8A8, *GPTQ, "--smoothquant-alpha", "none"],
    "W8A8 SmoothQuant 0.5 + GPTQ": [*W8A8, *GPTQ, "--smoothquant-alpha", "0.5"],
    "W8A8 SmoothQuant search + GPTQ": [*W8A8, *GPTQ, "--smoothquant-alpha", "search"],
    "W8A8 SmoothQuant 0.5 + RTN": [*W8A8, "--method", "rtn", "--smoothquant-alpha", "0.5"],
    "W8A8 FP8 RTN": ["--scheme", "w8a8-fp8", "--method", "rtn", "--smoothquant-alpha", "none"],
    "W8A16 FP8 RTN": ["--scheme", "w8a16-fp8", "--method", "rtn"],
    "W8A8 FP8 SmoothQuant search + RTN": ["--scheme", "w8a8-fp8", "--method", "rtn", "--smoothquant-alpha", "search"],
    # FP4 weights, beside the int4 baseline they are judged against (GPTQ w4 g64's loss, same run)
    "GPTQ w4 g64": [*GPTQ, "--bits", "4", "--group-size", "64"],
    "NVFP4 RTN": ["--scheme", "nvfp4", "--method", "rtn"],
    "MXFP4 RTN": ["--scheme", "mxfp4", "--method", "rtn"],
    "NVFP4 GPTQ": ["--scheme", "nvfp4", *GPTQ],
    "MXFP4 GPTQ": ["--scheme", "mxfp4", *GPTQ],
    "NVFP4 RTN mse": ["--scheme", "nvfp4", "--method", "rtn", "--mse"],
    "MXFP4 RTN mse": ["--scheme", "mxfp4", "--method", "rtn", "--mse"],
    "NVFP4 GPTQ mse": ["--scheme", "nvfp4", *GPTQ, "--mse"],
    "NVFP4-A4 GPTQ": ["--scheme", "nvfp4-a4", *GPTQ],
    "W8A8 FP8 SmoothQuant search + GPTQ": ["--scheme", "w8a8-fp8", *GPTQ, "--smoothquant-alpha", "search"],
    # random rotations folded in first (--rotate): the inputs' outlier channels spread over all of them
    "W8A8 rotated R1,R2 + RTN": [*W8A8, "--method", "rtn", "--rotate", "R1,R2"],
    "W8A8 rotated R1,R2 + GPTQ": [*W8A8, *GPTQ, "--rotate", "R1,R2"],
    "W8A8 rotated R1,R2 + SmoothQuant search + GPTQ": [*W8A8, *GPTQ, "--rotate", "R1,R2", "--smoothquant-alpha",
                                                       "search"],
    "NVFP4-A4 RTN": ["--scheme", "nvfp4-a4", "--method", "rtn"],
    "NVFP4-A4 rotated R1,R2 + RTN": ["--scheme", "nvfp4-a4", "--method", "rtn", "--rotate", "R1,R2"],
    "NVFP4-A4 rotated R1,R2 + GPTQ": ["--scheme", "nvfp4-a4", *GPTQ, "--rotate", "R1,R2"],
}
SPEED_DTYPES = ("float32", "bfloat16")
SPEED_ROWS = ("fp32", "W8A8 RTN", "NVFP4 RTN")


def perplexity(model: str, max_tokens: int) -> float:
    facts, _ = run_json(["eval", "ppl", model, "--dataset", "wikitext2", "--seqlen", "512", "--max-tokens",
                         str(max_tokens), "--batch-size", "4", "--dtype", "float32", "--json"])
    return facts["ppl"]


SPEED_SHAPES = {  # label -> bench options: throughput, batch-1 TPOT, and the TTFT of one 1,024-token prompt
    "batch64": ["--num-requests", "64", "--input-len", "128", "--output-len", "128"],
    "batch1": ["--num-requests", "4", "--input-len", "32", "--output-len", "64", "--max-num-seqs", "1"],
    # one request at a time (the client waits for each): the TTFT is one prompt's prefill, no queueing
    "prefill1024": ["--num-requests", "3", "--input-len", "1024", "--output-len", "1", "--max-concurrency", "1"],
}


def speed(model: str, dtype: str, workdir: Path) -> dict:
    """Engine throughput (64 x 128/128), batch-1 TPOT (1 x 32/64) and 1,024-token prefill of MODEL computing in
    `dtype`."""
    out = {}
    for label, shape in SPEED_SHAPES.items():
        path = workdir / f"bench-{label}.json"
        _run_bench(["bench", model, "--dtype", dtype, *shape, "--json", str(path)])
        metrics = json.loads(path.read_text())["runs"][0]["metrics"]
        out[label] = {k: metrics[k] for k in ("output_throughput", "mean_tpot_ms", "mean_ttft_ms")}
    return out


def transformers_speed(workdir: Path) -> dict:
    """transformers' generate on the dense model in fp32 (static batches), at the throughput shape."""
    path = workdir / "bench-hf.json"
    _run_bench(["bench", MODEL, "--dtype", "float32", *SPEED_SHAPES["batch64"], "--baseline", "hf", "--json",
                str(path)])
    metrics = json.loads(path.read_text())["runs"][1]["metrics"]
    return {"batch64": {k: metrics[k] for k in ("output_throughput", "mean_tpot_ms", "mean_ttft_ms")}}


def _run_bench(args: list[str]) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "llmopt", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llmopt {' '.join(args)} failed:\n{proc.stderr[-2000:]}")


def run_row(name: str, options: list[str] | None, args, workdir: Path) -> dict:
    row: dict = {"name": name}
    model = MODEL
    if options is not None:
        out = workdir / name.replace(" ", "_").replace("+", "plus")
        cmd = ["quantize", MODEL, *options, "-o", str(out), "--overwrite", "--json", "--num-samples",
               str(args.num_samples), "--seqlen", "512", "--calib", "c4"]
        facts, wall = run_json(cmd)
        row.update(command="llmopt " + " ".join(cmd), quantize_wall_s=facts["quantize_wall_s"],
                   total_wall_s=round(wall, 1), artifact_bytes=facts["artifact_weights_bytes"],
                   smoothquant_mean_alpha=facts.get("smoothquant_mean_alpha"))
        model = str(out)
    row["ppl_wikitext2"] = perplexity(model, args.eval_tokens)
    if not args.no_speed and name in SPEED_ROWS:
        row["speed"] = {dtype: speed(model, dtype, workdir) for dtype in args.speed_dtypes.split(",")}
        if name == "fp32":
            row["transformers_fp32"] = transformers_speed(workdir)
    return row


def add_speed(row: dict, workdir: Path, dtypes: tuple[str, ...] = SPEED_DTYPES) -> None:
    """The speed of a row measured earlier without it (every W8A8 artifact runs the same kernels: RTN's stands
    for them)."""
    model = MODEL
    if ROWS[row["name"]] is not None:
        model = str(workdir / "speed-artifact")
        run_json(["quantize", MODEL, *ROWS[row["name"]], "-o", model, "--overwrite", "--json"])
    row["speed"] = {dtype: speed(model, dtype, workdir) for dtype in dtypes}
    if row["name"] == "fp32":
        row["transformers_fp32"] = transformers_speed(workdir)


def markdown(results: list[dict]) -> str:
    fp = next((r for r in results if r["name"] == "fp32"), None)
    lines = ["| variant | ppl wikitext2 | vs fp32 | mean alpha | quantize wall s | artifact MB |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        delta = f"{(r['ppl_wikitext2'] / fp['ppl_wikitext2'] - 1) * 100:+.2f}%" if fp and r is not fp else "-"
        alpha = r.get("smoothquant_mean_alpha")
        cost = (f"{r['total_wall_s']:.0f} | {r['artifact_bytes'] / 2**20:.1f}" if "artifact_bytes" in r
                else "- | -")
        lines.append(f"| {r['name']} | {r['ppl_wikitext2']:.3f} | {delta} | "
                     f"{alpha if alpha is not None else '-'} | {cost} |")
    speeds = [r for r in results if "speed" in r]
    if speeds:
        lines += ["", "| variant | compute dtype | 64 x 128/128 output tok/s | vs fp32 dense fp32 | batch-1 TPOT ms | "
                  "vs fp32 dense fp32 | 1,024-token TTFT ms | vs fp32 dense fp32 |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        base = next((r["speed"]["float32"] for r in speeds if r["name"] == "fp32"), None)
        hf = next((r["transformers_fp32"] for r in speeds if "transformers_fp32" in r), None)
        if hf:
            tput = hf["batch64"]["output_throughput"]
            ratio = f"{tput / base['batch64']['output_throughput']:.2f}x" if base else "-"
            lines.append(f"| transformers fp32 dense | float32 | {tput:.1f} | {ratio} | - | - | - | - |")
        for r in speeds:
            for dtype, s in r["speed"].items():
                cells = []
                for label, key in (("batch64", "output_throughput"), ("batch1", "mean_tpot_ms"),
                                   ("prefill1024", "mean_ttft_ms")):
                    value = s.get(label, {}).get(key)
                    ref = base.get(label, {}).get(key) if base else None
                    cells += ["-", "-"] if value is None else [
                        f"{value:.1f}" if key == "output_throughput" else f"{value:.2f}",
                        f"{value / ref:.2f}x" if ref else "-"]
                lines.append(f"| {r['name']} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = row_parser(__doc__.splitlines()[0], "docs/results/data/lowprec.json")
    parser.add_argument("--no-speed", action="store_true", help="perplexity only")
    parser.add_argument("--speed-dtypes", default=",".join(SPEED_DTYPES),
                        help="compute dtypes of the speed rows (float32 alone on a CPU without bf16 units)")
    args = parser.parse_args()
    results = load_rows(args.json, args.resume)
    done = {r["name"] for r in results}
    with tempfile.TemporaryDirectory(prefix="llmopt-lowprec-") as tmp:
        for name, options in ROWS.items():
            if name in done or (args.only and not any(s in name for s in args.only.split(";"))):
                continue
            start = time.perf_counter()
            row = run_row(name, options, args, Path(tmp))
            row["cpu"] = cpu_line()
            results.append(row)
            save_rows(args.json, results)
            print(f"{name:<36} ppl {row['ppl_wikitext2']:.3f}  ({time.perf_counter() - start:.0f} s)", flush=True)
        if not args.no_speed:
            for row in results:
                if row["name"] in SPEED_ROWS and "speed" not in row:
                    add_speed(row, Path(tmp), tuple(args.speed_dtypes.split(",")))
                    save_rows(args.json, results)
                    print(f"{row['name']:<36} speed {row['speed']}", flush=True)
    order = list(ROWS)
    results.sort(key=lambda r: order.index(r["name"]) if r["name"] in order else 999)
    emit(markdown(results), args.markdown)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
