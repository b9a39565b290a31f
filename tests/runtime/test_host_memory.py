import sys

import pytest

from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.executor import host_memory


@pytest.fixture(autouse=True)
def fresh_cache():
    host_memory.keep_freed_host_memory.cache_clear()
    yield
    host_memory.keep_freed_host_memory.cache_clear()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_takes_the_thresholds():
    # CI runs on glibc Linux: if mallopt stopped being called (or refused), this fails
    assert host_memory.keep_freed_host_memory() is True


def test_opt_out(monkeypatch):
    monkeypatch.setenv("LLMOPT_KEEP_HOST_MEMORY", "0")
    assert host_memory.keep_freed_host_memory() is False


def test_cpu_runner_asks_for_it(monkeypatch):
    from llmopt.core.tiny import build_tiny_model
    from llmopt.runtime.executor import model_runner

    calls = []
    monkeypatch.setattr(model_runner, "keep_freed_host_memory", lambda: calls.append(1))
    model, _ = build_tiny_model()
    model_runner.ModelRunner(model, EngineConfig(block_size=4, kv_cache_bytes=1 << 20))
    assert calls == [1]
