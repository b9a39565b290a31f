"""Prompt lookup, the adaptive draft length, the speculative config's parsing, Medusa heads' file."""

import pytest
import torch

from llmopt.core.errors import ConfigError
from llmopt.core.medusa import MedusaHeads
from llmopt.runtime.engine.config import SpeculativeConfig
from llmopt.runtime.spec_decode.adaptive import AdaptiveSpeculation
from llmopt.runtime.spec_decode.ngram import prompt_lookup


def test_prompt_lookup_copies_what_followed_the_longest_suffix():
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] (n = 3) occurred at 0: followed by 4, 5, 9
    assert prompt_lookup(tokens, 1, 3, 3) == [4, 5, 9]
    # with n <= 2 the latest earlier [2, 3] (at 7) wins: followed by 7, 8
    assert prompt_lookup(tokens, 1, 2, 2) == [7, 8]
    assert prompt_lookup([1, 2, 3], 1, 3, 4) == []  # nothing repeats
    assert prompt_lookup([5, 6, 5], 1, 3, 4) == [6, 5]  # stops at the end of the sequence
    assert prompt_lookup([5, 6, 5], 2, 3, 4) == []  # no 2-gram repeats


def test_adaptive_speculates_at_batch_one_and_stops_when_tokens_cost_as_much_as_steps():
    memory_bound = AdaptiveSpeculation()
    for tokens, seconds in [(1, 0.020), (6, 0.0205), (1, 0.0201), (6, 0.0204)]:
        memory_bound.record_step(tokens, seconds)
    memory_bound.record_verification(0, 5, 2)
    assert memory_bound.num_tokens(0, 5, batch_size=1) >= 3

    compute_bound = AdaptiveSpeculation()
    for tokens, seconds in [(64, 0.40), (128, 0.80), (96, 0.60), (320, 2.0)]:  # ~6 ms per token, nothing fixed
        compute_bound.record_step(tokens, seconds)
    for _ in range(5):
        compute_bound.record_verification(1, 4, 1)  # acceptance ~0.2
    assert compute_bound.num_tokens(1, 4, batch_size=64) == 0
    for _ in range(20):
        compute_bound.record_verification(2, 4, 4)  # a sequence copying its prompt: every draft accepted
    assert compute_bound.num_tokens(2, 4, batch_size=64) == 0  # still no gain when a token costs a step's share

    assert AdaptiveSpeculation(enabled=False).num_tokens(3, 4, 64) == 4


def test_adaptive_counts_the_proposers_time():
    model = AdaptiveSpeculation()
    for tokens, seconds in [(1, 0.020), (4, 0.0202), (1, 0.020), (4, 0.0201)]:
        model.record_step(tokens, seconds)
    model.record_verification(0, 3, 1)
    assert model.num_tokens(0, 3, 1) > 0
    model.record_proposal(3, 3 * 0.05)  # a draft model that costs 50 ms a token: never worth it
    assert model.num_tokens(0, 3, 1) == 0


@pytest.mark.parametrize("text, method, model", [("ngram", "ngram", None), ("draft:/m/x", "draft", "/m/x"),
                                                 ("medusa", "medusa", None), ("medusa:/h", "medusa", "/h")])
def test_speculative_parse(text, method, model):
    config = SpeculativeConfig.parse(text, num_speculative_tokens=3)
    assert (config.method, config.model, config.num_speculative_tokens) == (method, model, 3)


@pytest.mark.parametrize("text", ["eagle", "draft", "ngram:x", ""])
def test_speculative_parse_refuses_bad_forms(text):
    with pytest.raises(ConfigError):
        SpeculativeConfig.parse(text)


def test_medusa_heads_save_and_load_bit_identically(tmp_path):
    heads = MedusaHeads(3, 16)
    for p in heads.parameters():
        p.data = torch.randn(p.shape)
    heads.save(tmp_path / "h.safetensors")
    loaded = MedusaHeads.load(tmp_path / "h.safetensors")
    assert loaded.num_heads == 3 and loaded.hidden_size == 16
    for a, b in zip(heads.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    x = torch.randn(5, 16)
    assert torch.equal(heads(x), loaded(x)) and heads(x, 2).shape == (2, 5, 16)


def test_medusa_heads_refuse_other_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ConfigError, match="not an llmopt Medusa heads file"):
        MedusaHeads.load(tmp_path / "x.safetensors")
    with pytest.raises(ConfigError, match="no Medusa heads"):
        MedusaHeads.load(tmp_path / "missing.safetensors")


def test_a_new_sequence_starts_from_the_acceptance_seen_so_far():
    model = AdaptiveSpeculation()
    assert model.acceptance(0) == 0.5
    for seq_id in range(1, 30):
        model.record_verification(seq_id, 4, 0)  # a proposer that is never right
    assert model.acceptance(100) < 0.1
