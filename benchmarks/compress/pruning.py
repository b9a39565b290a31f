"""Pruning quality and cost on SmolLM2-135M: magnitude / Wanda / SparseGPT, joint 2:4 + GPTQ, structured.

Each row runs `llmopt prune` (and `llmopt quantize`) and `llmopt eval ppl` in subprocesses and is appended
to the JSON as soon as it finishes; `--resume` skips rows already there.

    python benchmarks/compress/pruning.py --json docs/results/data/pruning.json --markdown docs/results/pruning.md
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from quantization import EVAL_SETS, MODEL, evaluate, run_json
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import emit, load_rows, row_parser, save_rows

from llmopt.core.hardware import cpu_line

ROWS = [  # name -> list of commands (each: llmopt args with {src} and {out})
    ("dense", []),
    *[(f"{m} 50%", [["prune", "{src}", "--method", m, "--sparsity", "0.5"]]) for m in ("magnitude", "wanda", "sparsegpt")],
    *[(f"{m} 2:4", [["prune", "{src}", "--method", m, "--pattern", "2:4"]]) for m in ("magnitude", "wanda", "sparsegpt")],
    *[(f"{m} 4:8", [["prune", "{src}", "--method", m, "--pattern", "4:8"]]) for m in ("magnitude", "wanda", "sparsegpt")],
    ("sparsegpt 2:4 + GPTQ w4 g64", [["prune", "{src}", "--method", "sparsegpt", "--pattern", "2:4"],
                                     ["quantize", "{src}", "--method", "gptq", "--bits", "4", "--group-size", "64",
                                      "--no-gptaq"]]),
    # One command, one calibration pass: SparseGPT then GPTQ per linear; GPTAQ matches the dense model's outputs.
    ("sparsegpt 2:4 + GPTQ w4 g64, one pass", [["quantize", "{src}", "--method", "gptq", "--bits", "4",
                                               "--group-size", "64", "--prune-pattern", "2:4"]]),
    ("sparsegpt 2:4 damp 0.1", [["prune", "{src}", "--method", "sparsegpt", "--pattern", "2:4", "--damp", "0.1"]]),
    ("structured mlp 25%", [["prune", "{src}", "--structured", "mlp", "--ratio", "0.25"]]),
    ("structured heads 25%", [["prune", "{src}", "--structured", "heads", "--ratio", "0.25"]]),
    ("structured layers 20%", [["prune", "{src}", "--structured", "layers", "--ratio", "0.2"]]),
]


def run_row(name: str, commands: list[list[str]], args, workdir: Path) -> dict:
    src, facts_all, wall, peak = MODEL, {}, 0.0, 0
    for i, command in enumerate(commands):
        out = workdir / f"{name.replace(' ', '_').replace(':', '-').replace('%', '').replace('+', '')}-{i}"
        cmd = [c.replace("{src}", src) for c in command] + ["-o", str(out), "--overwrite", "--json",
                                                             "--num-samples", str(args.num_samples)]
        if args.calib_dtype:
            cmd += ["--calib-dtype", args.calib_dtype]
        if command[0] == "prune" and "--structured" not in command and "magnitude" not in command:
            cmd += ["--calib", "c4"]
        facts, seconds = run_json(cmd)
        facts_all[command[0]] = facts
        wall += seconds
        peak = max(peak, facts["peak_rss_bytes"])
        src = str(out)
    row = {"name": name, "commands": ["llmopt " + " ".join(c) for c in commands], "wall_s": round(wall, 1),
           "peak_rss_bytes": peak, "ppl": evaluate(src, args.eval_tokens)}
    prune_facts = facts_all.get("prune")
    # a quantized artifact stores packed codes: count the parameters of the pruned (dense-shaped) model
    # (pruned inside `quantize --prune-pattern`: the dense model's count; its non-zeros are not counted, "-")
    pruned_in_quantize = "--prune-pattern" in commands[-1]
    info, _ = run_json(["models", "info", MODEL if pruned_in_quantize else src, "--json"])
    row["num_parameters"] = prune_facts["num_parameters_after"] if prune_facts else info["num_parameters"]
    row["num_nonzero"] = (prune_facts["num_nonzero_after"] if prune_facts else
                          None if pruned_in_quantize else info["num_parameters"])
    row["linear_sparsity"] = prune_facts["linear_sparsity"] if prune_facts else 0.0
    return row


def markdown(results: list[dict]) -> str:
    dense = next((r for r in results if r["name"] == "dense"), None)
    lines = ["| variant | " + " | ".join(f"ppl {d}" for d in EVAL_SETS) + " | parameters | non-zeros | wall s | "
             "peak RSS GB |", "|---|" + "---:|" * (len(EVAL_SETS) + 4)]
    for r in results:
        ppl = " | ".join(f"{r['ppl'][d]:.3f}" for d in EVAL_SETS)
        nonzero = "-" if r["num_nonzero"] is None else f"{r['num_nonzero']:,}"
        lines.append(f"| {r['name']} | {ppl} | {r['num_parameters']:,} | {nonzero} | "
                     f"{r['wall_s'] if r['name'] != 'dense' else '-'} | "
                     f"{r['peak_rss_bytes'] / 2**30:.2f} |" if r["name"] != "dense" else
                     f"| {r['name']} | {ppl} | {r['num_parameters']:,} | {r['num_nonzero']:,} | - | - |")
    if dense:
        lines.append("")
        lines.append("Loss = ppl increase over dense. Wanda/SparseGPT loss as a fraction of magnitude's:")
        by_name = {r["name"]: r for r in results}
        for target in ("50%", "2:4", "4:8"):
            mag = by_name.get(f"magnitude {target}")
            for m in ("wanda", "sparsegpt"):
                r = by_name.get(f"{m} {target}")
                if mag and r:
                    fr = [f"{d} {(r['ppl'][d] - dense['ppl'][d]) / (mag['ppl'][d] - dense['ppl'][d]):.2f}x"
                          for d in EVAL_SETS]
                    lines.append(f"- {m} {target}: " + ", ".join(fr))
        for a, b in (("sparsegpt 2:4", "wanda 2:4"), ("sparsegpt 2:4 + GPTQ w4 g64", "sparsegpt 2:4"),
                     ("sparsegpt 2:4 + GPTQ w4 g64, one pass", "sparsegpt 2:4"),
                     ("sparsegpt 2:4 damp 0.1", "wanda 2:4")):
            if a in by_name and b in by_name:
                ratios = ", ".join(f"{d} {by_name[a]['ppl'][d] / by_name[b]['ppl'][d]:.3f}x" for d in EVAL_SETS)
                lines.append(f"- ppl of {a} / {b}: {ratios}")
    return "\n".join(lines)


def main() -> None:
    parser = row_parser(__doc__.splitlines()[0], "docs/results/data/pruning.json")
    parser.add_argument("--calib-dtype", default=None, help="calibration forward dtype (default: llmopt's)")
    args = parser.parse_args()
    results = load_rows(args.json, args.resume)
    done = {r["name"] for r in results}
    with tempfile.TemporaryDirectory(prefix="llmopt-prune-bench-") as tmp:
        for name, commands in ROWS:
            if name in done or (args.only and not any(s in name for s in args.only.split(";"))):
                continue
            start = time.perf_counter()
            results.append({**run_row(name, commands, args, Path(tmp)), "cpu": cpu_line()})
            save_rows(args.json, results)
            print(f"{name:<32} {results[-1]['ppl']} ({time.perf_counter() - start:.0f} s)", flush=True)
    order = {name: i for i, (name, _) in enumerate(ROWS)}
    results.sort(key=lambda r: order.get(r["name"], 99))
    emit(markdown(results), args.markdown)


if __name__ == "__main__":
    main()
