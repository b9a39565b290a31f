"""The runtime against transformers: same greedy tokens; outputs independent of batching, chunked
prefill, preemption and prefix-cache hits."""

import pytest
import torch

from llmopt.core.tiny import build_tiny_model
from llmopt.runtime.engine.engine import Engine, EngineConfig
from llmopt.eval.hf_baseline import hf_generate
from llmopt.runtime.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
EXACT = {"fast_path": False}  # the model's own modules: transformers' numerics, token for token


def prompts(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    return build_tiny_model(request.param, seed=0)


def token_ids(outputs):
    return [o.token_ids for o in outputs]


def run_all(engine, requests):
    """Add (prompt, params) requests, step to the end; the finished RequestOutput of each, in order."""
    ids = [engine.add_request(p, params) for p, params in requests]
    done = {o.request_id: o for o in engine.stream() if o.finished}
    return [done[i] for i in ids]


def hf_outputs(model, tok, ps, max_tokens):
    # one prompt at a time: no padding, so transformers' own numerics are the reference
    return [hf_generate(model, tok, [p], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0] for p in ps]


def test_greedy_matches_transformers(tiny):
    model, tok = tiny
    ps = prompts()
    expected = hf_outputs(model, tok, ps, GREEDY.max_tokens)
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20, **EXACT))
    assert token_ids(engine.generate(ps, GREEDY)) == expected


@pytest.mark.parametrize("config", [
    EngineConfig(block_size=4, kv_cache_bytes=2**20, max_num_batched_tokens=7),  # chunked prefill
    EngineConfig(block_size=4, kv_cache_bytes=2**20, max_num_seqs=1),  # one at a time
    EngineConfig(block_size=2, kv_cache_bytes=40 * 2 * 2 * 2 * 2 * 16 * 4),  # tiny cache: preemption
    EngineConfig(block_size=4, kv_cache_bytes=2**20, policy="static", max_num_seqs=3),
], ids=["chunked", "serial", "preempt", "static"])
def test_outputs_do_not_depend_on_scheduling(tiny, config):
    model, tok = tiny
    ps = prompts(seed=1)
    reference = token_ids(Engine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=2**20)).generate(ps, GREEDY))
    engine = Engine(model, tok, config)
    assert token_ids(engine.generate(ps, GREEDY)) == reference
    if config.block_size == 2:
        assert engine.stats().num_preemptions > 0


def test_prefix_cache_hit_gives_the_same_tokens(tiny):
    model, tok = tiny
    shared = prompts(1, seed=2)[0] * 2
    ps = [shared + [i] for i in range(4)]
    cold = [Engine(model, tok, EngineConfig(block_size=4, enable_prefix_cache=False)).generate([p], GREEDY)[0]
            .token_ids for p in ps]
    engine = Engine(model, tok, EngineConfig(block_size=4, max_num_seqs=1))
    assert token_ids(engine.generate(ps, GREEDY)) == cold
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and 0 < stats.prefix_cache_hit_rate < 1
    engine.reset_stats()
    assert engine.stats().prefix_cache_hits == 0 and engine.stats().steps == []


def test_sampling_is_seeded_and_bad_requests_do_not_stop_the_engine(tiny):
    model, tok = tiny
    from llmopt.core.errors import ConfigError

    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=2**18))
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = token_ids(engine.generate([[1, 2, 3]], params))
    b = token_ids(engine.generate([[1, 2, 3]], params))
    assert a == b
    with pytest.raises(ConfigError, match="context"):
        engine.add_request([1] * 1020, SamplingParams(max_tokens=10))
    with pytest.raises(ConfigError, match="tokens of KV cache"):
        engine.add_request([1] * 900, SamplingParams(max_tokens=100))
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert engine.generate([[5, 6]], GREEDY)[0].token_ids == hf_outputs(model, tok, [[5, 6]], GREEDY.max_tokens)[0]


def test_abort_frees_the_request(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4))
    keep = engine.add_request([1, 2, 3], GREEDY)
    drop = engine.add_request([4, 5, 6], GREEDY)
    engine.step()
    assert engine.abort(drop)
    finished = {o.request_id: o for o in engine.stream() if o.finished}
    assert finished[drop].finish_reason == "abort" and len(finished[drop].token_ids) == 1
    assert len(finished[keep].token_ids) == GREEDY.max_tokens and finished[keep].finish_reason == "length"
    assert engine.block_manager.usage == 0 and not engine.has_unfinished()


def test_stop_strings_end_the_text_before_the_match(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4))
    [whole] = engine.generate([[7, 8, 9]], GREEDY)
    full = whole.text
    assert full == tok.decode(whole.token_ids, skip_special_tokens=True) and len(full) >= 10
    stop = full[6:9]
    expected = full[: full.find(stop)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop, "never-seen"))
    engine.add_request([7, 8, 9], params)
    outputs = list(engine.stream())
    final = outputs[-1]
    assert final.finished and final.finish_reason == "stop" and len(final.token_ids) < GREEDY.max_tokens
    assert final.text == expected
    # streamed pieces add up to the final text and never show the stop string
    assert "".join(o.new_text for o in outputs) == expected
    assert all(stop not in o.new_text for o in outputs)
    with pytest.raises(Exception, match="stop string"):
        SamplingParams(stop=("",))


def test_logprobs_match_transformers(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4, **EXACT))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    outputs = list(run_all(engine, [(prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))]))
    seq = outputs[0]
    assert len(seq.logprobs) == 6
    with torch.no_grad():
        reference = torch.log_softmax(model(input_ids=torch.tensor([prompt + seq.token_ids])).logits[0].float(),
                                      dim=-1)
    for step, (token, entry) in enumerate(zip(seq.token_ids, seq.logprobs)):
        row = reference[len(prompt) - 1 + step]
        assert len(entry) == 3 and token in entry  # greedy: the chosen token is among the top 3
        top_ids = torch.topk(row, 3).indices.tolist()
        assert sorted(entry) == sorted(top_ids)
        for token_id, value in entry.items():
            assert abs(value - row[token_id].item()) < 1e-4
    with pytest.raises(Exception, match="logprobs"):
        SamplingParams(logprobs=21)


def test_fast_path_matches_the_exact_path(tiny):
    model, tok = tiny
    ps = prompts(seed=3)
    exact = token_ids(Engine(model, tok, EngineConfig(block_size=4, fast_path=False)).generate(ps, GREEDY))
    # fp32 with fused projections, fused RMSNorm, joint rotary and the compiled decode attention: same maths,
    # so the same tokens here
    assert token_ids(Engine(model, tok, EngineConfig(block_size=4, fast_path=True)).generate(ps, GREEDY)) == exact
    # bf16 (prepacked oneDNN weights where available) against bf16 through the model's own modules
    bf16 = build_tiny_model(model.config.model_type, seed=0)[0].to(torch.bfloat16)
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=5)
    runs = []
    for fast in (False, True):
        engine = Engine(bf16, tok, EngineConfig(block_size=4, fast_path=fast))
        finished = run_all(engine, [(p, params) for p in ps])
        runs.append([o.logprobs[0] for o in finished])  # the first step: same inputs for both
    for plain, fast in zip(*runs):
        # the plain path's top token among the fast path's top 5, and every token both list within 0.1: the order
        # of two tokens one bf16 step apart (0.016 at these magnitudes) may differ between the paths' roundings
        top = max(plain, key=plain.get)
        assert top in fast and abs(fast[top] - plain[top]) < 0.1
        for token in plain.keys() & fast.keys():
            assert abs(fast[token] - plain[token]) < 0.1


def test_fast_fp32_logprobs_stay_within_1e4_of_the_exact_mode(tiny):
    # every step's top-20 log-probabilities along the exact mode's greedy path: prefill, decodes at batch 8
    # (compiled attention over the paged cache) and at batch 1 (the lm_head as a matrix-vector kernel)
    model, tok = tiny
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=20)
    runs = []
    for fast in (False, True):
        engine = Engine(model, tok, EngineConfig(block_size=4, fast_path=fast))
        assert engine.runner.decoder.fast == fast
        finished = run_all(engine, [(p, params) for p in prompts(seed=5)])
        finished += run_all(engine, [(prompts(1, seed=6)[0], params)])  # alone: batch-1 steps
        runs.append(finished)
    for exact, fast in zip(*runs):
        assert fast.token_ids == exact.token_ids
        for want, got in zip(exact.logprobs, fast.logprobs):
            for token, value in want.items():
                if token in got:
                    assert abs(got[token] - value) <= 1e-4 * max(1.0, abs(value))
            assert len(set(want) & set(got)) >= 18  # the same top 20 but for near-ties at the edge


def test_finished_requests_are_released_so_memory_stays_flat(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4, max_num_seqs=4))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for wave in range(3):
        outputs = run_all(engine, [(p, params) for p in prompts(6, seed=10 + wave)])
        assert all(o.finished and len(o.token_ids) == 5 for o in outputs)
        # nothing of a finished request stays behind: engine, output processor, runner, blocks
        assert engine.num_live_requests == 0 and len(engine.outputs) == 0
        assert not engine.runner.has_request_state() and engine.block_manager.usage == 0
    assert engine.stats().num_finished == 18 and engine.stats().finish_reasons == {"length": 18}


def test_each_output_carries_only_the_new_tokens_and_their_times(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4))
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True), arrival_time=123.0)
    outputs = list(engine.stream())
    assert all(o.request_id == rid for o in outputs) and [o.finished for o in outputs] == [False] * 5 + [True]
    assert [t for o in outputs for t in o.new_token_ids] == outputs[-1].token_ids
    assert [t for o in outputs for t in o.new_token_times] == outputs[-1].token_times
    assert outputs[-1].arrival_time == 123.0 and outputs[-1].num_prompt_tokens == 3
    assert "".join(o.new_text for o in outputs) == outputs[-1].text


def test_incremental_detokenizer_matches_a_whole_decode_across_split_characters(tiny):
    from llmopt.runtime.engine.output import IncrementalDetokenizer

    _, tok = tiny  # a byte tokenizer: multi-byte characters arrive one byte (token) at a time
    text = "naïve café — 東京 🚀 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert "\ufffd" not in "".join(pieces)
    assert any(p == "" for p in pieces)  # held back while a character was incomplete


def test_prompt_logprobs_score_every_prompt_token_across_chunks_and_cached_prefixes(tiny):
    model, tok = tiny
    prompt = prompts(1, seed=7)[0] * 3  # long enough for several chunks and full blocks
    with torch.no_grad():
        reference = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
    engine = Engine(model, tok, EngineConfig(block_size=4, max_num_batched_tokens=7, **EXACT))
    engine.generate([prompt], SamplingParams(max_tokens=2))  # its blocks now sit in the prefix cache
    params = SamplingParams(max_tokens=2, prompt_logprobs=2)
    engine.add_request(prompt, params)
    outputs = list(engine.stream())
    assert outputs[0].prompt_logprobs is not None  # as soon as the prompt is scored...
    scored = outputs[-1].prompt_logprobs  # ...and with the whole output at the end
    assert scored == outputs[0].prompt_logprobs
    assert scored[0] is None and len(scored) == len(prompt)
    for p in range(1, len(prompt)):
        entry = scored[p]
        assert abs(entry[prompt[p]] - float(reference[p - 1, prompt[p]])) < 1e-4
        assert set(torch.topk(reference[p - 1], 2).indices.tolist()) <= set(entry)


def test_steps_record_no_autograd_graph(tiny):
    """The loaded model's parameters require grad; a step that recorded a graph would cost time and memory."""
    model, tok = tiny
    assert any(p.requires_grad for p in model.parameters())
    engine = Engine(model, tok, EngineConfig(max_num_seqs=4))
    seen = []
    hook = engine.runner.decoder.register_forward_hook(lambda mod, args, out: seen.append(out.requires_grad))
    try:
        engine.generate(prompts(2), SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2))
    finally:
        hook.remove()
    assert seen and not any(seen)
