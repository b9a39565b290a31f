"""Serving metrics with the definitions (and result keys) of `vllm bench serve`, plus llmopt's own.

Per request (times in seconds from the start of the run):
  TTFT = first token - arrival; E2EL = last token - arrival;
  TPOT = (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token;
  ITL  = every gap between consecutive tokens of a request (all requests pooled);
  added TTFT = TTFT - the server's own time to first token, where the server reports it (a `Server-Timing: ttft;
  dur=MS` header, as `llmopt serve` sends on streams): the time the network and both HTTP stacks added.
Throughputs divide by the run's duration (first arrival to last token). Goodput counts the requests that
meet every given SLO (ms). Percentiles are numpy's linear interpolation, as vLLM's.

Engine-side (`StepStats` per engine step): prefill throughput = prompt tokens computed / time of the steps
that computed any; decode throughput = tokens of decode-only steps / their time; MBU and MFU over
decode-only steps (MBU) and the whole run (MFU).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from llmopt.core.errors import ConfigError
from llmopt.runtime.engine.stats import StepStats

PERCENTILES = (("mean", None), ("median", 50), ("p90", 90), ("p99", 99))
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    arrival: float
    token_times: list[float]  # when each output token became available
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    server_ttft: float | None = None  # the server's own time to first token (its Server-Timing header), if sent

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class HardwarePeaks:
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s
    source: str  # where each came from ("given", "measured ...", "theoretical ...")


@dataclass
class ModelCost:
    weight_bytes: int  # bytes of weights read per forward, as stored (packed int4 counts as such)
    linear_params: int  # parameters in matmuls (for 2 * params FLOPs per token)
    kv_bytes_per_token: int
    attention_flops_per_context_token: int  # per query token, per cached token: 4 * layers * heads * head_dim
    head_params: int = 0  # of linear_params, the lm_head's: computed only for the rows that are sampled


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=200,tpot=50' -> {'ttft': 200.0, 'tpot': 50.0} (milliseconds)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ConfigError(f"--slo {text!r}: expected KEY=MS pairs with KEY one of {', '.join(SLO_KEYS)}, "
                              "e.g. ttft=200,tpot=50")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ConfigError(f"--slo {text!r}: {value!r} is not a number of milliseconds") from None
        if slo[key] <= 0:
            raise ConfigError(f"--slo {text!r}: {key} must be > 0 ms")
    return slo


def _stats(prefix: str, values_s: list[float], into: dict) -> None:
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    for name, q in PERCENTILES:
        key = f"{name}_{prefix}_ms"
        if arr.size == 0:
            into[key] = 0.0
        else:
            into[key] = float(arr.mean()) if q is None else float(np.percentile(arr, q))


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2el}
    return all(values[k] is None or values[k] * 1000.0 <= limit for k, limit in slo.items())


def request_metrics(records: list[RequestRecord], slo: dict[str, float] | None = None) -> dict:
    if not records:
        raise ConfigError("no request completed: nothing to measure")
    start = min(r.arrival for r in records)
    duration = max(r.token_times[-1] for r in records) - start
    total_in = sum(r.num_prompt_tokens for r in records)
    total_out = sum(r.num_output_tokens for r in records)
    good = [r for r in records if meets_slo(r, slo or {})]
    metrics = {
        "completed": len(records),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(records) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "request_goodput": len(good) / duration if slo else None,
        "output_goodput": sum(r.num_output_tokens for r in good) / duration if slo else None,
    }
    _stats("ttft", [r.ttft for r in records], metrics)
    _stats("tpot", [r.tpot for r in records if r.tpot is not None], metrics)
    _stats("itl", [gap for r in records for gap in r.itls], metrics)
    _stats("e2el", [r.e2el for r in records], metrics)
    if all(r.server_ttft is not None for r in records):  # what the network and both HTTP stacks added to TTFT
        _stats("added_ttft", [r.ttft - r.server_ttft for r in records], metrics)
    return metrics


def engine_metrics(steps: list[StepStats], cost: ModelCost | None, peaks: HardwarePeaks | None,
                   num_preemptions: int, prefix_hit_rate: float, duration: float) -> dict:
    prefill_steps = [s for s in steps if s.num_prefill_tokens]
    decode_steps = [s for s in steps if not s.num_prefill_tokens and s.num_decode_tokens]
    prefill_time = sum(s.duration for s in prefill_steps)
    decode_time = sum(s.duration for s in decode_steps)
    metrics = {
        "prefill_throughput": sum(s.num_prefill_tokens for s in prefill_steps) / prefill_time if prefill_time else 0.0,
        "decode_throughput": sum(s.num_decode_tokens for s in decode_steps) / decode_time if decode_time else 0.0,
        "num_preemptions": num_preemptions,
        "prefix_cache_hit_rate": prefix_hit_rate,
        "num_steps": len(steps),
        "mean_batch_size": float(np.mean([s.num_seqs for s in steps])) if steps else 0.0,
        "max_batch_size": max((s.num_seqs for s in steps), default=0),
        "mean_kv_cache_usage": float(np.mean([s.kv_usage for s in steps])) if steps else 0.0,
        "max_kv_cache_usage": max((s.kv_usage for s in steps), default=0.0),
        "mbu": None, "mfu": None, "peaks_source": None, "peak_errors": [],
    }
    if cost is not None and peaks is not None and steps:
        if decode_steps:
            moved = sum(cost.weight_bytes + s.num_context_tokens * cost.kv_bytes_per_token for s in decode_steps)
            metrics["mbu"] = _utilization("MBU", moved / decode_time, peaks.bandwidth, metrics["peak_errors"])
        # the lm_head runs on sampled rows only: every decode row (a prompt's last chunk samples one more row
        # per request, left out: the MFU errs low)
        body = cost.linear_params - cost.head_params
        flops = sum(2 * body * (s.num_prefill_tokens + s.num_decode_tokens) + 2 * cost.head_params * s.num_decode_tokens
                    + cost.attention_flops_per_context_token * s.num_attention_pairs for s in steps)
        if duration:
            metrics["mfu"] = _utilization("MFU", flops / duration, peaks.flops, metrics["peak_errors"])
        metrics["peaks_source"] = peaks.source
    return metrics


def _utilization(name: str, achieved: float, peak: float, errors: list[str]) -> float | None:
    """achieved / peak, which can never exceed 1: a larger ratio means the peak is wrong (a clock or bandwidth
    below the real one, or weights served from cache), so the figure is withheld and the error recorded."""
    ratio = achieved / peak
    if ratio > 1.0:
        errors.append(f"{name} would be {ratio:.2f}: the achieved {achieved:.3g}/s exceeds the peak {peak:.3g}/s, "
                      "so that peak is wrong for this run")
        return None
    return ratio


def records_to_json(records: list[RequestRecord]) -> list[dict]:
    out = []
    for r in records:
        item = asdict(r)
        item.update(ttft=r.ttft, tpot=r.tpot, e2el=r.e2el)
        out.append(item)
    return out


@dataclass
class RunResult:
    name: str
    model: str
    config: dict
    metrics: dict
    records: list[RequestRecord] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"name": self.name, "model": self.model, "config": self.config, "metrics": self.metrics,
                "batch_sizes": self.batch_sizes, "requests": records_to_json(self.records)}
