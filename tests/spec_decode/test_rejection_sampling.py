"""Rejection sampling keeps the target's distribution exactly: chi-square tests of the first emitted token over
20,000 trials, for a random draft distribution and for deterministic drafts, at temperature 1 and 0.7 with
top-p; and through the engine, speculative and plain sampling give the same joint distribution of two tokens."""

import math
from collections import Counter

import pytest
import torch

from llmopt.runtime.engine.config import EngineConfig, SpeculativeConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.sampler import probabilities
from llmopt.runtime.executor.verify import accept_greedy, rejection_sample

TRIALS = 20_000


def chi2_critical(df: int, p: float = 0.001) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at 1 - p (z = 3.0902 for p = 0.001)."""
    z = {0.001: 3.0902}[p]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_statistic(counts: Counter, probs: torch.Tensor, n: int) -> tuple[float, int]:
    expected = probs * n
    cells = [i for i in range(len(probs)) if expected[i] > 0]
    assert all(counts[i] == 0 for i in range(len(probs)) if expected[i] == 0), "a token of zero probability"
    stat = sum((counts[i] - float(expected[i])) ** 2 / float(expected[i]) for i in cells)
    return stat, len(cells) - 1


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-draft", "fixed-draft"])
def test_first_token_follows_the_target_distribution(temperature, top_p, deterministic):
    vocab, k = 8, 3
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    target = probabilities(torch.randn(k + 1, vocab, generator=g) * 1.5, params)  # [k + 1, vocab]
    draft = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, dim=-1)
    counts, accepted = Counter(), 0
    for _ in range(TRIALS):
        if deterministic:
            drafts = [int(target[0].argmax()), 5, 1]  # e.g. prompt lookup: q is one-hot
            n, token = rejection_sample(target, drafts, None, g)
        else:
            drafts = [int(torch.multinomial(draft[j], 1, generator=g)) for j in range(k)]
            n, token = rejection_sample(target, drafts, draft, g)
        counts[drafts[0] if n > 0 else token] += 1
        accepted += n > 0
    stat, df = chi2_statistic(counts, target[0], TRIALS)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} over {df} df"
    assert 0 < accepted < TRIALS  # both branches ran


def test_a_draft_the_target_never_picks_is_always_rejected():
    target = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    for _ in range(50):
        assert rejection_sample(target, [0], None) == (0, 1)


def test_greedy_acceptance_is_the_longest_agreeing_prefix():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == 3
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == 1
    assert accept_greedy([1, 2], [3]) == 0


def _two_token_histogram(engine, prompt, n):
    # the second token is the one verified (a third follows it: speculating a request's last token gains nothing)
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, detokenize=False)
    outs = engine.generate([prompt] * n, params)
    return Counter(tuple(o.token_ids[:2]) for o in outs)


def test_engine_sampling_with_speculation_has_the_target_distribution():
    """A tiny model with an 8-token vocabulary: prompt lookup proposes the second token after the first; the
    (first, second) pairs of 6,000 speculative and 6,000 plain requests pass a two-sample chi-square test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                         bos_token_id=0, eos_token_id=0)).eval()
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6, 7] + [i % 8 for i in range(8)]
    # all 8 tokens occur in the prompt followed by something: every first token gets a draft
    spec_engine = Engine(model, None, EngineConfig(block_size=4, max_num_seqs=256, speculative=SpeculativeConfig(
        "ngram", num_speculative_tokens=1, ngram_min=1, ngram_max=1, adaptive=False)))
    plain_engine = Engine(model, None, EngineConfig(block_size=4, max_num_seqs=256))
    n = 6000
    spec, plain = _two_token_histogram(spec_engine, prompt, n), _two_token_histogram(plain_engine, prompt, n)
    assert spec_engine.stats().spec_decode.num_verifications == n
    cells = [c for c in set(spec) | set(plain) if spec[c] + plain[c] >= 10]
    stat = sum((spec[c] - plain[c]) ** 2 / (spec[c] + plain[c]) for c in cells)
    assert stat < chi2_critical(len(cells) - 1), f"chi2 {stat:.1f} over {len(cells) - 1} df"
