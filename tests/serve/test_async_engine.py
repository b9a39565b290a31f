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


def test_a_request_cancelled_before_the_engine_adds_it_never_kills_the_loop():
    """A queued request whose future was cancelled (a sibling of an n > 1 request refused, a client gone) is
    dropped; the engine thread keeps serving (it died of InvalidStateError: CANCELLED)."""
    import concurrent.futures

    def build():
        model, tokenizer = build_tiny_model("llama", seed=0)
        return Engine(model, tokenizer, EngineConfig(block_size=4))

    engine = AsyncEngine(build)
    engine.start()
    try:
        cancelled: concurrent.futures.Future = concurrent.futures.Future()
        cancelled.cancel()
        with engine._pending_lock:
            engine._pending += 1
        engine._inbox.put(("add", [1, 2], SamplingParams(max_tokens=2), None, cancelled))
        engine._inbox.put(("abort", 12345))  # an abort of an unknown request is harmless too

        async def run():
            return [o async for o in engine.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))]

        outputs = asyncio.run(run())
        assert outputs[-1].finished and len(outputs[-1].token_ids) == 3
        assert engine.alive and engine.num_waiting == 0
    finally:
        engine.stop(10)
