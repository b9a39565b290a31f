"""Load a MODEL, start its engine thread and build the app (what `llmopt serve` and the tests run)."""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Iterator

from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.fronts.create import create_engine
from llmopt.serve.app import DEFAULT_MAX_BODY_BYTES, Server, build_app
from llmopt.serve.async_engine import AsyncEngine

# the share of --shutdown-timeout kept to deliver the final events of the streams cut when it runs out
FLUSH_SHARE, MAX_FLUSH_S = 0.1, 1.0


def server_for(model, tokenizer, model_name: str, config: EngineConfig | None = None, api_key: str | None = None,
               chat_template: str | None = None, max_waiting: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Server:
    """A started server state over an already loaded model."""
    return _started(lambda: Engine(model, tokenizer, config, record_steps=False), model_name, api_key,
                    chat_template, max_waiting, max_body_bytes)


def start_server(model_name: str, config: EngineConfig, dtype: str, device: str = "cpu",
                 served_model_name: str | None = None, api_key: str | None = None, chat_template: str | None = None,
                 max_waiting: int | None = None, trust_remote_code: bool = False,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """(FastAPI app, Server) for MODEL; quantized artifacts run on the runtime's packed layers. The model is
    loaded in the engine's thread (async_engine's note: one thread for every torch operation)."""
    def build() -> Engine:
        return create_engine(model_name, config, dtype, device, trust_remote_code, record_steps=False)

    server = _started(build, served_model_name or model_name, api_key, chat_template, max_waiting, max_body_bytes)
    return build_app(server), server


# Modules a server's first request would import on the event loop's thread (anyio's asyncio backend, which
# Starlette's streaming response loads on first use): imported at start instead, they cost the first stream no
# time (docs/results/code-figures.md#first-request).
FIRST_REQUEST_MODULES = ("anyio._backends._asyncio",)


def preload_request_path() -> list[str]:
    """Import FIRST_REQUEST_MODULES now; the ones that imported (a library version without one is skipped)."""
    loaded = []
    for name in FIRST_REQUEST_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        loaded.append(name)
    return loaded


def _started(build, model_name: str, api_key: str | None, chat_template: str | None, max_waiting: int | None,
             max_body_bytes: int) -> Server:
    preload_request_path()
    engine = AsyncEngine(build, max_waiting)
    engine.start()
    return Server(engine, engine.engine.tokenizer, model_name, api_key, chat_template, max_body_bytes)


def begin_shutdown(http, server: Server, timeout: float) -> None:
    """A graceful stop (SIGTERM, Ctrl-C): new requests get 503 `server_shutting_down` (the listener stays open
    meanwhile, so a client learns why rather than finding the port closed); requests in flight run on; those still
    running near the end of `timeout` are ended by the engine with a final error (an SSE error event then [DONE], or
    a 503), early enough for that to reach the client. Once none is left (or the timeout ran out) uvicorn stops,
    with its own limit (the same timeout) for what remains. A second call (a second signal) stops uvicorn now."""
    import threading
    import time

    if server.engine.stopping:
        http.should_exit = True
        return
    flush = min(MAX_FLUSH_S, FLUSH_SHARE * timeout)
    server.engine.drain(max(0.0, timeout - flush))

    def close_when_drained():
        deadline = time.monotonic() + timeout
        while server.engine.num_in_flight and time.monotonic() < deadline and not http.should_exit:
            time.sleep(0.02)
        http.should_exit = True

    threading.Thread(target=close_when_drained, name="llmopt-drain", daemon=True).start()


@contextmanager
def in_thread(server: Server, start_timeout: float = 300.0, shutdown_timeout: float = 30.0,
              on_http=None) -> Iterator[str]:
    """Run `server` on a free loopback port in a background thread for the duration of the block, then stop it
    and its engine gracefully (begin_shutdown); yields the base URL (http://127.0.0.1:PORT/v1). on_http receives
    the uvicorn server (a test that shuts it down itself)."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="warning",
                                         timeout_graceful_shutdown=shutdown_timeout))
    if on_http is not None:
        on_http(http)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not http.started:
            if not thread.is_alive():
                raise RuntimeError(f"the server for {server.model_name} did not start")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server for {server.model_name} did not start within {start_timeout:.0f} s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        begin_shutdown(http, server, shutdown_timeout)
        thread.join(shutdown_timeout + 30)
        server.engine.stop(30)


@contextmanager
def serving(model_name: str, config: EngineConfig, dtype: str, device: str = "cpu") -> Iterator[str]:
    """Load and serve MODEL for the duration of the block (in_thread); yields the base URL."""
    _, server = start_server(model_name, config, dtype, device)
    with in_thread(server) as url:
        yield url
