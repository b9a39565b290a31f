"""The server outlives its failures: an engine loop that dies is restarted (requests in flight fail, later ones are
served, /health stays 200); a restart that fails stops the server instead of leaving a zombie; a graceful
shutdown lets streams finish or ends them with a final SSE error event within the timeout; a body being parsed
never stalls the event loop."""

import json
import logging
import threading
import time

import httpx
import pytest

from llmopt.runtime.engine.config import EngineConfig
from tests.serve.test_server import MODEL, Running
from tests.waits import wait_until

BODY = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


class Fatal(BaseException):
    """Not an Exception: escapes every per-request guard, as a bug in the loop itself would."""


def test_a_dead_engine_loop_is_restarted_and_the_server_goes_on(caplog):
    running = Running()
    engine = running.engine
    try:
        step = engine.step
        calls = {"n": 0}

        def dies_once():
            calls["n"] += 1
            if calls["n"] == 3:
                raise Fatal("the loop itself broke")
            return step()

        engine.step = dies_once
        with caplog.at_level(logging.CRITICAL, logger="llmopt.serve.async_engine"):
            lost = httpx.post(running.url + "/v1/completions", json={**BODY, "max_tokens": 50}, timeout=120)
        assert lost.status_code == 503, lost.text
        assert "restarted" in lost.json()["error"]["message"] and "Fatal" in lost.json()["error"]["message"]
        assert running.server.engine.restarts == 1
        assert any("engine loop died" in r.getMessage() for r in caplog.records)
        assert httpx.get(running.url + "/health").status_code == 200
        served = httpx.post(running.url + "/v1/completions", json=BODY, timeout=120)
        assert served.status_code == 200 and served.json()["choices"][0]["finish_reason"] == "length", served.text
        assert engine.num_live_requests == 0 and not engine.block_manager.usage
    finally:
        running.close()


def test_a_restart_that_fails_stops_the_server_rather_than_leaving_a_zombie():
    from llmopt.cli.serve import exit_if_engine_failed

    running = Running()
    engine = running.engine
    try:
        def broken():
            raise Fatal("broken for good")

        engine.step = broken
        engine.reset = broken
        failed = httpx.post(running.url + "/v1/completions", json=BODY, timeout=120)
        assert failed.status_code == 503, failed.text
        wait_until(lambda: running.server.engine.failed is not None, 60, "the engine marked failed")
        assert httpx.get(running.url + "/health").status_code == 503
        refused = httpx.post(running.url + "/v1/completions", json=BODY, timeout=60)
        assert refused.status_code == 503 and "exiting" in refused.json()["error"]["message"], refused.text

        class Http:
            should_exit = False

        http = Http()
        exit_if_engine_failed(http, running.server, poll_s=0.01)  # what `llmopt serve` runs beside uvicorn
        assert http.should_exit
    finally:
        running.close()


def slow_steps(engine, seconds: float) -> None:
    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()

    engine.step = slow


def sse_events(response) -> list:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_graceful_shutdown_finishes_short_streams_and_ends_long_ones_with_an_error_event():
    from llmopt.serve.launch import begin_shutdown

    holder = {}
    running = Running(config=EngineConfig(block_size=4), shutdown_timeout=2.0, on_http=lambda h: holder.update(h=h))
    slow_steps(running.engine, 0.02)  # ~50 tokens/s: 400 tokens outlast the 2 s timeout, 10 do not
    results = {}

    def stream(name, max_tokens):
        with httpx.stream("POST", running.url + "/v1/completions", timeout=120,
                          json={**BODY, "max_tokens": max_tokens, "stream": True}) as response:
            results[name] = (response.status_code, sse_events(response))

    try:
        threads = [threading.Thread(target=stream, args=(n, m)) for n, m in (("short", 10), ("long", 400))]
        for t in threads:
            t.start()
        wait_until(lambda: running.engine.num_running == 2, 60, "both streams running")
        begin_shutdown(holder["h"], running.server, 2.0)  # what SIGTERM / Ctrl-C run in `llmopt serve`
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    finally:
        running.close()
    status, events = results["short"]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    status, events = results["long"]
    assert status == 200 and events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_shutting_down" and "shutdown timeout" in error["message"]
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert 0 < len(texts) < 400  # cut short, after having streamed


def test_requests_during_a_shutdown_get_503():
    running = Running()
    try:
        running.server.engine.drain(30.0)
        response = httpx.post(running.url + "/v1/completions", json=BODY, timeout=60)
        assert response.status_code == 503 and response.json()["error"]["type"] == "server_shutting_down"
        assert httpx.get(running.url + "/health").status_code == 503
    finally:
        running.close()


def test_a_body_being_parsed_never_stalls_the_event_loop():
    """Parsing, validation and tokenization of a body larger than INLINE_PARSE_BYTES run in a worker thread: /health
    answers while one is held."""
    from llmopt.serve.app import INLINE_PARSE_BYTES

    large = json.dumps(BODY) + " " * INLINE_PARSE_BYTES  # (JSON's whitespace: the same request, a larger body)
    running = Running()
    server = running.server
    held, release = threading.Event(), threading.Event()
    parse = server.completion_jobs

    def slow_parse(body):
        held.set()
        release.wait(120)
        return parse(body)

    server.completion_jobs = slow_parse
    try:
        result = {}
        thread = threading.Thread(target=lambda: result.update(
            r=httpx.post(running.url + "/v1/completions", content=large, timeout=120,
                         headers={"content-type": "application/json"})))
        thread.start()
        assert held.wait(60), "the request never reached parsing"
        assert httpx.get(running.url + "/health", timeout=30).status_code == 200  # while the parse is held
        assert not result
        release.set()
        thread.join(60)
        assert result["r"].status_code == 200
    finally:
        release.set()
        running.close()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_large_body_within_the_limit_is_refused_for_its_length_not_stalled(endpoint):
    """A multi-megabyte prompt: a 400 naming the prompt (beyond the context, known from its length without
    tokenizing it), /health answering meanwhile."""
    running = Running()
    try:
        text = "word " * 600_000  # 3 MB
        body = ({"model": MODEL, "prompt": text} if endpoint == "completions" else
                {"model": MODEL, "messages": [{"role": "user", "content": text}]})
        path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
        result = {}
        thread = threading.Thread(target=lambda: result.update(r=httpx.post(running.url + path, json=body,
                                                                               timeout=300)))
        thread.start()
        health = [httpx.get(running.url + "/health", timeout=30).status_code for _ in range(3)]
        thread.join(300)
        assert health == [200, 200, 200]
        param = "prompt" if endpoint == "completions" else "messages"
        assert result["r"].status_code == 400 and result["r"].json()["error"]["param"] == param, result["r"].text
        assert "characters" in result["r"].json()["error"]["message"]  # refused by length, not tokenized
    finally:
        running.close()
