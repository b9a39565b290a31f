"""Does the variant a recipe benches first measure slower for being first? Runs a recipe R times, each in a new
process (and, with --fresh-build, with an empty compiled-kernel folder, as on a fresh clone), and prints the
first-benched variant's mean TTFT against the median of the others'.

    python benchmarks/studies/first_measured.py [--recipe recipes/ci-smoke.yaml] [--reps 2] [--order recipe|shuffled]
                                        [--fresh-build] [--json first_measured.json]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from llmopt.core.hardware import cpu_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402


def one_run(recipe: dict, fresh_build: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))  # the variants keep their order
        env = dict(os.environ)
        if fresh_build:
            env["TORCH_EXTENSIONS_DIR"] = str(Path(tmp) / "extensions")
        subprocess.run([sys.executable, "-m", "llmopt", "recipe", "run", str(path), "-o", str(Path(tmp) / "run")],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results = json.loads((Path(tmp) / "run" / "results.json").read_text())
    ttft = {v["name"]: v["bench"]["metrics"]["mean_ttft_ms"] for v in results["variants"]}
    first = (results.get("bench_order") or [v["name"] for v in results["variants"]])[0]
    rest = statistics.median(t for name, t in ttft.items() if name != first)
    return {"first": first, "first_ttft_ms": ttft[first], "rest_median_ttft_ms": rest,
            "ratio": ttft[first] / rest, "ttft_ms": ttft}


def main() -> None:
    parser = command_line(__doc__, default=None)
    parser.add_argument("--recipe", default=str(Path(__file__).resolve().parents[2] / "recipes" / "ci-smoke.yaml"))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--order", choices=["recipe", "shuffled"], default=None,
                        help="bench order (default: the recipe's own, shuffled unless it says otherwise)")
    parser.add_argument("--fresh-build", action="store_true")
    args = parser.parse_args()
    recipe = yaml.safe_load(Path(args.recipe).read_text())
    if args.order:
        recipe["bench"] = {**recipe["bench"], "order": args.order}
    runs = [one_run(recipe, args.fresh_build) for _ in range(args.reps)]
    print(f"CPU: {cpu_line()}")
    print(f"{'rep':>3}  {'first benched':<24} {'its TTFT ms':>11} {'others (median)':>15} {'ratio':>6}")
    for i, run in enumerate(runs):
        print(f"{i:>3}  {run['first']:<24} {run['first_ttft_ms']:>11.2f} {run['rest_median_ttft_ms']:>15.2f} "
              f"{run['ratio']:>6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_line(), "recipe": args.recipe, "order": args.order,
                                               "fresh_build": args.fresh_build, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
