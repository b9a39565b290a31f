"""Committing the CPU KV cache's memory ahead of use (EngineConfig.kv_cache_commit): at start or from an idle
thread, with madvise(MADV_POPULATE_WRITE), which faults pages in without changing what they hold; and the cache
sized in tokens (kv_cache_tokens)."""

import gc
import resource
import time

import pytest
import torch

from llmopt.core.errors import ConfigError
from llmopt.core.tiny import build_tiny_model
from llmopt.runtime.engine.engine import Engine, EngineConfig
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.attention.kv_cache import KVCacheSpec
from llmopt.runtime.executor.attention.kv_commit import KVCacheCommitter, block_ranges, commit_kv_cache

WAIT_S = 60  # a background commit of a few MiB; a slower machine fails with a message, never hangs


def spec() -> KVCacheSpec:
    return KVCacheSpec("kv", num_layers=2, dtype=torch.float32, num_kv_heads=2, head_dim=64)


def cache(num_blocks: int = 2048):  # 2 layers x (key, value) x 8 MiB: lazily committed huge-page mappings
    return spec().allocate(num_blocks, 16, torch.device("cpu"))


def minor_faults_writing(kv) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for layer in kv.layers:
        for tensor in layer:
            tensor.fill_(1.0)  # (no allocation: every fault is the cache's)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not done within {WAIT_S} s"
        time.sleep(0.02)


def test_startup_commit_faults_every_page_in_and_keeps_the_contents():
    kv = cache()
    kv.layers[0][0][3, 5] = 7.0  # a block already written keeps its values
    committer = commit_kv_cache(kv, "startup")
    if committer.failed:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux >= 5.14)")
    assert committer.done and committer.committed_blocks == kv.num_blocks
    assert kv.layers[0][0][3, 5].eq(7.0).all() and kv.layers[0][0].sum().item() == 7.0 * 2 * 64
    assert not kv.layers[1][1].any()
    lazy = cache()
    assert minor_faults_writing(kv) <= 1 < minor_faults_writing(lazy)


def test_background_commit_finishes_and_lazy_commits_nothing():
    kv = cache()
    assert commit_kv_cache(kv, "lazy") is None
    committer = commit_kv_cache(kv, "background")
    wait_until(lambda: committer.done or committer.failed, "the background commit")
    committer.stop()
    if committer.failed:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux >= 5.14)")
    assert minor_faults_writing(kv) <= 1
    with pytest.raises(ValueError, match="lazy, background, startup"):
        commit_kv_cache(kv, "eager")


def test_the_committer_lets_a_dropped_cache_go():
    kv = cache()
    committer = KVCacheCommitter(kv)
    del kv
    gc.collect()
    assert committer.commit_next(madvise=lambda *args: 0) is False and committer.committed_blocks == 0


def test_ranges_cover_whole_pages_of_the_asked_blocks():
    kv = cache(num_blocks=300)
    ranges = block_ranges(kv, 10, 20)
    per_block = 16 * 2 * 64 * 4  # 8 KiB: two pages
    assert len(ranges) == 4
    for (address, length), tensor in zip(ranges, (t for layer in kv.layers for t in layer)):
        assert address == tensor.data_ptr() + 10 * per_block and length == 10 * per_block


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("llama", seed=0)


def test_engine_commits_its_cache_in_the_background_by_default(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_tokens=4000))
    committer = engine.runner.kv_cache_committer
    wait_until(lambda: committer.done or committer.failed, "the engine's background commit")
    if committer.failed:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux >= 5.14)")
    assert engine.kv_cache_info()["committed_blocks"] == engine.runner.num_blocks == 1000
    out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0))
    lazy = Engine(model, tok, EngineConfig(block_size=4, kv_cache_tokens=4000, kv_cache_commit="lazy"))
    assert lazy.kv_cache_info()["committed_blocks"] is None
    assert lazy.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0))[0].token_ids == \
        out[0].token_ids
    engine.close()
    assert committer._thread is None


def test_cache_sized_in_tokens(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=16, kv_cache_tokens=100, kv_cache_commit="lazy"))
    info = engine.kv_cache_info()
    assert info["tokens"] == 112 and "100 tokens asked" in info["summary"]  # whole blocks: 7 of 16
    with pytest.raises(ConfigError, match="give one"):
        EngineConfig(kv_cache_tokens=100, kv_cache_bytes=1 << 20)
    with pytest.raises(ConfigError, match="kv-cache-tokens must be positive"):
        EngineConfig(kv_cache_tokens=0)
    with pytest.raises(ConfigError, match="kv-cache-commit must be one of"):
        EngineConfig(kv_cache_commit="eager")
