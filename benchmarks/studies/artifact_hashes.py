"""Tensor hashes of the README's compression artifacts and greedy outputs, to prove a refactor changed nothing.

Runs the README's commands for SmolLM2-135M (c4 calibration) in subprocesses through the CLI, hashes every
tensor of each artifact's `model.safetensors` (sha256 of its raw bytes, with dtype and shape) and records the
greedy completions of a few prompts on the dense model and on the GPTQ artifact. With `--compare` it reports
every tensor, setting or completion that differs from a saved run and exits 1 if any does.

    python benchmarks/studies/artifact_hashes.py --json /tmp/before.json
    python benchmarks/studies/artifact_hashes.py --json /tmp/after.json --compare /tmp/before.json
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from llmopt.core.hardware import cpu_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

MODEL = "smollm2-135m"
ARTIFACTS = {  # name -> llmopt arguments (the README's commands; `-o` is added)
    "gptq_w4g64": ["quantize", MODEL, "--method", "gptq", "--bits", "4", "--group-size", "64"],
    "awq_w4g64": ["quantize", MODEL, "--method", "awq", "--bits", "4", "--group-size", "64"],
    "rtn_w4g64": ["quantize", MODEL, "--method", "rtn", "--bits", "4", "--group-size", "64"],
    "sparsegpt_2of4": ["prune", MODEL, "--method", "sparsegpt", "--pattern", "2:4"],
    "wanda_50": ["prune", MODEL, "--method", "wanda", "--sparsity", "0.5"],
    "sparsegpt_2of4_gptq_w4g64": ["quantize", MODEL, "--method", "gptq", "--bits", "4", "--group-size", "64",
                                  "--prune-pattern", "2:4", "--num-samples", "32"],
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three reasons to learn Python:"]
# settings that legitimately differ run to run
VOLATILE = {"wall_time_s", "peak_rss_bytes", "created", "versions", "seconds", "time_s"}


def llmopt(args: list[str]) -> str:
    done = subprocess.run([sys.executable, "-m", "llmopt", *args], capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode:
        raise SystemExit(f"llmopt {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def tensor_hashes(folder: Path) -> dict[str, str]:
    hashes = {}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            hashes[name] = f"{t.dtype} {tuple(t.shape)} {hashlib.sha256(raw).hexdigest()[:16]}"
    return hashes


def stable(value):
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    return value


def greedy(model: str) -> list[str]:
    args = ["generate", model, "--max-tokens", "24", "--temperature", "0"]
    for p in PROMPTS:
        args += ["--prompt", p]
    return llmopt(args).splitlines()


def run(workdir: Path) -> dict:
    out = {"cpu": cpu_line(), "artifacts": {}, "greedy": {}}
    for name, args in ARTIFACTS.items():
        folder = workdir / name
        llmopt([*args, "-o", str(folder), "--json"])
        config = json.loads((folder / "config.json").read_text())
        out["artifacts"][name] = {
            "command": "llmopt " + " ".join(args),
            "tensors": tensor_hashes(folder),
            "quantization_config": config.get("quantization_config"),
            "llmopt": stable(json.loads((folder / "llmopt.json").read_text())),
        }
        print(f"{name}: {len(out['artifacts'][name]['tensors'])} tensors", flush=True)
    out["greedy"][MODEL] = greedy(MODEL)
    out["greedy"]["gptq_w4g64"] = greedy(str(workdir / "gptq_w4g64"))
    return out


def differences(before: dict, after: dict) -> list[str]:
    found = []
    for name, old in before["artifacts"].items():
        new = after["artifacts"].get(name)
        if new is None:
            found.append(f"{name}: missing")
            continue
        for key in sorted(set(old["tensors"]) | set(new["tensors"])):
            if old["tensors"].get(key) != new["tensors"].get(key):
                found.append(f"{name} {key}: {old['tensors'].get(key)} -> {new['tensors'].get(key)}")
        if old["quantization_config"] != new["quantization_config"]:
            found.append(f"{name} quantization_config differs")
    for model, lines in before["greedy"].items():
        if after["greedy"].get(model) != lines:
            found.append(f"greedy {model}: {lines} -> {after['greedy'].get(model)}")
    return found


def main() -> None:
    parser = command_line(__doc__, required=True, help="where to write the hashes")
    parser.add_argument("--compare", help="a JSON from an earlier run: report what differs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(tmp))
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.compare:
        found = differences(json.loads(Path(args.compare).read_text()), result)
        total = sum(len(a["tensors"]) for a in result["artifacts"].values())
        print(f"{total} tensors in {len(result['artifacts'])} artifacts, "
              f"{sum(len(v) for v in result['greedy'].values())} greedy completions: "
              f"{len(found)} differences")
        for line in found:
            print("  " + line)
        raise SystemExit(1 if found else 0)


if __name__ == "__main__":
    main()
