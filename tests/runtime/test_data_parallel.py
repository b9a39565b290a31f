"""Data parallelism: replicas in their own processes behind one front with the Engine's interface; routing by
load and prefix affinity; a replica that dies fails only its own requests and comes back."""

import os
import signal
import time

import pytest

from llmopt.core.errors import ConfigError, RequestsFailed
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.loader import load_runtime_model
from llmopt.runtime.fronts.create import create_engine
from llmopt.runtime.fronts.data_parallel import AFFINITY_SLACK_TOKENS, DataParallelEngine
from llmopt.runtime.fronts.replica import PrefixMemory, Replica, block_hashes

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(n)]


# --- routing (no processes) --------------------------------------------------------------------------------------
def test_block_hashes_chain_full_blocks_only():
    a, b = block_hashes(list(range(40)), 16), block_hashes(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2 and a == b  # the partial third block is not hashed
    assert block_hashes([5] + list(range(1, 32)), 16)[1] != a[1]  # a different first block changes the chain


def test_prefix_memory_matches_leading_blocks_and_forgets_the_oldest():
    memory = PrefixMemory(capacity=3)
    memory.add([1, 2, 3])
    assert memory.match([1, 2, 9]) == 2 and memory.match([9, 1]) == 0
    memory.add([4])
    assert memory.match([1]) == 0 and memory.match([2, 3, 4]) == 3


def _front(loads: list[int]) -> DataParallelEngine:
    front = DataParallelEngine.__new__(DataParallelEngine)
    front.config = EngineConfig()
    front.replicas = [Replica(i, [i], connection=object(), ready=True, outstanding=load) for i, load in
                      enumerate(loads)]
    return front


def test_routing_takes_the_least_loaded_replica_or_a_close_one_holding_the_prefix():
    prompt = list(range(64))
    front = _front([500, 100])
    assert front._route(prompt).index == 1  # nobody holds it: the least loaded
    front = _front([100 + AFFINITY_SLACK_TOKENS, 100])
    front.replicas[0].prefixes.add(block_hashes(prompt, 16))
    assert front._route(prompt).index == 0  # holds the prefix, within the slack
    front = _front([101 + AFFINITY_SLACK_TOKENS, 100])
    front.replicas[0].prefixes.add(block_hashes(prompt, 16))
    assert front._route(prompt).index == 1  # too loaded: the prefix is not worth the wait


def test_an_engine_is_one_replica():
    with pytest.raises(ConfigError, match="serve and bench"):
        Engine(None, None, EngineConfig(data_parallel_size=2))


# --- replicas ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def front(tiny_llama_dir):
    engine = create_engine(str(tiny_llama_dir), EngineConfig(data_parallel_size=2, max_num_seqs=8))
    yield engine
    engine.close()
    assert all(r.process.exitcode is not None for r in engine.replicas)  # no replica left behind


def test_two_replicas_complete_every_request_with_the_tokens_of_one_engine(front, tiny_llama_dir):
    model, tokenizer, _ = load_runtime_model(str(tiny_llama_dir))
    expected = [o.token_ids for o in Engine(model, tokenizer).generate(prompts(12), PARAMS)]
    ids_before = front._next_id
    got = front.generate(prompts(12), PARAMS)
    assert [o.token_ids for o in got] == expected
    assert {o.request_id for o in got} == set(range(ids_before, ids_before + 12))
    assert front.stats().num_finished >= 12
    assert front.kv_cache_info()["replicas"] == 2 and front.numerics()["data_parallel_size"] == 2


def test_a_repeated_prefix_goes_to_the_replica_that_cached_it(front):
    shared = [(3 * j) % 200 + 1 for j in range(64)]
    front.reset_stats(clear_prefix_cache=True)
    # long enough to be still running when the next request is routed (with 10 tokens the replica could finish it
    # before the front had read its first output, leaving both replicas idle and the tie to replica 0)
    first = front.add_request(shared + [5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
    where = front._requests[first][0]
    while not front.step():  # its prompt is cached once its first token is out
        pass
    assert first in front._requests, "the first request finished before the next was routed"
    other = front.add_request([9] * 30, PARAMS)  # the other replica is now the less loaded...
    assert front._requests[other][0] != where
    again = front.add_request(shared + [7, 8, 9], PARAMS)  # ...but this prompt's prefix is cached on `where`
    assert front._requests[again][0] == where
    while front.has_unfinished():
        front.step()
    assert front.stats().prefix_cache_hits >= 64 - 16  # the whole blocks of the shared prefix


def test_a_killed_replica_fails_only_its_requests_and_comes_back(front):
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    ids = [front.add_request(p, long) for p in prompts(4)]
    victim = front.replicas[1]
    theirs = {i for i in ids if front._requests[i][0] == 1}
    assert theirs and theirs != set(ids)
    front.step()
    os.kill(victim.process.pid, signal.SIGKILL)
    finished, failed = set(), set()
    deadline = time.monotonic() + 120
    while front.has_unfinished() and time.monotonic() < deadline:
        try:
            finished |= {o.request_id for o in front.step() if o.finished}
        except RequestsFailed as e:
            failed |= set(e.errors)
            assert all("replica 1" in str(err) for err in e.errors.values())
    assert failed == theirs and finished == set(ids) - theirs
    while not victim.ready and time.monotonic() < deadline:  # restarted
        front._receive(0.2)
    assert victim.ready and victim.restarts == 1
    assert front.generate([[1, 2, 3]] * 4, PARAMS)  # both replicas serve again


def test_served_with_two_replicas_over_the_openai_api(tiny_llama_dir):
    import openai

    from llmopt.serve.launch import in_thread, start_server

    model, tokenizer, _ = load_runtime_model(str(tiny_llama_dir))
    expected = Engine(model, tokenizer).generate([tokenizer("def f(x):")["input_ids"]], PARAMS)[0].text
    _, server = start_server(str(tiny_llama_dir), EngineConfig(data_parallel_size=2), "float32",
                             served_model_name="tiny")
    with in_thread(server) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        texts = [client.completions.create(model="tiny", prompt="def f(x):", max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for _ in range(3)]
        assert client.models.list().data[0].id == "tiny"
    server.engine.engine.close()
    assert texts == [expected] * 3


def test_bench_reads_the_replicas_counters(tiny_llama_dir):
    """`llmopt bench --data-parallel-size 2` on a shared-prefix workload: the replicas' steps and prefix-cache
    hits reach the metrics (read before the replicas stop)."""
    from llmopt.eval.bench import BenchConfig, WorkloadSpec, bench_runtime

    spec = WorkloadSpec(dataset="prefix-repetition", num_requests=16, input_len=8, output_len=4, prefix_len=64,
                        num_prefixes=2)
    # (64 tokens a step: a prompt's prefix is cached before the next one with it is admitted)
    config = BenchConfig(engine=EngineConfig(data_parallel_size=2, max_num_batched_tokens=64))
    result = bench_runtime("dp", str(tiny_llama_dir), spec, config)
    assert result.metrics["num_steps"] > 0 and result.metrics["prefix_cache_hit_rate"] > 0.5
    assert result.config["numerics"]["data_parallel_size"] == 2
