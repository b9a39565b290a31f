"""llmopt's default GPTQ vs llm-compressor's GPTQ on SmolLM2-135M, in the same invocation: wall time, peak RSS
and (with --eval) perplexity, for W4A16 symmetric group 64 with the same 128 x 512 C4 calibration tokens.

This machine's speed drifts by 15-50% within an hour, so the runs alternate (peer, llmopt, llmopt, peer, ...)
and the ratio of medians is the figure to read. llm-compressor pins a different transformers, so it runs from
its own virtual environment:

    python -m venv /tmp/lcvenv && /tmp/lcvenv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    python benchmarks/compress/gptq_vs_llmcompressor.py --peer-python /tmp/lcvenv/bin/python --pairs 2 --eval \
        --json docs/results/data/gptq_vs_llmcompressor.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quantization import EVAL_SETS, evaluate  # the quantization benchmark's perplexity protocol (beside this file)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

MODEL = "smollm2-135m"

# Runs in the peer's environment: argv = source folder, calibration ids (safetensors), output folder.
PEER_SCRIPT = '''
import json, sys, time
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier

source, ids_path, out = sys.argv[1:4]
ids = load_file(ids_path)["input_ids"]
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(source)
dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
recipe = GPTQModifier(ignore=["lm_head"], config_groups={"group_0": {"targets": ["Linear"], "weights": weights}})
oneshot(model=model, dataset=dataset, recipe=recipe, max_seq_length=ids.shape[1],
        num_calibration_samples=ids.shape[0], shuffle_calibration_samples=False)
quantized = time.perf_counter()
model.save_pretrained(out, save_compressed=True)
tokenizer.save_pretrained(out)
print(json.dumps({"quantize_wall_s": quantized - start, "total_wall_s": time.perf_counter() - start}))
'''


def peak_rss_of(command: list[str]) -> tuple[dict, int]:
    """Run a command through a small wrapper that reports the command's peak RSS (its ru_maxrss, bytes): the
    command's facts (its last JSON line) with the process wall time, and that peak."""
    wrapper = ("import json,os,subprocess,sys,resource\n"
               "p=subprocess.run(sys.argv[1:]); r=resource.getrusage(resource.RUSAGE_CHILDREN)\n"
               "print(json.dumps({'rc': p.returncode, 'peak_rss_bytes': r.ru_maxrss * 1024}), file=sys.stderr)\n"
               "sys.exit(p.returncode)")
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", wrapper, *command], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate()
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise SystemExit(f"{command[0]} failed ({process.returncode}):\n{stderr[-3000:]}")
    rss = json.loads(stderr.strip().splitlines()[-1])["peak_rss_bytes"]
    reported = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
    return {"process_wall_s": round(wall, 1), **reported}, rss


def main() -> None:
    parser = command_line(__doc__, default=None)
    parser.add_argument("--peer-python", required=True, help="python of a venv with llmcompressor installed")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--eval", action="store_true", help="also perplexity of fp32 and both artifacts")
    args = parser.parse_args()
    if not Path(args.peer_python).exists():
        raise SystemExit(f"--peer-python {args.peer_python} does not exist: create the venv (see the docstring)")

    from safetensors.torch import save_file

    from llmopt.core.datasets import calibration_samples
    from llmopt.core.models import load_tokenizer, resolve_model

    source = resolve_model(MODEL)
    work = Path(tempfile.mkdtemp(prefix="llmopt-vs-lc-"))
    # llmopt's own calibration draw (its defaults: c4, 128 x 512, seed 0), handed to the peer as token ids.
    ids = calibration_samples(load_tokenizer(source), "c4", 128, 512, 0)
    save_file({"input_ids": ids.contiguous()}, str(work / "calib.safetensors"))
    (work / "peer.py").write_text(PEER_SCRIPT)

    def run_peer(i):
        out = str(work / f"lc{i}")
        facts, rss = peak_rss_of([args.peer_python, str(work / "peer.py"), str(source.path),
                                  str(work / "calib.safetensors"), out])
        return {"tool": "llm-compressor", "artifact": out, **facts, "peak_rss_bytes": rss}

    def run_llmopt(i):
        out = str(work / f"llmopt{i}")
        facts, rss = peak_rss_of([sys.executable, "-m", "llmopt", "quantize", MODEL, "--method", "gptq", "--bits",
                                  "4", "--group-size", "64", "-o", out, "--json"])
        return {"tool": "llmopt", "artifact": out, **facts, "peak_rss_bytes": rss}

    runs = []
    for i in range(args.pairs):
        order = (run_peer, run_llmopt) if i % 2 == 0 else (run_llmopt, run_peer)
        for fn in order:
            runs.append(fn(i))
            r = runs[-1]
            print(f"{r['tool']:15s} quantize {r['quantize_wall_s']:7.1f} s  process {r['process_wall_s']:7.1f} s  "
                  f"peak RSS {r['peak_rss_bytes'] / 1e9:.3f} GB", flush=True)

    def median(tool, key):
        return statistics.median(r[key] for r in runs if r["tool"] == tool)

    summary = {key: {"llmopt": median("llmopt", key), "llm-compressor": median("llm-compressor", key),
                     "ratio": round(median("llmopt", key) / median("llm-compressor", key), 3)}
               for key in ("quantize_wall_s", "process_wall_s", "peak_rss_bytes")}
    if args.eval:
        first = {tool: next(r["artifact"] for r in runs if r["tool"] == tool) for tool in ("llmopt", "llm-compressor")}
        summary["ppl"] = {name: {d: round(ppl, 3) for d, ppl in evaluate(model, 32768).items()}
                          for name, model in (("fp32", MODEL), *first.items())}
    print("\n| figure | llmopt | llm-compressor | ratio |\n|---|---|---|---|")
    for key in ("quantize_wall_s", "process_wall_s", "peak_rss_bytes"):
        s = summary[key]
        print(f"| median {key} | {s['llmopt']:.4g} | {s['llm-compressor']:.4g} | {s['ratio']:.3f} |")
    if args.eval:
        p = summary["ppl"]
        for dataset in EVAL_SETS:
            print(f"| ppl {dataset} (fp32 {p['fp32'][dataset]}) | {p['llmopt'][dataset]} | "
                  f"{p['llm-compressor'][dataset]} | |")
    if args.json:
        with open(args.json, "w") as f:
            from llmopt.core.hardware import cpu_line

            json.dump({"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_line(),
                       "threads": os.cpu_count(), "runs": runs, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
