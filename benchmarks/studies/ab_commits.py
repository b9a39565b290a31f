"""Two commits of llmopt measured alternately in one run: no speed lost (or gained) by a change of the code.

Each commit is checked out into a temporary git worktree; every measurement runs in a fresh process whose
PYTHONPATH puts that worktree's `llmopt` first (the same venv, the same torch), alternating A, B, A, B, ... so
both see the same machine state. Per model (fp32 dense SmolLM2, and a GPTQ int4 artifact):
- throughput: 64 requests x 128 prompt / 128 output tokens, all at once (output tok/s);
- batch 1: 4 requests one at a time, 128 / 64 tokens (median TPOT).
Each linear's kernel per row count is what each commit measures at its start (`--linear-kernels fixed`: the
built-in choice, the same on both sides; the measured choices can differ by the noise of one timing).
The kernels' build folder is per worktree (TORCH_EXTENSIONS_DIR of its own), warmed by a first unmeasured run.

    python benchmarks/studies/ab_commits.py --a a46f9b4 --b HEAD --int4 ARTIFACT --reps 2 \
        --json docs/results/data/ab.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

CHILD = """
import json, sys
from llmopt.core.hardware import cpu_line
from llmopt.runtime.engine.config import EngineConfig
try:
    from llmopt.eval.bench import BenchConfig, bench_runtime
except ImportError:  # (commits before the bench drivers' module was named bench)
    from llmopt.eval.speed import BenchConfig, bench_runtime
from llmopt.eval.workloads import WorkloadSpec
kind, model, kernels = sys.argv[1], sys.argv[2], sys.argv[3]
if kind == "throughput":
    spec, config = WorkloadSpec("random", 64, 128, 128), BenchConfig(dtype="float32",
        engine=EngineConfig(max_num_seqs=64, kv_cache_bytes=1 << 30, linear_kernels=kernels))
else:
    spec = WorkloadSpec("random", 4, 128, 64)
    config = BenchConfig(dtype="float32", max_concurrency=1,
                         engine=EngineConfig(max_num_seqs=1, linear_kernels=kernels))
run = bench_runtime(kind, model, spec, config)
print("RESULT " + json.dumps({"cpu": cpu_line(), "output_throughput": run.metrics["output_throughput"],
                              "median_tpot_ms": run.metrics["median_tpot_ms"]}))
"""


def worktree(repo: Path, commit: str, root: Path) -> Path:
    path = root / commit.replace("/", "_")
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-f", str(path), commit], check=True,
                   capture_output=True)
    return path


def measure(tree: Path, kind: str, model: str, home: Path, timeout: float, kernels: str) -> dict:
    # (each tree's compiled kernels in a folder of their own: torch rebuilds an extension whose source changed)
    env = {**os.environ, "PYTHONPATH": str(tree), "LLMOPT_HOME": str(home), "TOKENIZERS_PARALLELISM": "false",
           "TORCH_EXTENSIONS_DIR": str(home / "torch_extensions")}
    done = subprocess.run([sys.executable, "-c", CHILD, kind, model, kernels], env=env, capture_output=True, text=True,
                          cwd=tree, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{tree.name} {kind} {model} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = command_line(__doc__, type=Path)
    parser.add_argument("--a", required=True, help="the baseline commit")
    parser.add_argument("--b", default="HEAD", help="the commit compared with it")
    parser.add_argument("--dense", default="smollm2-135m")
    parser.add_argument("--int4", help="a GPTQ int4 artifact of the same model")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one measurement may take")
    parser.add_argument("--rows", help="only these rows, comma-separated (e.g. gptq-int4/throughput)")
    parser.add_argument("--linear-kernels", default="measured", choices=("measured", "fixed"),
                        help="each commit's kernel per row count: measured at its start (the default) or the "
                        "built-in choice (fixed: the same kernels on both sides, so only the code differs)")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parents[2]
    for name in ("a", "b"):  # record the commits themselves, not names like HEAD that move
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", getattr(args, name)], check=True,
                             capture_output=True, text=True).stdout.strip()
        setattr(args, name, rev)
    home = Path(os.environ.get("LLMOPT_HOME", Path.home() / ".cache" / "llmopt"))
    models = [("fp32", args.dense)] + ([("gptq-int4", args.int4)] if args.int4 else [])
    with tempfile.TemporaryDirectory() as tmp:
        trees = {label: worktree(repo, commit, Path(tmp)) for label, commit in (("a", args.a), ("b", args.b))}
        homes = {}
        for label, tree in trees.items():  # own kernel builds per tree; the models' cache is shared by a link
            homes[label] = Path(tmp) / f"home-{label}"
            homes[label].mkdir()
            if (home / "models").exists():
                (homes[label] / "models").symlink_to(home / "models")
            # builds the kernels, warms caches
            measure(tree, "batch1", args.dense, homes[label], args.timeout, args.linear_kernels)
        wanted = set(args.rows.split(",")) if args.rows else None
        rows_run = [(name, model, kind) for name, model in models for kind in ("throughput", "batch1")
                    if wanted is None or f"{name}/{kind}" in wanted]
        results = {label: {f"{name}/{kind}": [] for name, _, kind in rows_run} for label in trees}
        cpu = None
        for rep in range(args.reps):
            for name, model, kind in rows_run:
                order = ("a", "b") if rep % 2 == 0 else ("b", "a")
                for label in order:
                    out = measure(trees[label], kind, model, homes[label], args.timeout, args.linear_kernels)
                    cpu = out["cpu"]
                    value = out["output_throughput"] if kind == "throughput" else out["median_tpot_ms"]
                    results[label][f"{name}/{kind}"].append(value)
                    print(f"rep {rep} {label} {name} {kind}: {value:.2f}", file=sys.stderr)
        for tree in trees.values():
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], capture_output=True)
    rows = []
    print(f"CPU: {cpu}")
    print(f"| row | {args.a} | {args.b} | b / a |")
    print("|---|---:|---:|---:|")
    for key in results["a"]:
        a, b = statistics.median(results["a"][key]), statistics.median(results["b"][key])
        unit = "out tok/s" if key.endswith("throughput") else "TPOT ms"
        rows.append({"row": key, "unit": unit, "a": a, "b": b, "ratio": b / a, "a_all": results["a"][key],
                     "b_all": results["b"][key]})
        print(f"| {key} ({unit}) | {a:.2f} | {b:.2f} | {b / a:.3f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu, "a": args.a, "b": args.b, "reps": args.reps,
                                         "linear_kernels": args.linear_kernels, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
