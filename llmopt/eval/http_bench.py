"""The bench workloads over HTTP against any OpenAI-compatible server (llmopt's, vLLM's, llama.cpp's
llama-server): streaming requests sent at their arrival times under a concurrency cap; each streamed chunk's
arrival is a token time (TTFT, ITL), the usage block gives the token counts.

The client is aiohttp's (as vLLM's serving benchmark): its own cost is in every time it measures, and httpx's
added several times aiohttp's to each time to first token (docs/results/code-figures.md#http-client)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

import aiohttp

from llmopt.core.errors import ConfigError
from llmopt.eval.metrics import RequestRecord
from llmopt.eval.workloads import BenchRequest

ENDPOINTS = ("completions", "chat")


def request_body(request: BenchRequest, endpoint: str, model: str, tokenizer) -> dict:
    body = {"model": model, "max_tokens": request.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if endpoint == "completions":
        return {**body, "prompt": request.prompt_token_ids}
    text = tokenizer.decode(request.prompt_token_ids, skip_special_tokens=True)
    return {**body, "messages": [{"role": "user", "content": text}]}


NOT_OPENAI = "is --base-url an OpenAI-compatible API (it ends in /v1)?"


def content_kind(headers) -> str:
    return headers.get("content-type", "no content type").split(";")[0] or "no content type"


def refusal(url: str, status: int, headers, body: bytes) -> str:
    """One line for a refused request: the OpenAI error's message, or what kind of page came back instead."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return (f"{url} answered {status} with {content_kind(headers)} ({len(body)} bytes), not an OpenAI error: "
                f"{NOT_OPENAI}")
    return f"{url} answered {status}: {message}"


def server_timing(header: str, name: str) -> float | None:
    """Seconds of the metric `name` in a Server-Timing header ('ttft;dur=412.9, db;dur=3' -> 0.4129), or None."""
    for metric in header.split(","):
        key, *params = (part.strip() for part in metric.split(";"))
        if key != name:
            continue
        for param in params:
            field, _, value = param.partition("=")
            if field.strip() == "dur":
                try:
                    return float(value.strip().strip('"')) / 1000
                except ValueError:
                    return None
    return None


def _chunk_has_output(chunk: dict) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def _one(session: aiohttp.ClientSession, url: str, body: dict, request: BenchRequest, start: float
               ) -> RequestRecord:
    sent = time.perf_counter()
    times: list[float] = []
    usage = None
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise ConfigError(refusal(url, response.status, response.headers, await response.read()))
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            raise ConfigError(f"{url} answered 200 with {content_kind(response.headers)}, not an event stream: "
                              f"{NOT_OPENAI}")
        async for line in response.content:  # one line at a time, as the bytes arrive
            if not line.startswith(b"data: ") or line.rstrip() == b"data: [DONE]":
                continue
            try:
                chunk = json.loads(line[6:])
            except ValueError:
                raise ConfigError(f"{url} sent an event that is not JSON ({line[:80].decode(errors='replace')!r}): "
                                  f"{NOT_OPENAI}") from None
            if "error" in chunk:
                raise ConfigError(f"{url} failed a request: {chunk['error'].get('message')}")
            if _chunk_has_output(chunk):
                times.append(time.perf_counter() - start)
            usage = chunk.get("usage") or usage
    if not times:
        times = [time.perf_counter() - start]
    num_output = usage["completion_tokens"] if usage else len(times)
    num_prompt = usage["prompt_tokens"] if usage else len(request.prompt_token_ids)
    return RequestRecord(sent - start, times, num_prompt, num_output,
                         server_ttft=server_timing(response.headers.get("server-timing", ""), "ttft"))


async def _run(base_url: str, endpoint: str, model: str, requests: list[BenchRequest], tokenizer,
               max_concurrency: int | None, api_key: str | None, progress) -> tuple[list[RequestRecord], float]:
    url = base_url.rstrip("/") + ("/completions" if endpoint == "completions" else "/chat/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    records: list[RequestRecord] = []
    pool = max_concurrency or len(requests) or 1
    connector = aiohttp.TCPConnector(limit=pool)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=600)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as session:
        # one connection opened before the clock starts (GET /models; any status will do): the first request's
        # time to first token is then the server's, not this client's connection set-up
        async with session.get(base_url.rstrip("/") + "/models") as response:
            await response.read()
        start = time.perf_counter()

        async def send(request: BenchRequest):
            delay = request.arrival_offset - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with limit:
                body = request_body(request, endpoint, model, tokenizer)
                # a kept-alive connection the server had already closed (llama.cpp's llama-server closes one after
                # a streamed response without saying so) fails the send and leaves the pool: try again, as many
                # times as the pool may hold such connections, the last one on a new connection
                for attempt in range(pool + 1):
                    try:
                        record = await _one(session, url, body, request, start)
                        break
                    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                        if attempt == pool:
                            raise
            records.append(record)
            if progress:
                progress(len(records), len(requests))

        await asyncio.gather(*(send(r) for r in requests))
        return records, time.perf_counter() - start


def run_http(base_url: str, endpoint: str, model: str, requests: list[BenchRequest], tokenizer,
             max_concurrency: int | None = None, api_key: str | None = None,
             progress: Callable[[int, int], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Send `requests` to the server at `base_url` (e.g. http://127.0.0.1:8000/v1); returns records, duration."""
    if endpoint not in ENDPOINTS:
        raise ConfigError(f"--endpoint {endpoint!r}: choose one of {', '.join(ENDPOINTS)}")
    try:
        return asyncio.run(_run(base_url, endpoint, model, requests, tokenizer, max_concurrency, api_key, progress))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        reason = str(exc).rstrip(".") or type(exc).__name__
        raise ConfigError(f"cannot reach {base_url} ({reason}): is the server running?") from None
