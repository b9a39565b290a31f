"""The OpenAI-compatible HTTP API (FastAPI) over an AsyncEngine: /v1/completions, /v1/chat/completions (both
with SSE streaming), /v1/models, /health and /metrics (Prometheus, vLLM's metric names with an llmopt: prefix).

A request body is read up to --max-body-bytes, then parsed, validated (serve.protocol), tokenized and checked, in a
worker thread when it is larger than INLINE_PARSE_BYTES, so a large body never stalls the event loop (/health,
the other streams); only a request that passed every check reaches the engine."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from llmopt.core.errors import ConfigError
from llmopt.runtime.engine.output import RequestOutput
from llmopt.runtime.engine.sampling import MAX_SEED, SamplingParams
from llmopt.serve.async_engine import AsyncEngine, EngineRestarted, EngineStopping, ServerOverloaded
from llmopt.serve.metrics import ServerMetrics
from llmopt.serve.protocol import (
    DEFAULT_MAX_BODY_BYTES, ChatCompletionRequest, CompletionRequest, SamplingFields, error_body, lone_surrogate_path,
)


class RequestError(Exception):
    """A 4xx for one request: the message, the field it is about, the status and OpenAI's error code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def validation_error(exc: ValidationError) -> RequestError:
    """The first pydantic error as a 400 naming its field."""
    first = exc.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if getattr(cause, "param", None):  # protocol's UnknownField / UnsupportedValue
        return RequestError(str(cause), cause.param)
    loc = [str(p) for p in first.get("loc", ())]
    if first.get("type") == "extra_forbidden":  # an unknown nested field: named in full (messages.0.contnet)
        return RequestError(f"unrecognized request argument supplied: {'.'.join(loc)}", ".".join(loc))
    return RequestError(f"{'.'.join(loc) or 'body'}: {first.get('msg')}", loc[0] if loc else None)


class Server:
    """The state behind the routes: the engine, the tokenizer, the served name."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, api_key: str | None = None,
                 chat_template: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.api_key, self.chat_template, self.max_body_bytes = api_key, chat_template, max_body_bytes
        self.max_context = engine.engine.max_context
        # the most characters one token covers: a text longer than max_context x this cannot fit the context,
        # and is refused without tokenizing it (seconds of a worker thread for a multi-megabyte prompt)
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
        # what the numbers served depend on, fixed at start (plain values: read from any thread)
        kv = engine.engine.kv_cache_info()
        self.engine_facts = {"numerics": engine.engine.numerics(),
                             "kv_cache": {k: kv[k] for k in ("bytes", "tokens", "dtype", "bytes_per_token", "layout",
                                                              "tokens_per_dtype")}}
        self.metrics = ServerMetrics(engine)

    # --- body -> request (in a worker thread) -----------------------------------------------------
    def parse(self, body: bytes, kind: type[SamplingFields]):
        """The validated request of `kind`; a RequestError naming the field otherwise."""
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(f"the body is not valid JSON: {exc}") from None
        except RecursionError:  # (the parser's own depth limit, ~1000 levels: no request nests that deep)
            raise RequestError("the body is too deeply nested: a request nests a few levels at most", None,
                               code="body_too_deeply_nested") from None
        if not isinstance(data, dict):
            raise RequestError(f"the body must be a JSON object, not {type(data).__name__}")
        surrogate = lone_surrogate_path(data)
        if surrogate is not None:
            raise RequestError(f"{surrogate}: the text holds a lone UTF-16 surrogate (such as \\ud800), which is not "
                               f"a character: send valid Unicode", surrogate)
        try:
            req = kind.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if req.model is not None and req.model != self.model_name:  # as OpenAI's API answers
            raise RequestError(f"the model `{req.model}` does not exist: this server serves `{self.model_name}`",
                               "model", 404, "model_not_found")
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        return req

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        try:
            self.engine.engine.check_token_ids(token_ids, param)
        except ConfigError as exc:
            raise RequestError(f"{param}: {exc}", param) from None

    def completion_jobs(self, body: bytes) -> tuple[CompletionRequest, list[tuple[list[int], SamplingParams]]]:
        """(the request, one (prompt ids, params) job per prompt and choice)."""
        req = self.parse(body, CompletionRequest)
        if req.echo and req.stream:
            raise RequestError("echo with stream is not supported: drop one of them", "echo")
        if req.max_tokens == 0 and not req.echo:
            raise RequestError("max_tokens 0 needs echo (scoring the prompt): raise max_tokens", "max_tokens")
        if req.best_of is not None and req.best_of != req.n:
            raise RequestError(f"best_of {req.best_of} other than n ({req.n}) is not supported: leave it out",
                               "best_of")
        prompts = self.completion_prompts(req)
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        jobs = []
        for prompt in prompts:
            # max_tokens 0: score the prompt, generate one token and drop it
            max_tokens = self.max_tokens_for(req.max_tokens or 1, prompt)
            for j in range(req.n):
                jobs.append((prompt, self.sampling_params(req, max_tokens, req.logprobs, j, prompt_logprobs)))
        return req, jobs

    def chat_jobs(self, body: bytes) -> tuple[ChatCompletionRequest, list[tuple[list[int], SamplingParams]]]:
        req = self.parse(body, ChatCompletionRequest)
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        prompt = self.chat_prompt(req)
        max_tokens = self.max_tokens_for(req.max_completion_tokens or req.max_tokens, prompt)
        top = req.top_logprobs or 0
        logprobs = max(top, 1) if req.logprobs else None
        return req, [(prompt, self.sampling_params(req, max_tokens, logprobs, j)) for j in range(req.n)]

    # --- request -> engine inputs ------------------------------------------------------------------
    def sampling_params(self, req: SamplingFields, max_tokens: int, logprobs: int | None, index: int,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        seed = req.seed
        if seed is not None and index:  # n > 1: a different draw per choice (kept within 64 bits)
            seed = (seed + index) & MAX_SEED
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                  top_k=max(req.top_k, 0), seed=seed, stop=req.stop_strings(),
                                  stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except ConfigError as exc:
            raise RequestError(str(exc), exc.param) from None

    def check_text_fits(self, text: str, param: str) -> None:
        if self.max_context and len(text) > self.max_context * self.max_token_chars:
            at_least = len(text) // self.max_token_chars
            raise RequestError(f"the {param} has {len(text)} characters, at least {at_least} tokens; the model's "
                               f"context is {self.max_context}", param)

    def max_tokens_for(self, requested: int | None, prompt: list[int]) -> int:
        if not prompt:
            raise RequestError("the prompt is empty: give at least one token", "prompt")
        room = (self.max_context - len(prompt)) if self.max_context else None
        if room is not None and room < 1:
            raise RequestError(f"the prompt has {len(prompt)} tokens; the model's context is {self.max_context}",
                               "prompt")
        if requested is None:
            return room if room is not None else 256
        if room is not None and requested > room:
            raise RequestError(f"max_tokens {requested} + {len(prompt)} prompt tokens exceeds the model's context of "
                               f"{self.max_context}: lower max_tokens", "max_tokens")
        return requested

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        if not prompt:
            raise RequestError("the prompt is empty", "prompt")
        encoded = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                self.check_text_fits(p, "prompt")
                encoded.append(self.tokenizer(p, add_special_tokens=req.add_special_tokens)["input_ids"])
            else:
                self.check_token_ids(p, "prompt" if len(prompt) == 1 else f"prompt[{i}]")
                encoded.append(list(p))
        return encoded

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        for i, message in enumerate(req.messages):
            unsupported = message.unsupported_part()
            if unsupported:
                raise RequestError(f"messages[{i}].content: parts of type {unsupported!r} are not supported (text "
                                   f"only)", "messages")
        messages = [m.template_fields() for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                      chat_template=self.chat_template)
        except Exception as exc:  # noqa: BLE001  (a template that rejects these messages)
            raise RequestError(f"the chat template cannot render these messages: {exc}", "messages") from None
        self.check_text_fits(text, "messages")
        # the template places the special tokens itself (as transformers tokenizes a rendered chat)
        return self.tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"]

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def run(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        start = time.perf_counter()
        first = None
        try:
            async for output in self.engine.generate(prompt, params):
                if first is None and output.new_token_ids:
                    first = time.perf_counter() - start
                if output.finished:
                    self.metrics.finished(output, len(prompt), first, time.perf_counter() - start)
                yield output
        except ConfigError as exc:
            raise RequestError(str(exc), exc.param) from None


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several requests as they come; leaving early cancels (aborts) the rest."""
    if len(streams) == 1:  # the common case: no pump task and queue hop per token
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, stream):
        try:
            async for output in stream:
                await queue.put((index, output))
        except BaseException as exc:  # noqa: BLE001  (re-raised in the consumer)
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(server: Server, token_ids: list[int], entries, offset: int) -> dict:
    """The legacy completions `logprobs` object for some tokens of one choice."""
    tokens = [server.token_text(t) for t in token_ids]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [e.get(t) for t, e in zip(token_ids, entries)],
            "top_logprobs": [{server.token_text(k): v for k, v in e.items()} for e in entries],
            "text_offset": offsets}


def chat_logprobs(server: Server, token_ids: list[int], entries, top: int) -> dict:
    content = []
    for token, entry in zip(token_ids, entries):
        text = server.token_text(token)
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        content.append({"token": text, "logprob": entry.get(token), "bytes": list(text.encode()),
                        "top_logprobs": [{"token": server.token_text(k), "logprob": v,
                                          "bytes": list(server.token_text(k).encode())} for k, v in ranked]})
    return {"content": content}


# --- the routes ------------------------------------------------------------------------------------
async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 once it exceeds `limit` bytes (by its Content-Length before reading any)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the body is {int(declared)} bytes, more than this server accepts ({limit}; "
                           f"--max-body-bytes)", None, 413, "body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the body is more than this server accepts ({limit} bytes; --max-body-bytes)",
                               None, 413, "body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


# Bodies up to this size are parsed, validated and tokenized on the event loop (well under a millisecond: a few
# thousand characters of prompt); larger ones in a worker thread, so that they never stall the other streams. The
# thread hop costs a fraction of a millisecond of every request's time to first token on a busy machine.
INLINE_PARSE_BYTES = 8192


async def parsed(jobs_of, body: bytes):
    """jobs_of(body) (Server.completion_jobs / chat_jobs): inline for a small body, else off the event loop."""
    if len(body) <= INLINE_PARSE_BYTES:
        return jobs_of(body)
    return await asyncio.to_thread(jobs_of, body)


class BearerAuth:
    """Plain ASGI middleware: /v1 routes need `Authorization: Bearer KEY`. (Starlette's @app.middleware("http")
    would relay every SSE chunk through an extra in-memory stream and task: a cost on every streamed token.)"""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not hmac.compare_digest(given, self.expected):
                body = error_body("invalid or missing API key: send Authorization: Bearer KEY",
                                  kind="authentication_error", code="invalid_api_key")
                return await JSONResponse(body, 401)(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(server: Server) -> FastAPI:
    app = FastAPI(title="llmopt", docs_url=None, redoc_url=None)
    app.state.server = server

    if server.api_key:
        app.add_middleware(BearerAuth, api_key=server.api_key)

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, exc: RequestError):
        return JSONResponse(error_body(str(exc), exc.param, code=exc.code), exc.status)

    @app.exception_handler(ServerOverloaded)
    async def overloaded(request: Request, exc: ServerOverloaded):
        return JSONResponse(error_body(str(exc), kind="server_overloaded"), 429, headers={"Retry-After": "1"})

    @app.exception_handler(EngineStopping)
    async def stopping(request: Request, exc: EngineStopping):
        return JSONResponse(error_body(str(exc), kind="server_shutting_down"), 503)

    @app.exception_handler(EngineRestarted)
    async def restarted(request: Request, exc: EngineRestarted):
        return JSONResponse(error_body(str(exc), kind="server_error"), 503, headers={"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):
        return JSONResponse(error_body(f"the request failed: {exc}", kind="server_error"), 500)

    @app.get("/health")
    async def health():
        problem = server.engine.unavailable()
        if problem is not None:  # a load balancer routes elsewhere; requests get 503 meanwhile
            return JSONResponse({"status": problem}, 503, headers={"Retry-After": "1"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "llmopt", "max_model_len": server.max_context,
                                            "llmopt": server.engine_facts}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, server.max_body_bytes)
        req, jobs = await parsed(server.completion_jobs, body)
        return await respond(server, req, jobs, "cmpl", completion_choice, completion_chunk)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request, server.max_body_bytes)
        req, jobs = await parsed(server.chat_jobs, body)
        return await respond(server, req, jobs, "chatcmpl", chat_choice, chat_chunk)

    return app


def completion_choice(server, req, index, output: RequestOutput, prompt: list[int]) -> dict:
    generated = req.max_tokens != 0
    text = output.text if generated else ""
    token_ids, entries = (output.token_ids, output.logprobs) if generated else ([], [])
    logprobs = completion_logprobs(server, token_ids, entries, 0) if req.logprobs is not None else None
    if req.echo:
        prompt_text = server.tokenizer.decode(prompt)
        if logprobs is not None:
            scored = output.prompt_logprobs or [None] * len(prompt)
            head = completion_logprobs(server, prompt, [e or {} for e in scored], 0)
            head["token_logprobs"][0], head["top_logprobs"][0] = None, None
            offset = len(prompt_text)
            logprobs = {key: head[key] + (logprobs[key] if key != "text_offset" else
                                          [offset + o for o in logprobs[key]]) for key in head}
        text = prompt_text + text
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": output.finish_reason if generated else "length"}


def completion_chunk(server, req, index, output: RequestOutput, state: dict) -> dict:
    logprobs = (completion_logprobs(server, output.new_token_ids, output.new_logprobs, state["chars"])
                if req.logprobs is not None else None)
    return {"index": index, "text": output.new_text, "logprobs": logprobs,
            "finish_reason": output.finish_reason if output.finished else None}


def chat_choice(server, req, index, output: RequestOutput, prompt: list[int]) -> dict:
    logprobs = chat_logprobs(server, output.token_ids, output.logprobs, req.top_logprobs or 0) if req.logprobs else None
    return {"index": index, "message": {"role": "assistant", "content": output.text}, "logprobs": logprobs,
            "finish_reason": output.finish_reason}


def chat_chunk(server, req, index, output: RequestOutput, state: dict) -> dict:
    logprobs = (chat_logprobs(server, output.new_token_ids, output.new_logprobs, req.top_logprobs or 0)
                if req.logprobs else None)
    delta = {"content": output.new_text}
    if not state["started"]:
        delta = {"role": "assistant", **delta}
    return {"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": output.finish_reason if output.finished else None}


async def respond(server: Server, req, jobs, prefix: str, choice, chunk):
    """Run every (prompt, params) job; one JSON body, or an SSE stream of chunks then [DONE]."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    kind = "text_completion" if prefix == "cmpl" else "chat.completion"
    head = {"id": request_id, "created": created, "model": server.model_name}
    prompt_tokens = sum(len(p) for i, (p, _) in enumerate(jobs) if i % req.n == 0)
    try:
        server.engine.admit(len(jobs))  # all of the request's sequences, or none of them
    except ValueError as e:
        raise RequestError(f"{e}: lower n (or send fewer prompts per request)", "n") from None
    streams = [server.run(prompt, params) for prompt, params in jobs]
    if not req.stream:
        finals: dict[int, RequestOutput] = {}
        async for index, output in merged(streams):
            if output.finished:
                finals[index] = output
        choices = [choice(server, req, i, finals[i], jobs[i][0]) for i in range(len(jobs))]
        completion_tokens = sum(len(o.token_ids) for o in finals.values()) if req.max_tokens != 0 else 0
        return {**head, "object": kind, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    stream_kind = "text_completion" if prefix == "cmpl" else "chat.completion.chunk"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    # errors before the first chunk (a bad prompt found by the engine) still get a 4xx, not a broken stream
    iterator = merged(streams)
    started = time.perf_counter()
    try:
        first = await iterator.__anext__()
    except StopAsyncIteration:
        first = None
    # the server's own time to the first output (W3C Server-Timing, milliseconds): a client subtracts it from the
    # time it saw to learn what the network and both HTTP stacks added (`llmopt bench --base-url` reports it)
    timing = {"Server-Timing": f"ttft;dur={1000 * (time.perf_counter() - started):.3f}"} if first else {}

    async def outputs():
        if first is not None:
            yield first
        async for item in iterator:
            yield item

    async def events():
        states = [{"chars": 0, "started": False} for _ in jobs]
        completion_tokens = 0
        try:
            async for index, output in outputs():
                completion_tokens += len(output.new_token_ids)
                state = states[index]
                if output.new_text or output.finished or output.new_logprobs:
                    body = chunk(server, req, index, output, state)
                    state["chars"] += len(output.new_text)
                    state["started"] = True
                    yield _sse({**head, "object": stream_kind, "choices": [body]})
            if include_usage:
                yield _sse({**head, "object": stream_kind, "choices": [],
                            "usage": _usage(prompt_tokens, completion_tokens)})
        except RequestError as exc:
            yield _sse(error_body(str(exc), exc.param))
        except EngineStopping as exc:  # the shutdown timeout ran out: a final error event, then [DONE]
            yield _sse(error_body(str(exc), kind="server_shutting_down"))
        except Exception as exc:  # noqa: BLE001  (this request fails; the server goes on)
            yield _sse(error_body(f"the request failed: {exc}", kind="server_error"))
        finally:
            await iterator.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=timing)
