"""llama.cpp's side of benchmarks/runtime/kvcache.py: one long prompt (token ids in a JSON file) through
llama-cpp-python with the KV cache in q8_0 (`-ctk q8_0 -ctv q8_0`, which needs flash attention), greedy; prints
one JSON line: TTFT, TPOT (mean time between streamed tokens after the first), peak RSS.

Runs in an environment with llama-cpp-python (it imports nothing of llmopt):

    python benchmarks/runtime/llamacpp_long.py MODEL.gguf tokens.json --max-tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import llama_cpp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("tokens", help="JSON list of prompt token ids")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-type", default="q8_0", choices=["q8_0", "f16", "f32"])
    args = parser.parse_args()
    prompt = json.load(open(args.tokens))
    cache_type = {"q8_0": llama_cpp.GGML_TYPE_Q8_0, "f16": llama_cpp.GGML_TYPE_F16,
                  "f32": llama_cpp.GGML_TYPE_F32}[args.cache_type]
    llm = llama_cpp.Llama(args.gguf, n_ctx=len(prompt) + args.max_tokens, n_batch=2048, n_ubatch=512,
                          n_threads=args.threads, n_threads_batch=args.threads, type_k=cache_type, type_v=cache_type,
                          flash_attn=True, verbose=False)
    # warm-up: a short prompt (weights paged in, threads started)
    list(llm.create_completion(prompt[:32], max_tokens=4, temperature=0.0, stream=True))
    llm.reset()
    start = time.perf_counter()
    times = []
    for _ in llm.create_completion(prompt, max_tokens=args.max_tokens, temperature=0.0, stream=True):
        times.append(time.perf_counter())
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    print(json.dumps({"backend": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "cache_type": args.cache_type,
                      "prompt_tokens": len(prompt), "output_tokens": len(times), "ttft_ms": (times[0] - start) * 1e3,
                      "tpot_ms": tpot * 1e3 if tpot else None,
                      "peak_rss_mib": peak_rss_mib()}))


def peak_rss_mib() -> float:
    """Peak resident memory since this process's exec (VmHWM; ru_maxrss would count the parent's at the fork)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


if __name__ == "__main__":
    main()
