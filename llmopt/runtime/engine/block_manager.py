"""Paged KV cache bookkeeping: fixed-size blocks, a free list, reference counts, and a radix-tree prefix
cache over full blocks (as SGLang's RadixAttention). No tensors here: the ModelRunner owns the KV memory.

Every block is in exactly one state: free (in the free list), in use (ref count > 0), or cached (in the
radix tree with ref count 0, evictable LRU). Full blocks enter the tree keyed by their exact token ids
under their parent block's node, so a match compares tokens, never hashes alone: a stale or colliding
entry cannot be matched.

The free list hands out the most recently freed blocks first and never-used ones (ascending ids) after them: a
freed block's memory is committed and likely in cache, where a never-used one may cost a first write (on VMs that
back memory lazily: runtime/executor/attention/kv_commit.py, which commits in ascending order).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmopt.core.errors import LLMOptError
from llmopt.runtime.engine.sequence import Sequence


class OutOfBlocksError(LLMOptError):
    """The KV cache has too few free blocks."""


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...] = ()
    block_id: int = -1
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    last_access: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_cache: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        # (token_ids, max_blocks, top_n) -> how many leading full blocks have kept prompt scores (the model
        # runner's PromptScoreCache.available): prompt-scoring requests may take that many from the prefix cache
        self.score_lookup = None
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.root = RadixNode()
        self.node_of_block: dict[int, RadixNode] = {}
        self._clock = 0
        # Prefix-cache accounting, for metrics.
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0

    # --- counts ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_evictable_blocks(self) -> int:
        return sum(1 for b in self.node_of_block if self.ref_counts[b] == 0)

    @property
    def num_available_blocks(self) -> int:
        return self.num_free_blocks + self.num_evictable_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by sequences (cached-but-unused blocks count as free)."""
        return 1 - self.num_available_blocks / self.num_blocks

    # --- prefix matching ------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match_prefix(self, token_ids: list[int], max_blocks: int | None = None) -> list[int]:
        """Block ids caching the longest prefix of full blocks of `token_ids` (at most max_blocks)."""
        if not self.enable_prefix_cache:
            return []
        node, blocks = self.root, []
        bs = self.block_size
        limit = len(token_ids) // bs if max_blocks is None else min(max_blocks, len(token_ids) // bs)
        now = self._tick()
        for i in range(limit):
            child = node.children.get(tuple(token_ids[i * bs:(i + 1) * bs]))
            if child is None:
                break
            child.last_access = now
            blocks.append(child.block_id)
            node = child
        return blocks

    # --- allocation -----------------------------------------------------------------------------
    def _cached_prefix_for(self, seq: Sequence) -> list[int]:
        top_n = seq.params.prompt_logprobs
        if top_n is not None:  # scoring the prompt: only blocks whose scores were kept (score_lookup)
            if self.score_lookup is None:
                return []
            limit = self.score_lookup(seq.token_ids, (seq.num_prompt_tokens - 1) // self.block_size, top_n)
            return self.match_prefix(seq.token_ids, limit) if limit else []
        # Keep at least one token to compute, so the step that admits the sequence produces logits.
        return self.match_prefix(seq.token_ids, (seq.num_tokens - 1) // self.block_size)

    def can_allocate(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Whether blocks for the first `num_tokens` tokens (default all) can be had, cache hits included."""
        cached = self._cached_prefix_for(seq)
        needed = seq.num_blocks(self.block_size, num_tokens) - len(cached)
        # Matched blocks that are cached-but-unused stop being evictable once taken.
        evictable_taken = sum(1 for b in cached if self.ref_counts[b] == 0)
        return needed <= self.num_available_blocks - evictable_taken

    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Give a waiting sequence its block table: cached prefix blocks shared, the rest fresh."""
        assert not seq.block_table, "sequence already has blocks"
        if not self.can_allocate(seq, num_tokens):
            raise OutOfBlocksError("not enough free KV-cache blocks for this sequence")
        cached = self._cached_prefix_for(seq)
        for block_id in cached:
            self.ref_counts[block_id] += 1
        seq.block_table = list(cached)
        seq.num_cached_tokens = len(cached) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        self.num_lookup_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_cached_tokens
        self._grow(seq, seq.num_blocks(self.block_size, num_tokens))

    def allocate_fresh(self, seq: Sequence) -> bool:
        """Blocks for all of a sequence's tokens, none from the prefix cache (their contents come from elsewhere:
        a prefill engine's, under disaggregation); False when they cannot be had now."""
        assert not seq.block_table, "sequence already has blocks"
        needed = seq.num_blocks(self.block_size)
        if needed > self.num_free_blocks and needed > self.num_available_blocks:
            return False
        self._grow(seq, needed)
        return True

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the sequence can hold `num_tokens` tokens in total."""
        needed = seq.num_blocks(self.block_size, num_tokens) - len(seq.block_table)
        # most decode steps need no block: skip counting the evictable ones (a scan of the cache)
        return needed <= 0 or needed <= self.num_free_blocks or needed <= self.num_available_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make room for `num_tokens` tokens in total (new tokens about to be computed)."""
        if not self.can_grow(seq, num_tokens):
            raise OutOfBlocksError("not enough free KV-cache blocks to grow this sequence")
        self._grow(seq, seq.num_blocks(self.block_size, num_tokens))

    def _grow(self, seq: Sequence, num_blocks: int) -> None:
        while len(seq.block_table) < num_blocks:
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        if not self.free_block_ids:
            self.evict(1)
        block_id = self.free_block_ids.popleft()
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks that `num_tokens` tokens need: after speculative decoding rejected drafts, the
        blocks that held only their KV go back to the free list. They never entered the prefix cache (only
        computed, accepted tokens are cached), so each is private to the sequence."""
        keep = seq.num_blocks(self.block_size, num_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            assert self.ref_counts[block_id] == 1 and block_id not in self.node_of_block, "truncating a shared block"
            self.ref_counts[block_id] = 0
            self.free_block_ids.appendleft(block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Insert the sequence's computed full blocks into the radix tree (they are immutable from now)."""
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        node = self.root
        now = self._tick()
        for i in range(seq.num_computed_tokens // bs):
            key = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block_id = seq.block_table[i]
            child = node.children.get(key)
            if child is None:
                if block_id in self.node_of_block:  # already cached under another path: cannot happen
                    break
                child = RadixNode(key, block_id, node, last_access=now)
                node.children[key] = child
                self.node_of_block[block_id] = child
            elif child.block_id != block_id:
                # Another sequence cached the same tokens first; ours stays private and is freed later.
                break
            child.last_access = now
            node = child

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks: uncached ones return to the free list, cached ones stay evictable
        (last used now: cache_full_blocks runs only when a block fills, so this is their last access)."""
        now = self._tick()
        for block_id in reversed(seq.block_table):
            node = self.node_of_block.get(block_id)
            if node is not None:
                node.last_access = now
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, "block freed twice"
            if self.ref_counts[block_id] == 0 and block_id not in self.node_of_block:
                self.free_block_ids.appendleft(block_id)
        seq.block_table = []

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` cached, unreferenced blocks, least recently used leaves first."""
        freed = 0
        while freed < num_blocks:
            leaves = [n for n in self.node_of_block.values() if not n.children and self.ref_counts[n.block_id] == 0]
            if not leaves:
                break
            leaf = min(leaves, key=lambda n: n.last_access)
            del leaf.parent.children[leaf.key]
            del self.node_of_block[leaf.block_id]
            self.free_block_ids.appendleft(leaf.block_id)
            freed += 1
        if freed < num_blocks and not self.free_block_ids:
            raise OutOfBlocksError("KV cache exhausted: every block is in use")
        return freed

    def reset_prefix_cache(self) -> None:
        for block_id, node in list(self.node_of_block.items()):
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.appendleft(block_id)
        self.root = RadixNode()
        self.node_of_block.clear()
