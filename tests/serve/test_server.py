"""The OpenAI-compatible server over real HTTP, driven by the official `openai` client and httpx."""

import asyncio
import json
import socket

import httpx
import openai
import pytest

from llmopt.core.errors import ConfigError
from llmopt.core.tiny import build_tiny_model
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.serve.launch import in_thread, server_for
from tests.waits import limit, output_of, wait_exit, wait_until

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A server on a free loopback port in a background thread (serve.launch.in_thread)."""

    def __init__(self, shutdown_timeout: float = 30.0, on_http=None, **options):
        model, tokenizer = build_tiny_model("llama", seed=0)
        self.tokenizer = tokenizer
        self.server = server_for(model, tokenizer, MODEL, options.pop("config", EngineConfig(block_size=4)),
                                 **options)
        self._running = in_thread(self.server, shutdown_timeout=shutdown_timeout, on_http=on_http)
        base = self._running.__enter__()
        self.url = base.removesuffix("/v1")
        self.client = openai.OpenAI(base_url=base, api_key=options.get("api_key") or "none", max_retries=0)

    def close(self):
        self._running.__exit__(None, None, None)

    @property
    def engine(self) -> Engine:
        return self.server.engine.engine


@pytest.fixture(scope="module")
def srv():
    running = Running()
    yield running
    running.close()


def offline_engine_output(prompt_ids, max_tokens, **params):
    model, tokenizer = build_tiny_model("llama", seed=0)
    [out] = Engine(model, tokenizer, EngineConfig(block_size=4)).generate(
        [prompt_ids], SamplingParams(max_tokens=max_tokens, **params))
    return out


def offline_text(prompt_ids, max_tokens, **params):
    return offline_engine_output(prompt_ids, max_tokens, **params).text


def test_models_and_health(srv):
    assert [m.id for m in srv.client.models.list().data] == [MODEL]
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    # what the served numbers depend on: every numerics setting, as configured and as resolved at start
    facts = httpx.get(srv.url + "/v1/models").json()["data"][0]["llmopt"]
    numerics = facts["numerics"]
    assert set(EngineConfig().numerics()) <= set(numerics)
    assert numerics["attention_backend_resolved"] in ("cpu", "torch") and numerics["linear_methods"]["dense"] > 0
    assert facts["kv_cache"]["layout"] == "kv" and facts["kv_cache"]["bytes_per_token"] > 0


def test_greedy_completion_equals_the_offline_engine_and_streaming_adds_up(srv):
    prompt = "def main():"
    result = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    ids = srv.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    assert result.choices[0].text == offline_text(ids, 20)
    assert result.choices[0].finish_reason in ("length", "stop")
    assert result.usage.prompt_tokens == len(ids) and 0 < result.usage.completion_tokens <= 20
    chunks = list(srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                stream=True))
    assert "".join(c.choices[0].text for c in chunks) == result.choices[0].text
    assert chunks[-1].choices[0].finish_reason == result.choices[0].finish_reason


def test_a_stream_says_the_servers_time_to_first_token(srv):
    import time

    from llmopt.eval.http_bench import server_timing

    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 4, "stream": True}
    sent = time.perf_counter()
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as response:
        ttft = server_timing(response.headers["server-timing"], "ttft")
        lines = response.iter_lines()
        next(lines)
        seen = time.perf_counter() - sent
        assert ttft is not None and 0 < ttft <= seen
        assert sum(1 for line in lines if line.startswith("data: ")) >= 2  # the rest, then [DONE]
    plain = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, timeout=60)
    assert plain.status_code == 200 and "server-timing" not in plain.headers  # streams only


def test_prompts_as_lists_and_token_ids_with_n_choices(srv):
    for prompt in (["ab", "cd"], [[5, 6, 7], [8, 9]]):
        result = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.8, seed=3,
                                               n=2, extra_body={"ignore_eos": True})
        assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
        assert result.usage.completion_tokens == 20
        again = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.8, seed=3,
                                              n=2, extra_body={"ignore_eos": True})
        assert [c.text for c in again.choices] == [c.text for c in result.choices]  # seeded: reproducible
    single = srv.client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0)
    assert len(single.choices) == 1 and single.usage.prompt_tokens == 3


def test_chat_completion_streams_with_usage(srv):
    messages = [{"role": "user", "content": "Say something."}]
    whole = srv.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(srv.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_stop_strings_and_logprobs(srv):
    whole = srv.client.completions.create(model=MODEL, prompt="xyz", max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    assert len(whole) > 8
    stop = whole[4:7]
    cut = srv.client.completions.create(model=MODEL, prompt="xyz", max_tokens=24, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == whole[:whole.find(stop)] and cut.finish_reason == "stop"
    scored = srv.client.completions.create(model=MODEL, prompt="xyz", max_tokens=6, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True}).choices[0]
    assert len(scored.logprobs.token_logprobs) == 6 and all(v <= 0 for v in scored.logprobs.token_logprobs)
    # (keyed by token text, as the API defines: byte tokens of one incomplete character share a key)
    assert all(top and all(v <= 0 for v in top.values()) for top in scored.logprobs.top_logprobs)
    chat = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                              extra_body={"ignore_eos": True}).choices[0]
    assert len(chat.logprobs.content) == 4 and all(len(t.top_logprobs) == 3 for t in chat.logprobs.content)


def test_echo_scores_the_prompt_as_a_plain_forward_does(srv):
    """What lm-evaluation-harness's local-completions sends for log-likelihoods."""
    import torch

    text = "The quick brown fox jumps over the lazy dog."
    result = srv.client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=1,
                                           temperature=0)
    choice = result.choices[0]
    ids = srv.tokenizer(text, add_special_tokens=True)["input_ids"]
    assert choice.text == srv.tokenizer.decode(ids) and result.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(ids)
    model, _ = build_tiny_model("llama", seed=0)
    with torch.no_grad():
        reference = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [float(reference[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    # with generation too: prompt scores first, then the completion's
    both = srv.client.completions.create(model=MODEL, prompt=text, max_tokens=3, echo=True, logprobs=0,
                                         temperature=0, extra_body={"ignore_eos": True}).choices[0]
    assert len(both.logprobs.token_logprobs) == len(ids) + 3
    assert both.logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
    assert both.text.startswith(choice.text)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "temperature": 5}, "temperature"),
    ({"prompt": "a", "max_tokens": 5000}, "max_tokens"),
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "echo": True, "stream": True}, "echo"),
    ({"max_tokens": 4}, "prompt"),
])
def test_bad_requests_get_400_naming_the_field(srv, body, param):
    response = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.get(srv.url + "/health").status_code == 200


def test_malformed_json_gets_400(srv):
    response = httpx.post(srv.url + "/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_a_client_that_disconnects_frees_its_request(srv):
    aborted = srv.engine.stats().finish_reasons.get("abort", 0)
    with httpx.stream("POST", srv.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "abc", "max_tokens": 900, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    wait_until(lambda: not (srv.engine.num_live_requests or srv.engine.block_manager.usage), 120,
               "the aborted request's state freed")
    assert srv.engine.stats().finish_reasons.get("abort", 0) == aborted + 1


def test_concurrent_streaming_clients_all_complete(srv):
    async def one(client, i):
        text, finish = "", None
        async with client.stream("POST", srv.url + "/v1/completions",
                                 json={"model": MODEL, "prompt": f"request {i}", "max_tokens": 12,
                                       "temperature": 0, "stream": True, "ignore_eos": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        return finish

    async def all_of_them():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(all_of_them()) == ["length"] * 64


def test_metrics_parse_and_move(srv):
    from prometheus_client.parser import text_string_to_metric_families

    def samples():
        text = httpx.get(srv.url + "/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if not s.labels or s.name.startswith("llmopt:request_success")}

    before = samples()
    srv.client.completions.create(model=MODEL, prompt="count me", max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = samples()
    assert after["llmopt:generation_tokens_total"] - before.get("llmopt:generation_tokens_total", 0) == 3
    assert after["llmopt:e2e_request_latency_seconds_count"] > before.get("llmopt:e2e_request_latency_seconds_count", 0)
    assert "llmopt:kv_cache_usage_perc" in after and "llmopt:num_requests_running" in after


def test_api_key_and_overload():
    running = Running(api_key="sesame", max_waiting=2, config=EngineConfig(block_size=4, max_num_seqs=1))
    try:
        assert httpx.get(running.url + "/v1/models").status_code == 401
        assert httpx.get(running.url + "/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=running.url + "/v1", api_key="wrong", max_retries=0).models.list()

        async def flood():
            async with httpx.AsyncClient(timeout=120, headers={"Authorization": "Bearer sesame"}) as client:
                body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*(client.post(running.url + "/v1/completions", json=body)
                                              for _ in range(12)))

        codes = [r.status_code for r in asyncio.run(flood())]
        assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
        limited = next(r for r in asyncio.run(flood()) if r.status_code == 429)
        assert limited.headers["retry-after"] == "1"
        assert httpx.get(running.url + "/health").status_code == 200
        # one request of more sequences than the server ever holds (--max-num-seqs 1 running + --max-waiting 2
        # waiting): a 400 naming n, and the engine lives on (its siblings' cancelled admissions killed the engine
        # thread: /health 503 and 429s until a restart); n = 3 fits and is served
        auth = {"Authorization": "Bearer sesame"}
        too_many = httpx.post(running.url + "/v1/completions", headers=auth, timeout=60,
                              json={"model": MODEL, "prompt": "x", "max_tokens": 4, "n": 4})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n", too_many.text
        assert "--max-num-seqs 1" in too_many.json()["error"]["message"]
        assert "--max-waiting 2" in too_many.json()["error"]["message"]
        assert httpx.get(running.url + "/health").status_code == 200
        three = httpx.post(running.url + "/v1/completions", headers=auth, timeout=60,
                           json={"model": MODEL, "prompt": "x", "max_tokens": 4, "n": 3, "ignore_eos": True})
        assert three.status_code == 200 and len(three.json()["choices"]) == 3, three.text
    finally:
        running.close()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_over_http_measures_the_server(srv, tmp_path, endpoint):
    from typer.testing import CliRunner

    from llmopt.cli.main import app

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "tiny-random-llama", "--base-url", srv.url + "/v1", "--model", MODEL,
                                      "--endpoint", endpoint, "--num-requests", "8", "--input-len", "16",
                                      "--output-len", "8", "--max-concurrency", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    [run] = json.loads(out.read_text())["runs"]
    assert run["config"]["backend"] == "http" and run["config"]["endpoint"] == endpoint
    assert run["metrics"]["completed"] == 8 and run["metrics"]["total_output_tokens"] == 64
    assert run["metrics"]["mean_ttft_ms"] > 0 and run["metrics"]["output_throughput"] > 0
    # every stream carried the server's own TTFT (Server-Timing), a part of what the client saw
    assert 0 <= run["metrics"]["median_added_ttft_ms"] < run["metrics"]["mean_ttft_ms"]
    refused = CliRunner().invoke(app, ["bench", "tiny-random-llama", "--base-url", "http://127.0.0.1:9/v1",
                                       "--num-requests", "2", "--input-len", "4", "--output-len", "2"])
    assert refused.exit_code == 1 and "is the server running" in refused.output


def test_llmopt_serve_keeps_what_it_loaded_out_of_the_garbage_collectors_passes(monkeypatch):
    """Objects alive when serving starts (the model, the tokenizer) are frozen: a full collection over them stalled
    the event loop ~250 ms on a 2-core machine."""
    import gc

    import uvicorn
    from typer.testing import CliRunner

    from llmopt.cli.main import app

    frozen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: frozen.append(gc.get_freeze_count()))
    try:
        result = CliRunner().invoke(app, ["serve", "tiny-random-llama", "--port", str(free_port()), "--dtype",
                                          "float32"])
    finally:
        gc.unfreeze()
    assert result.exit_code == 0, result.output
    assert frozen and frozen[0] > 1000


def test_serve_refuses_a_chat_template_that_does_not_compile_and_reads_the_key_without_the_command_line(
        tmp_path, monkeypatch):
    """A template with a Jinja syntax error is refused at start (its line named), before the model loads; the API
    key comes from $LLMOPT_API_KEY or --api-key-file as well as --api-key (which `ps` shows)."""
    from typer.testing import CliRunner

    from llmopt.cli.main import app
    from llmopt.cli.serve import resolve_api_key

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    result = CliRunner().invoke(app, ["serve", "tiny-random-llama", "--port", str(free_port()), "--chat-template",
                                      str(bad)])
    assert result.exit_code == 1 and "Jinja syntax error on line 2" in result.output, result.output
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    assert resolve_api_key(None, key) == "s3cret" and resolve_api_key("k", None) == "k"
    with pytest.raises(ConfigError, match="both give the key"):
        resolve_api_key("k", key)
    key.write_text("\n")
    with pytest.raises(ConfigError, match="its first line is empty"):
        resolve_api_key(None, key)
    seen = {}
    monkeypatch.setenv("LLMOPT_API_KEY", "from-env")
    monkeypatch.setattr("llmopt.serve.launch.start_server", lambda *a, **k: seen.update(k) or (_ for _ in ()).throw(
        ConfigError("stop here")))
    result = CliRunner().invoke(app, ["serve", "tiny-random-llama", "--port", str(free_port())])
    assert seen["api_key"] == "from-env", result.output
    result = CliRunner().invoke(app, ["serve", "tiny-random-llama", "--max-waiting", "-1"])
    assert result.exit_code == 2 and "--max-waiting" in result.output


def test_llmopt_serve_stops_gracefully_on_sigterm(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmopt", "serve", "tiny-random-llama", "--port", str(port),
                             "--dtype", "float32"], env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=limit(10)).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 300, "the server answering /health 200", proc, poll=0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=limit(30)).status_code == 200
        # SIGTERM mid-stream: the stream runs to its end (within --shutdown-timeout), then the server exits 0
        body = {"model": "tiny-random-llama", "prompt": [1, 2, 3], "max_tokens": 1000, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                          timeout=limit(300)) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    proc.send_signal(signal.SIGTERM)  # after the first chunk
                    events.append(line[6:])
                    break
            # while the stream drains, a new request is answered (503 server_shutting_down), not refused at the port
            wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=limit(10)).status_code == 503,
                       30, "/health 503 once shutting down", proc, poll=0.01)
            late = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=limit(30),
                              json={"model": "tiny-random-llama", "prompt": "x", "max_tokens": 2})
            assert late.status_code == 503 and late.json()["error"]["type"] == "server_shutting_down", late.text
            events += [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 1000, events[-3:]
        assert wait_exit(proc, 120, "the server after SIGTERM") == 0, output_of(proc)
        assert "nanobind" not in proc.stdout.read().decode(errors="replace")  # (no leak report at exit)
    finally:
        proc.kill()


def test_an_8bit_kv_cache_serves_and_scoring_requests_share_the_prefix_cache():
    """`serve --kv-cache-dtype int8`: completions as the engine gives them, the cache reported in /v1/models; and
    echo + logprobs requests (lm-eval's loglikelihood) that share a context prefill it once."""
    running = Running(config=EngineConfig(block_size=4, kv_cache_dtype="int8"))
    try:
        kv = httpx.get(running.url + "/v1/models").json()["data"][0]["llmopt"]["kv_cache"]
        assert kv["dtype"] == "int8" and kv["tokens_per_dtype"]["int8"] == kv["tokens"]
        assert kv["tokens"] > 3 * kv["tokens_per_dtype"]["float32"]  # head_dim 16: 64 / (16 + 4) = 3.2x
        out = running.client.completions.create(model=MODEL, prompt="hello there", max_tokens=6, temperature=0)
        model, tokenizer = build_tiny_model("llama", seed=0)
        [want] = Engine(model, tokenizer, EngineConfig(block_size=4, kv_cache_dtype="int8")).generate(
            [tokenizer("hello there")["input_ids"]], SamplingParams(max_tokens=6))
        assert out.choices[0].text == want.text
        context = "a shared question that spans several blocks of the cache: answer"
        scores = [running.client.completions.create(model=MODEL, prompt=context + choice, max_tokens=1, echo=True,
                                                    logprobs=1, temperature=0).choices[0].logprobs
                  for choice in (" yes", " no", " yes")]
        # the cached context scores as computed (the rest: the same numbers through other kernels, last bits apart)
        assert scores[0].token_logprobs[0] is scores[2].token_logprobs[0] is None
        assert scores[0].token_logprobs[1:] == pytest.approx(scores[2].token_logprobs[1:], abs=1e-4)
        assert running.engine.stats().prefix_cache_hits > 0
    finally:
        running.close()


def test_the_first_requests_lazy_imports_are_done_at_start():
    # in a fresh interpreter: the module is not there until preload_request_path imports it (anyio's asyncio
    # backend, which the first streamed response would import on the event loop's thread)
    import subprocess
    import sys

    code = ("import sys; from llmopt.serve.launch import FIRST_REQUEST_MODULES, preload_request_path; "
            "before = [m for m in FIRST_REQUEST_MODULES if m in sys.modules]; loaded = preload_request_path(); "
            "print(before, loaded, all(m in sys.modules for m in FIRST_REQUEST_MODULES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit(120))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[] ['anyio._backends._asyncio'] True"
