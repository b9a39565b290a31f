"""Batch-1 decode of several models alternated round by round (A, B, C, A, B, C, ...): on a shared machine whose speed
drifts over minutes, each round's ratios to the first model are the figure, not one run's absolute times.

    python benchmarks/studies/ab_models.py smollm2-135m W8A8_DIR NVFP4_DIR --rounds 3 --json /tmp/ab.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

SHAPE = ["--num-requests", "4", "--input-len", "32", "--output-len", "64", "--max-num-seqs", "1"]


def tpot_ms(model: str, dtype: str, workdir: Path) -> float:
    out = workdir / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "llmopt", "bench", model, "--dtype", dtype, *SHAPE, "--json",
                           str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llmopt bench {model} failed:\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text())["runs"][0]["metrics"]["mean_tpot_ms"]


def main() -> None:
    parser = command_line(__doc__, default=None)
    parser.add_argument("models", nargs="+", help="the first is the baseline of the ratios")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="llmopt-ab-") as tmp:
        for r in range(args.rounds):
            row = {model: tpot_ms(model, args.dtype, Path(tmp)) for model in args.models}
            rounds.append(row)
            base = row[args.models[0]]
            print(f"round {r}: " + ", ".join(f"{m} {t:.2f} ms ({t / base:.3f}x)" for m, t in row.items()), flush=True)
    base = args.models[0]
    medians = {m: statistics.median(row[m] / row[base] for row in rounds) for m in args.models}
    print("| model | batch-1 TPOT ms per round | median ratio to " + base + " |\n|---|---|---:|")
    for m in args.models:
        print(f"| {m} | {', '.join(f'{row[m]:.2f}' for row in rounds)} | {medians[m]:.3f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "shape": SHAPE, "rounds": rounds,
                                               "median_ratio": medians}, indent=1))


if __name__ == "__main__":
    main()
