"""Quantizing a model larger than memory: peak RSS of `--max-memory` (one decoder layer at a time from the
safetensors files, shards written as layers finish) against the in-memory pipeline, on a generated random
Llama checkpoint (~2 GB fp32), and whether both write the same tensors (bitwise).

Each run is a process of its own. The streamed one first quantizes a one-layer model of the same shapes, so
that what every run pays once (interpreter, torch, transformers' model code, the libraries' code pages and
thread pools, the tokenizer) is resident; that is the fixed cost, and the peak is measured from there on
(Linux's VmHWM restarted through /proc/self/clear_refs).

    python benchmarks/compress/larger_than_memory.py --json docs/results/data/larger_than_memory.json
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from llmopt.core.hardware import cpu_line
from llmopt.core.offload import parse_memory
from llmopt.core.tiny import save_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line, emit, save_rows

RUN = """
import json, sys, time
from pathlib import Path
from llmopt.compress.api import quantize_configs
from llmopt.jobs.quantize import quantize_to_artifact
def status(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024
model, warm_model, out, max_memory, settings = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
max_memory = None if max_memory == "none" else int(max_memory)
settings = json.loads(settings)
cold = status("VmRSS")
if warm_model != "none":
    quantize_to_artifact(warm_model, out + "-warm", quantize_configs(settings["method"], settings["config"]),
                         max_memory=max_memory, overwrite=True)
fixed = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
start = time.perf_counter()
facts = quantize_to_artifact(model, out, quantize_configs(settings["method"], settings["config"]),
                             max_memory=max_memory, overwrite=True)
print(json.dumps({"cold_rss": cold, "fixed_rss": fixed, "peak_rss": status("VmHWM"),
                  "wall_s": round(time.perf_counter() - start, 1), "shards": len(list(Path(out).glob("model*.safetensors")))}))
"""


def parse_args():
    parser = command_line(__doc__, default="docs/results/data/larger_than_memory.json")
    parser.add_argument("--work", default="/tmp/llmopt-larger-than-memory", help="folder for the models and artifacts")
    parser.add_argument("--layers", type=int, default=38)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-memory", default="600MB")
    parser.add_argument("--method", default="gptq")
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--markdown", default=None)
    return parser.parse_args()


def make_model(path: Path, layers: int, args) -> Path:
    if not (path / "config.json").exists():
        save_tiny_model(path, "llama", seed=0, max_shard_size="500MB", hidden_size=args.hidden,
                        intermediate_size=args.intermediate, num_hidden_layers=layers,
                        num_attention_heads=args.hidden // 64, num_key_value_heads=max(args.hidden // 256, 1),
                        vocab_size=args.vocab, max_position_embeddings=4096)
    return path


def run(model: Path, warm: Path | None, out: Path, max_memory: int | None, settings: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, str(model), str(warm or "none"), str(out),
                           str(max_memory or "none"), json.dumps(settings)],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"quantize failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})
    return out


def same_tensors(a: Path, b: Path) -> bool:
    ta, tb = tensors(a), tensors(b)
    return set(ta) == set(tb) and all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)


def main() -> None:
    args = parse_args()
    work = Path(args.work)
    model = make_model(work / "model", args.layers, args)
    warm = make_model(work / "model-1layer", 1, args)
    fp32 = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    budget = parse_memory(args.max_memory)
    config = {"bits": 4, "group_size": 64}
    if args.method != "rtn":
        config.update(calib="pystdlib", num_samples=args.num_samples, seqlen=args.seqlen)
    settings = {"method": args.method, "config": config}
    streamed = run(model, warm, work / "streamed", budget, settings)
    in_memory = run(model, warm, work / "in-memory", None, settings)
    equal = same_tensors(work / "streamed", work / "in-memory")
    mb = 1e6
    rows = {"cpu": cpu_line(), "model_fp32_bytes": fp32, "layers": args.layers, "max_memory_bytes": budget,
            "settings": settings, "streamed": streamed, "in_memory": in_memory, "bitwise_equal": equal}
    table = "\n".join([
        f"model: random Llama, {args.layers} layers, hidden {args.hidden}, fp32 {fp32 / 1e9:.2f} GB; "
        f"{args.method} w4g64; --max-memory {args.max_memory}",
        "| run | peak RSS MB | above fixed MB | peak / fp32 size | wall s | shards |",
        "|---|---:|---:|---:|---:|---:|",
        *[f"| {name} | {r['peak_rss'] / mb:.0f} | {(r['peak_rss'] - r['fixed_rss']) / mb:.0f} | "
          f"{r['peak_rss'] / fp32:.2f} | {r['wall_s']} | {r['shards']} |"
          for name, r in (("--max-memory", streamed), ("in memory", in_memory))],
        f"fixed cost (after a one-layer run): {streamed['fixed_rss'] / mb:.0f} MB "
        f"(cold start {streamed['cold_rss'] / mb:.0f} MB); same tensors: {'yes' if equal else 'NO'}",
    ])
    save_rows(args.json, rows)
    emit(table, args.markdown)


if __name__ == "__main__":
    main()
