"""How tensor parallelism splits a Llama-family decoder over `world` ranks (Megatron's layout, as vLLM and
nano-vllm shard it):
- q/k/v and gate/up column-parallel (each rank computes its heads' and its MLP slice's outputs), o_proj and
  down_proj row-parallel (each rank a partial sum over its inputs, added by one all-reduce each);
- attention split by whole KV heads with their query groups, so each rank runs plain GQA on its own heads and
  holds its own heads' KV cache; with fewer KV heads than ranks a KV head is replicated and its query group
  split;
- the embedding and lm_head split along the vocabulary (lookup masked + all-reduce; logits gathered);
- norms replicated.
Shares are contiguous and as even as the units allow (boundaries at ceil(r n / world): sizes differ by one at most).
SmolLM2's 3 KV heads over 2 ranks: rank 0 heads 0-1 (6 query heads), rank 1 head 2 (3 query heads).

Each checkpoint tensor (`model.layers.0.self_attn.q_proj.weight`) or quantized weight (`...q_proj`) is narrowed
by `ShardPlan.shard` as it is read, before any linear method packs it."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from llmopt.core.adapters import attention_geometry
from llmopt.core.contract import QuantizedWeight
from llmopt.core.contract.sparse24 import Sparse24Weight
from llmopt.core.contract.sparse_bitmask import BitmaskWeight, compressed_weight
from llmopt.core.errors import ConfigError

# the widths the MLP's split may fall on, widest first: quantization groups are powers of two up to 128
MLP_UNITS = (128, 64, 32, 16, 8, 1)


def split_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s [start, stop) of n units over `world` ranks: contiguous, sizes differing by one at most."""
    return -(-rank * n // world), -(-(rank + 1) * n // world)


def head_split(num_heads: int, num_kv_heads: int, world: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(query heads, KV heads) of a rank, [start, stop) each: whole KV heads with their query groups; with
    fewer KV heads than ranks, each KV head on world / num_kv_heads ranks that split its query group."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        kv = split_range(num_kv_heads, world, rank)
        return (kv[0] * group, kv[1] * group), kv
    replicas = world // num_kv_heads
    if world % num_kv_heads or group % replicas:
        raise ConfigError(f"{num_heads} attention heads with {num_kv_heads} KV heads do not split over {world} "
                          f"ranks: give a --tensor-parallel-size that divides {num_kv_heads} or one that "
                          f"{num_kv_heads} divides with the query groups of {group} splitting evenly")
    kv_head, part = divmod(rank, replicas)
    width = group // replicas
    first = kv_head * group + part * width
    return (first, first + width), (kv_head, kv_head + 1)


@dataclass(frozen=True)
class ParallelGrid:
    """The engine's ranks as a grid of pipeline stages x tensor-parallel ranks (vLLM's order: the tensor-parallel
    rank varies fastest). Rank 0 (stage 0, tensor-parallel rank 0) is the engine's process; each stage's ranks
    form one tensor-parallel group, and the residual stream goes from (stage s, rank t) to (stage s + 1, rank t)."""

    tensor: int = 1
    stages: int = 1

    @property
    def world(self) -> int:
        return self.tensor * self.stages

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(stage, tensor-parallel rank) of a global rank."""
        return divmod(rank, self.tensor)

    def rank(self, stage: int, tensor_rank: int) -> int:
        return stage * self.tensor + tensor_rank

    def share(self, rank: int) -> dict:
        """load_runtime_model's `shard` and `stage` arguments for a global rank (None where the grid has one)."""
        stage, tensor_rank = self.coordinates(rank)
        return {"shard": (tensor_rank, self.tensor) if self.tensor > 1 else None,
                "stage": (stage, self.stages) if self.stages > 1 else None}

    def stage_ranks(self, stage: int) -> list[int]:
        """The global ranks of one stage's tensor-parallel group."""
        return [self.rank(stage, t) for t in range(self.tensor)]

    def describe(self, rank: int) -> str:
        """A rank as error messages name it."""
        stage, tensor_rank = self.coordinates(rank)
        if self.stages == 1:
            return f"tensor-parallel rank {rank}"
        if self.tensor == 1:
            return f"pipeline stage {stage}"
        return f"rank {rank} (pipeline stage {stage}, tensor-parallel rank {tensor_rank})"


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's contiguous layers [first, stop) of `num_layers` (split_range: sizes differ by one at
    most). Every stage also reads the embedding, final norm and lm_head: stage 0 embeds and projects the logits,
    the last applies the final norm."""

    stage: int
    stages: int
    layers: tuple[int, int]
    num_layers: int

    LAYER = re.compile(r"model\.layers\.(\d+)\.")

    @classmethod
    def for_config(cls, config, stage: int, stages: int) -> StagePlan:
        n = config.num_hidden_layers
        if stages > n:
            raise ConfigError(f"--pipeline-parallel-size {stages} exceeds the model's {n} layers",
                              param="pipeline_parallel_size")
        return cls(stage, stages, split_range(n, stages, stage), n)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def max_layers(self) -> int:
        """The most layers any stage holds: every stage's cache has as many blocks."""
        return -(-self.num_layers // self.stages)

    def holds(self, name: str) -> bool:
        """Whether this stage loads the checkpoint tensor or linear `name`."""
        match = self.LAYER.match(name)
        return match is None or self.layers[0] <= int(match[1]) < self.layers[1]

    def shard(self, name: str, value):
        return value if self.holds(name) else None


def mlp_unit(intermediate: int, world: int) -> int:
    """The widest unit (a multiple of any quantization group up to it) the MLP's features split on, each rank
    getting at least one."""
    return next(u for u in MLP_UNITS if intermediate % u == 0 and intermediate // u >= world)


@dataclass(frozen=True)
class ShardPlan:
    """One rank's share of every tensor of a Llama-family checkpoint."""

    rank: int
    world: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    max_kv_heads: int  # the most KV heads any rank holds: every rank's cache has as many blocks
    mlp: tuple[int, int]
    intermediate: int
    vocab: tuple[int, int]
    vocab_size: int

    @classmethod
    def for_config(cls, config, rank: int, world: int) -> ShardPlan:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        geometry = attention_geometry(config)
        nq, nkv, hd = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
        if nq < world:
            raise ConfigError(f"--tensor-parallel-size {world} exceeds the model's {nq} attention heads")
        q, kv = head_split(nq, nkv, world, rank)
        kv_counts = [b - a for _, (a, b) in (head_split(nq, nkv, world, r) for r in range(world))]
        intermediate = config.intermediate_size
        unit = mlp_unit(intermediate, world)
        mlp = tuple(u * unit for u in split_range(intermediate // unit, world, rank))
        return cls(rank, world, hd, nq, nkv, q, kv, max(kv_counts), mlp, intermediate,
                   split_range(config.vocab_size, world, rank), config.vocab_size)

    @property
    def local_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) on this rank."""
        return self.q_heads[1] - self.q_heads[0], self.kv_heads[1] - self.kv_heads[0]

    @property
    def vocab_width(self) -> int:
        """Every rank's logits width once padded (the widest share): gathered shards have one shape."""
        return split_range(self.vocab_size, self.world, 0)[1]

    def _rows(self, module: str) -> list[tuple[int, int]] | None:
        """The output rows of a column-parallel module (a checkpoint's module name), None for others."""
        hd, nq, nkv, inter = self.head_dim, self.num_heads, self.num_kv_heads, self.intermediate
        q = (self.q_heads[0] * hd, self.q_heads[1] * hd)
        kv = (self.kv_heads[0] * hd, self.kv_heads[1] * hd)
        leaf = module.rsplit(".", 1)[-1]
        if leaf == "q_proj":
            return [q]
        if leaf in ("k_proj", "v_proj"):
            return [kv]
        if leaf in ("gate_proj", "up_proj"):
            return [self.mlp]
        if leaf == "qkv_proj":  # Phi-3's packed [q; k; v] rows
            k_at, v_at = nq * hd, (nq + nkv) * hd
            return [q, (k_at + kv[0], k_at + kv[1]), (v_at + kv[0], v_at + kv[1])]
        if leaf == "gate_up_proj":  # Phi-3's packed [gate; up] rows
            return [self.mlp, (inter + self.mlp[0], inter + self.mlp[1])]
        if module in ("lm_head", "model.embed_tokens"):
            return [self.vocab]
        return None

    def _columns(self, module: str) -> tuple[int, int] | None:
        """The input columns of a row-parallel module, None for others."""
        leaf = module.rsplit(".", 1)[-1]
        if leaf == "o_proj":
            return self.q_heads[0] * self.head_dim, self.q_heads[1] * self.head_dim
        if leaf == "down_proj":
            return self.mlp
        return None

    def shard(self, name: str, value):
        """This rank's share of a checkpoint tensor (`module.weight` / `module.bias` / any other) or of a
        quantized linear (`module`); None when the rank holds none of it (a row-parallel bias off rank 0)."""
        if isinstance(value, QuantizedWeight):
            rows, columns = self._rows(name), self._columns(name)
            if rows is not None:
                return value.select_rows(rows)
            if columns is not None:
                return value.narrow_columns(*columns, keep_bias=self.rank == 0)
            return value
        if isinstance(value, (Sparse24Weight, BitmaskWeight)):  # compressed: the dense share, compressed again
            bias = None if value.bias is None else self.shard(f"{name}.bias", value.bias)
            return compressed_weight(self.shard(f"{name}.weight", value.decompress()), value.pattern, bias)
        module, _, kind = name.rpartition(".")
        if kind not in ("weight", "bias"):
            return value
        rows, columns = self._rows(module), self._columns(module)
        if rows is not None:
            return torch.cat([value[a:b] for a, b in rows]) if len(rows) > 1 else value[rows[0][0]:rows[0][1]]
        if columns is not None:
            if kind == "bias":
                return value if self.rank == 0 else None
            return value[:, columns[0]:columns[1]]
        return value
