"""The attention backends called on bare cache tensors, as the kernel tests hold them: `attend` / `store` through
a backend by name ("torch": the torch ops; "cpu": the compiled CPU kernels; "triton"), `metadata` as that backend
builds it."""

import torch

from llmopt.runtime.executor.attention import ATTENTION_BACKENDS, LayerCache


def backend(name: str):
    return ATTENTION_BACKENDS.get(name)()


def layer_cache(k_cache, v_cache, scales=None) -> LayerCache:
    return LayerCache(k_cache, v_cache, *(scales if scales is not None else (None, None)))


def attend(name: str, q, k_cache, v_cache, meta, scale, k_new=None, v_new=None, scales=None) -> torch.Tensor:
    return backend(name).attend(q, layer_cache(k_cache, v_cache, scales), meta, scale, k_new, v_new)


def store(name: str, k, v, k_cache, v_cache, slot_mapping, scales=None) -> None:
    meta = metadata("torch", [0, k.shape[0]], [k.shape[0]], [[0]], slot_mapping, 1)  # (only its slots are read)
    backend(name).store(k, v, layer_cache(k_cache, v_cache, scales), meta)


def metadata(name: str, query_starts, context_lens, block_tables, slot_mapping, block_size, device="cpu"):
    return backend(name).build_metadata(query_starts, context_lens, block_tables, slot_mapping, block_size, device)
