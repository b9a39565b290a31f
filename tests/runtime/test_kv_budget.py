"""The KV cache sized from the machine: a fraction of the available memory, no more than the engine can fill,
reported at start-up with the tokens it holds; explicit sizes still win."""

import pytest
import torch


from llmopt.core.errors import ConfigError
from llmopt.core.tiny import build_tiny_model
from llmopt.runtime.engine.engine import Engine, EngineConfig
from llmopt.runtime.executor.attention.kv_cache import zeros_lazily
from llmopt.runtime.executor.model_runner import ModelRunner
from llmopt.runtime.executor.platform import Platform
from llmopt.runtime.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("llama", seed=0)


def test_default_budget_is_a_fraction_of_available_memory(tiny, monkeypatch):
    model, _ = tiny
    monkeypatch.setattr(Platform, "available_memory", lambda self: 2**20)  # 1 MiB available
    runner = ModelRunner(model, EngineConfig(block_size=4, kv_cache_memory_fraction=0.5, max_num_seqs=64))
    per_block = runner.decoder.kv_cache_spec(torch.float32).bytes_per_block(4)
    assert runner.num_blocks == (2**19) // per_block
    assert runner.kv_cache_bytes == runner.num_blocks * per_block <= 2**19
    summary = runner.kv_cache_summary()
    assert "50% of available memory" in summary and f"{runner.num_blocks * 4:,} tokens in float32" in summary


def test_default_budget_stops_at_what_the_engine_can_fill(tiny, monkeypatch):
    model, _ = tiny
    monkeypatch.setattr(Platform, "available_memory", lambda self: 2**40)
    runner = ModelRunner(model, EngineConfig(block_size=16, max_num_seqs=3))
    # 3 sequences x 1024 positions (the tiny model's context) = 192 blocks of 16
    assert runner.num_blocks == 3 * 1024 // 16
    assert "3 sequences x the full context" in runner.kv_cache_summary()


def test_explicit_size_and_bad_fraction(tiny):
    model, _ = tiny
    runner = ModelRunner(model, EngineConfig(block_size=4, kv_cache_bytes=1 << 16))
    assert runner.kv_cache_source == "given"
    with pytest.raises(ConfigError, match="kv-cache-memory-fraction 1.5"):
        ModelRunner(model, EngineConfig(block_size=4, kv_cache_memory_fraction=1.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lazily_zeroed_cache(dtype):
    t = zeros_lazily((3, 4, 2, 8), dtype, torch.device("cpu"))
    assert t.shape == (3, 4, 2, 8) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[1, 2] = 1.0
    assert t.sum().item() == 16


def test_a_large_cache_tensor_starts_on_a_huge_page_boundary():
    # (madvise'd into transparent huge pages where the OS has them: one fault per 2 MiB of new blocks instead of
    # one per 4 KiB, each a few tens of us on a VM); zero, writable, and alive after the mapping's frame is gone
    import gc
    import mmap

    from llmopt.runtime.executor.attention.kv_cache import HUGE_PAGE_BYTES

    t = zeros_lazily((5, 1024, 1024), torch.float32, torch.device("cpu"))  # 20 MiB
    gc.collect()
    assert t.shape == (5, 1024, 1024) and t.is_contiguous() and not t.any()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    t[4, -1, -1] = 3.0
    t[0, 0, 0] = 2.0
    assert t.sum().item() == 5.0


def test_a_64_request_run_fits_without_preemption_in_fp32(tiny):
    # the default budget holds every sequence of a 64-request run at once, so nothing is evicted and recomputed
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(max_num_seqs=64))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (100,), generator=g).tolist() for _ in range(64)]
    engine.generate(prompts, SamplingParams(max_tokens=156, ignore_eos=True))
    stats = engine.stats()
    assert stats.num_preemptions == 0
    assert max(s.num_seqs for s in stats.steps) == 64
