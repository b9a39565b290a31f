"""Load a MODEL, start its engine thread and build the app (what `llmopt serve` and the tests run)."""

from __future__ import annotations

from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.executor.loader import load_runtime_model
from llmopt.serve.app import Server, build_app
from llmopt.serve.async_engine import AsyncEngine


def server_for(model, tokenizer, model_name: str, config: EngineConfig | None = None, api_key: str | None = None,
               chat_template: str | None = None, max_waiting: int | None = None) -> Server:
    """A started server state over an already loaded model."""
    engine = AsyncEngine(Engine(model, tokenizer, config), max_waiting)
    engine.start()
    return Server(engine, tokenizer, model_name, api_key, chat_template)


def start_server(model_name: str, config: EngineConfig, dtype: str, device: str = "cpu",
                 served_model_name: str | None = None, api_key: str | None = None, chat_template: str | None = None,
                 max_waiting: int | None = None, trust_remote_code: bool = False):
    """(FastAPI app, Server) for MODEL; quantized artifacts run on the runtime's packed layers."""
    model, tokenizer, _ = load_runtime_model(model_name, dtype=dtype, device=device,
                                             trust_remote_code=trust_remote_code)
    server = server_for(model, tokenizer, served_model_name or model_name, config, api_key, chat_template,
                        max_waiting)
    return build_app(server), server
