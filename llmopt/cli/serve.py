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

API_KEY_ENV = "LLMOPT_API_KEY"

@with_engine_options
def serve(
    model: ModelArg,
    host: Annotated[str, typer.Option("--host", help="Address to bind (loopback unless told otherwise).")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar=API_KEY_ENV, show_envvar=True,
        help="Require `Authorization: Bearer KEY` on /v1 routes. A key on the command line is visible to every user "
        f"of the host (`ps`): prefer ${API_KEY_ENV} or --api-key-file.")] = None,
    api_key_file: Annotated[Optional[Path], typer.Option(
        "--api-key-file", help="Read the API key from this file (its first line).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(
        "--served-model-name", help="The model id clients use (default: MODEL as given).")] = None,
    chat_template: Annotated[Optional[Path], typer.Option(
        "--chat-template", help="A Jinja chat template file replacing the tokenizer's.")] = None,
    max_waiting: Annotated[Optional[int], typer.Option(
        "--max-waiting", min=0, help="Waiting requests beyond which new ones get 429 (default: unbounded).")] = None,
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
    api_key = resolve_api_key(api_key, api_key_file)
    template = read_chat_template(chat_template) if chat_template is not None else None
    app, server = start_server(model, engine, resolve_dtype_option(dtype, device), device,
                               served_model_name=served_model_name, api_key=api_key, chat_template=template,
                               max_waiting=max_waiting, trust_remote_code=trust_remote_code,
                               max_body_bytes=max_body_bytes)
    stderr.print(f"serving {server.model_name} at http://{host}:{port}/v1 "
                 f"({server.engine.engine.kv_cache_info()['summary']})", highlight=False, markup=False, soft_wrap=True)
    # what is loaded by now (the model's modules, the tokenizer: ~435k objects for SmolLM2) lives as long as the
    # process: kept out of the garbage collector's full passes, each of which stalled the event loop, and so every
    # stream, for a quarter of a second (docs/results/code-figures.md#gc-freeze)
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


def resolve_api_key(given: str | None, key_file: Path | None) -> str | None:
    """The API key: --api-key (or $LLMOPT_API_KEY), or the first line of --api-key-file; never both, never empty."""
    from llmopt.core.errors import ConfigError

    if key_file is not None:
        if given is not None:
            raise ConfigError(f"--api-key-file and --api-key (or ${API_KEY_ENV}) both give the key: give one",
                              param="api_key_file")
        try:
            lines = key_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--api-key-file {key_file}: cannot read it ({getattr(e, 'strerror', None) or e})",
                              param="api_key_file") from None
        given = lines[0].strip() if lines else ""
        if not given:
            raise ConfigError(f"--api-key-file {key_file}: its first line is empty: write the key there",
                              param="api_key_file")
    if given is not None and not given.strip():
        raise ConfigError("--api-key is empty: give a key, or leave it out to serve without one", param="api_key")
    return given


def read_chat_template(path: Path) -> str:
    """The --chat-template file's text, compiled once here: a template that is not Jinja is refused at start
    (with its line), not by every chat request later."""
    from llmopt.core.errors import ConfigError
    from llmopt.serve.protocol import compile_chat_template

    if not path.is_file():
        raise ConfigError(f"--chat-template {path} does not exist", param="chat_template")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path}: cannot read it as text ({e})", param="chat_template") from None
    problem = compile_chat_template(text)
    if problem is not None:
        raise ConfigError(f"--chat-template {path}: {problem}: fix the template", param="chat_template")
    return text


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
