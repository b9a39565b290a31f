"""BlockManager and radix prefix cache: unit tests and hypothesis property tests over random operations."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmopt.runtime.engine.block_manager import BlockManager, OutOfBlocksError
from llmopt.runtime.engine.sequence import Sequence


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)), "a block is in the free list twice"
    assert all(c >= 0 for c in bm.ref_counts)
    expected = [0] * bm.num_blocks
    for seq in live:
        for b in seq.block_table:
            expected[b] += 1
    assert expected == bm.ref_counts, "ref counts differ from the block tables"
    for b in range(bm.num_blocks):
        states = [b in free, bm.ref_counts[b] > 0, b in bm.node_of_block and bm.ref_counts[b] == 0]
        assert sum(states) == 1, f"block {b} is in {sum(states)} states"
    # Every tree node is keyed by exactly its block's tokens on its path.
    for block, node in bm.node_of_block.items():
        assert node.block_id == block and node.parent.children[node.key] is node
        assert len(node.key) == bm.block_size


def test_prefix_is_shared_and_matched_by_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence(list(range(10)))
    bm.allocate(a)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)  # blocks for tokens 0-3 and 4-7
    b = Sequence(list(range(8)) + [99, 98, 97])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    c = Sequence([0, 1, 2, 3, 4, 5, 6, 100, 8])  # differs inside block 2: only block 1 matches
    bm.allocate(c)
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1]
    check_invariants(bm, [a, b, c])


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = Sequence(list(range(8)))
    bm.allocate(a)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.free(a)
    again = Sequence(list(range(8)))
    bm.allocate(again)
    assert again.num_cached_tokens == 4 and again.num_computed_tokens == 4


def test_unreferenced_cache_is_evicted_lru_when_blocks_run_out():
    bm = BlockManager(num_blocks=6, block_size=2)
    old, new = Sequence([1, 2, 3, 4, 5]), Sequence([7, 8, 9, 10, 11])  # 3 blocks each, 2 of them full
    for seq in (old, new):
        bm.allocate(seq)
        seq.num_computed_tokens = 4
        bm.cache_full_blocks(seq)
        bm.free(seq)
    assert bm.num_free_blocks == 2 and bm.num_evictable_blocks == 4
    bm.match_prefix([7, 8, 9, 10])  # touch `new`: `old` is now least recently used
    big = Sequence(list(range(20, 27)))
    bm.allocate(big)  # needs 4 blocks: the 2 free ones + both of old's cached blocks
    assert bm.match_prefix([1, 2, 3, 4]) == [] and bm.match_prefix([7, 8]) != []
    with pytest.raises(OutOfBlocksError):
        bm.allocate(Sequence(list(range(50, 60))))
    check_invariants(bm, [big])


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "compute", "free", "evict"]),
                         st.integers(0, 1000)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 12))
def test_random_operations_keep_every_invariant(ops, block_size, num_blocks):
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size)
    live: list[Sequence] = []
    vocab = [0, 1, 2]  # few distinct tokens: prefixes collide often
    for op, r in ops:
        if op == "add":
            tokens = [vocab[(r >> i) % 3] for i in range(1 + r % 9)]
            seq = Sequence(tokens)
            if bm.can_allocate(seq):
                bm.allocate(seq)
                live.append(seq)
            else:
                with pytest.raises(OutOfBlocksError):
                    bm.allocate(seq)
        elif op == "grow" and live:
            seq = live[r % len(live)]
            if bm.can_grow(seq, seq.num_tokens + 1):
                seq.token_ids.append(vocab[r % 3])
                bm.grow(seq, seq.num_tokens)
        elif op == "compute" and live:
            seq = live[r % len(live)]
            seq.num_computed_tokens = seq.num_tokens
            bm.cache_full_blocks(seq)
        elif op == "free" and live:
            bm.free(live.pop(r % len(live)))
        elif op == "evict":
            try:
                bm.evict(1 + r % 3)
            except OutOfBlocksError:
                assert bm.num_free_blocks == 0
        check_invariants(bm, live)
        # A cached prefix always matches the tokens it was computed for.
        for seq in live:
            matched = bm.match_prefix(seq.token_ids)
            for i, block in enumerate(matched):
                assert bm.node_of_block[block].key == tuple(seq.token_ids[i * block_size:(i + 1) * block_size])
    for seq in live:
        bm.free(seq)
    check_invariants(bm, [])
    assert bm.num_available_blocks == num_blocks


def test_freed_blocks_are_reused_before_never_used_ones():
    # a freed block's memory is committed (and warm); a never-used one may cost a first write (on VMs that back
    # memory lazily, ~25 ms per 2 MiB): the most recently freed go out first
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_cache=False)
    a = Sequence(list(range(12)))
    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    bm.free(a)
    b = Sequence(list(range(8)))
    bm.allocate(b)
    assert sorted(b.block_table) == [0, 1] and b.block_table[0] == 0  # (a's freed last-to-first: 0 on top)
    b.token_ids.extend(range(20, 28))
    bm.grow(b, 16)
    assert b.block_table == [0, 1, 2, 3]  # a's last block, then the first never-used one
