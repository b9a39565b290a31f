"""Rolled-back KV: blocks that held only rejected drafts are freed, none leaks, and the prefix cache never holds a
rejected token (property test over random workloads with cache hits and preemption)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmopt.runtime.engine.block_manager import BlockManager
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.engine.sequence import Sequence

from tests.spec_decode.conftest import speculative


def test_truncate_frees_the_blocks_past_the_kept_tokens():
    bm = BlockManager(8, block_size=4)
    seq = Sequence(list(range(6)))
    bm.allocate(seq, 14)  # 4 blocks
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    bm.truncate(seq, 7)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.free(seq)
    assert bm.num_free_blocks == 8


def test_truncate_refuses_a_block_the_prefix_cache_shares():
    bm = BlockManager(8, block_size=4)
    seq = Sequence(list(range(9)))
    bm.allocate(seq)
    seq.num_computed_tokens = 8
    bm.cache_full_blocks(seq)
    with pytest.raises(AssertionError):
        bm.truncate(seq, 3)


def cached_paths(bm: BlockManager) -> list[list[int]]:
    """Token ids along every root-to-node path of the radix tree."""
    paths, stack = [], [(bm.root, [])]
    while stack:
        node, tokens = stack.pop()
        for child in node.children.values():
            path = tokens + list(child.key)
            paths.append(path)
            stack.append((child, path))
    return paths


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_leak_and_no_rejected_token_in_the_prefix_cache(tiny, spec_files, data):
    model, tok = tiny
    alphabet = st.integers(3, 12)  # few distinct tokens: repeats for prompt lookup and shared prefixes
    prompts = data.draw(st.lists(st.lists(alphabet, min_size=2, max_size=24), min_size=1, max_size=6))
    prompts += prompts[: data.draw(st.integers(0, len(prompts)))]  # exact repeats: prefix-cache hits
    max_tokens = data.draw(st.integers(1, 20))
    proposer = data.draw(st.sampled_from(["ngram", "draft-other", "medusa"]))
    block_size = data.draw(st.sampled_from([2, 4]))
    kv_blocks = data.draw(st.sampled_from([24, 256]))  # 24: preemptions
    config = dict(block_size=block_size, kv_cache_bytes=kv_blocks * block_size * 2 * 2 * 2 * 16 * 4,
                  max_num_batched_tokens=data.draw(st.sampled_from([8, 2048])))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain = Engine(model, tok, EngineConfig(**config))
    engine = Engine(model, tok, EngineConfig(**config, speculative=speculative(proposer, spec_files, k=3)))
    try:
        want = [o.token_ids for o in plain.generate(prompts, params)]
    except Exception as e:  # a request larger than this cache: both engines refuse it alike
        with pytest.raises(type(e)):
            engine.generate(prompts, params)
        return
    got = engine.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    bm = engine.block_manager
    assert all(count == 0 for count in bm.ref_counts)  # nothing held after every request finished
    assert bm.num_free_blocks + len(bm.node_of_block) == bm.num_blocks
    sequences = [p + o.token_ids for p, o in zip(prompts, got)]
    for path in cached_paths(bm):
        assert any(s[:len(path)] == path for s in sequences), f"cached tokens {path} are no request's tokens"
