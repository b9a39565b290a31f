"""Request validation before the engine: every bad body is a 4xx naming its field, nothing reaches the engine,
the engine goes on (/health 200). Each case here was a 500 with torch's text, or silently ignored, before."""

import json

import httpx
import openai
import pytest

from tests.serve.test_server import MODEL, Running


@pytest.fixture(scope="module")
def srv():
    running = Running()
    yield running
    running.close()


def post(srv, body, endpoint="completions"):
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    # (ASCII JSON: a lone surrogate travels as its escape, as a client's JSON encoder sends it)
    return httpx.post(srv.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=120)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


@pytest.mark.parametrize("endpoint, extra, param", [
    # a misspelt field is refused, as OpenAI's API refuses it (it was ignored: max_tokens stayed 16)
    ("completions", {"max_token": 5}, "max_token"),
    ("chat", {"max_token": 5}, "max_token"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "contnet": "x"}]}, "messages.0.contnet"),
    ("completions", {"stream": True, "stream_options": {"include_usage": True, "usage": 1}}, "stream_options.usage"),
    # usage in every chunk (vLLM's) is not implemented: it was accepted and reported once, at the end
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    # token ids outside the vocabulary (they were a 500: "index out of range in self")
    ("completions", {"prompt": [1, 2, 10 ** 6]}, "prompt"),
    ("completions", {"prompt": [-1, 2]}, "prompt"),
    ("completions", {"prompt": [[1, 2], [3, 10 ** 6]]}, "prompt[1]"),
    ("completions", {"stop_token_ids": [10 ** 6]}, "stop_token_ids"),
    # seeds beyond 64 bits (a 500: "Overflow when unpacking long long")
    ("completions", {"seed": 2 ** 64}, "seed"),
    ("completions", {"seed": -(2 ** 63) - 1}, "seed"),
    ("chat", {"seed": 2 ** 70}, "seed"),
    # top_logprobs without logprobs (ignored before)
    ("chat", {"top_logprobs": 3}, "top_logprobs"),
    # known fields at values the server does not implement
    ("completions", {"repetition_penalty": 1.3}, "repetition_penalty"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {"min_tokens": 2}, "min_tokens"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"suffix": "}"}, "suffix"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ("completions", {"top_k": -2}, "top_k"),
    # JSON's true / false are not token ids 1 / 0, nor counts (they were accepted as [1, 0])
    ("completions", {"prompt": [True, False]}, "prompt"),
    ("completions", {"max_tokens": True}, "max_tokens"),
    ("completions", {"stop_token_ids": [True]}, "stop_token_ids"),
    # a lone UTF-16 surrogate is no character: no tokenizer encodes it (a 500 with the tokenizer's text before)
    ("completions", {"prompt": "hi \ud800 there"}, "prompt"),
    ("completions", {"prompt": ["fine", "\udfff"]}, "prompt.1"),
    ("chat", {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages.0.content"),
    ("completions", {"stop": ["\ud800"]}, "stop.0"),
])
def test_bad_fields_get_400_naming_them(srv, endpoint, extra, param):
    served = srv.engine.stats().num_finished
    response = post(srv, {**(COMPLETION if endpoint == "completions" else CHAT), **extra}, endpoint)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param.split(".")[0].split("[")[0] in error["message"] or param == "messages", error
    assert srv.engine.stats().num_finished == served  # nothing reached the engine
    assert httpx.get(srv.url + "/health").status_code == 200


def test_a_body_nested_beyond_any_request_gets_400(srv):
    """100,000 levels of arrays: the JSON parser's depth limit is a 400 naming the problem, not a 500."""
    deep = '{"model": "%s", "max_tokens": 3, "prompt": %s%s}' % (MODEL, "[" * 100_000, "]" * 100_000)
    response = httpx.post(srv.url + "/v1/completions", content=deep, timeout=120,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert "too deeply nested" in response.json()["error"]["message"]
    assert httpx.get(srv.url + "/health").status_code == 200


@pytest.mark.parametrize("endpoint, extra", [
    # what vLLM clients and lm-evaluation-harness send at values that change nothing stay accepted
    ("completions", {"repetition_penalty": 1.0, "min_tokens": 0, "top_k": -1, "min_p": 0.0, "logit_bias": {},
                     "skip_special_tokens": True, "spaces_between_special_tokens": True, "user": "me",
                     "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "use_beam_search": False,
                     "include_stop_str_in_output": False, "priority": 0, "add_special_tokens": True}),
    ("chat", {"repetition_penalty": 1, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
              "user": "me", "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True,
              "stream_options": None, "add_generation_prompt": True, "chat_template_kwargs": {}}),
])
def test_extension_fields_at_their_neutral_values_are_accepted(srv, endpoint, extra):
    response = post(srv, {**(COMPLETION if endpoint == "completions" else CHAT), **extra, "temperature": 0},
                    endpoint)
    assert response.status_code == 200, response.text


def test_64_bit_seeds_work_and_repeat(srv):
    # the largest seeds torch takes, with n > 1 (seed + index stays within 64 bits)
    for seed in (2 ** 64 - 1, -(2 ** 63)):
        response = post(srv, {**COMPLETION, "seed": seed, "n": 2, "temperature": 1.0})
        assert response.status_code == 200, response.text
        again = post(srv, {**COMPLETION, "seed": seed, "n": 2, "temperature": 1.0})
        assert [c["text"] for c in again.json()["choices"]] == [c["text"] for c in response.json()["choices"]]


def test_stop_token_ids_end_the_output(srv):
    from tests.serve.test_server import offline_engine_output

    body = {**COMPLETION, "prompt": "abc", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    out = offline_engine_output(srv.tokenizer("abc", add_special_tokens=True)["input_ids"], 10, ignore_eos=True)
    stop_at = out.token_ids[3]
    first = out.token_ids.index(stop_at)
    stopped = post(srv, {**body, "stop_token_ids": [stop_at]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == srv.tokenizer.decode(out.token_ids[:first + 1], skip_special_tokens=True)


def test_an_unknown_model_is_404_as_openai_answers(srv):
    response = post(srv, {**COMPLETION, "model": "gpt-5"})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and MODEL in error["message"]
    with pytest.raises(openai.NotFoundError):
        srv.client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
    assert post(srv, {k: v for k, v in COMPLETION.items() if k != "model"}).status_code == 200  # optional


def test_a_body_that_is_not_an_object_is_400(srv):
    response = httpx.post(srv.url + "/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"]


def test_bodies_over_the_limit_get_413_before_parsing():
    running = Running(max_body_bytes=1000)
    try:
        big = {**COMPLETION, "prompt": "x " * 2000}
        response = httpx.post(running.url + "/v1/completions", json=big, timeout=60)
        assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large", response.text
        assert "--max-body-bytes" in response.json()["error"]["message"]

        def chunks():  # no Content-Length: counted while it arrives
            yield b'{"prompt": "'
            for _ in range(50):
                yield b"x" * 100
            yield b'"}'

        streamed = httpx.post(running.url + "/v1/completions", content=chunks(), timeout=60,
                              headers={"content-type": "application/json"})
        assert streamed.status_code == 413, streamed.text
        assert post(running, COMPLETION).status_code == 200
        assert httpx.get(running.url + "/health").status_code == 200
    finally:
        running.close()
