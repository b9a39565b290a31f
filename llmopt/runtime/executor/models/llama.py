"""The runtime's model class for the Llama family (Llama, Mistral, Qwen2, Qwen3): one forward over the flat
batch of all scheduled tokens, attention over the paged KV cache through the engine's attention backend.

It takes its parameters from a loaded model (any artifact llmopt reads: dense, packed int4/int8 linear methods,
pruned): the packed modules (`PACKED_MODULES`: q/k/v and gate/up) become one linear each, and the norms,
rotary tables and embedding are its own — no transformers module runs in its forward. Its layer loop is written
once (`_layers`); the numerics path is the op set it runs with (models/layer_ops.py):
- exact (`fast=False`; the default where no fused kernels exist): transformers' order for every op, so greedy
  tokens match transformers token for token in fp32;
- fast (the default on CPU and on CUDA with Triton, every dtype): q/k/v and gate/up one matmul each (bf16 weights
  prepacked for oneDNN), one fused RMSNorm call, one rotary application for q and k together. Same maths,
  different rounding order: bf16 results differ from transformers' by bf16 rounding, as any two bf16 kernels do;
  fp32 logits stay within ~1e-5 relative of the exact mode's. With fused kernels (the compiled CPU ops,
  kernels/cpu_ops.py; Triton's on CUDA, kernels/triton_fused.py) each run of element-wise ops is one call, decode
  attention reads the paged cache in place, and the batch-1 lm_head is a matrix-vector kernel; a CPU decode step
  can then run as a graph recorded from the same loop (models/decode_graph.py).
Tensor parallelism: o_proj and down_proj are row-parallel linears (their partial sums all-reduced), the embedding
vocabulary-parallel; the loop does not know.
"""


from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.core.adapters import attention_geometry
from llmopt.runtime.executor.attention import AttentionBackend, KVCache, KVCacheSpec
from llmopt.runtime.executor.attention.metadata import AttentionMetadata
from llmopt.runtime.executor.kernels.cpu_ops import GEMV_BATCHED_ROWS
from llmopt.runtime.executor.linear import fuse_linears
from llmopt.runtime.executor.models.base import RuntimeDecoder
from llmopt.runtime.executor.models.decode_graph import DecodeGraphs
from llmopt.runtime.executor.models.decode_graph import supports as decode_graph_supports
from llmopt.runtime.executor.models.registry import register_model_family
from llmopt.runtime.executor.models.layer_ops import FusedOps, Heads, Norm, TorchOps
from llmopt.runtime.executor.models.layers import RotaryEmbedding
from llmopt.runtime.executor.models.weights import DecoderWeights, method_name, rope_tables
from llmopt.runtime.executor.platform import Platform
from llmopt.runtime.distributed.group import TensorParallelGroup
from llmopt.runtime.distributed.sharding import ShardPlan, StagePlan, split_range

# A layer's linears the runtime runs as one (fed the same input) -> the checkpoint's names of its parts, in order
# (nano-vllm's packed_modules_mapping). Phi-3 ships q/k/v and gate/up packed already.
PACKED_MODULES = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
PACKED_MODULES_PHI3 = {**PACKED_MODULES, "qkv": ("self_attn.qkv_proj",), "gate_up": ("mlp.gate_up_proj",)}
QK_NORM_TYPES = ("qwen3",)  # per-head RMSNorm on q and k before the rotation
# rows from which an fp32 head prepacked for oneDNN beats gemv on its exactly narrowed fp16 / bf16 copy
# (LlamaFamilyDecoder._gemv_serves; docs/results/code-figures.md#logits-head)
GEMV_NARROW_HEAD_ROWS = 32


class DecoderBlock(nn.Module):
    """One decoder layer as the runtime calls it: qkv(x) -> [T, (H + 2 KVH) * D]; gate_up(x) -> [T, 2 I]."""

    def __init__(self, input_norm, post_norm, qkv, o_proj, gate_up, down_proj, q_norm, k_norm):
        super().__init__()
        self.input_norm, self.post_norm = input_norm, post_norm
        self.qkv, self.o_proj, self.gate_up, self.down_proj = qkv, o_proj, gate_up, down_proj
        self.q_norm, self.k_norm = q_norm, k_norm

    def linears(self) -> tuple[nn.Module, ...]:
        """The four projections in the order a layer runs them (the layer loop's and the decode graph's order)."""
        return self.qkv, self.o_proj, self.gate_up, self.down_proj


class LayerStep(NamedTuple):
    """What the layer loop reads of one layer, looked up once: the projections' forwards for [T, in] inputs
    (nn.Module's call machinery, four times a layer, shows at batch-1 decode; the runtime registers no hooks), the
    post-attention norm, the norm after the layer (the next layer's input norm, or the final norm) and Qwen3's
    per-head q / k norms."""

    qkv: object
    o_proj: object
    gate_up: object
    down_proj: object
    post_norm: Norm
    next_norm: Norm
    q_norm: nn.Module | None
    k_norm: nn.Module | None


def _forward_2d(module: nn.Module):
    """The module's forward for [T, in] inputs, bound once (a prepacked dense linear's skips the module)."""
    forward_2d = getattr(module, "forward_2d", None)
    return forward_2d() if forward_2d is not None else module.forward


class VocabParallelEmbedding(nn.Module):
    """A rank's rows [first, first + rows) of the embedding table: tokens outside them look up zeros, and the
    all-reduce of every rank's lookup is the full embedding (exact: one rank contributes each row)."""

    def __init__(self, weight: torch.Tensor, first: int, group: TensorParallelGroup):
        super().__init__()
        self.register_buffer("weight", weight)  # [rows, hidden], shared with the checkpoint's tensor
        self.first, self.group = first, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.group.all_reduce(h.masked_fill_(outside[:, None], 0))


class RowParallelLinear(nn.Module):
    """A rank's share of a linear split along its input features (o_proj, down_proj under tensor parallelism): its
    partial sums all-reduced, so every rank holds the full output."""

    def __init__(self, linear: nn.Module, group: TensorParallelGroup):
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))

    def forward_2d(self):
        forward, all_reduce = _forward_2d(self.linear), self.group.all_reduce
        return lambda x: all_reduce(forward(x))


def exactly_narrowed(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight as fp16 or bf16 when every value survives the round trip (an artifact's fp16 lm_head
    loaded in fp32: half the bytes per batch-1 token, the same logits), else the weight itself."""
    if weight.dtype != torch.float32:
        return weight
    for narrow in (torch.float16, torch.bfloat16):
        # a few rows first: a full-precision weight fails there, without converting all of it (113 MB for SmolLM2)
        if not torch.equal(weight[:8].to(narrow).float(), weight[:8]):
            continue
        candidate = weight.to(narrow)
        if torch.equal(candidate.float(), weight):
            return candidate
    return weight


@register_model_family("llama", "mistral", "qwen2", "qwen3", "phi3")
class LlamaFamilyDecoder(RuntimeDecoder):
    """Built from a config and its weights by name (models/weights.py): each checkpoint tensor or linear goes to
    the loader registered for its name; the packed modules' parts are then fused."""

    cache_layout = "kv"
    tensor_parallel = True  # its checkpoints shard by distributed.sharding.ShardPlan
    lm_head_quantizable = True

    def __init__(self, config, weights, attention: AttentionBackend, fast: bool, dtype: torch.dtype,
                 device: torch.device, plan: ShardPlan | None = None, group: TensorParallelGroup | None = None,
                 stage: StagePlan | None = None):
        """plan, group: this rank's share of a tensor-parallel model (weights already narrowed by the plan) and
        its group; stage: the pipeline stage whose layers it holds; None for the whole model."""
        super().__init__()
        self.config, self.dtype, self.fast, self.attention = config, dtype, fast, attention
        geometry = attention_geometry(config)
        self.num_heads, self.num_kv_heads, self.head_dim = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
        self.plan, self.group = plan, group
        if plan is not None:  # this rank's heads
            self.num_heads, self.num_kv_heads = plan.local_heads
        self.scale = self.head_dim ** -0.5
        self.stage = stage
        self.layer_ids = range(*stage.layers) if stage is not None else range(config.num_hidden_layers)
        self.num_layers = len(self.layer_ids)
        inv_freq, scaling = rope_tables(config)
        self.rotary = RotaryEmbedding(inv_freq.to(device), scaling)
        self._load(config, weights, device)
        if group is not None:
            self.embed = VocabParallelEmbedding(self.embed.weight, plan.vocab[0], group)
            self._vocab_widths = [b - a for a, b in (split_range(plan.vocab_size, plan.world, r)
                                                     for r in range(plan.world))]
        self.logits_head = fuse_linears([self.lm_head], prepack=self.fast, pack_float32=True)
        self._gemv_weight = None  # the lm_head weight for batch-1 decode (below)
        self.decode_graphs: DecodeGraphs | None = None  # (build_decode_graphs, once the KV cache exists)
        self.heads = Heads(self.num_heads, self.num_kv_heads, self.head_dim)
        norms = [b.input_norm for b in self.blocks] + [self.norm]
        self.first_norm = Norm.of(norms[0])
        self.steps = [LayerStep(*(_forward_2d(m) for m in b.linears()), Norm.of(b.post_norm), Norm.of(n),
                                b.q_norm, b.k_norm) for b, n in zip(self.blocks, norms[1:])]
        # the fused element-wise ops serve the fast path: compiled on CPU (kernels/csrc/fused_cpu.cpp), Triton on
        # CUDA (kernels/triton_fused.py); the op set follows them (fused_ops.setter)
        self.fused_ops = (Platform.of(device).fused_ops()
                          if self.fast and all(b.q_norm is None for b in self.blocks) else None)
        if self.fused_ops is not None and type(self.lm_head) is nn.Linear and self.lm_head.bias is None \
                and hasattr(self.fused_ops, "gemv"):
            self._gemv_weight = exactly_narrowed(self.lm_head.weight.detach())

    @property
    def fused_ops(self):
        """The fused kernels the layer loop runs on (None: torch ops)."""
        return self._fused_kernels

    @fused_ops.setter
    def fused_ops(self, kernels) -> None:
        self._fused_kernels = kernels
        self.ops = TorchOps(self.heads, self.fast) if kernels is None else FusedOps(self.heads, kernels)

    def quantize_lm_head(self, input_activations, group_size: int = -1) -> str:
        """`--lm-head int8` / `int8-g32`: the logits head rounded to int8 per vocabulary row or per group_size
        columns (symmetric round-to-nearest, the RTN quantizer's) and built as the registry's int8 linear for
        `input_activations` (8-bit inputs: integer dots), in place of the checkpoint's float head; the embedding
        keeps its float weight (tied or not). Returns the head's linear method."""
        from llmopt.core.contract.rounding import quantize_rtn
        from llmopt.core.contract import QuantScheme
        from llmopt.core.errors import ConfigError
        from llmopt.runtime.executor.linear import make_linear

        if type(self.lm_head) is not nn.Linear or self.group is not None:
            raise ConfigError("--lm-head int8 rounds a float lm_head of a one-process model (this one's is "
                              f"{type(self.lm_head).__name__}{', tensor-parallel' if self.group else ''}): use "
                              "--lm-head model", param="lm_head")
        weight = self.lm_head.weight.detach()
        qweight = quantize_rtn(weight.float(), QuantScheme(8, group_size, True), bias=self.lm_head.bias)
        self.logits_head = make_linear(qweight, weight.dtype, weight.device, input_activations)
        self._gemv_weight = None  # (the head's own kernels serve batch 1 too)
        return method_name(self.logits_head)

    def prepare_graphs(self, max_positions: int) -> None:
        self.rotary.freeze(max_positions, self.dtype)

    def build_decode_graphs(self, kv_cache: KVCache) -> list[int]:
        """Decode steps over `kv_cache` run their layers as one compiled call from now on, where this model and
        cache allow it (models/decode_graph.py; after the engine set the linears' row plans: each graph calls
        the kernels they chose). Returns the step sizes (decodes per step) that do."""
        self.decode_graphs = DecodeGraphs(self, kv_cache) if decode_graph_supports(self, kv_cache) else None
        return self.decode_graphs.row_counts if self.decode_graphs is not None else []

    def _load(self, config, weights, device) -> None:
        """Register a loader per checkpoint name, hand every weight to its loader, then build the blocks."""
        packed = PACKED_MODULES_PHI3 if config.model_type == "phi3" else PACKED_MODULES
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["self_attn.q_norm", "self_attn.k_norm"] if config.model_type in QK_NORM_TYPES else []
        shared = DecoderWeights(config)
        slots = []
        for i in self.layer_ids:
            prefix = f"model.layers.{i}."
            slots.append({group: [shared.linear(prefix + part) for part in parts] for group, parts in packed.items()})
            for norm in norms:
                shared.keep(f"{prefix}{norm}.weight")
        self.embed, self.norm, self.lm_head = shared.load(weights)
        blocks = []
        for i, layer in zip(self.layer_ids, slots):
            prefix = f"model.layers.{i}."
            built = {group: [shared.build(slot) for slot in parts] for group, parts in layer.items()}
            q_norm, k_norm = ((shared.norm(f"{prefix}self_attn.{n}") for n in ("q_norm", "k_norm"))
                              if config.model_type in QK_NORM_TYPES else (None, None))
            qkv, o_proj, gate_up, down_proj = (fuse_linears(built[group], prepack=self.fast)
                                               for group in ("qkv", "o_proj", "gate_up", "down_proj"))
            if self.group is not None:  # (split along their input features: partial sums)
                o_proj, down_proj = RowParallelLinear(o_proj, self.group), RowParallelLinear(down_proj, self.group)
            blocks.append(DecoderBlock(shared.norm(prefix + "input_layernorm"),
                                       shared.norm(prefix + "post_attention_layernorm"), qkv, o_proj, gate_up,
                                       down_proj, q_norm, k_norm))
        self.linear_methods = shared.linear_methods
        self.blocks = nn.ModuleList(blocks)

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec("kv", self.num_layers, dtype, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, hidden: torch.Tensor | None = None, final: bool = True) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]. A pipeline stage after the first starts
        from the previous stage's residual stream `hidden` [T, hidden]; one before the last (final=False) returns
        its residual stream, not normalized."""
        h = self.embed(input_ids) if hidden is None else hidden  # [T, hidden]
        cos, sin = self.ops.tables(self.rotary, positions, h.dtype)
        graph = (self.decode_graphs.for_step(meta, kv_cache, h.shape[0])
                 if self.decode_graphs is not None and self._fused_kernels is not None else None)
        if graph is not None:  # (decodes only: this loop recorded as one compiled call, models/decode_graph.py)
            decode = meta.decode
            x = graph.run(h, cos, sin, meta.slot_mapping, decode.block_tables, decode.context_lens)
        else:
            h, x = self._layers(h, cos, sin, meta, kv_cache, self.ops, self.attention, self.steps)
        return x if final else h

    def _layers(self, h, cos, sin, meta, kv_cache, ops, attention, steps):
        """The layer loop, the only one: (the residual stream h after the layers, its final norm x). Every tensor
        goes through `ops`, a linear of `steps` or `attention`, so the decode graph's recorder can stand in for
        them (models/decode_graph.py). h [T, hidden]; cos, sin as ops.tables gives them."""
        x = ops.norm(h, self.first_norm)
        for step, cache in zip(steps, kv_cache):
            q, k, v = ops.rotate(step.qkv(x), cos, sin, step.q_norm, step.k_norm)
            attention.store(k, v, cache, meta)
            o = attention.attend(q, cache, meta, self.scale, k, v)
            h, x = ops.add_norm(h, step.o_proj(ops.merge_heads(o)), step.post_norm)
            h, x = ops.add_norm(h, step.down_proj(ops.silu_mul(step.gate_up(x))), step.next_norm)
        return h, x

    def logits(self, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor | None:
        """[S, hidden] -> [S, vocab], fp32 (as_float) or as the head computed them (the model's dtype). Under
        tensor parallelism every rank computes its vocabulary share and rank 0 gets them all (others: None)."""
        logits = self._local_logits(hidden)
        if self.group is not None:
            logits = self.group.gather_vocab(logits, self._vocab_widths)
            if logits is None:
                return None
        return logits.float() if as_float else logits

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self._gemv_weight
        if self.fused_ops is not None and weight is not None and self._gemv_serves(hidden, weight):
            return self.fused_ops.gemv(hidden, weight)
        return self.logits_head(hidden)

    def _gemv_serves(self, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the gemv kernel computes these logits (the vocab x hidden weight, 57 MB for SmolLM2 in 16 bits,
        streamed once by one kernel): at batch-1 decode and speculative verification's few rows (1, 3-8); and for
        fp32 inputs against a narrower weight (an fp32 model whose head holds exactly fp16 / bf16 values) below
        GEMV_NARROW_HEAD_ROWS rows, or at every row count where the fp32 head is not prepacked for oneDNN
        (docs/results/code-figures.md#logits-head)."""
        rows = hidden.shape[0]
        if hidden.dtype == torch.float32 and weight.dtype != torch.float32:
            return rows < GEMV_NARROW_HEAD_ROWS or not getattr(self.logits_head, "packed", False)
        return weight.dtype == hidden.dtype and (rows == 1 or rows in GEMV_BATCHED_ROWS)
