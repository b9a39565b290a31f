"""Serving metrics on a synthetic trace whose answers are computed by hand."""

import math

import pytest

from llmopt.core.errors import ConfigError
from llmopt.eval.metrics import HardwarePeaks, ModelCost, RequestRecord, engine_metrics, parse_slo, request_metrics
from llmopt.eval.workloads import WorkloadSpec, build_workload
from llmopt.runtime.engine.stats import StepStats

# Request A arrives at 0, tokens at 0.1, 0.15, 0.25: TTFT 100 ms, E2EL 250 ms, TPOT (250-100)/2 = 75 ms,
# ITLs 50 and 100 ms. Request B arrives at 0.2, one token at 0.5: TTFT 300 ms, E2EL 300 ms, no TPOT.
TRACE = [RequestRecord(0.0, [0.1, 0.15, 0.25], num_prompt_tokens=10, num_output_tokens=3),
         RequestRecord(0.2, [0.5], num_prompt_tokens=6, num_output_tokens=1)]


def test_request_metrics_by_hand():
    m = request_metrics(TRACE, {"ttft": 200, "tpot": 80})
    assert m["duration"] == pytest.approx(0.5)
    assert m["request_throughput"] == pytest.approx(2 / 0.5)
    assert m["output_throughput"] == pytest.approx(4 / 0.5)
    assert m["total_token_throughput"] == pytest.approx(20 / 0.5)
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["p90_ttft_ms"] == pytest.approx(100 + 0.9 * 200)  # linear interpolation between 100 and 300
    assert m["mean_tpot_ms"] == pytest.approx(75) and m["p99_tpot_ms"] == pytest.approx(75)
    assert m["mean_itl_ms"] == pytest.approx(75) and m["median_itl_ms"] == pytest.approx(75)
    assert m["mean_e2el_ms"] == pytest.approx((250 + 300) / 2)
    # only A meets ttft <= 200 (B's TTFT is 300 ms); B has no TPOT, which never fails an SLO
    assert m["request_goodput"] == pytest.approx(1 / 0.5) and m["output_goodput"] == pytest.approx(3 / 0.5)
    assert request_metrics(TRACE, {"ttft": 400})["request_goodput"] == pytest.approx(4.0)
    assert request_metrics(TRACE)["request_goodput"] is None


def test_added_ttft_against_the_servers_own_is_reported_only_when_every_request_has_it():
    from dataclasses import replace

    assert "median_added_ttft_ms" not in request_metrics(TRACE)  # a server that sends no Server-Timing
    timed = [replace(TRACE[0], server_ttft=0.097), replace(TRACE[1], server_ttft=0.292)]  # added 3 and 8 ms
    m = request_metrics(timed)
    assert m["mean_added_ttft_ms"] == pytest.approx(5.5) and m["median_added_ttft_ms"] == pytest.approx(5.5)
    assert m["p99_added_ttft_ms"] == pytest.approx(3 + 0.99 * 5)
    assert "mean_added_ttft_ms" not in request_metrics([timed[0], TRACE[1]])


def test_engine_metrics_by_hand():
    steps = [StepStats(0.2, 2, 100, 0, 100, 3000, 0.1),  # prefill step
             StepStats(0.01, 2, 0, 2, 110, 110, 0.2),  # decode-only steps
             StepStats(0.03, 2, 0, 2, 112, 112, 0.3)]
    cost = ModelCost(weight_bytes=1000, linear_params=50, kv_bytes_per_token=10, attention_flops_per_context_token=4)
    peaks = HardwarePeaks(bandwidth=1e6, flops=1e5, source="given")
    m = engine_metrics(steps, cost, peaks, num_preemptions=1, prefix_hit_rate=0.5, duration=0.25)
    assert m["prefill_throughput"] == pytest.approx(100 / 0.2)
    assert m["decode_throughput"] == pytest.approx(4 / 0.04)
    assert m["mbu"] == pytest.approx((1000 + 1100 + 1000 + 1120) / 0.04 / 1e6)
    flops = 2 * 50 * 104 + 4 * (3000 + 110 + 112)
    assert m["mfu"] == pytest.approx(flops / 0.25 / 1e5)
    # an lm_head of 20 of the 50 parameters: computed for the 4 decode rows only, not the 100 prompt tokens
    with_head = engine_metrics(steps, ModelCost(1000, 50, 10, 4, head_params=20), peaks, 1, 0.5, 0.25)
    assert with_head["mfu"] == pytest.approx((2 * 30 * 104 + 2 * 20 * 4 + 4 * (3000 + 110 + 112)) / 0.25 / 1e5)
    # a utilization above 1 means the peak is wrong: withheld, with the reason
    fast = engine_metrics(steps, cost, HardwarePeaks(bandwidth=1e3, flops=1e2, source="given"), 1, 0.5, 0.25)
    assert fast["mbu"] is None and fast["mfu"] is None
    assert [e.split(" would be")[0] for e in fast["peak_errors"]] == ["MBU", "MFU"]
    assert m["mean_batch_size"] == 2 and m["max_kv_cache_usage"] == 0.3 and m["num_preemptions"] == 1


@pytest.mark.parametrize("text,message", [("ttft", "KEY=MS"), ("latency=3", "KEY=MS"), ("ttft=abc", "not a number"),
                                          ("tpot=-1", "> 0")])
def test_bad_slo(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_slo(text)
    assert parse_slo("ttft=200, tpot=50") == {"ttft": 200.0, "tpot": 50.0}


class _Tok:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 200 for c in text]}


def test_workloads(tmp_path):
    spec = WorkloadSpec("random", num_requests=50, input_len=20, output_len=10, range_ratio=0.5, request_rate=4.0)
    requests = build_workload(spec, _Tok(), 300)
    assert len(requests) == 50
    assert all(10 <= len(r.prompt_token_ids) <= 30 and 5 <= r.max_tokens <= 15 for r in requests)
    gaps = [b.arrival_offset - a.arrival_offset for a, b in zip(requests, requests[1:])]
    assert all(g > 0 for g in gaps) and 0.1 < sum(gaps) / len(gaps) < 0.5  # Poisson at 4/s: mean gap 0.25 s
    assert [r.prompt_token_ids for r in build_workload(spec, _Tok(), 300)] == [r.prompt_token_ids for r in requests]
    prefix = build_workload(WorkloadSpec("prefix-repetition", num_requests=8, input_len=5, prefix_len=12,
                                         num_prefixes=2), _Tok(), 300)
    heads = {tuple(r.prompt_token_ids[:12]) for r in prefix}
    assert len(heads) == 2 and all(len(r.prompt_token_ids) == 17 for r in prefix)
    assert all(r.arrival_offset == 0 for r in prefix)  # rate inf: all at once
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text('[{"id": "a", "conversations": [{"from": "human", "value": "hello there, how are you"}]}]')
    [one] = build_workload(WorkloadSpec("sharegpt", num_requests=1, dataset_path=str(sharegpt)), _Tok(), 300)
    assert one.prompt_token_ids == _Tok()("hello there, how are you")["input_ids"]
    with pytest.raises(ConfigError, match="only 1 usable"):
        build_workload(WorkloadSpec("sharegpt", num_requests=2, dataset_path=str(sharegpt)), _Tok(), 300)
    for bad in (dict(request_rate=0), dict(num_requests=0), dict(dataset="nope"), dict(range_ratio=1.0)):
        with pytest.raises(ConfigError):
            WorkloadSpec(**bad)
    assert math.isinf(WorkloadSpec().request_rate)
