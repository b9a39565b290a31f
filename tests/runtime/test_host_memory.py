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


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_headroom_is_the_tightest_limit_on_the_way_up(tmp_path):
    write(tmp_path / "self" / "cgroup", "0::/pod/app\n")
    write(tmp_path / "fs" / "pod" / "app" / "memory.max", "max\n")
    write(tmp_path / "fs" / "pod" / "app" / "memory.current", "100\n")
    write(tmp_path / "fs" / "pod" / "memory.max", "4096\n")  # the pod's limit binds
    write(tmp_path / "fs" / "pod" / "memory.current", "1000\n")
    assert host_memory.cgroup_memory_headroom(str(tmp_path / "self" / "cgroup"), str(tmp_path / "fs")) == 3096


def test_cgroup_v1_headroom_and_no_limit(tmp_path):
    write(tmp_path / "self" / "cgroup", "4:memory:/box\n3:cpuset:/\n")
    write(tmp_path / "fs" / "memory" / "box" / "memory.limit_in_bytes", "2000\n")
    write(tmp_path / "fs" / "memory" / "box" / "memory.usage_in_bytes", "2500\n")
    write(tmp_path / "fs" / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "none"
    write(tmp_path / "fs" / "memory" / "memory.usage_in_bytes", "5\n")
    assert host_memory.cgroup_memory_headroom(str(tmp_path / "self" / "cgroup"), str(tmp_path / "fs")) == 0
    write(tmp_path / "fs" / "memory" / "box" / "memory.limit_in_bytes", "9223372036854771712\n")
    assert host_memory.cgroup_memory_headroom(str(tmp_path / "self" / "cgroup"), str(tmp_path / "fs")) is None
    assert host_memory.cgroup_memory_headroom(str(tmp_path / "missing"), str(tmp_path / "fs")) is None


def test_the_cpu_kv_budget_stays_inside_the_cgroup(monkeypatch):
    import psutil
    import torch

    from llmopt.runtime.executor import model_runner

    monkeypatch.setattr(model_runner, "cgroup_memory_headroom", lambda: 1 << 20)  # a container with 1 MiB left
    assert model_runner.available_memory(torch.device("cpu")) == 1 << 20
    monkeypatch.setattr(model_runner, "cgroup_memory_headroom", lambda: None)
    assert model_runner.available_memory(torch.device("cpu")) == psutil.virtual_memory().available
