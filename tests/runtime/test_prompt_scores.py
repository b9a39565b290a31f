"""Prompt-scoring requests (prompt_logprobs; lm-eval's loglikelihood) reuse the prefix cache: a request whose
prompt starts with an already-scored prefix prefills only the rest, and its scores equal a cold engine's."""

import pytest
import torch

from llmopt.core.tiny import build_tiny_model
from llmopt.runtime.engine.engine import Engine, EngineConfig
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.prompt_scores import PromptScoreCache, block_keys
from tests.runtime.test_engine import prompts


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("llama", seed=0)


def scored(engine, prompt, top=1):
    out = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=top))[0]
    return out, out.prompt_logprobs


def assert_same_scores(a, b, tol=1e-5):
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys()
        assert max(abs(x[t] - y[t]) for t in x) < tol


@pytest.mark.parametrize("chunk", [2048, 5], ids=["one-shot", "chunked"])
def test_scoring_requests_share_a_scored_context(tiny, chunk):
    model, tok = tiny
    context = prompts(1, seed=3)[0] * 2  # 2 x its length: several blocks of 4
    choices = [[7, 8, 9], [10, 11], [12, 13, 14, 15, 16]]
    cold = [scored(Engine(model, tok, EngineConfig(block_size=4, enable_prefix_cache=False)), context + c)[1]
            for c in choices]
    engine = Engine(model, tok, EngineConfig(block_size=4, max_num_batched_tokens=chunk))
    outputs = [scored(engine, context + c) for c in choices]
    for (out, scores), want in zip(outputs, cold):
        assert_same_scores(scores, want)
    assert outputs[0][0].num_cached_tokens == 0
    full_blocks = len(context) // 4
    assert all(out.num_cached_tokens == full_blocks * 4 for out, _ in outputs[1:])
    assert engine.stats().prefix_cache_hits > 0


def test_a_different_top_n_or_a_plain_request_does_not_take_scores_it_lacks(tiny):
    model, tok = tiny
    context = prompts(1, seed=4)[0] * 2
    engine = Engine(model, tok, EngineConfig(block_size=4))
    engine.generate([context + [1]], SamplingParams(max_tokens=2))  # KV cached, but never scored
    out, _ = scored(engine, context + [2], top=1)
    assert out.num_cached_tokens == 0  # no kept scores: the whole prompt is computed
    out, _ = scored(engine, context + [3], top=2)
    assert out.num_cached_tokens == 0  # scores kept with top 1 only
    out, scores = scored(engine, context + [4], top=2)
    assert out.num_cached_tokens > 0
    cold = scored(Engine(model, tok, EngineConfig(block_size=4, enable_prefix_cache=False)), context + [4], 2)[1]
    assert_same_scores(scores, cold)


def test_score_cache_keys_chain_every_token_and_forget_the_oldest():
    assert block_keys([1, 2, 3, 4], 2, 2)[0] == block_keys([1, 2, 9, 9], 2, 2)[0]
    assert block_keys([1, 2, 3, 4], 2, 2)[1] != block_keys([0, 2, 3, 4], 2, 2)[1]  # same block, other prefix
    cache = PromptScoreCache(block_size=2, max_blocks=2)
    state = cache.start(0, [5, 6, 7, 8, 9, 10])
    hidden = {b: torch.full((3,), float(b)) for b in range(3)}
    cache.record(state, [{6: -1.0}, {7: -2.0}, {8: -3.0}, {9: -4.0}, {10: -5.0}], hidden, top_n=0)
    assert state.stored == 3 and len(cache.blocks) == 2  # the first block was dropped
    assert cache.available([5, 6, 7, 8, 9, 10], 3, 0) == 0  # leading blocks only
    cache.release(0)
    assert not cache.sequences


def test_scoring_requests_preempted_and_recomputed_give_the_same_scores(tiny):
    """A cache too small for all at once: scoring requests are preempted mid-prompt and recomputed (their kept
    scores and hidden states started afresh), some from a cached prefix; every score equals a cold engine's."""
    model, tok = tiny
    context = prompts(1, seed=5)[0] * 2
    ps = [context + [i, i + 1] * 6 for i in range(6)] + [prompts(1, seed=6)[0] * 3 for _ in range(2)]
    params = SamplingParams(max_tokens=8, prompt_logprobs=1, ignore_eos=True)
    cold = [Engine(model, tok, EngineConfig(block_size=2, enable_prefix_cache=False)).generate([p], params)[0]
            for p in ps]
    per_token = Engine(model, tok, EngineConfig(block_size=2)).runner.kv_cache_spec.bytes_per_token
    longest = max(len(p) for p in ps) + params.max_tokens
    engine = Engine(model, tok, EngineConfig(block_size=2, kv_cache_bytes=(longest + 4) * per_token,
                                             max_num_batched_tokens=16))
    outputs = engine.generate(ps, params)
    assert engine.stats().num_preemptions > 0 and engine.stats().prefix_cache_hits > 0
    for out, want in zip(outputs, cold):
        assert out.token_ids == want.token_ids
        assert_same_scores(out.prompt_logprobs, want.prompt_logprobs)
