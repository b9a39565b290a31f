"""Driving a workload through the runtime (or transformers' `generate`, static batches) and measuring it.

`bench` runs the model, and optionally a baseline (`hf`: the same model through transformers; or another
MODEL through the runtime) in the same invocation, so ratios compare runs on an equally noisy machine.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from llmopt.core.errors import ConfigError
from llmopt.eval.metrics import (
    HardwarePeaks, ModelCost, RequestRecord, RunResult, engine_metrics, request_metrics,
)
from llmopt.eval.workloads import BenchRequest, WorkloadSpec, build_workload
from llmopt.runtime.engine.config import EngineConfig

ProgressFn = Callable[[int, int], None]  # (completed, total)


@dataclass(frozen=True)
class BenchConfig:
    dtype: str = "auto"  # resolved by each run (core.hardware.resolve_dtype): the baseline gets the same
    device: str = "cpu"
    engine: EngineConfig = field(default_factory=EngineConfig)  # batching, KV cache, prefix cache
    max_concurrency: int | None = None
    hf_batch_size: int = 32
    slo: tuple[tuple[str, float], ...] = ()
    peak_bandwidth: float | None = None  # bytes/s
    peak_flops: float | None = None  # FLOP/s
    num_threads: int | None = None

    def __post_init__(self):
        for name in ("max_concurrency", "num_threads", "hf_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-').replace('num-threads', 'threads')} must be at least 1 "
                                  f"(got {value})", param=name)


# --- model facts ------------------------------------------------------------------------------------
def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _decode_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters and buffers a decode step reads: buffers a layer reads only for many-row
    steps (int4's plain nibble copy) are not decode traffic."""
    buffers = [b for m in module.modules() for name, b in m.named_buffers(recurse=False)
               if name not in getattr(m, "prefill_only_buffers", ())]
    return _bytes(list(module.parameters()) + buffers)


def model_cost(decoder: nn.Module, kv_bytes_per_token: int) -> ModelCost:
    """Bytes read and FLOPs per token of a runtime model (an engine's `runner.decoder`): decoder layers, final
    norm, lm_head; kv_bytes_per_token from its KVCacheSpec (one place sizes the cache)."""
    from llmopt.core.adapters import attention_geometry

    layers, lm_head = decoder.blocks, decoder.lm_head
    # --lm-head int8: the logits head is a quantized layer of its own (its codes, not the float weight, per token)
    head = decoder.logits_head if hasattr(getattr(decoder, "logits_head", None), "prefill_only_buffers") else lm_head
    weight_bytes = _decode_bytes(layers) + _decode_bytes(head)
    linear_params = sum(getattr(m, "in_features", 0) * getattr(m, "out_features", 0) for m in layers.modules()
                        if hasattr(m, "in_features") and not list(m.children()))
    linear_params += lm_head.in_features * lm_head.out_features
    geometry = attention_geometry(decoder.config)
    return ModelCost(weight_bytes, linear_params, kv_bytes_per_token,
                     4 * decoder.num_layers * geometry.num_heads * geometry.head_dim,
                     lm_head.in_features * lm_head.out_features)


def best_time(fn, device: str) -> float:
    """The shortest of 5 timed calls of fn() in seconds (the first warms up; CUDA synchronized)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    best = math.inf
    for _ in range(5):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def measure_peaks(dtype: torch.dtype, bandwidth: float | None = None, flops: float | None = None,
                  device: str = "cpu") -> HardwarePeaks:
    """Peak bandwidth and FLOP/s: the given values; else on CPU the machine's (core.hardware: a copy beyond the
    last-level cache, and the units' theoretical rate for `dtype` or the measured GEMM rate where higher,
    measured once per machine); on other devices a short copy test and a matmul test (best of 5)."""
    if bandwidth is not None and flops is not None:
        return HardwarePeaks(bandwidth, flops, "given")
    if torch.device(device).type == "cpu":
        from llmopt.core.hardware import measured_rates, peak_flops

        flops_source = "given"
        if flops is None:
            flops, flops_source = peak_flops(dtype)
        bandwidth_source = "given" if bandwidth is not None else "measured copy beyond the last-level cache"
        bandwidth = bandwidth if bandwidth is not None else measured_rates().bandwidth
        return HardwarePeaks(bandwidth, flops, f"bandwidth: {bandwidth_source}; FLOP/s: {flops_source}")
    if bandwidth is None:
        src = torch.ones(64 * 2**20 // 4, dtype=torch.float32, device=device)  # 64 MiB, beyond the caches
        dst = torch.empty_like(src)
        best = best_time(lambda: dst.copy_(src), device)
        bandwidth = 2 * src.numel() * 4 / best  # read + write
    if flops is None:
        n = 1024
        a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
        best = best_time(lambda: a @ b, device)
        flops = 2 * n**3 / best
    return HardwarePeaks(bandwidth, flops, "measured (64 MiB copy, 1024^3 matmul)")


# --- runtime driver ---------------------------------------------------------------------------------
WARM_UP_ROUNDS = 2  # the second round still ran ~20% faster than the first on a tiny model: two, then measure


def warm_up(engine, requests: list[BenchRequest]) -> None:
    """The workload's first requests (their prompt lengths and batch shape), twice, through prefill and decode,
    then zeroed counters and an empty prefix cache: the measured run starts cold in cache but warm in code
    (compiled kernels, allocator pools, thread pools), whichever variant a recipe measures first."""
    from llmopt.runtime.engine.sampling import SamplingParams

    sample = [r.prompt_token_ids for r in requests[:4]]
    params = SamplingParams(max_tokens=max(2, min(8, max(r.max_tokens for r in requests[:4]))), ignore_eos=True,
                            detokenize=False)
    for _ in range(WARM_UP_ROUNDS):
        engine.generate(sample, params)
    engine.reset_stats(clear_prefix_cache=True)


def run_engine(engine, requests: list[BenchRequest], max_concurrency: int | None = None,
               progress: ProgressFn | None = None) -> tuple[list[RequestRecord], float]:
    """Feed requests at their arrival times (at most max_concurrency in flight); returns records, duration."""
    from llmopt.runtime.engine.sampling import SamplingParams

    pending = deque(sorted(requests, key=lambda r: r.arrival_offset))
    records: list[RequestRecord] = []
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while pending and pending[0].arrival_offset <= now - start and (
                max_concurrency is None or engine.num_live_requests < max_concurrency):
            request = pending.popleft()
            # a request held back by max_concurrency starts when it is sent, as in vLLM's client
            engine.add_request(request.prompt_token_ids,
                               SamplingParams(max_tokens=request.max_tokens, ignore_eos=True, detokenize=False),
                               arrival_time=max(start + request.arrival_offset, now))
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0].arrival_offset - (time.perf_counter() - start)))
            continue
        for output in engine.step():
            if output.finished:
                records.append(RequestRecord(output.arrival_time - start, [t - start for t in output.token_times],
                                             output.num_prompt_tokens, len(output.token_ids),
                                             output.num_cached_tokens))
                if progress:
                    progress(len(records), len(requests))
    return records, time.perf_counter() - start


# --- transformers baseline --------------------------------------------------------------------------
class _TimingStreamer:
    """A transformers streamer that only notes when each generation step's tokens arrive."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


@torch.inference_mode()
def run_hf_static(model, tokenizer, requests: list[BenchRequest], batch_size: int,
                  progress: ProgressFn | None = None) -> tuple[list[RequestRecord], float]:
    """Static batches through `model.generate` (left padding, greedy, EOS ignored); each batch runs as long as
    its longest request, and starts once all its requests have arrived."""
    from llmopt.eval.hf_baseline import left_padded, pad_token_id

    pad_id = pad_token_id(tokenizer)
    device = next(model.parameters()).device
    records: list[RequestRecord] = []
    ordered = sorted(requests, key=lambda r: r.arrival_offset)
    start = time.perf_counter()
    for i in range(0, len(ordered), batch_size):
        batch = ordered[i:i + batch_size]
        wait = batch[-1].arrival_offset - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        input_ids, mask = left_padded([r.prompt_token_ids for r in batch], pad_id)
        new_tokens = max(r.max_tokens for r in batch)
        streamer = _TimingStreamer()
        model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                       pad_token_id=pad_id, eos_token_id=None, streamer=streamer)
        for r in batch:
            records.append(RequestRecord(r.arrival_offset, [t - start for t in streamer.times[: r.max_tokens]],
                                         len(r.prompt_token_ids), r.max_tokens))
        if progress:
            progress(len(records), len(requests))
    return records, time.perf_counter() - start


# --- one run ----------------------------------------------------------------------------------------
def _resolved(config: BenchConfig) -> BenchConfig:
    """The config with dtype 'auto' replaced by what it means on this device."""
    from dataclasses import replace

    from llmopt.core.hardware import resolve_dtype

    return replace(config, dtype=resolve_dtype(config.dtype, config.device))


def bench_runtime(name: str, model_name: str, spec: WorkloadSpec, config: BenchConfig,
                  progress: ProgressFn | None = None) -> RunResult:
    """One measured runtime run."""
    from llmopt.core.models import DTYPES
    from llmopt.runtime.fronts.create import create_engine

    config = _resolved(config)
    engine = create_engine(model_name, config.engine, dtype=config.dtype, device=config.device)
    requests = build_workload(spec, engine.tokenizer, engine.vocab_size)
    # (under tensor or pipeline parallelism rank 0's decoder holds its share only, and data-parallel replicas
    # keep theirs in their own processes, as disaggregated workers do: no MBU / MFU from them)
    parallel = config.engine
    single = (parallel.tensor_parallel_size == parallel.pipeline_parallel_size == parallel.data_parallel_size == 1
              and parallel.disaggregation is None)
    try:
        warm_up(engine, requests)
        records, duration = run_engine(engine, requests, config.max_concurrency, progress)
        stats, kv, numerics = engine.stats(), engine.kv_cache_info(), engine.numerics()
        cost = model_cost(engine.runner.decoder, kv["bytes_per_token"]) if single else None
        # (the weights' pages change decode speed, not numbers: runtime/executor/host_memory.py; None: another
        # process's runner)
        huge_pages = getattr(engine.runner, "weights_in_huge_pages", None)
    finally:
        engine.close()  # (the other ranks or replicas)
    peaks = measure_peaks(DTYPES[config.dtype], config.peak_bandwidth, config.peak_flops, config.device)
    metrics = request_metrics(records, dict(config.slo))
    metrics.update(engine_metrics(stats.steps, cost, peaks, stats.num_preemptions, stats.prefix_cache_hit_rate,
                                  metrics["duration"]))
    step_time = sum(s.duration for s in stats.steps)
    metrics["all_reduce_share"] = stats.all_reduce_seconds / step_time if stats.num_all_reduces and step_time else None
    metrics["peak_bandwidth"], metrics["peak_flops"] = peaks.bandwidth, peaks.flops
    metrics["kv_cache_bytes"], metrics["kv_cache_tokens"] = kv["bytes"], kv["tokens"]
    # TTFT of the requests that found their prefix cached (the first of each prefix pays the full prefill)
    hits = [r.ttft for r in records if r.num_cached_tokens > 0]
    metrics["mean_ttft_prefix_hit_ms"] = 1000 * sum(hits) / len(hits) if hits else None
    if stats.spec_decode is not None:
        metrics.update({f"spec_{key}": value for key, value in stats.spec_decode.to_json().items()})
    return RunResult(name, model_name, {"backend": "runtime", **asdict(config), "workload": asdict(spec),
                                        "kv_cache": kv["summary"], "numerics": numerics,
                                        "weights_in_huge_pages_bytes": huge_pages, "hardware": _hardware(config)},
                     metrics, records, [s.num_seqs for s in stats.steps])


def bench_hf(name: str, model_name: str, spec: WorkloadSpec, config: BenchConfig,
             progress: ProgressFn | None = None) -> RunResult:
    from llmopt.formats.load import load_model

    config = _resolved(config)
    model, tokenizer, _ = load_model(model_name, dtype=config.dtype, device=config.device)
    requests = build_workload(spec, tokenizer, model.config.vocab_size)
    warm = [BenchRequest(r.prompt_token_ids, 2) for r in requests[:2]]
    run_hf_static(model, tokenizer, warm, config.hf_batch_size)
    records, _ = run_hf_static(model, tokenizer, requests, config.hf_batch_size, progress)
    metrics = request_metrics(records, dict(config.slo))
    return RunResult(name, model_name, {"backend": "hf", "dtype": config.dtype, "batch_size": config.hf_batch_size,
                                        "workload": asdict(spec), "hardware": _hardware(config)}, metrics, records)


def _hardware(config: BenchConfig) -> dict:
    """The machine a run measured (every benchmark JSON names its CPU)."""
    from llmopt.core.hardware import hardware_facts

    facts = hardware_facts(measure=torch.device(config.device).type == "cpu")
    if torch.device(config.device).type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(torch.device(config.device))
    return facts


@dataclass(frozen=True)
class HttpTarget:
    """An OpenAI-compatible server to bench over HTTP."""

    base_url: str  # e.g. http://127.0.0.1:8000/v1
    endpoint: str = "completions"  # or "chat"
    model: str | None = None  # the served model name (default: the MODEL argument)
    api_key: str | None = None


def bench_http(name: str, model_name: str, spec: WorkloadSpec, config: BenchConfig, target: HttpTarget,
               progress: ProgressFn | None = None) -> RunResult:
    """One run against a server; MODEL gives the tokenizer the workload is built with."""
    from llmopt.core.models import load_tokenizer, resolve_model
    from llmopt.eval.http_bench import run_http

    tokenizer = load_tokenizer(resolve_model(model_name))
    requests = build_workload(spec, tokenizer, len(tokenizer))
    served = target.model or model_name
    warm = [BenchRequest(r.prompt_token_ids, 2) for r in requests[:2]]
    run_http(target.base_url, target.endpoint, served, warm, tokenizer, None, target.api_key)
    records, _ = run_http(target.base_url, target.endpoint, served, requests, tokenizer, config.max_concurrency,
                          target.api_key, progress)
    metrics = request_metrics(records, dict(config.slo))
    return RunResult(name, model_name, {"backend": "http", **asdict(target), "api_key": None,
                                        "max_concurrency": config.max_concurrency, "workload": asdict(spec),
                                        "hardware": _hardware(config)}, metrics, records)


def bench(model_name: str, spec: WorkloadSpec, config: BenchConfig, baseline: str | None = None,
          progress: ProgressFn | None = None, target: HttpTarget | None = None) -> list[RunResult]:
    """The model's run, then the baseline's (named 'baseline'): 'hf' or another MODEL through the runtime, both
    in the same resolved dtype (each run resolves 'auto' alike); a runtime baseline runs what the options under
    test would change without them (no speculative decoding, the KV cache in the model's dtype). With `target`,
    the first run goes over HTTP to that server, and a baseline that is a URL is another server, benched the same
    way."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if target is not None:
        runs = [bench_http(target.base_url, model_name, spec, config, target, progress)]
        if baseline:
            if not baseline.startswith(("http://", "https://")):
                raise ConfigError("with --base-url, --baseline takes another server's base URL")
            other = HttpTarget(baseline, target.endpoint, target.model, target.api_key)
            runs.append(bench_http("baseline", model_name, spec, config, other, progress))
        return runs
    runs = [bench_runtime(model_name, model_name, spec, config, progress)]
    if baseline == "hf":
        runs.append(bench_hf("baseline", model_name, spec, config, progress))
    elif baseline:  # another model on the runtime, without speculative decoding, with the model's own KV dtype
        plain = replace(config, engine=replace(config.engine, speculative=None, kv_cache_dtype="auto"))
        runs.append(bench_runtime("baseline", baseline, spec, plain, progress))
        if config.engine.speculative is not None:
            runs[0].metrics["decode_speedup"] = decode_speedup(runs[0].metrics, runs[1].metrics)
    return runs


def decode_speedup(metrics: dict, baseline: dict) -> float | None:
    """The baseline's mean TPOT over this run's: how much faster each output token came after the first."""
    ours, theirs = metrics.get("mean_tpot_ms"), baseline.get("mean_tpot_ms")
    return theirs / ours if ours and theirs else None
