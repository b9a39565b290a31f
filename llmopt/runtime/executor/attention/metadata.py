"""A step's attention metadata, built once per step by the attention backend (`AttentionBackend.build_metadata`)
and read by every layer: which rows are decodes, which are prefill chunks, and where each sequence's blocks are.

Sequences whose step is a single token (decodes) are attended together in one padded batch; sequences with several
new tokens (prefill chunks) one by one, each with its causal mask over cached + new tokens; a few new tokens after
a cached prefix (speculative verification) become decode rows, each over the keys up to its own position.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

# Sequences with at most this many new tokens after a cached prefix attend as decode rows (batched with the
# decodes, through the compiled kernel on CPU) instead of one masked SDPA per sequence.
MAX_QUERIES_AS_DECODES = 8


@dataclass
class PrefillGroup:
    start: int  # offset of the sequence's new tokens in the flat batch
    end: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)]
    context_len: int
    mask: torch.Tensor  # [new, context_len] bool, causal over cached + new tokens


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [B] positions in the flat batch of the single new token of each sequence
    block_tables: torch.Tensor  # [B, max_blocks] (padded with block 0; the mask hides the padding)
    context_lens: torch.Tensor  # [B] int64
    contiguous: bool  # rows are 0..B-1 in order (no gather/scatter needed)
    block_size: int

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, 1, max_blocks * block_size] bool: slot < context_len. Only the torch path reads it (the compiled
        kernels read context_lens): made on first use, not every step."""
        slots = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.context_lens.device)
        return (slots.unsqueeze(0) < self.context_lens.unsqueeze(1))[:, None, None, :]


@dataclass
class AttentionMetadata:
    query_starts: list[int]  # [num_seqs + 1] offsets of each sequence's new tokens in the flat batch
    context_lens: list[int]  # [num_seqs] tokens in the cache after this step (cached + new)
    block_tables: list[list[int]]  # [num_seqs][blocks]
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) of each new token
    prefills: list[PrefillGroup]
    decode: DecodeGroup | None

    @classmethod
    def build(cls, query_starts: list[int], context_lens: list[int], block_tables: list[list[int]],
              slot_mapping: torch.Tensor, block_size: int, device: torch.device | str = "cpu", **extra
              ) -> AttentionMetadata:
        """extra: a backend's own fields (a subclass's)."""
        prefills, decode_rows, decode_tables, decode_lens = [], [], [], []
        for i, ctx in enumerate(context_lens):
            start, end = query_starts[i], query_starts[i + 1]
            num_blocks = (ctx + block_size - 1) // block_size
            if end - start == 1 or (end - start <= MAX_QUERIES_AS_DECODES and ctx > end - start):
                # a decode, or a few new tokens after a cached prefix (speculative verification, a short chunk):
                # each query row attends as a decode over the keys up to its own position
                table = block_tables[i][:num_blocks]
                for row in range(start, end):
                    decode_rows.append(row)
                    decode_tables.append(table)
                    decode_lens.append(ctx - (end - 1 - row))
                continue
            query_pos = torch.arange(ctx - (end - start), ctx, device=device).unsqueeze(1)
            mask = torch.arange(ctx, device=device).unsqueeze(0) <= query_pos
            prefills.append(PrefillGroup(start, end, torch.tensor(block_tables[i][:num_blocks], device=device),
                                         ctx, mask))
        decode = None
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], device=device)
            lens = torch.tensor(decode_lens, device=device)
            decode = DecodeGroup(torch.tensor(decode_rows, device=device), tables, lens,
                                 decode_rows == list(range(len(decode_rows))), block_size)
        return cls(query_starts, context_lens, block_tables, slot_mapping, prefills, decode, **extra)
