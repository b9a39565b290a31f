"""With every proposer, greedy speculative decoding emits the non-speculative greedy tokens, whatever the
batching: several sequences at once, chunked prefill, preemption, prefix-cache hits, one sequence at a time."""

import pytest
import torch

from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams

from tests.spec_decode.conftest import PROPOSERS, speculative

GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


def prompts(n=8, seed=0):
    """Random prompts, each repeated so that prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = torch.randint(0, 250, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        out.append(p * 3)
    return out


CONFIGS = {
    "batched": dict(block_size=4, kv_cache_bytes=2**20),
    "chunked": dict(block_size=4, kv_cache_bytes=2**20, max_num_batched_tokens=7),
    "serial": dict(block_size=4, kv_cache_bytes=2**20, max_num_seqs=1),
    "preempt": dict(block_size=2, kv_cache_bytes=60 * 2 * 2 * 2 * 2 * 16 * 4),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_output_equals_non_speculative(tiny, spec_files, proposer, config):
    model, tok = tiny
    ps = prompts(seed=1)
    reference = [o.token_ids for o in Engine(model, tok, EngineConfig(**CONFIGS[config])).generate(ps, GREEDY)]
    engine = Engine(model, tok, EngineConfig(**CONFIGS[config], speculative=speculative(proposer, spec_files)))
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == reference
    stats = engine.stats().spec_decode
    assert stats.num_draft_tokens > 0  # it did speculate
    if proposer == "draft-same":
        assert stats.acceptance_rate > 0.95  # an identical draft: only rounding across batch shapes differs
    if config == "preempt":
        assert engine.stats().num_preemptions > 0
    assert engine.block_manager.usage == 0  # every block back (free or cached)


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_prefix_cache_hits_give_the_same_tokens(tiny, spec_files, proposer):
    model, tok = tiny
    shared = prompts(1, seed=2)[0] * 2
    ps = [shared + [i] for i in range(4)]
    cold = [Engine(model, tok, EngineConfig(block_size=4, enable_prefix_cache=False)).generate([p], GREEDY)[0]
            .token_ids for p in ps]
    engine = Engine(model, tok, EngineConfig(block_size=4, max_num_seqs=1,
                                             speculative=speculative(proposer, spec_files)))
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == cold
    assert engine.stats().prefix_cache_hits > 0


def test_stop_tokens_and_max_tokens_cut_accepted_drafts(tiny, spec_files):
    """A draft run that passes max_tokens or an EOS stops where plain decoding would."""
    model, tok = tiny
    ps = prompts(4, seed=3)
    plain = Engine(model, tok, EngineConfig(block_size=4))
    spec = Engine(model, tok, EngineConfig(block_size=4, speculative=speculative("draft-same", spec_files)))
    for max_tokens in (1, 2, 5, 13):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        assert [o.token_ids for o in spec.generate(ps, params)] == [o.token_ids for o in plain.generate(ps, params)]
    reference = plain.generate(ps, SamplingParams(max_tokens=30, ignore_eos=True))
    stop = reference[0].token_ids[6]  # a token the first request emits mid-run
    params = SamplingParams(max_tokens=30, stop_token_ids=(stop,))
    got, want = spec.generate(ps, params), plain.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert got[0].token_ids[-1] == stop


def test_requests_with_logprobs_do_not_speculate_and_still_match(tiny, spec_files):
    model, tok = tiny
    ps = prompts(2, seed=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    plain = Engine(model, tok, EngineConfig(block_size=4)).generate(ps, params)
    engine = Engine(model, tok, EngineConfig(block_size=4, speculative=speculative("draft-same", spec_files)))
    got = engine.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert [len(o.logprobs) for o in got] == [12, 12]
    assert engine.stats().spec_decode.num_draft_tokens == 0


def test_finished_outputs_count_their_drafts(tiny, spec_files):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4, speculative=speculative("draft-same", spec_files)))
    [out] = engine.generate(prompts(1), SamplingParams(max_tokens=20, ignore_eos=True))
    assert out.num_draft_tokens == out.num_accepted_tokens > 0 and out.num_verifications > 0
    stats = engine.stats().spec_decode
    assert stats.mean_accepted_length == 1 + stats.num_accepted_tokens / stats.num_verifications


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("how", ["speculation (16 drafts)", "a batch of 8"])
def test_in_bf16_outputs_part_only_at_near_ties_of_the_exact_model(tiny_llama_dir, how):
    """In bf16 a step's rows go through kernels chosen by the step's row count (one-row GEMV and decode attention
    for a lone decode; batched GEMMs and the prefill attention for a verification's k + 1 rows or a batch), which
    add in another order: logits differ by bf16 rounding, and greedy output may part where two tokens are that
    close (docs/guides/serve.md, "Speculative decoding"). Where it parts, the two tokens must be the fp32 model's top two, within
    NEAR_TIE nats of each other: the same distribution, not a wrong token. (fp32 stays identical: the test above.)"""
    from llmopt.runtime.engine.config import SpeculativeConfig
    from llmopt.runtime.executor.loader import load_for_engine

    near_tie = 0.02  # nats: bf16 keeps 8 bits of mantissa, logits here are ~4 in size (2^-8 x 4 = 0.016)

    def engine(dtype, **settings):
        config = EngineConfig(**settings)
        model, tok, _ = load_for_engine(str(tiny_llama_dir), config, dtype=dtype)
        return Engine(model, tok, config), tok

    plain, tok = engine("bfloat16")
    prompt = tok("The cat sat on the mat. The cat sat on the mat. The")["input_ids"]
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    alone = plain.generate([prompt], params)[0].token_ids
    if how.startswith("speculation"):
        other, _ = engine("bfloat16", speculative=SpeculativeConfig("ngram", num_speculative_tokens=16,
                                                                     adaptive=False))
        got = other.generate([prompt], params)[0].token_ids
        assert other.stats().spec_decode.num_accepted_tokens > 0
    else:
        got = plain.generate([prompt] + [tok(f"Number {i} is")["input_ids"] for i in range(7)], params)[0].token_ids
    parted = first_difference(alone, got)
    if parted is None:
        return  # (identical: nothing to check)
    exact, _ = engine("float32")
    top = exact.generate([prompt + alone[:parted]], SamplingParams(max_tokens=1, logprobs=2))[0].logprobs[0]
    assert set(top) == {alone[parted], got[parted]}, (parted, top)
    assert abs(top[alone[parted]] - top[got[parted]]) < near_tie, (parted, top)
