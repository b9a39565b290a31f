import math

import pytest
import torch

from llmopt.core.errors import ConfigError
from llmopt.eval.perplexity import perplexity, windows_of


def plain_loop_ppl(model, ids, seqlen):
    """The textbook transformers loop: labels=input_ids, HF's own loss, per window."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, ids.numel() - seqlen + 1, seqlen):
            window = ids[start:start + seqlen].unsqueeze(0)
            loss = model(input_ids=window, labels=window).loss
            total += loss.item() * (seqlen - 1)
            count += seqlen - 1
    return math.exp(total / count), count


def test_matches_plain_transformers_loop_and_batch_size_does_not_matter():
    from llmopt.core.tiny import build_tiny_model

    model, _ = build_tiny_model("llama")
    ids = torch.randint(0, 256, (1000,), generator=torch.Generator().manual_seed(0))
    expected, count = plain_loop_ppl(model, ids, 64)
    for batch_size in (1, 3, 16):
        result = perplexity(model, ids, seqlen=64, batch_size=batch_size)
        assert result.num_tokens == count == 15 * 63
        assert result.num_windows == 15
        assert result.ppl == pytest.approx(expected, rel=1e-5)


def test_windows_and_bad_settings():
    ids = torch.arange(10)
    assert windows_of(ids, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ConfigError, match="at least 2"):
        windows_of(ids, 1)
    with pytest.raises(ConfigError, match="fewer than one window"):
        windows_of(ids, 11)
