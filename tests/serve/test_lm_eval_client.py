"""lm-evaluation-harness's own OpenAI-compatible client (`local-completions`) against the server, unchanged:
log-likelihood requests (echo + logprobs) score as a plain forward does, generation requests stop at `until`.
Strict request validation must never refuse what it sends."""

import pytest
import torch

from tests.serve.test_server import MODEL, Running


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    running = Running()
    folder = tmp_path_factory.mktemp("tokenizer")
    running.tokenizer.save_pretrained(folder)
    yield running, folder
    running.close()


def harness_model(running, folder, **options):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(model=MODEL, base_url=running.url + "/v1/completions", tokenizer=str(folder),
                               tokenizer_backend="huggingface", max_retries=1, max_length=1024, **options)


def test_loglikelihood_through_lm_eval_matches_a_plain_forward(served):
    from lm_eval.api.instance import Instance

    from llmopt.core.tiny import build_tiny_model

    running, folder = served
    lm = harness_model(running, folder, batch_size=2)
    pairs = [("def main():", " return 1"), ("import os", "\nimport sys"), ("x = 1", " + 2")]
    requests = [Instance("loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    scores = lm.loglikelihood(requests)
    model, tokenizer = build_tiny_model("llama", seed=0)
    for (context, continuation), (logprob, _) in zip(pairs, scores):
        # lm-eval's own encoding: the context's and the continuation's tokens, scored after the context
        whole = lm.tok_encode(context + continuation)
        ctx = lm.tok_encode(context)
        with torch.no_grad():
            logits = torch.log_softmax(model(input_ids=torch.tensor([whole])).logits[0].float(), dim=-1)
        expected = sum(float(logits[p - 1, whole[p]]) for p in range(len(ctx), len(whole)))
        assert logprob == pytest.approx(expected, abs=1e-3)


def test_generate_until_through_lm_eval(served):
    from lm_eval.api.instance import Instance

    running, folder = served
    lm = harness_model(running, folder)
    requests = [Instance("generate_until", doc={}, arguments=("def main():", {"until": ["\n\n"], "max_gen_toks": 8,
                                                                               "do_sample": False}), idx=0)]
    [text] = lm.generate_until(requests)
    assert isinstance(text, str) and "\n\n" not in text
