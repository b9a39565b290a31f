"""llmopt against llama.cpp on the same weights and machine: batch-1 decode and a 512-token prompt's TTFT, int4,
fp32 and bf16, plus where the time of llmopt's batch-1 decode step goes.

Weights: an int4 artifact of --model (RTN w4 g32 asymmetric: the layout of llama.cpp's Q4_1, so `llmopt export
--format gguf` writes the very same codes; GPTQ codes share the layout and so the speed) run by llmopt's runtime,
and its GGUF export run by llama.cpp; fp32: the model run by llmopt in fp32 and its F32 GGUF export by llama.cpp;
bf16: the model run by llmopt in bf16 (`--dtype auto` on CPUs with AVX512-BF16 or AMX) and by llama.cpp from a BF16
file its own quantizer made of the F32 one (the same rounding to nearest even).
llama.cpp runs in its own process (llama-cpp-python, `Llama.generate` greedy, n_threads = --threads), so neither
runtime's thread pool spins beside the other's; llmopt runs its Engine in this one (`--dtype auto` for the int4
row's activations, what `llmopt bench` uses). Each round measures every row in turn (medians over --rounds):
- batch-1 TPOT: --requests prompts of 128 random tokens, 128 tokens generated each, one at a time (EOS ignored);
- TTFT of a 512-token prompt (a fresh cache each time, the prompt never seen before);
- beside the fp32 rows, the machine's memory speed at that moment: every fp32 weight read once by torch's sum (the
  bytes each fp32 batch-1 token reads; both runtimes' TPOT over that time is printed);
the int4 row also with `--lm-head int8` and `int8-g32` (the logits head rounded to int8 at load per row, or per 32
columns as Q8_0; llama.cpp's own Q4_1 file holds its head in Q6_K), against the same llama.cpp figures; with
--small-pages also the int4 and fp32 rows with the weights left in malloc's 4 KiB pages (LLMOPT_WEIGHTS_HUGE_PAGES=0;
the default moves them into transparent huge pages).
Then the profile of 16 int4 batch-1 decode steps (torch.profiler): the linears' kernels, attention, the lm_head,
the other ops, and the rest of the step's wall time (Python, dispatch). With --llama-server (the path of
llama.cpp's `llama-server`, built from source here), serving: `llmopt serve` on the int4 artifact against
`llama-server -np C -cb` on its GGUF export, C = 8 and 64 clients streaming 128/128 completions (2 C requests),
both driven by `llmopt bench --base-url`'s client (`llmopt.eval.bench.bench_http`), each with a KV cache of the
same tokens committed at start and of the same dtype (--serve-kv-cache-dtype: float16 by default, llama-server's own
default cache type; --serve-rounds rounds, medians).

    python benchmarks/runtime/peers.py --json docs/results/data/peers.json [--model smollm2-135m] [--rounds 3]
        [--pairs fp32,bf16] [--llama-server PATH] [--clients 8,64] [--serve-rounds 1] [--serve-kv-cache-dtype float16]
        [--small-pages]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest.mock import patch

from serve import free_port, started  # (benchmarks/runtime/serve.py: a server subprocess, once its /health answers)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

VOCAB_LOW, VOCAB_HIGH = 200, 40000  # random prompt tokens: ordinary ids of SmolLM2's vocabulary
LLAMA_CACHE_TYPES = {"float16": "f16", "float32": "f32", "bfloat16": "bf16"}  # llmopt's KV dtype -> llama-server's
PRODUCT_OPS = ("mm", "gemv", "matmul", "linear", "int4", "panel", "sparse24", "int8")  # ops that are a linear


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)] for _ in range(count)]


# --- llama.cpp (in its own process) --------------------------------------------------------------------------------
def llamacpp_run(gguf: str, threads: int, decode_prompts: list[list[int]], out_tokens: int,
                 long_prompt: list[int], result) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(gguf, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                          verbose=False)

    def generate(prompt: list[int], n: int) -> list[float]:
        llm.reset()
        times = [time.perf_counter()]
        for i, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True)):
            times.append(time.perf_counter())
            if i + 1 >= n:
                break
        return times

    generate(decode_prompts[0][:32], 4)  # warm-up: weights paged in, threads started
    tpots = []
    for prompt in decode_prompts:
        t = generate(prompt, out_tokens)
        tpots.append((t[-1] - t[1]) / (len(t) - 2))
    t = generate(long_prompt, 1)
    result.put({"tpot_ms": statistics.median(tpots) * 1e3, "ttft512_ms": (t[1] - t[0]) * 1e3})


def llamacpp_quantize(source: Path, output: Path, ftype_name: str, threads: int, f16_embedding: bool = False) -> None:
    """llama.cpp's own conversion of a GGUF file (its quantizer, `llama-quantize`; ftype_name: a LLAMA_FTYPE_MOSTLY_*
    name), in a process of its own; f16_embedding: the token embedding and output tensor in F16
    (`--token-embedding-type f16 --output-tensor-type f16`)."""
    context = mp.get_context("spawn")
    process = context.Process(target=_llamacpp_quantize,
                              args=(str(source), str(output), ftype_name, threads, f16_embedding))
    process.start()
    process.join(timeout=600)
    if process.exitcode != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed for {output.name} (exit code {process.exitcode})")


def _llamacpp_quantize(source: str, output: str, ftype_name: str, threads: int, f16_embedding: bool) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, ftype_name), threads
    if f16_embedding:
        params.token_embedding_type = params.output_tensor_type = llama_cpp.GGML_TYPE_F16
    sys.exit(llama_cpp.llama_model_quantize(source.encode(), output.encode(), params))


def llamacpp(gguf: str, args, decode_prompts, long_prompt) -> dict:
    context = mp.get_context("spawn")
    result = context.Queue()
    process = context.Process(target=llamacpp_run, args=(gguf, args.threads, decode_prompts, args.output_len,
                                                         long_prompt, result))
    process.start()
    out = result.get(timeout=600)
    process.join(timeout=60)
    return out


# --- llmopt (this process) -----------------------------------------------------------------------------------------
def llmopt_engine(model: str, dtype: str, lm_head: str = "model"):
    from llmopt.runtime.engine.config import EngineConfig
    from llmopt.runtime.fronts.create import create_engine

    return create_engine(model, EngineConfig(max_num_seqs=8, lm_head=lm_head), dtype=dtype)


def weights_in_small_pages(small: bool):
    """A context in which engines created leave their weights where the loader put them (LLMOPT_WEIGHTS_HUGE_PAGES=0:
    malloc's 4 KiB pages) when `small`; else as the default, moved into transparent huge pages. The environment is
    restored on leaving."""
    return patch.dict(os.environ, {"LLMOPT_WEIGHTS_HUGE_PAGES": "0"} if small else {})


def llmopt_run(engine, args, decode_prompts, long_prompt) -> dict:
    from llmopt.runtime.engine.sampling import SamplingParams

    engine.generate([decode_prompts[0][:32]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    tpots = []
    for prompt in decode_prompts:
        out = engine.generate([prompt], SamplingParams(max_tokens=args.output_len, ignore_eos=True))[0]
        t = out.token_times
        tpots.append((t[-1] - t[0]) / (len(t) - 1))
    engine.reset_stats(clear_prefix_cache=True)
    start = time.perf_counter()
    out = engine.generate([long_prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    return {"tpot_ms": statistics.median(tpots) * 1e3, "ttft512_ms": (out.token_times[0] - start) * 1e3}


def step_profile(engine, steps: int = 16) -> dict:
    """Where a batch-1 decode step's time goes: ms per step by kind of op, and the wall time no op accounts for."""
    from torch.profiler import ProfilerActivity, profile

    from llmopt.runtime.engine.sampling import SamplingParams

    vocab = engine.vocab_size
    engine.add_request(prompts(1, 128, 99)[0], SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while not any(o.new_token_ids for o in engine.step()):
        pass
    engine.step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) * 1e3 / steps
    while engine.has_unfinished():
        engine.step()
    split = {"linears": 0.0, "attention": 0.0, "lm_head": 0.0, "other ops": 0.0}
    for event in prof.key_averages(group_by_input_shape=True):
        ms = event.self_cpu_time_total / 1e3 / steps
        name = event.key.lower().rsplit("::", 1)[-1]
        product = any(word in name for word in PRODUCT_OPS)
        if "attention" in name:
            split["attention"] += ms
        elif product and str(vocab) in str(event.input_shapes):
            split["lm_head"] += ms
        elif product:
            split["linears"] += ms
        else:
            split["other ops"] += ms
    split = {k: round(v, 3) for k, v in split.items()}
    split["python and dispatch"] = round(wall - sum(split.values()), 3)
    split["step wall ms (profiled)"] = round(wall, 3)
    return split


def fp32_weights(model_dir: Path) -> list:
    """Every tensor of the model's checkpoint in fp32, loaded once for weight_read_ms."""
    from safetensors.torch import load_file

    return [t.float().contiguous() for f in sorted(model_dir.glob("*.safetensors")) for t in load_file(f).values()]


def weight_read_ms(tensors: list, threads: int, repeats: int = 10) -> dict:
    """This machine's memory speed at the moment, in the bytes of an fp32 batch-1 token: every weight of the model
    (fp32_weights) read once by torch's sum over each tensor (in model order, `threads` threads; median of `repeats`
    after a warm-up pass). A decode step multiplies every weight once, so it reads these bytes whichever runtime
    runs it; torch's sum is a reference read, not the fastest one the memory allows."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for tensor in tensors:
                tensor.sum()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    mbytes = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    ms = statistics.median(times[1:]) * 1e3
    return {"fp32_weight_mb": round(mbytes, 1), "read_once_ms": round(ms, 2), "gb_per_s": round(mbytes / ms, 1)}


# --- serving -------------------------------------------------------------------------------------------------------
def served_tok_s(model: str, command: list[str], port: int, clients: int) -> dict:
    from llmopt.eval.bench import BenchConfig, HttpTarget, WorkloadSpec, bench_http

    process = started(command, port)
    try:
        spec = WorkloadSpec(num_requests=2 * clients, input_len=128, output_len=128)
        result = bench_http("served", model, spec, BenchConfig(max_concurrency=clients),
                            HttpTarget(f"http://127.0.0.1:{port}/v1", model="served"))
        m = result.metrics
        return {"output_tok_s": m["output_throughput"], "median_ttft_ms": m["median_ttft_ms"],
                "median_tpot_ms": m["median_tpot_ms"], "completed": m["completed"]}
    finally:
        process.kill()
        process.wait(timeout=30)


def serving(args, int4: Path, gguf: Path, clients: int) -> dict:
    """--serve-rounds rounds, each llama-server then llmopt serve; the medians of their output tok/s. Both get a KV
    cache of the same tokens (2 C requests' worth of C at once), committed at start: llama.cpp clears its cache
    before serving, and llmopt is told to commit it (--kv-cache-commit startup) instead of in the background. Both
    caches hold --serve-kv-cache-dtype (llama-server's -ctk / -ctv, llmopt's --kv-cache-dtype)."""
    context = clients * (128 + 128 + 16)
    kv_dtype = args.serve_kv_cache_dtype
    rounds = {"llmopt": [], "llama-server": []}
    for _ in range(args.serve_rounds):
        port = free_port()
        rounds["llama-server"].append(served_tok_s(
            args.model, [args.llama_server, "-m", str(gguf), "-np", str(clients), "-cb", "-t", str(args.threads),
                         "-tb", str(args.threads), "-c", str(context), "-ctk", LLAMA_CACHE_TYPES[kv_dtype],
                         "-ctv", LLAMA_CACHE_TYPES[kv_dtype], "--host", "127.0.0.1", "--port", str(port),
                         "-a", "served"], port, clients))
        port = free_port()
        rounds["llmopt"].append(served_tok_s(
            args.model, [sys.executable, "-m", "llmopt", "serve", str(int4), "--port", str(port),
                         "--served-model-name", "served", "--max-num-seqs", str(max(clients, 8)),
                         "--lm-head", args.serve_lm_head, "--kv-cache-tokens", str(context),
                         "--kv-cache-commit", "startup", "--kv-cache-dtype", kv_dtype], port, clients))
    result = {name: median_run(runs) for name, runs in rounds.items()}
    result["ratio"] = result["llmopt"]["output_tok_s"] / result["llama-server"]["output_tok_s"]
    return result


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over the rounds, with every round's output tok/s."""
    merged = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    merged["rounds_output_tok_s"] = [run["output_tok_s"] for run in runs]
    return merged


def main() -> None:
    parser = command_line(__doc__, default=None)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: adds the serving rows")
    parser.add_argument("--clients", default="8,64")
    parser.add_argument("--serve-rounds", type=int, default=1, help="serving rounds per client count (medians)")
    parser.add_argument("--serve-lm-head", default="model", choices=("model", "int8", "int8-g32"),
                        help="`llmopt serve --lm-head` in the serving rows")
    parser.add_argument("--serve-kv-cache-dtype", default="float16", choices=tuple(LLAMA_CACHE_TYPES),
                        help="both servers' KV cache dtype in the serving rows (float16: llama-server's default)")
    parser.add_argument("--small-pages", action="store_true",
                        help="also the int4 and fp32 rows with the weights in 4 KiB pages (LLMOPT_WEIGHTS_HUGE_PAGES=0)")
    parser.add_argument("--pairs", default=None,
                        help="only these rows, comma-separated (int4, int4 int8-head, int4 int8-g32-head, fp32, bf16, "
                             "and with --small-pages int4 4k-pages, fp32 4k-pages)")
    parser.add_argument("--work", default=None, help="where the artifacts and GGUF files go (default: a temp dir)")
    args = parser.parse_args()

    from llmopt.compress.api import make_config
    from llmopt.core.hardware import cpu_line
    from llmopt.core.io import write_json
    from llmopt.core.models import resolve_model
    from llmopt.formats.gguf import export_gguf
    from llmopt.jobs.quantize import quantize_to_artifact

    print(cpu_line(), flush=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="llmopt-peers-"))
    int4 = work / "rtn-w4g32-asym"
    if not (int4 / "llmopt.json").is_file():
        quantize_to_artifact(args.model, int4, [make_config("rtn", bits=4, group_size=32, sym=False)],
                             overwrite=True)
    ggufs = {"int4": work / "int4-q4_1.gguf", "fp32": work / "f32.gguf", "bf16": work / "bf16.gguf"}
    for kind, source in (("int4", int4), ("fp32", resolve_model(args.model).path)):
        if not ggufs[kind].is_file():
            export_gguf(source, ggufs[kind])
    if not ggufs["bf16"].is_file():  # llama.cpp's own rounding of the F32 file (to nearest even, as torch's)
        llamacpp_quantize(ggufs["fp32"], ggufs["bf16"], "LLAMA_FTYPE_MOSTLY_BF16", args.threads)
    decode_prompts = prompts(args.requests, 128, 0)
    long_prompt = prompts(1, 512, 1)[0]
    # kind -> (model, dtype, --lm-head, the llama.cpp row it is compared with); "int4 int8-head": the same int4
    # artifact with its logits head rounded to int8 at load (llama.cpp's Q4_1 file keeps its head as Q6_K)
    pairs = {"int4": (str(int4), "auto", "model", "int4"), "int4 int8-head": (str(int4), "auto", "int8", "int4"),
             "int4 int8-g32-head": (str(int4), "auto", "int8-g32", "int4"),
             "fp32": (args.model, "float32", "model", "fp32"), "bf16": (args.model, "bfloat16", "model", "bf16")}
    if args.small_pages:  # the same engines with their weights left in malloc's 4 KiB pages
        pairs |= {"int4 4k-pages": pairs["int4"], "fp32 4k-pages": pairs["fp32"]}
    if args.pairs:
        pairs = {kind: pairs[kind] for kind in args.pairs.split(",")}
    rows = {f"{kind} llmopt": [] for kind in pairs} | {f"{theirs} llama.cpp": [] for *_, theirs in pairs.values()}
    numerics = {}  # what llmopt's engine computed with (int4: 8-bit inputs by default), per kind
    weights = fp32_weights(resolve_model(args.model).path)
    reads = []  # every fp32 weight read once, measured beside each round's fp32 rows
    for round_index in range(args.rounds):
        for kind, (model, dtype, lm_head, theirs) in pairs.items():
            if kind == "fp32":
                reads.append(weight_read_ms(weights, args.threads))
            with weights_in_small_pages(kind.endswith("4k-pages")):
                engine = llmopt_engine(model, dtype, lm_head)
            numerics.setdefault(kind, engine.numerics())
            rows[f"{kind} llmopt"].append(llmopt_run(engine, args, decode_prompts, long_prompt))
            del engine
            if kind == theirs:
                rows[f"{kind} llama.cpp"].append(llamacpp(str(ggufs[kind]), args, decode_prompts, long_prompt))
            print(f"round {round_index} {kind}: llmopt {rows[f'{kind} llmopt'][-1]}, llama.cpp "
                  f"{rows[f'{theirs} llama.cpp'][-1]}", flush=True)
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in rows.items()}
    profile_split = step_profile(llmopt_engine(str(int4), "auto")) if "int4" in pairs else {}
    profile_int8_head = step_profile(llmopt_engine(str(int4), "auto", "int8")) if "int4" in pairs else {}
    print("\n| row | llmopt | llama.cpp | llmopt / llama.cpp |\n|---|---:|---:|---:|")
    for kind, (*_, their_kind) in pairs.items():
        ours, theirs = medians[f"{kind} llmopt"], medians[f"{their_kind} llama.cpp"]
        for key, label in (("tpot_ms", "batch-1 TPOT ms"), ("ttft512_ms", "TTFT of a 512-token prompt, ms")):
            print(f"| {kind} {label} | {ours[key]:.1f} | {theirs[key]:.1f} | {ours[key] / theirs[key]:.2f}x |")
    read = {k: statistics.median(r[k] for r in reads) for k in reads[0]} if reads else {}
    if reads:
        for kind in ("fp32 llmopt", "fp32 llama.cpp"):
            read[f"{kind} tpot / read"] = round(medians[kind]["tpot_ms"] / read["read_once_ms"], 2)
        print(f"\nfp32 weights read once by torch.sum: {read['fp32_weight_mb']:.0f} MB in {read['read_once_ms']:.1f} "
              f"ms ({read['gb_per_s']:.1f} GB/s); batch-1 TPOT / that: llmopt {read['fp32 llmopt tpot / read']:.2f}, "
              f"llama.cpp {read['fp32 llama.cpp tpot / read']:.2f}")
    if profile_split:
        print("\nllmopt int4 batch-1 decode step, ms per step by part:", profile_split)
        print("the same with --lm-head int8:", profile_int8_head)
    served = {}
    if args.llama_server:
        for clients in (int(c) for c in args.clients.split(",")):
            try:
                served[clients] = serving(args, int4, ggufs["int4"], clients)
            except Exception as exc:  # noqa: BLE001  (a server that dies under load is a result to record)
                served[clients] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"| {clients} clients | failed: {served[clients]['error']} |", flush=True)
                continue
            print(f"| {clients} clients, 128/128, output tok/s | {served[clients]['llmopt']['output_tok_s']:.1f} | "
                  f"{served[clients]['llama-server']['output_tok_s']:.1f} | {served[clients]['ratio']:.2f}x |",
                  flush=True)
    if args.json:
        write_json(args.json, {"cpu": cpu_line(), "model": args.model, "settings": vars(args), "rounds": rows,
                               "median": medians, "fp32_weights_read": {"rounds": reads, "median": read},
                               "llmopt_numerics": numerics, "int4_step_profile": profile_split,
                               "int4_int8_head_step_profile": profile_int8_head,
                               "serving": served}, indent=1)


if __name__ == "__main__":
    main()
