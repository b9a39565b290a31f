"""AsyncEngine: the engine is built and stepped in one thread; a build that fails fails start()."""

import asyncio
import threading

import pytest

from llmopt.core.errors import ConfigError
from llmopt.core.tiny import build_tiny_model
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.serve.async_engine import AsyncEngine


def test_engine_is_built_and_stepped_in_the_engine_thread():
    threads = {}

    def build():
        threads["build"] = threading.current_thread().name
        model, tokenizer = build_tiny_model("llama", seed=0)
        engine = Engine(model, tokenizer, EngineConfig(block_size=4))
        step = engine.step

        def spy():
            threads["step"] = threading.current_thread().name
            return step()

        engine.step = spy
        return engine

    engine = AsyncEngine(build)
    engine.start()
    try:
        async def run():
            return [o async for o in engine.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))]

        outputs = asyncio.run(run())
    finally:
        engine.stop(10)
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 3
    assert threads == {"build": "llmopt-engine", "step": "llmopt-engine"}
    assert threading.current_thread().name != "llmopt-engine"


def test_a_failing_build_fails_start():
    def build():
        raise ConfigError("no such model")

    engine = AsyncEngine(build)
    with pytest.raises(ConfigError, match="no such model"):
        engine.start()
    assert not engine.alive
