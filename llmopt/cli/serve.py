"""`llmopt serve`: an OpenAI-compatible HTTP server over the runtime."""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmopt.cli.options import (
    DEFAULT_DEVICE, DeviceOpt, Dtype, DtypeOpt, ModelArg, TrustRemoteCodeOpt, resolve_dtype_option,
    with_engine_options,
)
from llmopt.serve.protocol import DEFAULT_MAX_BODY_BYTES

@with_engine_options
def serve(
    model: ModelArg,
    host: Annotated[str, typer.Option("--host", help="Address to bind (loopback unless told otherwise).")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", help="Require `Authorization: Bearer KEY` on /v1 routes.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(
        "--served-model-name", help="The model id clients use (default: MODEL as given).")] = None,
    chat_template: Annotated[Optional[Path], typer.Option(
        "--chat-template", help="A Jinja chat template file replacing the tokenizer's.")] = None,
    max_waiting: Annotated[Optional[int], typer.Option(
        "--max-waiting", help="Waiting requests beyond which new ones get 429 (default: unbounded).")] = None,
    shutdown_timeout: Annotated[float, typer.Option(
        "--shutdown-timeout", min=0, help="Seconds in-flight requests get to finish on SIGTERM / Ctrl-C; streams "
        "still running then end with an SSE error event.")] = 30.0,
    max_body_bytes: Annotated[int, typer.Option(
        "--max-body-bytes", min=1, help="Request bodies larger than this get 413 before they are parsed.")
    ] = DEFAULT_MAX_BODY_BYTES,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = DEFAULT_DEVICE,
    trust_remote_code: TrustRemoteCodeOpt = False,
    engine=None,
) -> None:
    """Serve MODEL over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    from llmopt.cli.output import stderr
    from llmopt.core.errors import ConfigError

    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError:
        raise ConfigError("llmopt serve needs the serve extra: pip install 'llmopt[serve]'") from None
    from llmopt.serve.launch import begin_shutdown, start_server

    check_listen_address(host, port)  # before minutes of loading, not after
    if chat_template is not None and not chat_template.is_file():
        raise ConfigError(f"--chat-template {chat_template} does not exist")
    app, server = start_server(model, engine, resolve_dtype_option(dtype, device), device,
                               served_model_name=served_model_name, api_key=api_key,
                               chat_template=chat_template.read_text() if chat_template else None,
                               max_waiting=max_waiting, trust_remote_code=trust_remote_code,
                               max_body_bytes=max_body_bytes)
    stderr.print(f"serving {server.model_name} at http://{host}:{port}/v1 "
                 f"({server.engine.engine.kv_cache_info()['summary']})", highlight=False, markup=False, soft_wrap=True)
    # what is loaded by now (the model's modules, the tokenizer: ~435k objects for SmolLM2) lives as long as the
    # process: kept out of the garbage collector's full passes, each of which stalled the event loop, and so every
    # stream, for ~250 ms (2-core EPYC)
    gc.collect()
    gc.freeze()
    http = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                         timeout_graceful_shutdown=shutdown_timeout))

    def request_exit(signum, frame):  # stop accepting, let in-flight requests finish, then exit 0
        begin_shutdown(http, server, shutdown_timeout)

    http.capture_signals = contextlib.nullcontext  # our handlers: uvicorn's re-raise the signal after shutdown
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_exit)
    watchdog = threading.Thread(target=exit_if_engine_failed, args=(http, server), daemon=True)
    watchdog.start()
    try:
        http.run()
    finally:
        server.engine.stop(shutdown_timeout)
    if server.engine.failed is not None:
        raise ConfigError(f"the engine failed and could not be restarted ({server.engine.failed}): the server "
                          f"stopped; see the log above")


def exit_if_engine_failed(http, server, poll_s: float = 1.0) -> None:
    """A server whose engine cannot run is stopped (exit 1), never left answering 503 for ever."""
    while not http.should_exit:
        if server.engine.failed is not None:
            http.should_exit = True
            return
        time.sleep(poll_s)


def check_listen_address(host: str, port: int) -> None:
    """Refuse a port out of range, a host that does not resolve, or an address already in use, in one line."""
    import socket

    from llmopt.core.errors import ConfigError

    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: give a port in 0-65535", param="port")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: cannot resolve it ({e.strerror}); give an address such as 127.0.0.1",
                          param="host") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}): choose another --port or --host",
                              param="port") from None
