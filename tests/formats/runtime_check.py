"""The check every low-precision artifact's tests share: the runtime, on the linear methods it should choose, gives
the log-probabilities of llmopt's dequantized reader (the reference every kernel answers to)."""

from __future__ import annotations

import pytest
import torch


def assert_runtime_matches_reader(artifact, methods: set[str], prompt: list[int], max_tokens: int) -> None:
    from llmopt.formats.read import load_artifact_model
    from llmopt.runtime.engine.config import EngineConfig
    from llmopt.runtime.engine.engine import Engine
    from llmopt.runtime.engine.sampling import SamplingParams
    from llmopt.runtime.executor.loader import load_runtime_model

    model, tokenizer, _ = load_runtime_model(str(artifact), dtype="float32")
    engine = Engine(model, tokenizer, EngineConfig(block_size=4))
    assert set(engine.numerics()["linear_methods"]) == methods
    [out] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0))
    reference = load_artifact_model(artifact, dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(input_ids=torch.tensor([prompt + out.token_ids])).logits[0], -1)
    expected = [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    assert [entry[t] for entry, t in zip(out.logprobs, out.token_ids)] == pytest.approx(expected, abs=1e-4)
