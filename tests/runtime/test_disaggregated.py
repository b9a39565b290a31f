"""Prefill/decode disaggregation: the KV hand-over between two engines (exact), and P:D workers in their own
processes behind one front: the tokens of one engine, prefix-cache hits on the prefill side, a killed decode worker
failing only its requests while the front stays up, and the OpenAI server on top."""

import math
import os
import signal
import time

import httpx
import pytest
import torch

from llmopt.core.errors import ConfigError, RequestsFailed
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.loader import load_runtime_model
from llmopt.runtime.fronts.disaggregated import kv_layout, read_payload, unpack_kv
from llmopt.runtime.fronts.handover import DecodeEngine, PrefillEngine
from llmopt.runtime.fronts.create import create_engine
from tests.waits import wait_until

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 250 + 1 for j in range(5 + 9 * i)] for i in range(n)]


# --- the hand-over between two engines (one process) -----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    model, tokenizer, _ = load_runtime_model(str(tiny_llama_dir))
    return model, tokenizer


def prefill_then_decode(tiny, kv_dtype: str, prompt: list[int], params: SamplingParams):
    """Engine A computes the prompt and its first token, engine B takes its KV and decodes the rest; returns
    (B's output, A's handed-over blocks, A's engine)."""
    model, tokenizer = tiny
    config = EngineConfig(block_size=4, kv_cache_bytes=1 << 20, kv_cache_dtype=kv_dtype)
    prefill, decode = PrefillEngine(model, tokenizer, config), DecodeEngine(model, tokenizer, config)
    captured = {}
    layout = kv_layout(decode.runner)
    num_blocks = math.ceil(len(prompt) / 4)

    def capture(seq):  # through the wire format: one flat payload
        captured["payload"] = read_payload(prefill.runner, seq.block_table[:num_blocks], layout)

    prefill.on_prefilled = capture
    first = prefill.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    kv = unpack_kv(captured["payload"], layout, num_blocks)
    decode.add_prefilled(prompt, first.token_ids[0], params, kv)
    outputs = list(decode.stream())
    assert outputs[0].new_token_ids[0] == first.token_ids[0]  # the first output reports the first token
    return outputs[-1], kv, prefill


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_handed_over_kv_continues_as_one_engine_would(tiny, kv_dtype):
    model, tokenizer = tiny
    prompt = prompts(4)[3]
    config = EngineConfig(block_size=4, kv_cache_bytes=1 << 20, kv_cache_dtype=kv_dtype)
    colocated = Engine(model, tokenizer, config)
    expected = colocated.generate([prompt], PARAMS)[0]
    got, _, _ = prefill_then_decode(tiny, kv_dtype, prompt, PARAMS)
    assert got.token_ids == expected.token_ids and got.text == expected.text and got.finish_reason == "length"


def test_the_transferred_kv_is_what_the_decode_side_would_compute(tiny):
    """fp32: the blocks handed over equal, bit for bit, the blocks an engine that computes the prompt itself holds."""
    model, tokenizer = tiny
    prompt = prompts(5)[4]
    _, handed, _ = prefill_then_decode(tiny, "float32", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    own = PrefillEngine(model, tokenizer, EngineConfig(block_size=4, kv_cache_bytes=1 << 20, enable_prefix_cache=False))
    seq_blocks = {}
    own.on_prefilled = lambda seq: seq_blocks.setdefault("ids", list(seq.block_table))
    own.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    computed = own.runner.read_kv_blocks(seq_blocks["ids"][:len(handed[0])])
    rows = len(prompt)  # the last block's slots past the prompt hold nothing meaningful
    for a, b in zip(handed, computed, strict=True):
        assert torch.equal(a.flatten(0, 1)[:rows], b.flatten(0, 1)[:rows])


def test_a_handed_over_request_waits_for_blocks_and_can_be_aborted(tiny):
    model, tokenizer = tiny
    prompt = prompts(3)[2]
    prefill = PrefillEngine(model, tokenizer, EngineConfig(block_size=4, kv_cache_bytes=1 << 20))
    kv = {}
    prefill.on_prefilled = lambda seq: kv.setdefault("kv", prefill.runner.read_kv_blocks(seq.block_table[:6]))
    first = prefill.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0].token_ids[0]
    decode = DecodeEngine(model, tokenizer, EngineConfig(block_size=4, kv_cache_bytes=1 << 20, max_num_seqs=1))
    busy = decode.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    decode.step()
    waiting = decode.add_prefilled(prompt, first, PARAMS, kv["kv"])
    outputs = decode.step()  # the sequence cap holds it back
    assert [o.request_id for o in outputs] == [busy] and decode.num_running == 1
    assert decode.abort(waiting)
    finished = {o.request_id: o for o in decode.stream() if o.finished}
    assert finished[waiting].finish_reason == "abort" and finished[busy].finish_reason == "length"


def test_disaggregation_options_are_checked():
    with pytest.raises(ConfigError, match="prefill:decode"):
        EngineConfig(disaggregate="2")
    with pytest.raises(ConfigError, match="data-parallel-size"):
        EngineConfig(disaggregate="1:1", data_parallel_size=2)
    assert EngineConfig(disaggregate="2:3").disaggregation == (2, 3)


# --- workers in their own processes --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def front(tiny_llama_dir):
    engine = create_engine(str(tiny_llama_dir), EngineConfig(disaggregate="1:1", max_num_seqs=8))
    yield engine
    engine.close()
    assert all(r.process.exitcode is not None for r in engine.replicas)  # no worker left behind


def test_prefill_and_decode_workers_give_the_tokens_of_one_engine(front, tiny):
    model, tokenizer = tiny
    expected = Engine(model, tokenizer).generate(prompts(6), PARAMS)
    one_token = SamplingParams(max_tokens=1, ignore_eos=True)  # ends on the prefill worker: no hand-over
    front.reset_stats()
    got = front.generate(prompts(6) + [[5, 6, 7]], [PARAMS] * 6 + [one_token])
    assert [o.token_ids for o in got[:6]] == [o.token_ids for o in expected]
    assert [o.text for o in got[:6]] == [o.text for o in expected]
    assert len(got[6].token_ids) == 1 and got[6].finish_reason == "length"
    stats = front.stats()
    assert stats.num_finished == 7 and stats.finish_reasons == {"length": 7}
    assert front.numerics()["disaggregate"] == "1:1" and "1 prefill + 1 decode" in front.kv_cache_info()["summary"]


def test_prefix_cache_hits_on_the_prefill_side_skip_prefill(front):
    shared = [(3 * j) % 200 + 1 for j in range(64)]
    front.reset_stats(clear_prefix_cache=True)
    first = front.generate([shared + [5, 6]], PARAMS)[0]
    again = front.generate([shared + [7, 8, 9]], PARAMS)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64  # the whole blocks of the shared prefix
    assert front.stats().prefix_cache_hits == 64


def test_a_killed_decode_worker_fails_its_requests_and_the_front_stays_up(front):
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    ids = [front.add_request(p, long) for p in prompts(3)]
    decode = front.replicas[1]
    seen = set()
    deadline = time.monotonic() + 120
    while len(seen) < 3 and time.monotonic() < deadline:  # every request is decoding
        seen |= {o.request_id for o in front.step()}
    os.kill(decode.process.pid, signal.SIGKILL)
    failed = {}
    while front.has_unfinished() and time.monotonic() < deadline:
        try:
            assert not any(o.finished for o in front.step())
        except RequestsFailed as e:
            failed.update(e.errors)
    assert set(failed) == set(ids)
    assert all("decode worker 0" in str(err) and "died" in str(err) for err in failed.values())
    while not decode.ready and time.monotonic() < deadline:  # restarted, linked to the prefill worker again
        front._receive(0.2)
    assert decode.ready and decode.restarts == 1
    assert [len(o.token_ids) for o in front.generate(prompts(2), PARAMS)] == [12, 12]


def test_served_disaggregated_over_the_openai_api(tiny_llama_dir, tiny):
    import openai

    from llmopt.serve.launch import in_thread, start_server

    model, tokenizer = tiny
    expected = Engine(model, tokenizer).generate([tokenizer("def f(x):")["input_ids"]], PARAMS)[0].text
    _, server = start_server(str(tiny_llama_dir), EngineConfig(disaggregate="1:1"), "float32",
                             served_model_name="tiny")
    with in_thread(server) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        texts = [client.completions.create(model="tiny", prompt="def f(x):", max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for _ in range(2)]
        stream = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        # a worker killed while the server is idle: /health says so (503) while it starts again, requests get a
        # retryable 503 meanwhile (never a 500, never a server that says it is healthy and answers nothing), then
        # both are served again -- for either role
        health = url.removesuffix("/v1") + "/health"
        for worker in server.engine.engine.replicas:
            os.kill(worker.process.pid, signal.SIGKILL)
            wait_until(lambda: httpx.get(health).status_code == 503, 30, f"/health reporting {worker.role} down")
            down = httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            assert down.status_code == 503 and down.headers.get("retry-after") == "1", down.text
            assert f"no {worker.role} worker is running" in httpx.get(health).json()["status"]
            wait_until(lambda: httpx.get(health).status_code == 200, 120, f"the {worker.role} worker back")
            again = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].text
            assert again == expected
    server.engine.engine.close()
    assert texts == [expected] * 2 and streamed == expected


def test_a_role_whose_workers_all_died_for_good_stops_the_front():
    """Every worker of a role past its restarts: the front raises ParallelError (the server exits 1), and while one
    is starting again a retryable ReplicaFailed, each naming the role."""
    from llmopt.core.errors import ParallelError, ReplicaFailed
    from llmopt.runtime.fronts.data_parallel import MAX_RESTARTS
    from llmopt.runtime.fronts.replica import Replica
    from llmopt.runtime.fronts.disaggregated import DisaggregatedEngine

    front = DisaggregatedEngine.__new__(DisaggregatedEngine)
    front.replicas = [Replica(0, [0], role="prefill", ready=True, connection=object()),
                      Replica(1, [0], role="decode", restarts=1, connection=object())]
    front._lock, front._outputs = __import__("threading").RLock(), []
    with pytest.raises(ReplicaFailed, match="no decode worker is running: decode worker 0 is starting again"):
        front._ready(front._pool("decode"))
    assert "decode worker 0 is starting again" in front.unavailable()
    front.replicas[1].connection, front.replicas[1].restarts = None, MAX_RESTARTS
    with pytest.raises(ParallelError, match=f"every decode worker died more than {MAX_RESTARTS} times"):
        front._ready(front._pool("decode"))


def test_bench_runs_disaggregated(tiny_llama_dir):
    """`llmopt bench --disaggregate 1:1`: every request completes, the workers' steps reach the metrics."""
    from llmopt.eval.bench import BenchConfig, WorkloadSpec, bench_runtime

    spec = WorkloadSpec(num_requests=8, input_len=16, output_len=6)
    result = bench_runtime("pd", str(tiny_llama_dir), spec, BenchConfig(engine=EngineConfig(disaggregate="1:1")))
    assert result.metrics["completed"] == 8 and result.metrics["num_steps"] > 0
    assert result.config["numerics"]["disaggregate"] == "1:1"
